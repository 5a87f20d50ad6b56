"""Speculative decoding's ceiling on the target's step: decode tokens/s with synthetic drafts.

One engine (dummy weights of the Llama-3.1-8B shape; --tiny: the tests' tiny Llama on the
CPU) decodes a batch of random prompts greedily, first without speculation (recording each
continuation), then with a synthetic proposer that replays the recorded continuation: every
draft right (acceptance 1.0), or each draft token right with probability 0.7 (else a wrong
token). Greedy output with drafts must equal the recording without them; the script checks it.
The replay reads token ids only, so the engine pipelines while it speculates (rows "replay");
rows "replay-wait" are the same drafts with the engine waiting for each step (the baseline:
how it runs proposers that read a step's results, and how it ran all of them before).

In bf16 on random weights it does not at batch > 1: near-tied logits flip when the step's
shape changes (a verifying step tiles attention differently; H200, session 20: batch 8 and 32
diverged within a few tokens, batch 1 and f32 did not), and a replayed draft is wrong from the
first flip on. So the drafts replay a fixed point: the output of a run with the drafts of the
recording before it, until a run reproduces its drafts (`recording_passes`); `identical` says
whether that equals the output without speculation (always true in f32, --dtype float32).

Issue 67's rows: "replay" paces pipelining by the requests' running acceptance (the engine's
default: spec_decode/pacing.py), "replay-always" pipelines behind every step (before issue 67);
"replay-wait" launches the next step as soon as a waited one is read (the default),
"replay-wait-old" on the next engine step, after the outputs are processed (before). --modes
picks rows.

--eagle3 adds rows at the cost of chained EAGLE3 drafting: a random-weight head of a real
head's shape (Llama-3.1-8B's: one layer of 32 x 128 heads, 8 KV heads, 14336 MLP, 32000
draft tokens; --tiny: the tests' tiny head) runs on the device behind every step with k
tokens, as served, while the drafts verified are the replay's (a random head's own would all
be rejected): the tokens/s a head of that acceptance would give, pipelined ("eagle3", as the
engine serves EAGLE3 and MTP) and waiting for each step ("eagle3-wait", as it served them
before).

    # H200
    python benchmarks/spec_decode.py --eagle3 --output-json benchmarks/results/spec_decode_h200.json
    # CPU check
    JAX_PLATFORMS=cpu python benchmarks/spec_decode.py --tiny --eagle3

Decode tokens/s = batch * (N - 1) / (time of N new tokens - time of 1), so the prefill and
the first token drop out. Each configuration runs once to compile its verifying programs
before it is timed (the median over --rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


sys.path.insert(0, ROOT)
from jaxserve.spec_decode.proposer import Proposer  # noqa: E402


MODES = ("replay", "replay-always", "replay-wait", "replay-wait-old")


class ReplayProposer(Proposer):
    """Drafts from a recorded greedy continuation: each token right with probability `p`. It
    reads token ids only, so it drafts ahead of the device (the engine pipelines while it
    speculates: spec_decode/drafting.py); WaitingReplay is the same drafts with the engine
    waiting for each step, as it does for proposers that read a step's results."""
    pipelines = True

    def __init__(self, recorded: dict[tuple, list[int]], k: int, p: float, vocab: int, seed: int = 0):
        self.recorded, self.k, self.p, self.vocab = recorded, k, p, vocab
        self.rng = np.random.default_rng(seed)

    def retain(self, running_ids) -> None:
        pass

    def propose(self, requests, limits, tails=None):
        out = []
        for i, (req, lim) in enumerate(zip(requests, limits)):
            cont = self.recorded[tuple(req.prompt_token_ids)]
            m = len(req.output_token_ids) + (len(tails[i]) if tails else 0)
            drafts = np.array(cont[m:m + lim], np.int64)
            wrong = self.rng.random(len(drafts)) >= self.p
            drafts[wrong] = (drafts[wrong] + 1) % self.vocab
            out.append(drafts.tolist())
        return out


class WaitingReplay(ReplayProposer):
    pipelines = False


class HeadCostReplay(ReplayProposer):
    """The replay's drafts, with `head` (an after-step proposer: eagle3.Eagle3Proposer) running
    on the device behind every step as it does when serving; its own drafts are dropped."""

    def __init__(self, head, *args):
        super().__init__(*args)
        self.head = head
        self.num_lookahead_tokens = head.num_lookahead_tokens

    def after_dispatch(self, step, prev_ids):
        return self.head.after_dispatch(step, prev_ids)


class WaitingHeadCostReplay(HeadCostReplay):
    pipelines = False


def eagle3_head(llm, k: int, tiny: bool, path: str):
    """An Eagle3Proposer of k tokens bound to llm's runner, with a random head (written to
    `path` once) of the tests' tiny shape or Llama-3.1-8B's EAGLE3 head's."""
    from jaxserve.spec_decode.config import SpeculativeConfig
    from jaxserve.spec_decode.eagle3 import Eagle3Proposer

    write_head(path, llm.engine.config.model, tiny)
    head = Eagle3Proposer(SpeculativeConfig("eagle3", k, model=path), llm.engine.config)
    head.bind(llm.engine.runner.target_view())
    return head


def write_head(path: str, cfg, tiny: bool) -> str:
    """A random EAGLE3 head for the target `cfg` at `path` (written once: kept for the next
    run), of the tests' tiny shape or Llama-3.1-8B's EAGLE3 head's."""
    sys.path.insert(0, ROOT)
    from tests.spec_helpers import write_eagle3_head

    if not os.path.exists(os.path.join(path, "config.json")):
        shape = dict(aux_layers=(0, 1, 1)) if tiny else dict(heads=(32, 8, 128), intermediate_size=14336)
        write_eagle3_head(path, cfg, draft_vocab=64 if tiny else 32000, **shape)
    return path


def ngram_cost_ms(batch: int, context: int, k: int, vocab: int, repeats: int = 20) -> float:
    """Host ms of one n-gram proposal for `batch` requests of `context` tokens (vLLM's
    default lookup of 5 tokens down to 1; random tokens: the worst case, every length tried)."""
    from jaxserve.core.request import Request
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.spec_decode.config import SpeculativeConfig
    from jaxserve.spec_decode.ngram import NgramProposer

    rng = np.random.default_rng(1)
    reqs = [Request(str(i), rng.integers(0, vocab, size=context).tolist(), SamplingParams())
            for i in range(batch)]
    proposer = NgramProposer(SpeculativeConfig("ngram", k, 1, 5))
    proposer.propose(reqs, [k] * batch)          # the first call copies the prompts
    t = time.perf_counter()
    for _ in range(repeats):
        for r in reqs:                           # a step later: one new token each
            r.output_token_ids.append(int(rng.integers(0, vocab)))
        proposer.propose(reqs, [k] * batch)
    return 1e3 * (time.perf_counter() - t) / repeats


def load_target(tiny: bool, dtype: str):
    """(config, params, dtype) of the target: the tests' tiny Llama in f32, or dummy weights of
    the Llama-3.1-8B shape in `dtype`."""
    from jaxserve.models import loader

    if tiny:
        cfg, params, _ = loader.load_model(os.path.join(ROOT, "tests/golden/ckpt/llama"), dtype="float32")
        return cfg, params, "float32"
    cfg, params, _ = loader.load_model("Llama-3.1-8B", load_format="dummy", dtype=dtype)
    return cfg, params, dtype


def build_engine(args):
    from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from jaxserve.engine.builder import build_engine
    from jaxserve.engine.llm import LLM
    from jaxserve.models import registry

    cfg, params, dtype = load_target(args.tiny, args.dtype)
    max_len = args.prompt_len + args.output_len + 16
    blocks = max(args.batch_sizes) * -(-max_len // 16) + 8
    config = EngineConfig(
        model=cfg, cache=CacheConfig(block_size=16, num_kv_blocks=blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes),
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=max_len),
        dtype=dtype, warmup=not args.tiny)
    return LLM.from_engine(build_engine(config, params, None, registry.get_family(cfg.architecture)))


def timed(llm, prompts, n):
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]


def decode_rate(llm, prompts, n, rounds):
    """(decode tokens/s, the outputs) over `rounds` timed runs after one untimed."""
    timed(llm, prompts, n)
    rates, outs = [], None
    for _ in range(rounds):
        one, _ = timed(llm, prompts, 1)
        full, outs = timed(llm, prompts, n)
        rates.append(len(prompts) * (n - 1) / (full - one))
    return statistics.median(rates), outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny Llama (a CPU check)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--spec-tokens", type=int, nargs="+", default=[1, 3, 5])
    p.add_argument("--acceptance", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="the 8B shape's dtype (not --tiny)")
    p.add_argument("--max-passes", type=int, default=4, help="recording passes per k (fixed point)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="the drafted rows to run (module doc)")
    p.add_argument("--eagle3", action="store_true",
                   help="also rows at the cost of a chained EAGLE3 head (module doc)")
    p.add_argument("--eagle3-dir", default="/tmp/jaxserve_bench_eagle3_head",
                   help="where --eagle3's random head is written (kept for the next run)")
    args = p.parse_args()
    args.batch_sizes = args.batch_sizes or ([1, 4] if args.tiny else [1, 8, 32])
    args.prompt_len = args.prompt_len or (8 if args.tiny else 128)
    args.output_len = args.output_len or (32 if args.tiny else 128)
    if args.tiny:
        args.rounds = min(args.rounds, 2)

    from jaxserve.spec_decode.metrics import mean_acceptance_length
    from jaxserve.spec_decode.pacing import DraftPacing

    llm = build_engine(args)
    core, vocab = llm.engine.core, llm.engine.config.model.vocab_size
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    rng = np.random.default_rng(0)
    rows = []
    heads = {}                # k -> its Eagle3Proposer (the head's jitted chain is per k)
    for b in args.batch_sizes:
        prompts = [rng.integers(3, vocab, size=args.prompt_len).tolist() for _ in range(b)]
        core.proposer = None
        base, recorded_outs = decode_rate(llm, prompts, args.output_len, args.rounds)
        recorded = {tuple(pr): out for pr, out in zip(prompts, recorded_outs)}
        rows.append(dict(batch=b, k=0, acceptance=None, tokens_per_s=base, speedup=1.0))
        print(f"batch {b:3d}  no speculation        {base:9.1f} tok/s", flush=True)
        for k in args.spec_tokens:
            runner.return_hidden_states(False)
            scheduler.num_lookahead_tokens = 0
            runner.batch.max_spec_tokens = k                    # one K per verifying program
            fixed, passes = recorded, 0
            while passes < args.max_passes:                     # the drafts' fixed point
                passes += 1
                core.proposer = ReplayProposer(fixed, k, 1.0, vocab)
                _, outs = timed(llm, prompts, args.output_len)
                again = {tuple(pr): out for pr, out in zip(prompts, outs)}
                if again == fixed:
                    break
                fixed = again
            for proposer in tuple(args.modes) + (("eagle3", "eagle3-wait") if args.eagle3 else ()):
                core.launch_after_wait = proposer != "replay-wait-old"
                for acc in args.acceptance:
                    core.pacing = None if proposer == "replay-always" else DraftPacing()
                    if proposer.startswith("eagle3"):
                        if k not in heads:
                            heads[k] = eagle3_head(llm, k, args.tiny, args.eagle3_dir)
                        runner.return_hidden_states(aux_layers=heads[k].aux_layers)
                        kind = HeadCostReplay if proposer == "eagle3" else WaitingHeadCostReplay
                        core.proposer = kind(heads[k], fixed, k, acc, vocab)
                    else:
                        runner.return_hidden_states(False)
                        kind = WaitingReplay if proposer.startswith("replay-wait") else ReplayProposer
                        core.proposer = kind(fixed, k, acc, vocab)
                    scheduler.num_lookahead_tokens = core.proposer.num_lookahead_tokens
                    runner.batch.max_spec_tokens = k     # one K per verifying program
                    before, void0 = llm.get_metrics(), scheduler.num_void_chunks
                    rate, outs = decode_rate(llm, prompts, args.output_len, args.rounds)
                    row = dict(batch=b, k=k, acceptance=acc, proposer=proposer, tokens_per_s=rate,
                               speedup=rate / base,
                               mean_acceptance_length=mean_acceptance_length(before, llm.get_metrics()) or 1.0,
                               identical=outs == recorded_outs, recording_passes=passes,
                               void_chunks=scheduler.num_void_chunks - void0)
                    rows.append(row)
                    print(f"batch {b:3d}  k={k} p={acc:.1f} {proposer:15s} {rate:9.1f} tok/s  "
                          f"x{rate / base:4.2f}  acceptance length {row['mean_acceptance_length']:.2f}  "
                          f"void chunks {row['void_chunks']}  identical={row['identical']} "
                          f"passes={passes}", flush=True)
        core.proposer, core.pacing, core.launch_after_wait = None, DraftPacing(), True
        runner.return_hidden_states(False)
        scheduler.num_lookahead_tokens = 0
    ngram = {f"batch {b}, {n} tokens": ngram_cost_ms(b, n, 3, vocab)
             for b in args.batch_sizes for n in (512, 4096)}
    for name, ms in ngram.items():
        print(f"n-gram proposal on the host, {name}: {ms:.2f} ms per step", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"tiny": args.tiny, "prompt_len": args.prompt_len, "output_len": args.output_len,
                       "rows": rows, "ngram_host_ms_per_step": ngram}, f, indent=1)
    if (args.tiny or args.dtype == "float32") and not all(r.get("identical", True) for r in rows):
        sys.exit("greedy output with drafts differs from the output without them")


if __name__ == "__main__":
    main()
