"""Several hosts through jax.distributed (jaxserve/distributed.py): two CPU processes of 2 fake
devices each, one TP=4 engine across both, generate what one process of 4 devices generates
(and what no mesh generates); a worker's death is an error on rank 0, not a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "distributed_check.py")
GOLDEN_LLAMA = os.path.join(HERE, "golden", "ckpt", "llama", "config.json")


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The golden tiny Llama's config with 4 KV heads (TP=4 splits them), dummy weights."""
    with open(GOLDEN_LLAMA) as f:
        config = json.load(f)
    config["num_key_value_heads"] = 4
    path = tmp_path_factory.mktemp("llama4kv")
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _hosts(model_dir, *extra, stdin=None, logs=None):
    """Rank 0 and rank 1 (stderr to files in `logs` if given: an unread pipe can fill up)."""
    port = _free_port()
    return [subprocess.Popen([sys.executable, CHECK, "host", str(rank), str(port), model_dir, *extra],
                             env=_env(2), stdin=stdin if rank == 0 else None, stdout=subprocess.PIPE,
                             stderr=open(os.path.join(logs, f"rank{rank}.err"), "w") if logs
                             else subprocess.PIPE, text=True)
            for rank in (0, 1)]


def test_two_hosts_match_one_process(model_dir):
    hosts = _hosts(model_dir)
    outs = [p.communicate(timeout=300) for p in hosts]
    for p, (out, err) in zip(hosts, outs):
        assert p.returncode == 0, err[-3000:]        # the worker too: rank 0's stop message
    two_hosts = json.loads(outs[0][0].strip().splitlines()[-1])
    res = subprocess.run([sys.executable, CHECK, "single", model_dir], env=_env(4),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    one = json.loads(res.stdout.strip().splitlines()[-1])
    assert two_hosts == one["4"] == one["1"]
    assert len({tuple(t) for t in two_hosts}) == 3     # the prompts do not all give one answer


def test_lost_worker_fails_rank_0(model_dir, tmp_path):
    rank0, worker = _hosts(model_dir, "lose-worker", stdin=subprocess.PIPE, logs=str(tmp_path))
    try:
        line = ""
        while line not in ("ready", None):    # gloo prints to stdout too
            line = rank0.stdout.readline().strip() or (None if rank0.poll() is not None else "")
        assert line == "ready", (tmp_path / "rank0.err").read_text()[-3000:]
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        time.sleep(0.5)
        t0 = time.monotonic()
        out, err = rank0.communicate("go\n", timeout=120)
        assert rank0.returncode == 3, (tmp_path / "rank0.err").read_text()[-3000:]
        assert "worker rank 1 disconnected" in out
        assert time.monotonic() - t0 < 20    # at the next step, not after a heartbeat timeout
    finally:
        for p in (rank0, worker):
            if p.poll() is None:
                p.kill()


def test_step_key_survives_the_wire():
    """A step program's key (input layout with its pytree structure, variant) goes over the
    channel as JSON and comes back equal; the packed words as raw u32."""
    from jaxserve.worker import packing
    from jaxserve.models.attention import AttentionPlan
    from jaxserve.worker.step_program import StepVariant
    from jaxserve.sample.tensors import make_sampling_tensors
    from jaxserve.worker.step_channel import OP_STEP, StepBroadcaster, decode_key, encode_key, recv_message
    from jaxserve.core.step_input import StepInput

    z = np.zeros(4, np.int32)
    x = StepInput(z, z, z, z, np.zeros(3, np.int32), np.zeros(2, np.int32), np.zeros((2, 4), np.int32),
                  np.zeros(2, np.int32), make_sampling_tensors([], 2, 32, 64, with_extras=False),
                  prev_token_rows=z)
    packed, layout = packing.pack(x)
    variant = StepVariant(2, True, False, AttentionPlan(3, True), True, (1, 0))
    assert decode_key(encode_key(layout, variant)) == (layout, variant)
    a, b = socket.socketpair()
    with a, b:
        tap = StepBroadcaster({1: a})
        tap.step(layout, variant, packed + 7)
        recv_message(b)                                   # the key, once
        op, key_id, payload = recv_message(b)
        assert (op, key_id) == (OP_STEP, 0)
        assert (np.frombuffer(payload, np.uint32) == packed + 7).all()


def test_hosts_from_flags_or_jax_environment(monkeypatch):
    from jaxserve.cli import build_parser
    from jaxserve.engine.distributed import DistributedConfig
    from jaxserve.engine.args import distributed_config, engine_kwargs
    from jaxserve.engine.checks import StartupError

    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.5:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert DistributedConfig.resolve() == DistributedConfig(4, 2, "10.0.0.5", 1234)
    args = build_parser().parse_args(["serve", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                      "h0", "--master-port", "999", "-dp", "2"])
    assert distributed_config(args) == DistributedConfig(2, 1, "h0", 999)   # flags win
    assert engine_kwargs(args)["data_parallel_size"] == 2
    args = build_parser().parse_args(["serve", "--nnodes", "2", "--node-rank", "2"])
    with pytest.raises(StartupError, match=r"node_rank must be in \[0, nnodes - 1 = 1\]"):
        distributed_config(args)


def test_two_hosts_from_the_command_line(model_dir, tmp_path):
    """`jaxserve generate --nnodes 2 --node-rank R` on each host: rank 0 writes the results,
    the worker follows and exits 0 after rank 0's stop message."""
    batch = tmp_path / "in.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {
        "model": "m", "prompt": [3, 17, 42], "max_tokens": 5, "temperature": 0}}) + "\n")
    port = _free_port()
    common = [sys.executable, "-m", "jaxserve.cli", "generate", model_dir, "--load-format", "dummy",
              "--served-model-name", "m", "-tp", "4", "--max-model-len", "64", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "32", "--no-warmup", "--nnodes", "2", "--master-port", str(port),
              "-i", str(batch)]
    hosts = [subprocess.Popen(common + ["--node-rank", str(rank), "-o", str(tmp_path / f"out{rank}.jsonl")],
                              env=_env(2), stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / f"rank{rank}.err", "w"))
             for rank in (0, 1)]
    for rank, p in enumerate(hosts):
        assert p.wait(300) == 0, (tmp_path / f"rank{rank}.err").read_text()[-3000:]
    line = json.loads((tmp_path / "out0.jsonl").read_text())
    assert line["response"]["body"]["usage"]["completion_tokens"] == 5
    assert not (tmp_path / "out1.jsonl").exists()     # the worker ran no batch of its own
