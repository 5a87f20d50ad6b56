"""TP / EP on 8 fake CPU devices match one device (see model_sharding_check.py for the cases).

The check runs in a subprocess: the fake-device count must be set before jax is imported,
and would otherwise change the devices every other test in this process sees.
"""

from __future__ import annotations

from fake_devices import run_check


def test_sharded_logits_match_one_device():
    run_check("model_sharding_check.py", ok=12)
