"""The engine's defaults where there is no GPU (LLM(), `jaxserve serve` on a laptop, CI).

Since issue 39 a CPU step costs what its tokens and contexts cost: the attention walks each
step's keys only up to its furthest position and the cache is written in place, so neither
the cache's size nor max_model_len is paid per token (tests/test_cpu_step_cost.py). The
values below are therefore chosen for memory and start-up, not speed:

- KV_CACHE_BYTES: 1 GiB holds 1,456 blocks of the default model (SmolLM2-135M, f32): all 16
  sequences at 2,048 tokens would need 2,049, so about 11 full-length ones fit; the runner
  takes no more than max_num_seqs full-length sequences need.
- MAX_NUM_SEQS: 16 users at once; a bucket's rows cost matmul work on a CPU, and a lone
  decode runs in its own one-token bucket whatever this is.
- MAX_NUM_BATCHED_TOKENS: 256, the largest bucket: 6 buckets (1, 16, ..., 256), 12 step
  programs to compile at start-up; a long prompt is prefilled 256 tokens a step.
- MAX_MODEL_LEN: 2,048 (or the model's own limit, if lower).
"""

from __future__ import annotations

KV_CACHE_BYTES = 1 << 30
MAX_NUM_SEQS = 16
MAX_NUM_BATCHED_TOKENS = 256
MAX_MODEL_LEN = 2048
