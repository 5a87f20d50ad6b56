"""n-gram acceptance on real text with the real default model (SmolLM2-135M-Instruct), CPU.

Prompts are passages of this repository's own documentation (README.md, ARCHITECTURE.md)
under three chat tasks: reprint the passage with its grammar corrected (an editing workload,
where prompt lookup shines), summarise it, and answer a question about it. Greedy decoding,
with and without n-gram speculation (outputs must be identical); prints the mean acceptance
length (tokens kept per verifying step) per task and the accepted tokens per draft position,
for the engine as it runs (pipelined: the drafts of step N+1 proposed before N is read, from
N's drafts and a guess of the token N samples after them) and, beside it ("waiting"), with the
engine waiting for each step and proposing from its kept tokens.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/spec_ngram_acceptance.py
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = {
    "edit": "Reprint the following text exactly, only correcting grammar mistakes:\n\n{p}",
    "summary": "Summarise the following text in three sentences:\n\n{p}",
    "question": "Read the text, then say what it describes and name the files it mentions.\n\n{p}",
}


def passages(n: int, words: int = 90) -> list[str]:
    text = " ".join(open(os.path.join(ROOT, f)).read() for f in ("README.md", "ARCHITECTURE.md"))
    tokens = [w for w in text.split() if not w.startswith(("|", "```", "#"))]
    step = max(1, (len(tokens) - words) // n)
    return [" ".join(tokens[i * step:i * step + words]) for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--spec-config", default='{"method": "ngram", "num_speculative_tokens": 3, '
                                             '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.spec_decode.metrics import mean_acceptance_length

    kw = dict(max_model_len=1024, max_num_seqs=8, warmup=False)
    plain, spec = LLM(**kw), LLM(speculative_config=json.loads(args.spec_config), **kw)
    waiting = LLM(speculative_config=json.loads(args.spec_config), **kw)
    waiting.engine.core.proposer.pipelines = False       # the core then waits for each step
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = {}
    for task, template in TASKS.items():
        convs = [[{"role": "user", "content": template.format(p=x)}] for x in passages(args.passages)]
        want = [o.outputs[0].token_ids for o in plain.chat(convs, params, use_tqdm=False)]
        for name, llm in (("pipelined", spec), ("waiting", waiting)):
            before = llm.get_metrics()
            got = [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
            after = llm.get_metrics()
            per_pos = {k.split("{")[1].rstrip("}"): after[k] - before.get(k, 0.0)
                       for k in after if k.startswith("spec_decode_num_accepted_tokens_per_pos")}
            rows[f"{task} {name}"] = row = {
                "mean_acceptance_length": mean_acceptance_length(before, after),
                "drafts": after["spec_decode_num_drafts_total"] - before["spec_decode_num_drafts_total"],
                "accepted_per_position": per_pos, "output_tokens": sum(map(len, got)),
                "identical": got == want}
            print(task, name, json.dumps(row), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"spec_config": json.loads(args.spec_config), "tasks": rows}, f, indent=1)


if __name__ == "__main__":
    main()
