"""Expert parallelism on 8 fake CPU devices (expert_parallel_check.py): the MoE dispatch and
combine (local experts + psum, and the all-to-all form) against a dense reference, and every
MoE family on EP 2 / EP 4 / EP 2 x TP 2 against one device, impl "xla" and "pallas".

Subprocesses: the fake-device count must be set before jax is imported."""

from __future__ import annotations

import pytest

from fake_devices import run_check

CHECKS = {"dispatch": 5, "models": 8}      # part -> how many checks print "ok"


@pytest.mark.parametrize("part", list(CHECKS))
def test_expert_parallel_matches_one_device(part):
    run_check("expert_parallel_check.py", part, ok=CHECKS[part])
