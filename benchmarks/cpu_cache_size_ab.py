"""Issue 39's cache-size check on the CPU, side by side in one process: the default engine
(`LLM()`: 1 GiB of KV cache, max_model_len 2048, 16 sequences) against the same model with
a 32-block cache (max_model_len 256, one sequence), rounds alternating so both see the same
background load. Greedy, 64 new tokens, the same prompt; both must give the same tokens.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/cpu_cache_size_ab.py --rounds 5

ms per output token = (time of 64 new tokens - time of 1) / 63, the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SMALL = dict(num_kv_blocks=32, max_model_len=256, max_num_seqs=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    from jaxserve import LLM, SamplingParams

    engines = {"defaults": LLM(), "32 blocks": LLM(**SMALL)}
    for llm in engines.values():
        llm.engine.runner.wait_for_warmup()

    def generate(llm, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([args.prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        return time.perf_counter() - t, out

    tokens = {name: generate(llm, 2)[1] for name, llm in engines.items()}    # warm
    times = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            one, _ = generate(llm, 1)
            full, tokens[name] = generate(llm, args.output_len)
            times[name].append(1e3 * (full - one) / (args.output_len - 1))
    row = {name: {"num_kv_blocks": engines[name].engine.runner.num_blocks,
                  "ms_per_output_token": statistics.median(t), "rounds_ms": [round(x, 1) for x in t]}
           for name, t in times.items()}
    row["ratio"] = row["defaults"]["ms_per_output_token"] / row["32 blocks"]["ms_per_output_token"]
    row["same_tokens"] = tokens["defaults"] == tokens["32 blocks"]
    print(json.dumps(row))


if __name__ == "__main__":
    main()
