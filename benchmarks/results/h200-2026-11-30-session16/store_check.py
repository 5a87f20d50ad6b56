"""Greedy tokens of the 8B engine (dummy weights, the start-up bench's settings) with its step
programs traced and compiled (program_cache off: argv[1] == "0") or loaded from the program
store that the CLI fills (argv[1] == "1"), with the seconds each way: the loaded programs must
give the same tokens. Session 16, run 6."""
import json, sys, time
t0 = time.perf_counter()
from jaxserve import LLM, SamplingParams   # noqa: E402

llm = LLM("Llama-3.1-8B", load_format="dummy", dtype="bfloat16", max_logprobs=0,
          max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048,
          attention_impl="pallas", program_cache=sys.argv[1] == "1")
built = time.perf_counter() - t0
prompts = [{"prompt_token_ids": list(range(100 + 37 * i, 140 + 61 * i))} for i in range(6)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
print(json.dumps({"program_cache": sys.argv[1] == "1", "process_to_engine_s": round(built, 2),
                  "seconds": {k: round(v, 2) for k, v in llm.engine.runner.compile_seconds.items()},
                  "tokens": [o.outputs[0].token_ids for o in outs]}), flush=True)
