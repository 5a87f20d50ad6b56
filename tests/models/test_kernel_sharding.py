"""The paged-attention kernel per head shard (sharding/kernels.py) on TP 2 / 4 of 8 fake CPU
devices equals the unsharded kernel, and the sampler's threshold kernels on vocab-split logits
(run replicated) equal theirs (kernel_sharding_check.py, a subprocess: the fake-device count
must be set before jax is imported)."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharded_paged_attention_matches_one_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, os.path.join(HERE, "kernel_sharding_check.py")],
                            cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok ") == 8, result.stdout
