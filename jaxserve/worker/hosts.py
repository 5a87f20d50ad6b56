"""What every host of a multi-host engine must agree on before its SPMD step (engine/distributed.py
starts the hosts; worker/step_channel.py carries the steps)."""

from __future__ import annotations

import numpy as np


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (a byte count), so all hosts size their caches
    alike; `value` itself on one host. Counted in KiB: int32 on the wire."""
    import jax

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    kib = multihost_utils.process_allgather(np.int32(min(value >> 10, 2**31 - 1)))
    return int(np.min(kib)) << 10
