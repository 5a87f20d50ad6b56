"""DeepSeek V3 / V3.2 and Qwen3-Next / Qwen3.5 under TP 2 / 4, EP 2 and TP 2 x EP 2 on 8 fake
CPU devices match one device within 1e-5 (f32), with the placements the sharding rules promise
(heads split, the MLA latent and the V3.2 indexer replicated, DeltaNet state by head); the
engine on a TP 2 x EP 2 mesh gives transformers' greedy tokens (new_families_sharding_check.py).
DeepSeek V4: TP 2, EP 2 and TP 2 x EP 2 within 4e-5, its kernels per head shard on TP 2, no
weight gathered, its dummy weights drawn on a mesh.

Subprocesses: the fake-device count must be set before jax is imported."""

from __future__ import annotations

import os

import pytest

from fake_devices import run_check

HERE = os.path.dirname(os.path.abspath(__file__))
# family -> how many checks print "ok"
CHECKS = {"deepseek": 14, "qwen3_next": 12, "deepseek_v4": 6}


@pytest.mark.parametrize("family", list(CHECKS))
def test_sharded_family_matches_one_device(family):
    run_check("new_families_sharding_check.py", family, ok=CHECKS[family])


def test_grouped_conv_channels_give_the_same_heads():
    """The mesh's conv channel order (one block per key head) splits into the same q, k, v
    heads as HF's q | k | v order: post_conv(grouped) on permuted channels equals post_conv."""
    import numpy as np

    from jaxserve.models.layers import deltanet as gdn
    from jaxserve.models import qwen3_next
    from jaxserve.models.loaders.hf import read_hf_config
    from jaxserve.models.loaders.qwen3_next import grouped_channel_order

    cfg = qwen3_next.config_from_hf(read_hf_config(os.path.join(HERE, os.pardir, "golden", "ckpt", "qwen3_next")))
    rng = np.random.default_rng(0)
    t, h = 5, cfg.linear_num_value_heads
    conv, a, b = (rng.normal(size=s).astype(np.float32) for s in ((t, cfg.conv_dim), (t, h), (t, h)))
    a_log, dt_bias = rng.normal(size=h).astype(np.float32), rng.normal(size=h).astype(np.float32)
    kw = dict(num_k_heads=cfg.linear_num_key_heads, k_dim=cfg.linear_key_head_dim, v_dim=cfg.linear_value_head_dim)
    order = grouped_channel_order(cfg)
    assert sorted(order.tolist()) == list(range(cfg.conv_dim)) and order.tolist() != sorted(order.tolist())
    want = gdn.post_conv(conv, a, b, a_log, dt_bias, **kw)
    got = gdn.post_conv(conv[:, order], a, b, a_log, dt_bias, **kw, grouped=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
