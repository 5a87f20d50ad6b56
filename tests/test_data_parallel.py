"""Data parallelism (engine/data_parallel.py): two engines on two fake CPU devices behind one
LLM generate what one engine does; routing, aborts and metrics (data_parallel_check.py, in a
subprocess: the fake-device count must be set before jax is imported)."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_data_parallel_matches_one_engine():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, os.path.join(HERE, "data_parallel_check.py")],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok ") == 4, result.stdout
