"""MiniMax-M2 under TP 2 / 4 and EP on 8 fake CPU devices matches one device within 1e-5 (f32),
with one all-reduce of q's and k's sums of squares per layer; the engine on a TP 2 x EP 2 mesh
gives transformers' greedy tokens (minimax_sharding_check.py).

A subprocess: the fake-device count must be set before jax is imported."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharded_minimax_matches_one_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, os.path.join(HERE, "minimax_sharding_check.py")], cwd=HERE,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok ") == 9, result.stdout
