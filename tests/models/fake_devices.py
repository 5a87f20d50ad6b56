"""Running a *_check.py script of this folder in a subprocess with 8 fake CPU devices: the
fake-device count must be set before jax is imported (the scripts set it), which would disturb
every other test in the same process."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_check(script: str, *args: str, ok: int) -> str:
    """Run `script` (a file name here) with `args`; it must exit 0 and print `ok` lines "ok ..."."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, os.path.join(HERE, script), *args], cwd=HERE, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok ") == ok, result.stdout
    return result.stdout
