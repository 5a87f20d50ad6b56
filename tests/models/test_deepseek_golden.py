"""DeepSeek V3 / V3.2 against transformers on tiny random weights (goldens from
tests/golden/make_golden_deepseek.py): chunked ragged prefill through a scattered paged
latent cache, then 16 batched greedy decode steps; a prefix-cache hit; logits close, first
token log-probabilities within 2e-3, identical greedy tokens.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import deepseek
from jaxserve.models.loader import load_model
from model_step_builder import Chunk, build_step, scattered_block_tables

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
NAMES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v3_noqlora": "DeepseekV3ForCausalLM",
         "deepseek_v32": "DeepseekV32ForCausalLM"}
BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_SEQ = 8, 32, 6
STEP_T, S = 24, 4
ATOL = 1e-4
LOGPROB_TOL = 2e-3


def empty_caches(cfg, num_blocks: int, block_size: int, dtype=jnp.float32) -> list[dict]:
    """Zeroed caches from the model's cache specs: per layer {name: f[num_blocks, P, *shape]}."""
    return [{name: jnp.zeros((num_blocks, block_size, *shape), dtype) for name, shape in spec.arrays}
            for spec in deepseek.cache_specs(cfg)]


@functools.partial(jax.jit, static_argnums=0)
def _step(cfg, params, caches, x):
    caches, hidden_TD, _ = deepseek.forward(cfg, params, caches, x)
    return caches, deepseek.compute_logits(cfg, params, hidden_TD)


def _load(name, dtype="float32"):
    golden = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    cfg, params, _ = load_model(os.path.join(GOLDEN_DIR, "ckpt", name), dtype=dtype)
    assert cfg.architecture == NAMES[name]
    return golden, cfg, params, [golden[f"prompt_{i}"].tolist() for i in range(3)]


def _logprobs(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


@pytest.mark.parametrize("name", list(NAMES))
def test_matches_transformers(name):
    golden, cfg, params, prompts = _load(name)
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=len(name))
    caches = empty_caches(cfg, NUM_BLOCKS, BLOCK_SIZE)
    split = 12      # the long prompt in two chunks, the first beside the two short prompts
    steps = [[Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:split], 0)],
             [Chunk(2, prompts[2][split:], split)]]
    got = {i: [] for i in range(3)}
    for chunks in steps:
        x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)
        caches, logits_TV = _step(cfg, params, caches, x)
        ends = np.cumsum([len(c.token_ids) for c in chunks])
        for c, rows in zip(chunks, np.split(np.asarray(logits_TV)[:ends[-1]], ends[:-1])):
            got[c.seq].append(rows)
    for i in range(3):
        prefill = np.concatenate(got[i])
        want = golden[f"prefill_logits_{i}"]
        np.testing.assert_allclose(prefill, want, atol=ATOL, rtol=0, err_msg=f"{name} prefill {i}")
        np.testing.assert_allclose(_logprobs(prefill[-1]), _logprobs(want[-1]), atol=LOGPROB_TOL, rtol=0)

    tokens = [[int(np.argmax(got[i][-1][-1]))] for i in range(3)]
    decode_SNV = np.stack([_decode_step(cfg, params, caches, tables, prompts, tokens, step)
                           for step in range(16)], axis=1)
    for i in range(3):
        np.testing.assert_allclose(decode_SNV[i], golden[f"decode_logits_{i}"], atol=ATOL, rtol=0,
                                   err_msg=f"{name} decode, seq {i}")
        assert tokens[i] == golden[f"greedy_{i}"].tolist(), f"{name} greedy tokens, seq {i}"


def _decode_step(cfg, params, caches, tables, prompts, tokens, step):
    """One batched greedy step of the three sequences (the caches list is updated in place);
    appends each sequence's argmax to `tokens`, returns the logits f32[3, V]."""
    chunks = [Chunk(i, [tokens[i][-1]], len(prompts[i]) + step) for i in range(3)]
    x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)
    caches[:], logits_TV = _step(cfg, params, list(caches), x)
    logits_SV = np.asarray(logits_TV)[np.asarray(x.logits_indices)[:3]]
    for i in range(3):
        tokens[i].append(int(np.argmax(logits_SV[i])))
    return logits_SV


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_prefix_cache_hit(name):
    """A second sequence whose table shares the first two (full) blocks of the long prompt
    computes only the prompt's tail, reading the shared latents (and index keys)."""
    golden, cfg, params, prompts = _load(name)
    tables = scattered_block_tables(2, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=3)
    shared = 2 * BLOCK_SIZE
    tables[1, :2] = tables[0, :2]
    caches = empty_caches(cfg, NUM_BLOCKS, BLOCK_SIZE)
    x = build_step([Chunk(0, prompts[2], 0)], tables, BLOCK_SIZE, STEP_T, S)
    caches, _ = _step(cfg, params, caches, x)
    x = build_step([Chunk(1, prompts[2][shared:], shared)], tables, BLOCK_SIZE, STEP_T, S)
    _, logits_TV = _step(cfg, params, caches, x)
    n = len(prompts[2]) - shared
    np.testing.assert_allclose(np.asarray(logits_TV[:n]), golden["prefill_logits_2"][shared:],
                               atol=ATOL, rtol=0)


def test_config_fields():
    _, cfg, _, _ = _load("deepseek_v32")
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_topk, cfg.n_group, cfg.topk_group) == (32, 8, 8, 4, 2)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    specs = deepseek.cache_specs(cfg)
    assert specs[0].arrays == (("latent", (40,)), ("index_k", (16,)))
    _, cfg3, params, _ = _load("deepseek_v3")
    assert deepseek.cache_specs(cfg3)[0].arrays == (("latent", (40,)),)
    assert float(jnp.abs(params["layers"][1]["router_bias"]).max()) > 0.1   # non-trivial bias


@functools.partial(jax.jit, static_argnums=0)
def _step_pallas(cfg, params, caches, x):
    caches, hidden_TD, _ = deepseek.forward(cfg, params, caches, x, "pallas")
    return caches, deepseek.compute_logits(cfg, params, hidden_TD)


def test_pallas_kernels_in_the_model():
    """V3.2 with the MLA and TopK kernels (interpreted): the chunked ragged prefill's logits
    and two batched decode steps match the goldens (the sparse choice included)."""
    golden, cfg, params, prompts = _load("deepseek_v32")
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=7)
    caches = empty_caches(cfg, NUM_BLOCKS, BLOCK_SIZE)
    x = build_step([Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:10], 0)],
                   tables, BLOCK_SIZE, STEP_T, S)
    caches, _ = _step_pallas(cfg, params, caches, x)
    x = build_step([Chunk(2, prompts[2][10:], 10)], tables, BLOCK_SIZE, STEP_T, S)
    caches, logits_TV = _step_pallas(cfg, params, caches, x)
    np.testing.assert_allclose(np.asarray(logits_TV[:10]), golden["prefill_logits_2"][10:], atol=ATOL, rtol=0)
    tokens = [golden[f"greedy_{i}"].tolist() for i in range(3)]
    for step in range(2):
        chunks = [Chunk(i, [tokens[i][step]], len(prompts[i]) + step) for i in range(3)]
        x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)
        caches, logits_TV = _step_pallas(cfg, params, caches, x)
        logits_SV = np.asarray(logits_TV)[np.asarray(x.logits_indices)[:3]]
        want = np.stack([golden[f"decode_logits_{i}"][step] for i in range(3)])
        np.testing.assert_allclose(logits_SV, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(NAMES))
def test_fused_projections_match_the_goldens(name):
    """The runner's fused weights (fuse_projections: the input projections, the q latent's,
    the dense and shared gate|up each one matrix) give the goldens' prefill logits."""
    golden, cfg, params, prompts = _load(name)
    fused = deepseek.fuse_projections(cfg, {**params, "layers": list(params["layers"])})
    names = set().union(*fused["layers"])
    assert {"w_in", "ws_gate_up", "w_gate_up"} <= names
    assert not {"wq_a", "wq", "wkv_a", "wk_idx", "w_idx", "ws_gate", "ws_up"} & names
    assert ("w_q_lat" in names) == (name == "deepseek_v32")     # V3: wq_b alone, nothing to fuse
    x = build_step([Chunk(i, p, 0) for i, p in enumerate(prompts)],
                   scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS), BLOCK_SIZE, 32, S)
    _, logits_TV = _step(cfg, fused, empty_caches(cfg, NUM_BLOCKS, BLOCK_SIZE), x)
    want = np.concatenate([golden[f"prefill_logits_{i}"] for i in range(3)])
    np.testing.assert_allclose(np.asarray(logits_TV)[:len(want)], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_bfloat16_prefill_is_close(name):
    """bf16 weights, activations and caches (the router bias stays f32): logits near the f32
    golden, top-1 nearly always equal. V3.2: a few rows past index_topk pick another position
    in bf16 (the goldens' top-k gaps are ~4e-4, below bf16's resolution), so there only most
    rows are held to the bound."""
    golden, cfg, params, prompts = _load(name, dtype="bfloat16")
    assert params["layers"][1]["router_bias"].dtype == jnp.float32
    x = build_step([Chunk(i, p, 0) for i, p in enumerate(prompts)],
                   scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS), BLOCK_SIZE, 32, S)
    _, logits_TV = _step(cfg, params, empty_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, jnp.bfloat16), x)
    want = np.concatenate([golden[f"prefill_logits_{i}"] for i in range(3)])
    got = np.asarray(logits_TV, np.float32)[:len(want)]
    close = np.abs(got - want).max(-1) < 0.08
    assert close.all() if name == "deepseek_v3" else close.mean() >= 0.85, np.abs(got - want).max(-1)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_mtp_layer_matches_transformers(tmp_path):
    """The MTP layer (weights from deepseek_v3_mtp.npz written beside the checkpoint, loaded
    into params["mtp"]) on prompt 2: embed(token i+1) with our final hidden state i, at
    position i, over its own latent cache; logits as transformers' MtpLayer gives them."""
    import shutil

    from safetensors.numpy import save_file

    mtp = np.load(os.path.join(GOLDEN_DIR, "deepseek_v3_mtp.npz"))
    path = tmp_path / "ckpt"
    shutil.copytree(os.path.join(GOLDEN_DIR, "ckpt", "deepseek_v3"), path)
    save_file({k[len("tensor:"):]: mtp[k] for k in mtp.files if k.startswith("tensor:")},
              str(path / "model-mtp.safetensors"))
    golden = np.load(os.path.join(GOLDEN_DIR, "deepseek_v3.npz"))
    cfg, params, _ = load_model(str(path))
    assert len(params["mtp"]) == cfg.num_mtp_layers == 1
    prompt = golden["prompt_2"].tolist()
    tables = scattered_block_tables(1, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=11)
    x = build_step([Chunk(0, prompt, 0)], tables, BLOCK_SIZE, STEP_T, S)
    _, hidden_TD, _ = jax.jit(deepseek.forward, static_argnums=0)(
        cfg, params, empty_caches(cfg, NUM_BLOCKS, BLOCK_SIZE), x)
    t = len(prompt) - 1
    x_mtp = build_step([Chunk(0, prompt[1:], 0)], tables, BLOCK_SIZE, STEP_T, S)
    mtp_caches = [{n: jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, *shape)) for n, shape in spec.arrays}
                  for spec in deepseek.mtp_cache_specs(cfg)]
    prev_TD = jnp.zeros_like(hidden_TD).at[:t].set(hidden_TD[:t])
    _, logits_TV, _ = jax.jit(deepseek.mtp_forward, static_argnums=0)(cfg, params, mtp_caches, x_mtp, prev_TD)
    np.testing.assert_allclose(np.asarray(logits_TV[:t]), mtp["logits"], atol=ATOL, rtol=0)


FUSED_MLA = deepseek.Kernels("pallas", "pallas", fused_mla=True)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _step_kernels(cfg, params, caches, x, kernels):
    caches, hidden_TD, _ = deepseek.forward(cfg, params, caches, x, kernels)
    return caches, deepseek.compute_logits(cfg, params, hidden_TD)


@pytest.mark.parametrize("name", list(NAMES))
def test_fused_mla_kernels_in_the_model(name, monkeypatch):
    """The fused MLA kernels ("mla" in the kernel plan; interpreted) over the runner's fused
    weights: the chunked ragged prefill (a mixed step: two whole prompts beside a chunk) and
    four batched decode steps give the goldens' logits and greedy tokens, and every layer of
    every step took the fused block."""
    from jaxserve.models import deepseek_mla

    calls = []
    block = deepseek_mla.attention_block
    monkeypatch.setattr(deepseek_mla, "attention_block", lambda *a: calls.append(1) or block(*a))
    golden, cfg, params, prompts = _load(name)
    params = deepseek.fuse_projections(cfg, {**params, "layers": list(params["layers"])})
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=9)
    caches = empty_caches(cfg, NUM_BLOCKS, BLOCK_SIZE)
    split = 12
    x = build_step([Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:split], 0)],
                   tables, BLOCK_SIZE, STEP_T, S)
    caches, _ = _step_kernels(cfg, params, caches, x, FUSED_MLA)
    x = build_step([Chunk(2, prompts[2][split:], split)], tables, BLOCK_SIZE, STEP_T, S)
    caches, logits_TV = _step_kernels(cfg, params, caches, x, FUSED_MLA)
    n = len(prompts[2]) - split
    np.testing.assert_allclose(np.asarray(logits_TV[:n]), golden["prefill_logits_2"][split:],
                               atol=ATOL, rtol=0)
    tokens = [[golden[f"greedy_{i}"].tolist()[0]] for i in range(3)]
    for step in range(4):
        chunks = [Chunk(i, [tokens[i][-1]], len(prompts[i]) + step) for i in range(3)]
        x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)
        caches, logits_TV = _step_kernels(cfg, params, caches, x, FUSED_MLA)
        logits_SV = np.asarray(logits_TV)[np.asarray(x.logits_indices)[:3]]
        want = np.stack([golden[f"decode_logits_{i}"][step] for i in range(3)])
        np.testing.assert_allclose(logits_SV, want, atol=ATOL, rtol=0, err_msg=f"{name} step {step}")
        for i in range(3):
            tokens[i].append(int(np.argmax(logits_SV[i])))
    for i in range(3):
        assert tokens[i] == golden[f"greedy_{i}"].tolist()[:5], f"{name} greedy tokens, seq {i}"
    # every step has STEP_T tokens, so each trace (one or two) ran every layer fused
    assert calls and len(calls) % cfg.num_layers == 0


def test_engine_runs_the_fused_mla_path(monkeypatch):
    """Through the engine (--fused-kernels mla,moe, Pallas attention; interpreted): the
    runner's fused weights reach the fused block, and V3.2's greedy tokens are the goldens'."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.models import deepseek_mla

    calls = []
    block = deepseek_mla.attention_block
    monkeypatch.setattr(deepseek_mla, "attention_block", lambda *a: calls.append(1) or block(*a))
    golden, _, _, prompts = _load("deepseek_v32")
    llm = LLM(os.path.join(GOLDEN_DIR, "ckpt", "deepseek_v32"), dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128, block_size=16, num_kv_blocks=64,
              warmup=False, fused_kernels="mla,moe", attention_impl="pallas")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [golden[f"greedy_{i}"].tolist()[:6]
                                                           for i in range(3)]
    assert calls
