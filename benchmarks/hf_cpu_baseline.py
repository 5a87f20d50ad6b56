"""Baseline on the CPU: Hugging Face transformers `generate` on the same model file jaxserve
serves (by default the embedded SmolLM2-135M-Instruct GGUF, which transformers dequantizes),
greedy, f32, so the ratio of `jaxserve bench latency --baseline hf` is reproducible.

Runs where torch and transformers are installed (not jaxserve's environment):

    /work/ref311/bin/python benchmarks/hf_cpu_baseline.py --output-len 64
    /work/ref311/bin/python benchmarks/hf_cpu_baseline.py --prompt-ids ids.json --output-len 64

ms per output token = (median time of generate for `--output-len` new tokens - median time
for 1 new token) / (output_len - 1): decode only, as jaxserve's median decode step. Prints
one JSON line. Nothing is downloaded: the GGUF must be in jaxserve's cache (or --gguf).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# This folder holds kernels.py, which transformers would import for the `kernels` package
# (then fails: "Could not import module 'LlamaConfig'").
sys.path = [x for x in sys.path if os.path.abspath(x or ".") != os.path.dirname(os.path.abspath(__file__))]

DEFAULT_GGUF = os.path.join(os.environ.get("JAXSERVE_CACHE") or
                            os.path.join(os.path.expanduser("~"), ".cache", "jaxserve"),
                            "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_gguf_model(path: str):
    """The GGUF's model in f32, dequantized by transformers' GGUF reader. Not through
    from_pretrained(gguf_file=): that needs accelerate, which the reference env lacks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):     # the reader maps GGUF names to this model's
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"{path}: missing {missing}, unexpected {unexpected}")
    return model.eval()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=DEFAULT_GGUF, help="the model file (default: jaxserve's default model)")
    p.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    p.add_argument("--prompt-ids", default=None,
                   help="a JSON file holding a list of prompts, each a list of token ids "
                        "(one per sequence of the batch; overrides --prompt)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    folder, name = os.path.split(args.gguf)
    t0 = time.perf_counter()
    model = load_gguf_model(args.gguf)
    load_s = time.perf_counter() - t0
    if args.prompt_ids:
        with open(args.prompt_ids) as f:
            prompts = json.load(f)
    else:
        prompts = [AutoTokenizer.from_pretrained(folder, gguf_file=name)(args.prompt)["input_ids"]]
    if len({len(x) for x in prompts}) != 1:
        raise SystemExit("--prompt-ids: every prompt must have the same length (no padding here)")
    ids = torch.tensor(prompts, dtype=torch.long)

    def timed(new_tokens: int) -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=model.config.eos_token_id)
            assert out.shape[1] == ids.shape[1] + new_tokens
            return time.perf_counter() - t

    timed(2)                                                   # warm-up
    one = statistics.median(timed(1) for _ in range(args.num_iters))
    full = statistics.median(timed(args.output_len) for _ in range(args.num_iters))
    row = {"engine": "transformers", "transformers": transformers.__version__,
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "model": args.gguf, "batch_size": len(prompts), "input_len": ids.shape[1],
           "output_len": args.output_len, "load_s": load_s, "prefill_s": one,
           "generate_s": full, "ms_per_output_token": 1e3 * (full - one) / (args.output_len - 1)}
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
