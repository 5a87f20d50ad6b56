"""DeepSeek V3 / V3.2 and Qwen3-Next / Qwen3.5 under TP 2 / 4, EP 2 and TP 2 x EP 2 on 8 fake
CPU devices match one device within 1e-5 (f32), with the placements the sharding rules promise
(heads split, the MLA latent and the V3.2 indexer replicated, DeltaNet state by head); the
engine on a TP 2 x EP 2 mesh gives transformers' greedy tokens (new_families_sharding_check.py).

Subprocesses: the fake-device count must be set before jax is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# family -> how many checks print "ok"
CHECKS = {"deepseek": 11, "qwen3_next": 9}


@pytest.mark.parametrize("family", list(CHECKS))
def test_sharded_family_matches_one_device(family):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, os.path.join(HERE, "new_families_sharding_check.py"), family],
                            cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok ") == CHECKS[family], result.stdout
