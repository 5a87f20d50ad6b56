"""The engine's acceptance of a train-draft head on its run's held-out prompts (the held-out
split of OUTPUT/regenerated.jsonl), as train-draft's own report measures it
(evaluate.engine_acceptance: 3 chained drafts, greedy, beside n-gram, and whether greedy output
equals the output without speculation), here in float32 on any machine.

    python benchmarks/eval_draft_head_held_out.py HEAD_DIR REGENERATED_JSONL NUM_PROMPTS MAX_TOKENS
"""
import json
import sys
import time

from jaxserve.models import loader, registry
from jaxserve.train_draft.evaluate import engine_acceptance
from jaxserve.train_draft.regenerate import load_regenerated

head_dir, regenerated, n, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg, params, tok = loader.load_model(None, dtype="float32")            # the default model
_, held = load_regenerated(regenerated, 768, cfg.vocab_size)
prompts = [e.token_ids[:e.prompt_len].tolist() for e in held[:n]]
t0 = time.time()
report = engine_acceptance(cfg, params, tok, registry.get_family(cfg.architecture), "float32", head_dir,
                           prompts, max_tokens, 3)
print(json.dumps({"dtype": "float32", "seconds": round(time.time() - t0, 1), **report}))
