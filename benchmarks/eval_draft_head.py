"""Engine acceptance of a trained EAGLE3 head for the default model with 3 chained drafts,
beside n-gram on the same prompts (16 ShareGPT first turns far past the ones trained on,
greedy, 64 tokens), and whether greedy output equals the output without speculation.

    python benchmarks/eval_draft_head.py SHAREGPT_JSON HEAD_DIR OUT_JSON
"""
import json, os, sys
from jaxserve import LLM, SamplingParams
from jaxserve.spec_decode.metrics import mean_acceptance_length
from jaxserve.bench.datasets import iter_json_array
gguf = os.path.expanduser("~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf")
sg = sys.argv[1]
convs = []
for rec in iter_json_array(sg):
    c = rec.get("conversations") or []
    if c and c[0].get("from") == "human" and 20 < len(c[0]["value"]) < 400:
        convs.append(c[0]["value"])
    if len(convs) >= 5016: break
prompts = [[{"role": "user", "content": p}] for p in convs[5000:5016]]   # far past the 2000 records trained on
p = SamplingParams(temperature=0, max_tokens=64)
res = {}
base = None
for name, spec in (("none", None), ("eagle3", {"method": "eagle3", "model": sys.argv[2], "num_speculative_tokens": 3}),
                   ("ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4})):
    llm = LLM(gguf, max_model_len=1024, max_num_seqs=16, speculative_config=spec)
    before = llm.get_metrics()
    outs = llm.chat(prompts, p, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    if base is None: base = toks
    res[name] = dict(mean_acceptance_length=mean_acceptance_length(before, llm.get_metrics()), identical=toks == base)
    print(name, res[name], flush=True)
    del llm
json.dump(res, open(sys.argv[3], "w"), indent=1)
