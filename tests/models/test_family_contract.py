"""Every registered model family through the ModelFamily contract (models/interface.py), on
the tiny golden checkpoints' configs (tests/golden/ckpt/): parameter shapes agree with their
logical axes and the sharding rules know every axis; cache specs name arrays with axes; the
loaded and the dummy parameters have the declared shapes; prepare_weights only re-lays the
weights (the same logits after it); one prefill step of forward + compute_logits gives the
declared shapes. And the registry offers nothing the contract lacks."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.kv_cache.specs import PagedSpec, StateSpec
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.models import loader, registry
from jaxserve.models.interface import ModelFamily
from jaxserve.models.loaders import hf as hf_loader
from jaxserve.sharding.rules import LOGICAL_AXIS_RULES
from hybrid_step_builder import Chunk, build_hybrid_step, empty_caches, scattered_block_tables

CKPT = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "ckpt")
# one checkpoint per family object at least (test_every_family_has_a_case)
CASES = ["llama", "qwen3_moe", "deepseek_v32", "minimax_m2", "qwen3_next", "qwen3_5", "deepseek_v4"]
BLOCK, NUM_BLOCKS, NUM_SLOTS = 4, 16, 3


def _case(name):
    hf = hf_loader.read_hf_config(os.path.join(CKPT, name))
    family = registry.get_family(hf["architectures"][0])
    return family, family.config_from_hf(hf)


def _is_shape(x):
    return isinstance(x, tuple)


def test_every_family_has_a_case():
    families = {id(f): f for f in registry.ARCHITECTURES.values()}
    covered = {id(_case(name)[0]) for name in CASES}
    missing = [f.name for i, f in families.items() if i not in covered]
    assert not missing, f"families without a contract case: {missing}"


def test_registry_offers_nothing_the_contract_lacks():
    contract = {n for n in [*dir(ModelFamily), *ModelFamily.__annotations__] if not n.startswith("_")}
    for arch, family in registry.ARCHITECTURES.items():
        assert isinstance(family, ModelFamily), arch
        extra = {n for n in dir(family) if not n.startswith("_")} - contract
        assert not extra, f"{arch}: {family!r} has members outside the contract: {sorted(extra)}"
        assert family.name and isinstance(family.supports_mtp, bool)


@pytest.mark.parametrize("name", CASES)
def test_param_specs_and_axes_agree(name):
    family, cfg = _case(name)
    assert loader.model_config_from_hf(hf_loader.read_hf_config(os.path.join(CKPT, name))) == cfg
    shapes = family.param_shapes(cfg)
    axes = family.param_logical_axes(cfg, shapes)
    assert jax.tree.structure(shapes, is_leaf=_is_shape) == jax.tree.structure(axes, is_leaf=_is_shape)
    for shape, ax in zip(jax.tree.leaves(shapes, is_leaf=_is_shape), jax.tree.leaves(axes, is_leaf=_is_shape)):
        assert len(shape) == len(ax) and all(a in LOGICAL_AXIS_RULES for a in ax), (shape, ax)
    for field, size, logical in family.divisible_dims(cfg):
        assert size > 0 and logical in LOGICAL_AXIS_RULES, field
    # what the HF loader gives: the declared shapes (plus an "mtp" subtree where the
    # checkpoint has one), and axes for all of it
    _, params = loader.load_hf(os.path.join(CKPT, name))
    got = jax.tree.map(lambda a: tuple(a.shape), params)
    assert {k: v for k, v in got.items() if k != "mtp"} == shapes
    family.param_logical_axes(cfg, got)


@pytest.mark.parametrize("name", CASES)
def test_cache_specs_have_axes(name):
    family, cfg = _case(name)
    specs = family.cache_specs(cfg)
    if family.supports_mtp:
        mtp_cfg = dataclasses.replace(cfg, num_mtp_layers=1)       # (the golden has none)
        specs = specs + family.mtp_cache_specs(mtp_cfg)
        assert len(family.mtp_cache_specs(mtp_cfg)) == 1
    else:
        with pytest.raises(NotImplementedError):
            family.mtp_cache_specs(cfg)
    assert len(family.cache_specs(cfg)) == cfg.num_layers
    for spec in specs:
        assert isinstance(spec, (PagedSpec, StateSpec))
        lead = 2 if isinstance(spec, PagedSpec) else 1      # [num_blocks, P] or [num_slots]
        for array, shape in spec.arrays:
            ax = family.cache_axes[array]
            assert len(ax) == lead + len(shape) and all(a in LOGICAL_AXIS_RULES for a in ax), (array, ax)


@pytest.mark.parametrize("name", CASES)
def test_one_step(name):
    """Dummy weights, one prefill step of two sequences: forward's caches keep their shapes,
    the hidden rows are [T, D], the logits [S, V]; after prepare_weights the same logits."""
    family, cfg = _case(name)
    params = family.dummy_params(cfg, "float32", seed=1)
    assert jax.tree.map(lambda a: tuple(a.shape), params) == family.param_shapes(cfg)
    chunks = [Chunk(0, [1, 2, 3, 4, 5], 0), Chunk(1, [6, 7], 0)]
    x = build_hybrid_step(chunks, scattered_block_tables(2, 3, NUM_BLOCKS), np.array([1, 2]), BLOCK,
                          num_tokens=8, num_seqs=2)
    specs = family.cache_specs(cfg)

    def logits_of(params):
        kernels = family.make_kernels(cfg, "xla")
        caches = empty_caches(specs, NUM_BLOCKS, BLOCK, NUM_SLOTS)
        new, hidden, aux = family.forward(cfg, params, caches, x, kernels, (0,))
        assert jax.tree.map(jnp.shape, new) == jax.tree.map(jnp.shape, caches)
        assert hidden.shape == (8, cfg.hidden_size) and len(aux) == 1
        logits = family.compute_logits(cfg, params, hidden[x.logits_indices], kernels)
        assert logits.shape == (2, cfg.vocab_size) and logits.dtype == jnp.float32
        return np.asarray(logits)

    want = logits_of(params)
    assert np.isfinite(want).all()
    prepared = family.prepare_weights(cfg, params, kernel_plan=KernelPlan(), mesh=None, backend="xla")
    np.testing.assert_allclose(logits_of(prepared), want, rtol=1e-4, atol=1e-4)
