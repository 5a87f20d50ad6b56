"""Expert parallelism on 8 fake CPU devices (expert_parallel_check.py): the MoE dispatch and
combine (local experts + psum, and the all-to-all form) against a dense reference, and every
MoE family on EP 2 / EP 4 / EP 2 x TP 2 against one device, impl "xla" and "pallas".

Subprocesses: the fake-device count must be set before jax is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = {"dispatch": 5, "models": 8}      # part -> how many checks print "ok"


@pytest.mark.parametrize("part", list(CHECKS))
def test_expert_parallel_matches_one_device(part):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, os.path.join(HERE, "expert_parallel_check.py"), part],
                            cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok ") == CHECKS[part], result.stdout
