"""Multi-step decode (`num_scheduler_steps` K = 8) on every family's tiny checkpoint (f32):
the engine's greedy tokens are transformers' (the golden .npz, which the engine gives one step
at a time too, batched, on every family here), alone and batched, with a request ending on an EOS and one
on max_tokens inside a K-step loop (the tokens after the stop computed and dropped), and a
prefix-cache hit afterwards (the paged caches the loop wrote, MLA's latent and the indexer's
keys; a hybrid model's saved state) continuing them exactly.

The policy: which families decode in steps by default (pallas_kernels/policy.py), and never
while speculating."""

import dataclasses
import os

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tests.conftest import GOLDEN_DIR
from tests.step_bound import bound_steps

K = 8
FAMILIES = ["llama", "mixtral", "deepseek_v3", "deepseek_v32", "minimax_m2", "qwen3_next",
            "qwen3_5"]


def golden(name):
    """(prompts, transformers' 17 greedy tokens after each) of the family's golden file."""
    g = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    return ([g[f"prompt_{i}"].tolist() for i in range(3)],
            [g[f"greedy_{i}"].tolist() for i in range(3)])


def engine_with_eos(name, eos: int):
    """The K-step engine of a tiny checkpoint, its EOS set to `eos`, with prefix caching."""
    from jaxserve.engine.builder import build_engine
    from jaxserve.models import loader, registry
    cfg, params, tok = loader.load_model(os.path.join(GOLDEN_DIR, "ckpt", name), dtype="float32")
    cfg = dataclasses.replace(cfg, eos_token_ids=(eos,))
    config = EngineConfig(model=cfg, cache=CacheConfig(block_size=4, num_kv_blocks=96,
                                                       enable_prefix_caching=True),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                    max_model_len=64, num_scheduler_steps=K),
                          dtype="float32", warmup=False)
    return bound_steps(build_engine(config, params, tok, registry.get_family(cfg.architecture)))


def eos_inside_a_loop(greedy):
    """(request, index, token): a token first appearing at an index inside the first two
    K-step loops (tokens 1..K and K+1..2K come from them), not at a loop's last token."""
    for i, g in enumerate(greedy):
        for j in [*range(2, K), *range(K + 2, 2 * K)]:
            if g[j] not in g[:j]:
                return i, j, g[j]
    raise AssertionError("no token first appears inside a loop")


def run(engine, requests):
    """{request id: (tokens, finish reason, cached prompt tokens)} and, per request, how many
    tokens its last step sampled beyond those it kept (a stop inside the loop drops some)."""
    from jaxserve.core.scheduler import Scheduler
    dropped, update = {}, engine.scheduler.update

    def spy(out, result):
        updates = update(out, result)
        for u in updates:
            if u.finished is not None:
                sampled = result.sampled_token_ids[result.req_ids.index(u.request_id)]
                dropped[u.request_id] = len(sampled) - len(u.new_token_ids)
        return updates
    engine.scheduler.update = spy
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (o := schedule(), steps.append(o.num_steps))[0]
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                done[o.request_id] = (list(c.token_ids), c.finish_reason, o.num_cached_tokens)
    engine.scheduler.update, engine.scheduler.schedule = update, schedule
    assert isinstance(engine.scheduler, Scheduler) and engine.scheduler.pool.num_used == 0
    assert K in steps                                   # it did decode K steps a launch
    return done, dropped


@pytest.mark.parametrize("name", FAMILIES)
def test_k_steps_give_the_greedy_tokens(name):
    prompts, greedy = golden(name)
    e, j, eos = eos_inside_a_loop(greedy)
    m = (e + 1) % 3                                    # ends on max_tokens inside a loop
    engine = engine_with_eos(name, eos)
    full = lambda **kw: SamplingParams(**{"temperature": 0, "max_tokens": 17, **kw})  # noqa: E731

    alone, _ = run(engine, [("alone", prompts[1], full(ignore_eos=True))])
    assert alone["alone"][0] == greedy[1]

    # A chat's next turn: the prompt and 16 of its tokens, a prefix hit over what the loops
    # wrote (MLA's latent and the indexer's keys too) up to the last full block; a hybrid
    # model's state at that block's end (the hybrid goldens' 17-token prompt: position 32,
    # inside the second loop, which saved it there), then the same tokens as without a hit.
    turn = [("turn", prompts[1] + greedy[1][:16], full(max_tokens=6, ignore_eos=True))]
    hit, _ = run(engine, turn)
    engine.scheduler.kv.reset_prefix_cache()
    again, _ = run(engine, turn)
    assert hit["turn"][0] == again["turn"][0] and hit["turn"][0][0] == greedy[1][16]
    assert (hit["turn"][2], again["turn"][2]) == ((len(prompts[1]) + 15) // 4 * 4, 0)

    batch = [(str(i), prompts[i], full() if i == e else
              SamplingParams(temperature=0, max_tokens=K // 2 + 2, ignore_eos=True) if i == m
              else full(ignore_eos=True)) for i in range(3)]
    got, dropped = run(engine, batch)
    assert got[str(e)][:2] == (greedy[e][:j + 1], "stop")
    assert got[str(m)][:2] == (greedy[m][:K // 2 + 2], "length")
    third = 3 - e - m
    assert got[str(third)][0] == greedy[third]
    assert dropped[str(e)] > 0 and dropped[str(m)] > 0    # both ended inside a loop


def test_multi_step_families_and_speculation_in_the_default():
    """On one GPU: K = 8 for the families of AUTO_MULTI_STEP_FAMILIES whatever their fused
    kernels; 1 on a CPU, on a mesh, and whenever the engine speculates (a verifying step is
    one step). The llama family (Mixtral included) decodes in steps where the fused stack
    takes it (test_multi_step.py): not these tiny shapes (head dim 16)."""
    import json
    from jaxserve.models import registry
    from jaxserve.models.loader import model_config_from_hf
    from jaxserve.pallas_kernels.policy import AUTO_SCHEDULER_STEPS, KernelPlan

    def steps(name, device="NVIDIA H100 80GB HBM3", devices=1, speculative=None, fused="auto"):
        with open(os.path.join(GOLDEN_DIR, "ckpt", name, "config.json")) as f:
            cfg = model_config_from_hf(json.load(f))
        family = registry.get_family(cfg.architecture).name
        plan = KernelPlan.resolve(fused, cfg, family, devices, device)
        return plan.scheduler_steps(None, speculative)
    for name in ("deepseek_v3", "deepseek_v32", "minimax_m2", "qwen3_next", "qwen3_5", "qwen3_5_moe"):
        assert steps(name) == AUTO_SCHEDULER_STEPS == 8, name
        assert steps(name, fused="none") == 8, name   # the fused kernels do not decide it
        assert steps(name, speculative=object()) == 1, name
        assert steps(name, device="cpu") == 1, name
        assert steps(name, devices=2, fused="none") == 1, name
    assert steps("mixtral") == steps("llama") == 1    # the fused stack does not fit them
    # and asked for by hand, K steps with speculation are refused (MTP included)
    from jaxserve.spec_decode.config import SpeculativeConfig
    with open(os.path.join(GOLDEN_DIR, "ckpt", "deepseek_v3", "config.json")) as f:
        cfg = model_config_from_hf(json.load(f))
    with pytest.raises(ValueError, match="num_scheduler_steps must be 1 with speculative"):
        EngineConfig(model=cfg, scheduler=SchedulerConfig(num_scheduler_steps=K),
                     speculative=SpeculativeConfig.from_dict({"method": "mtp",
                                                              "num_speculative_tokens": 1}))


@pytest.mark.slow          # warm-up compiles every program (~40 s on 2 cores)
def test_a_hybrid_engine_compiles_its_saving_loops_in_warmup():
    """With prefix caching a hybrid model's loops that save a state take a layout of their
    own (StepInput.state_save_slots): warm-up compiles it, and nothing compiles afterwards."""
    import jax
    from jaxserve.engine.builder import build_engine
    from jaxserve.models import loader, registry
    prompts, greedy = golden("qwen3_5")
    cfg, params, tok = loader.load_model(os.path.join(GOLDEN_DIR, "ckpt", "qwen3_5"), dtype="float32")
    config = EngineConfig(model=cfg, cache=CacheConfig(block_size=4, num_kv_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16,
                                                    max_model_len=64, num_scheduler_steps=K),
                          dtype="float32", warmup=True)
    engine = bound_steps(build_engine(config, params, tok, registry.get_family(cfg.architecture)))
    engine.wait_for_warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    sp = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    assert run(engine, [("0", prompts[1], sp)])[0]["0"][0] == greedy[1]
    assert compiles == []
