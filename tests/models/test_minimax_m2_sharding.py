"""MiniMax-M2 under TP 2 / 4 and EP on 8 fake CPU devices matches one device within 1e-5 (f32),
with one all-reduce of q's and k's sums of squares per layer; the engine on a TP 2 x EP 2 mesh
gives transformers' greedy tokens (minimax_sharding_check.py).

A subprocess: the fake-device count must be set before jax is imported."""

from __future__ import annotations

from fake_devices import run_check


def test_sharded_minimax_matches_one_device():
    run_check("minimax_sharding_check.py", ok=9)
