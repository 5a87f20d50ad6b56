"""TP / EP on 8 fake CPU devices match one device (see model_sharding_check.py for the cases).

The check runs in a subprocess: the fake-device count must be set before jax is imported,
and would otherwise change the devices every other test in this process sees.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharded_logits_match_one_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, os.path.join(HERE, "model_sharding_check.py")], cwd=HERE,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok ") == 12, result.stdout
