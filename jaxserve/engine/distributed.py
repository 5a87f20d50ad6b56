"""Several hosts: one engine whose SPMD step spans every process's devices.

JAX's own multi-controller runtime does the work: `jax.distributed.initialize` (vLLM-like
flags --nnodes, --node-rank, --master-addr, --master-port, or JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID) joins the processes, `jax.devices()` then lists every
host's devices, the mesh spans them all and the loader places each parameter with
`make_array_from_callback`, so a process holds only its own devices' slices. On the CPU the
collectives are gloo's.

Rank 0 runs the scheduler (and the server); every other rank builds the same engine (same
flags: the same programs and cache sizes) and runs `run_worker`, which launches each device
program rank 0 launches, in the same order, from the step channel (step_channel.py). Rank 0
reads the step's sampled tokens, which the program leaves replicated on every device.

Failure: a worker that dies is seen by rank 0 at its next step (its socket is closed):
WorkerLostError, the engine stops. A step already waiting on a dead peer's collective cannot
be interrupted; JAX's heartbeat (HEARTBEAT_TIMEOUT_S) then aborts the process with "another
task died". A worker whose rank 0 goes away exits with an error; after rank 0's stop message
it exits 0.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import secrets
import socket
import time

import numpy as np

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 30      # JAX declares a silent process dead after this long
CONNECT_TIMEOUT_S = 900       # workers connect once their engine is built (loaded, warmed up)
DEFAULT_MASTER_PORT = 29500


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self):
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1; got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes - 1 = {self.nnodes - 1}]; got {self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535]; got {self.master_port}")

    @classmethod
    def resolve(cls, nnodes: int | None = None, node_rank: int | None = None,
                master_addr: str | None = None, master_port: int | None = None) -> "DistributedConfig":
        """The flags, else JAX's environment variables (JAX_COORDINATOR_ADDRESS=host:port,
        JAX_NUM_PROCESSES, JAX_PROCESS_ID), else one host."""
        env = os.environ
        address = env.get("JAX_COORDINATOR_ADDRESS", "")
        env_addr, _, env_port = address.rpartition(":") if ":" in address else (address, "", "")

        def number(value, name):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name} must be an integer; got {value!r}") from None

        if nnodes is None:
            nnodes = number(env["JAX_NUM_PROCESSES"], "JAX_NUM_PROCESSES") if env.get("JAX_NUM_PROCESSES") else 1
        if node_rank is None:
            node_rank = number(env["JAX_PROCESS_ID"], "JAX_PROCESS_ID") if env.get("JAX_PROCESS_ID") else 0
        if master_port is None:
            master_port = number(env_port, "JAX_COORDINATOR_ADDRESS's port") if env_port else DEFAULT_MASTER_PORT
        return cls(nnodes, node_rank, master_addr or env_addr or "127.0.0.1", master_port)

    @property
    def is_worker(self) -> bool:
        return self.node_rank != 0


@dataclasses.dataclass
class Cluster:
    """This process's place among the hosts, after initialize()."""
    config: DistributedConfig
    channel_port: int
    secret: int
    listener: socket.socket | None = None     # rank 0's, until every worker connected


_CLUSTER: Cluster | None = None


def current() -> Cluster | None:
    """The hosts this process joined (None: one host)."""
    return _CLUSTER


def initialize(config: DistributedConfig) -> Cluster | None:
    """Join the hosts (before any other use of jax) and agree on the step channel's port.
    None for one host. The engine built next in this process (engine/builder.py
    from_engine_args) is the one that spans them."""
    global _CLUSTER
    if config.nnodes == 1:
        return None
    if _CLUSTER is not None:
        raise RuntimeError("jax.distributed is already initialized in this process")
    import jax

    # NOTE: without it XLA:CPU has no cross-process collectives ("Multiprocess computations
    # aren't implemented on the CPU backend"); GPUs use NCCL whatever this says
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"{config.master_addr}:{config.master_port}", config.nnodes,
                               config.node_rank, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    from jax.experimental import multihost_utils

    listener, mine = None, np.zeros(3, np.int32)
    if not config.is_worker:
        listener = socket.create_server((config.master_addr, 0), backlog=config.nnodes)
        secret = secrets.randbits(62)
        mine[:] = listener.getsockname()[1], secret >> 31, secret & 0x7FFFFFFF
    port, high, low = (int(v) for v in multihost_utils.broadcast_one_to_all(mine))
    logger.info("host %d of %d joined; %d devices in all", config.node_rank, config.nnodes,
                jax.device_count())
    _CLUSTER = Cluster(config, port, (high << 31) | low, listener)
    return _CLUSTER


def check_engine_args(cluster: Cluster | None, tensor_parallel_size: int, expert_parallel_size: int,
                      speculative_config) -> None:
    """Refuse what several hosts cannot run (before anything loads)."""
    if cluster is None:
        return
    import jax

    if tensor_parallel_size * expert_parallel_size != jax.device_count():
        raise ValueError(
            f"with nnodes = {cluster.config.nnodes} the mesh spans every host's devices: "
            f"tensor_parallel_size * expert_parallel_size must be {jax.device_count()}; got "
            f"{tensor_parallel_size} * {expert_parallel_size}")
    if speculative_config:
        raise ValueError("speculative_config is not supported with nnodes > 1 yet (the "
                         "proposer's programs do not run on the other hosts)")


def _hello(rank: int, secret: int) -> bytes:
    return np.asarray([rank, secret >> 31, secret & 0x7FFFFFFF], np.int64).tobytes()


def connect_workers(cluster: Cluster, runner) -> None:
    """Rank 0: wait for every worker to connect, then tap the runner's launches."""
    from jaxserve.worker.step_channel import StepBroadcaster

    listener, workers = cluster.listener, {}
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while len(workers) < cluster.config.nnodes - 1:
        listener.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock, address = listener.accept()
        except TimeoutError:
            raise TimeoutError(f"{len(workers)} of {cluster.config.nnodes - 1} worker hosts connected "
                               f"within {CONNECT_TIMEOUT_S} s; did every host start?") from None
        sock.settimeout(30)
        hello = sock.recv(24, socket.MSG_WAITALL)
        rank = int(np.frombuffer(hello, np.int64)[0]) if len(hello) == 24 else -1
        if hello != _hello(rank, cluster.secret) or rank in workers or not 0 < rank < cluster.config.nnodes:
            logger.warning("refused a step-channel connection from %s (not a worker of this run)", address)
            sock.close()
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        workers[rank] = sock
    listener.close()
    cluster.listener = None
    runner.step_tap = StepBroadcaster(workers)
    # NOTE: before jax.distributed's own exit hook (atexit runs hooks last-in first-out), so
    # the workers leave the shutdown barrier with rank 0
    atexit.register(stop_workers, runner)


def worker_main(engine) -> int:
    """A worker host's life once it has built the same engine as rank 0 (engine/builder.py
    from_engine_args, with rank 0's options): follow its steps, leave the cluster. 0 after
    rank 0's stop message."""
    import jax

    run_worker(_CLUSTER, engine)
    jax.distributed.shutdown()
    return 0


def run_worker(cluster: Cluster, engine) -> None:
    """Ranks > 0: launch rank 0's programs until it says stop (returns) or goes away (raises)."""
    from jaxserve.worker.step_channel import serve_steps

    sock = socket.create_connection((cluster.config.master_addr, cluster.channel_port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.sendall(_hello(cluster.config.node_rank, cluster.secret))
    sock.settimeout(None)      # rank 0 may be idle for hours between requests
    logger.info("host %d: following rank 0's steps", cluster.config.node_rank)
    try:
        serve_steps(sock, engine.runner)
    finally:
        sock.close()


def stop_workers(runner) -> None:
    """Rank 0: tell the workers to exit (if there are any)."""
    tap = runner.step_tap
    if tap is not None:
        tap.stop()
        runner.step_tap = None
