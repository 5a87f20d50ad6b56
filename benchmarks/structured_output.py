"""Issue 35's structured-output cost: N concurrent requests, each with its own JSON schema,
against the same requests unconstrained, in one process (rounds alternate so both see the
same machine), plus the schemas' compile times.

    python benchmarks/structured_output.py --model .benchdata/llama8b-dummy --load-format dummy \
        --num-requests 64 --output-len 128 --rounds 2

NOTE: dummy weights cannot write meaningful JSON; what is measured is the mask's cost (host
fill, the lean masked step program, and the engine waiting for each step so that every
matcher has consumed its token before its next mask). Each schema is an object with a
bounded integer, an enum and a free string: random weights stay inside the string, so the
matcher is live on every step, and ignore_eos keeps both runs at exactly output-len tokens.
The model folder must hold a tokenizer (the grammars need the vocabulary as text):
.benchdata/llama8b-dummy has Llama-3's (benchmarks/prepare_benchdata.sh).

Prints one JSON line: tokens/s of each run, their ratio, compile seconds p50 / p99 (cold, one
distinct schema each), and the host milliseconds per step spent filling masks (llguidance's
fills alone, and the whole of a step's masks: catching up, with drafts advancing the matchers
over them and rolling back; without drafts this includes the wait for the in-flight step's ids).

--ab adds a third run, the constrained requests with the masks filled before one program (the
path before issue 67: `runner.late_masks = False`), rounds interleaved in the same process,
and where the host waited: per step, its wait for the last step's ids (the masks), and for the
device when reading a step back (collect).

With speculation (issue 35: a mask per draft row), both runs draft, e.g.
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
and the line adds each run's mean acceptance length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def schema(i: int) -> dict:
    return {"type": "object",
            "properties": {f"id_{i}": {"type": "integer", "minimum": 0, "maximum": 10 ** (i % 6 + 1)},
                           f"kind_{i}": {"enum": [f"a{i}", f"b{i}", f"c{i}"]},
                           f"note_{i}": {"type": "string"}},
            "required": [f"id_{i}", f"kind_{i}", f"note_{i}"], "additionalProperties": False}


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=".benchdata/llama8b-dummy")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-compile-schemas", type=int, default=200,
                   help="distinct schemas compiled cold for the compile-time percentiles")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--attention-impl", default="auto")
    p.add_argument("--speculative-config", default=None, help="vLLM's speculative_config as JSON")
    p.add_argument("--ab", action="store_true",
                   help="also the constrained run with the masks filled before one program (the old path)")
    args = p.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.spec_decode import metrics as spec_metrics
    from jaxserve.structured import StructuredOutputsParams, masks

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, max_logprobs=0,
              attention_impl=args.attention_impl,
              speculative_config=json.loads(args.speculative_config) if args.speculative_config else None)
    llm.engine.runner.wait_for_warmup()      # the masked programs compile in the background
    grammars = llm.engine.grammars
    if grammars is None:
        raise SystemExit(f"{args.model} has no tokenizer: structured output needs one")

    # Compile times: distinct schemas, none cached (offset past the throughput runs' ones).
    base = 10_000
    grammars.ll_tokenizer                     # built once (about 1 s for 128K tokens), not timed
    compile_s = []
    for i in range(args.num_compile_schemas):
        t = time.perf_counter()
        grammars.check(StructuredOutputsParams(json=schema(base + i)))
        compile_s.append(time.perf_counter() - t)

    fill = {"seconds": 0.0, "step_seconds": 0.0, "steps": 0}
    real_fill = masks.fill_masks

    def timed_fill(*a, **k):
        t = time.perf_counter()
        real_fill(*a, **k)
        fill["seconds"] += time.perf_counter() - t

    masks.fill_masks = timed_fill
    real_step_masks = masks.fill_step_masks

    def timed_step_masks(*a, **k):
        t = time.perf_counter()
        real_step_masks(*a, **k)
        fill["step_seconds"] += time.perf_counter() - t
        fill["steps"] += 1

    masks.fill_step_masks = timed_step_masks
    runner, structured = llm.engine.runner, llm.engine.core.structured
    waits = {"ids": 0.0, "collect": 0.0}

    def timer(name, real):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                waits[name] += time.perf_counter() - t
        return timed

    structured.last_sampled = timer("ids", structured.last_sampled)
    runner.collect = timer("collect", runner.collect)

    vocab = llm.engine.config.model.vocab_size
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % (vocab // 2) + 3 for j in range(args.input_len)]}
               for i in range(args.num_requests)]

    def params(constrained: bool):
        return [SamplingParams(temperature=0.8, seed=i, max_tokens=args.output_len, ignore_eos=True,
                               output_kind="final_only",
                               structured_outputs=StructuredOutputsParams(json=schema(i)) if constrained else None)
                for i in range(args.num_requests)]

    kinds = ["unconstrained", "constrained"] + (["constrained_one_program"] if args.ab else [])
    acceptance = {k: [] for k in kinds}
    host = {k: {"ids_wait_ms": [], "collect_wait_ms": [], "steps": []} for k in kinds}

    def run(kind: str) -> float:
        runner.late_masks = kind != "constrained_one_program"
        before, steps0 = llm.get_metrics(), llm.engine.num_steps
        waits.update(ids=0.0, collect=0.0)
        t = time.perf_counter()
        outs = llm.generate(prompts, params(kind != "unconstrained"), use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == args.num_requests * args.output_len, tokens
        steps = max(llm.engine.num_steps - steps0, 1)
        host[kind]["ids_wait_ms"].append(round(1e3 * waits["ids"] / steps, 3))
        host[kind]["collect_wait_ms"].append(round(1e3 * waits["collect"] / steps, 3))
        host[kind]["steps"].append(steps)
        if args.speculative_config:
            acceptance[kind].append(spec_metrics.mean_acceptance_length(before, llm.get_metrics()))
        print(f"# {kind}: {tokens / seconds:.1f} tok/s, {steps} steps, host waits per step: ids "
              f"{host[kind]['ids_wait_ms'][-1]} ms, collect {host[kind]['collect_wait_ms'][-1]} ms", flush=True)
        return tokens / seconds

    for kind in kinds:                         # warm: the schemas compile here, once
        run(kind)
    fill.update(seconds=0.0, step_seconds=0.0, steps=0)
    for v in list(acceptance.values()) + [h for k in kinds for h in host[k].values()]:
        v.clear()
    tps = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            tps[kind].append(run(kind))
    runner.late_masks = True
    med = {k: statistics.median(v) for k, v in tps.items()}
    print(json.dumps({
        "num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
        "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
        "rounds_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in tps.items()},
        "constrained_over_unconstrained": round(med["constrained"] / med["unconstrained"], 3),
        **({"one_program_over_unconstrained": round(med["constrained_one_program"] / med["unconstrained"], 3)}
           if args.ab else {}),
        "host_waits_ms_per_step": host,
        "compile_ms": {"p50": round(1e3 * percentile(compile_s, 50), 2),
                       "p99": round(1e3 * percentile(compile_s, 99), 2),
                       "max": round(1e3 * max(compile_s), 2), "schemas": len(compile_s)},
        "mask_fill_ms_per_step": round(1e3 * fill["seconds"] / max(fill["steps"], 1), 3),
        "step_masks_ms_per_step": round(1e3 * fill["step_seconds"] / max(fill["steps"], 1), 3),
        "mask_fill_steps": fill["steps"],
        **({"speculative_config": json.loads(args.speculative_config),
            "mean_acceptance_length": {k: [None if x is None else round(x, 3) for x in v]
                                       for k, v in acceptance.items()}}
           if args.speculative_config else {}),
    }))


if __name__ == "__main__":
    main()
