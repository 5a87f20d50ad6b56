"""The paged-attention kernel per head shard (sharding/kernels.py) on TP 2 / 4 of 8 fake CPU
devices equals the unsharded kernel, and the sampler's threshold kernels on vocab-split logits
(run replicated) equal theirs (kernel_sharding_check.py, a subprocess: the fake-device count
must be set before jax is imported)."""

from __future__ import annotations

from fake_devices import run_check


def test_sharded_paged_attention_matches_one_device():
    run_check("kernel_sharding_check.py", ok=8)
