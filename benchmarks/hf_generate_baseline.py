"""Baseline: Hugging Face transformers `generate` on a random-weight model of a given config,
in bf16 on one CUDA GPU (torch), at the same batch sizes and lengths as `jaxserve bench latency`.

    python benchmarks/hf_generate_baseline.py jaxserve/models/configs/Llama-3.1-8B.json \
        --batch-size 1 64 --input-len 128 --output-len 128 --output-json hf.json

Per batch size: the median time of `generate` for 1 new token (prefill) and for
`--output-len` new tokens (greedy, no EOS stop); decode ms per token is their difference
over `output_len - 1`. `--cache-implementation static` gives `generate` a static KV cache,
with which transformers compiles the decode step with torch.compile itself (the strongest HF
set-up on this GPU; the first calls compile, hence the warm-up). Needs torch with CUDA and
transformers; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time


def main() -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a HF config.json")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--cache-implementation", default=None,
                   help='passed to generate: "static" (compiled decode step) or the default dynamic cache')
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    config = AutoConfig.from_pretrained(args.config)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())

    def timed(batch: int, new_tokens: int) -> float:
        ids = torch.randint(1000, config.vocab_size, (batch, args.input_len), device="cuda")
        mask = torch.ones_like(ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            extra = {"cache_implementation": args.cache_implementation} if args.cache_implementation else {}
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **extra)
        torch.cuda.synchronize()
        assert out.shape[1] == args.input_len + new_tokens, out.shape
        return time.perf_counter() - t

    rows = []
    for batch in args.batch_size:
        timed(batch, 4)                                   # warm-up: kernels, allocator, compiles
        if args.cache_implementation:                     # each cache length compiles once
            timed(batch, 1), timed(batch, args.output_len)
        prefill = statistics.median(timed(batch, 1) for _ in range(args.num_iters))
        full = statistics.median(timed(batch, args.output_len) for _ in range(args.num_iters))
        per_token = (full - prefill) / (args.output_len - 1)
        rows.append({"batch_size": batch, "generate_s": full, "prefill_s": prefill,
                     "ms_per_output_token": 1e3 * per_token, "decode_tok_per_s": batch / per_token})
    result = {"benchmark": "hf_generate", "torch": torch.__version__, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name(), "config": args.config, "build_s": build_s,
              "cache_implementation": args.cache_implementation,
              "weight_gb": weight_bytes / 1e9, "input_len": args.input_len, "output_len": args.output_len,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
              "results": rows}
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
