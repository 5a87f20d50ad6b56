#!/usr/bin/env bash
# The H200 measurements behind BENCHMARKS.md, in two stages (each fits one device call):
#   bash benchmarks/h200_suite.sh latency   # HBM copy rate; decode latency of the 8B shape
#                                           # (Pallas and XLA attention), HF generate, the
#                                           # default model's shape; cold start-up
#   bash benchmarks/h200_suite.sh serving   # ShareGPT offline throughput; the HTTP server
#                                           # under load (needs fastapi & co. as wheels in .whl/)
#   bash benchmarks/h200_suite.sh decode serving2 variants
#                                           # the same, as run in the second session: cold and warm
#                                           # start-up, 1,000 ShareGPT prompts, TTFT/ITL with a real
#                                           # tokenizer (.benchdata/llama8b-dummy: the 8B config plus
#                                           # Llama-3's tokenizer.json), batch-1 variants
#   round6 .. round13                       # the third and fourth sessions' calls, one stage
#                                           # each (see each function's comment)
#   round15, round16                        # the fifth session's calls
#   round17                                 # the fifteenth session's serving and decode call
#   round9, round14                         # prepared, not yet run: what those sessions left
#                                           # unmeasured (round9's 30B throughput ran in round13
#                                           # and timed out; round14 gives it 420 s)
# Inputs: `bash benchmarks/prepare_benchdata.sh` builds .benchdata/ (ShareGPT requests, the
# dummy model directories with real tokenizers); run with `carry: [".benchdata", ".whl"]`.
# Results land in $OUT (default ./bench-out); every step has its own time limit, so one
# failure or hang leaves the others' figures.
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
SHAREGPT=${SHAREGPT:-.benchdata/sharegpt1000.jsonl}
JS=(python3 -m jaxserve.cli)
LLAMA=(Llama-3.1-8B --load-format dummy --dtype bfloat16 --max-logprobs 0)

step() {   # step SECONDS NAME CMD...: run with a limit, log everything, never stop the suite
  local limit=$1 name=$2; shift 2
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep -v -E "it/s\]|s/it\]" | tee -a "$LOG"
  echo "=== $name exit ${PIPESTATUS[0]} ($(date -u +%H:%M:%S))" | tee -a "$LOG"
}

setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || echo "pip install -e . failed" | tee -a "$LOG"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$LOG"
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$LOG"
}

latency() {
  step 60 hbm python3 benchmarks/hbm_bandwidth.py
  # (a) + (e): the first engine of a fresh machine is the cold start-up.
  step 150 lat_8b_pallas "${JS[@]}" bench latency "${LLAMA[@]}" --attention-impl pallas \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 3 --max-num-batched-tokens 1024 \
    --profile-dir /tmp/prof --disable-tqdm --output-json "$OUT/lat_8b_pallas.json"
  cp "$(ls -t /tmp/prof/batch1-*/plugins/profile/*/perfetto_trace.json.gz | head -1)" "$OUT/trace_8b_b1.json.gz" 2>/dev/null
  # (c) HF transformers generate, same shape, bf16, torch
  step 100 hf_8b python3 benchmarks/hf_generate_baseline.py models/configs/Llama-3.1-8B.json \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 2 --output-json "$OUT/hf_8b.json"
  # (b) the same with plain-XLA attention
  step 120 lat_8b_xla "${JS[@]}" bench latency "${LLAMA[@]}" --attention-impl xla \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 3 --max-num-batched-tokens 1024 \
    --disable-tqdm --output-json "$OUT/lat_8b_xla.json"
  # (d) the default model's shape (SmolLM2-135M; the GGUF itself is over the carry limit)
  step 90 lat_smollm2 "${JS[@]}" bench latency benchmarks/configs/SmolLM2-135M.json --load-format dummy \
    --dtype bfloat16 --max-logprobs 0 --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 3 \
    --max-num-batched-tokens 1024 --profile-dir /tmp/prof_smol --disable-tqdm --output-json "$OUT/lat_smollm2.json"
}

serving() {
  # One persistent compilation cache for the throughput run and the server: the server's
  # start-up below is then a warm one (the cold one is in the latency stage).
  export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  step 200 tput_sharegpt "${JS[@]}" bench throughput "${LLAMA[@]}" --dataset-name jsonl --dataset-path "$SHAREGPT" \
    --num-prompts "${NUM_PROMPTS:-500}" --max-num-seqs 256 --max-num-batched-tokens 2048 --max-model-len 2048 \
    --disable-tqdm --output-json "$OUT/tput_sharegpt.json"
  "${JS[@]}" serve "${LLAMA[@]}" --max-model-len 2048 --port 8011 --log-level warning >"$OUT/server.log" 2>&1 &
  local server=$!
  step 200 serve_sharegpt "${JS[@]}" bench serve --base-url http://127.0.0.1:8011 --wait-for-server 150 \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts "${SERVE_PROMPTS:-100}" \
    --request-rate ${RATES:-4 16} --goodput ttft:100 tpot:50 --disable-tqdm --output-json "$OUT/serve_sharegpt.json"
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
  step 80 dispatch python3 benchmarks/dispatch_cost.py --batch-size 1 64
}

ENGINE=(--max-num-seqs 256 --max-num-batched-tokens 2048 --max-model-len 2048)

decode() {
  # Cold start-up (the first engine of a fresh machine), batch 1 and 64, a profile of batch 1.
  step 240 lat_8b "${JS[@]}" bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 2 --profile-dir /tmp/prof \
    --disable-tqdm --output-json "$OUT/lat_8b.json"
  cp "$(ls -t /tmp/prof/batch1-*/plugins/profile/*/*.trace.json.gz /tmp/prof/batch1-*/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -1)" "$OUT/trace_b1.json.gz"
  # Warm start-up: the same engine again, its programs now in the persistent cache.
  step 120 warm_start "${JS[@]}" bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 --input-len 128 --output-len 16 --num-iters 1 --device-only-iters 0 \
    --disable-tqdm --output-json "$OUT/warm_start.json"
}

serving2() {
  local dir=.benchdata/llama8b-dummy
  step 240 tput "${JS[@]}" bench throughput "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts "${NUM_PROMPTS:-1000}" \
    --disable-tqdm --output-json "$OUT/tput.json"
  "${JS[@]}" serve "$dir" --load-format dummy --dtype bfloat16 --max-logprobs 0 "${ENGINE[@]}" \
    --port 8011 --log-level warning >"$OUT/server.log" 2>&1 &
  local server=$!
  step 240 serve "${JS[@]}" bench serve --base-url http://127.0.0.1:8011 --wait-for-server 150 \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts "${SERVE_PROMPTS:-150}" \
    --request-rate ${RATES:-4 16} --goodput ttft:100 tpot:50 --disable-tqdm --output-json "$OUT/serve.json"
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
}

variants() {
  # Batch-1 decode under alternatives, each compiled lazily (--no-warmup): fused rope/KV write
  # alone, fused add+RMSNorm alone, cuBLAS instead of XLA's Triton GEMMs.
  local common=("${JS[@]}" bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas --no-warmup
                --batch-size 1 --input-len 128 --output-len 64 --num-iters 1 --device-only-iters 20 --disable-tqdm)
  step 90 var_rope env JAXSERVE_FUSED_KERNELS=rope "${common[@]}" --output-json "$OUT/var_rope.json"
  step 90 var_norm env JAXSERVE_FUSED_KERNELS=norm "${common[@]}" --output-json "$OUT/var_norm.json"
  step 90 var_cublas env XLA_FLAGS=--xla_gpu_enable_triton_gemm=false "${common[@]}" --output-json "$OUT/var_cublas.json"
}

# jaxserve with one of this session's changes taken back, for attribution
NO_T1=(python3 -c "import sys, jaxserve.runner as r; r.SINGLE_TOKEN_BUCKET = False; from jaxserve.cli import main; sys.exit(main())")
NO_FUSE=(python3 -c "import sys, jaxserve.models.llama as m; del m.fuse_projections; from jaxserve.cli import main; sys.exit(main())")

round2() {
  # MoE grouped matmul at decode sizes: the expert-skipping kernel (with a tile sweep) against
  # lax.ragged_dot and grouped_matmul(auto).
  step 200 kernels_moe python3 benchmarks/kernels.py --only moe --quick --sweep --moe-auto-only \
    --json "$OUT/kernels_moe.json"
  decode_b1_b64
  # Batch 1 with the single-token bucket or the fused projections taken back.
  local b1=(bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas --no-warmup
            --batch-size 1 --input-len 128 --output-len 64 --num-iters 1 --device-only-iters 20 --disable-tqdm)
  step 90 var_no_t1 "${NO_T1[@]}" "${b1[@]}"
  step 90 var_no_fuse "${NO_FUSE[@]}" "${b1[@]}"
  step 150 lat_qwen3moe "${JS[@]}" bench latency Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 --max-num-seqs 16 --max-num-batched-tokens 128 --max-model-len 512 \
    --attention-impl pallas --batch-size 1 16 --input-len 64 --output-len 32 --num-iters 1 \
    --no-warmup --device-only-iters 0 --disable-tqdm --output-json "$OUT/lat_qwen3moe.json"
  SERVE_PROMPTS=100 serve_run serve_default
  SERVE_PROMPTS=100 serve_run serve_lp128 --long-prefill-token-threshold 128
}

round3() {
  decode_b1_b64              # first: the cold start-up of a fresh machine
  step 120 warm_start "${JS[@]}" bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 --input-len 128 --output-len 16 --num-iters 1 --device-only-iters 0 \
    --disable-tqdm --output-json "$OUT/warm_start.json"
  step 200 kernels_moe python3 benchmarks/kernels.py --only moe --quick --sweep --moe-auto-only \
    --json "$OUT/kernels_moe.json"
  step 150 lat_qwen3moe "${JS[@]}" bench latency Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 --max-num-seqs 16 --max-num-batched-tokens 128 --max-model-len 512 \
    --attention-impl pallas --batch-size 1 16 --input-len 64 --output-len 32 --num-iters 1 \
    --no-warmup --device-only-iters 0 --disable-tqdm --output-json "$OUT/lat_qwen3moe.json"
  step 240 tput "${JS[@]}" bench throughput "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts "${NUM_PROMPTS:-1000}" \
    --disable-tqdm --output-json "$OUT/tput.json"
  SERVE_PROMPTS=100 serve_run serve
}

# The server handing each request's output to the event loop on its own (before batching).
PER_REQUEST=(python3 -c "import sys; from jaxserve.engine import AsyncEngine as A; A._deliver_step = lambda self, outs: [self._deliver(o.request_id, o) for o in outs]; from jaxserve.cli import main; sys.exit(main())")

round4() {
  step 200 lat_8b "${JS[@]}" bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 1 --disable-tqdm --output-json "$OUT/lat_8b.json"
  step 120 warm_start "${JS[@]}" bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 --input-len 128 --output-len 16 --num-iters 1 --device-only-iters 0 \
    --disable-tqdm --output-json "$OUT/warm_start.json"
  SERVE_PROMPTS=100 serve_run serve
  SERVE_PROMPTS=100 SERVER=PER_REQUEST serve_run serve_per_request
  step 150 lat_qwen3moe "${JS[@]}" bench latency Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 --max-num-seqs 16 --max-num-batched-tokens 128 --max-model-len 512 \
    --attention-impl pallas --batch-size 1 16 --input-len 64 --output-len 32 --num-iters 1 \
    --no-warmup --device-only-iters 0 --disable-tqdm --output-json "$OUT/lat_qwen3moe.json"
}

round5() {   # the server alone on a fresh machine (cold start-up), one rate per client run
  "${JS[@]}" serve .benchdata/llama8b-dummy --load-format dummy --dtype bfloat16 --max-logprobs 0 \
    "${ENGINE[@]}" --port 8011 --log-level warning >"$OUT/serve5.log" 2>&1 &
  local server=$!
  for rate in 4 16; do
    step 150 "serve_rate$rate" "${JS[@]}" bench serve --base-url http://127.0.0.1:8011 --wait-for-server 120 \
      --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts 100 --request-rate $rate \
      --goodput ttft:100 tpot:50 --disable-tqdm --output-json "$OUT/serve_rate$rate.json"
  done
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
}

QWEN8=(Qwen3-8B --load-format dummy --dtype bfloat16 --max-logprobs 0)

round6() {   # third session, first call: attention and norm kernel sweeps, the Qwen3-8B shape
  step 260 kernels python3 benchmarks/kernels.py --only attention,rmsnorm --quick --sweep \
    --json "$OUT/kernels.json"
  step 150 lat_qwen3_8b "${JS[@]}" bench latency "${QWEN8[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 1 --disable-tqdm \
    --output-json "$OUT/lat_qwen3_8b.json"
  step 120 hf_qwen3_8b python3 benchmarks/hf_generate_baseline.py models/configs/Qwen3-8B.json \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 1 --output-json "$OUT/hf_qwen3_8b.json"
}

round7() {   # third session, second call: throughput at the Qwen3 shapes, a warm server
  step 150 kernels python3 benchmarks/kernels.py --only rmsnorm,attention --quick --sweep \
    --json "$OUT/kernels.json"
  export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  step 200 tput_qwen3_8b "${JS[@]}" bench throughput "${QWEN8[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts 1000 --disable-tqdm \
    --output-json "$OUT/tput_qwen3_8b.json"
  # the 8B server waiting for every program before /health, then ITL at 4 and 16 req/s
  SERVE_PROMPTS=100 serve_run serve_warm --warmup-all
  SERVE_PROMPTS=100 RATES=4 serve_run serve_lp64 --warmup-all --long-prefill-token-threshold 64
  step 150 hf_qwen3_moe python3 benchmarks/hf_generate_baseline.py models/configs/Qwen3-30B-A3B.json \
    --batch-size 1 16 --input-len 64 --output-len 32 --num-iters 1 --output-json "$OUT/hf_qwen3_moe.json"
}

round8() {   # third session, last call: the Mosaic GPU prefill kernel in the engine (kernel
             # check, 1,000 ShareGPT prompts), ITL with short prefill chunks, the XLA baseline
             # at the Qwen3-8B shape
  step 90 kernels python3 benchmarks/kernels.py --only attention --quick --json "$OUT/kernels.json"
  step 150 tput "${JS[@]}" bench throughput "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts 1000 --disable-tqdm \
    --output-json "$OUT/tput.json"
  SERVE_PROMPTS=100 serve_run serve_lp64 --warmup-all --long-prefill-token-threshold 64
  step 90 lat_qwen3_8b_xla "${JS[@]}" bench latency "${QWEN8[@]}" "${ENGINE[@]}" --attention-impl xla \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 1 --disable-tqdm \
    --output-json "$OUT/lat_qwen3_8b_xla.json"
}

# jaxserve with the Mosaic GPU attention kernel declined (Triton for every batch), for attribution
NO_MGPU=(python3 -c "import sys, jaxserve.pallas_kernels.ragged_paged_attention_mgpu as m; m.supports = lambda *a, **k: False; from jaxserve.cli import main; sys.exit(main())")

round9() {   # prepared for the next session: what the third session left unmeasured
  # cold start-up with the Mosaic programs in the large buckets (a fresh machine: run first)
  step 200 lat_8b "${JS[@]}" bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 1 --disable-tqdm \
    --output-json "$OUT/lat_8b.json"
  # the 38.8 -> 44.0 req/s gain: the same run with the Mosaic kernel declined
  step 150 tput_no_mgpu "${NO_MGPU[@]}" bench throughput "${LLAMA[@]}" "${ENGINE[@]}" \
    --attention-impl pallas --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts 1000 \
    --disable-tqdm --output-json "$OUT/tput_no_mgpu.json"
  # the server at the Qwen3-8B shape with Qwen's tokenizer (Mosaic kernel in the large steps)
  SERVE_PROMPTS=100 SERVE_DIR=.benchdata/qwen3-8b-dummy serve_run serve_qwen3_8b --warmup-all
  step 220 tput_qwen3_moe "${JS[@]}" bench throughput Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 "${ENGINE[@]}" --attention-impl pallas --dataset-name jsonl --dataset-path "$SHAREGPT" \
    --num-prompts 1000 --disable-tqdm --output-json "$OUT/tput_qwen3_moe.json"
}

round10() {   # fourth session: decode attention, our Mosaic GPU kernel's decode configuration
              # and its sweep beside the Triton kernel and cuDNN (all six decode cases)
  step 400 kernels_decode python3 benchmarks/kernels.py --only decode --sweep \
    --json "$OUT/kernels_decode.json"
}

round11() {   # fourth session: the MoE router kernel, one-token projections, the Qwen3-30B-A3B
              # step with the router kernel, sort-free grouping and two-row projections
  step 120 kernels_moe python3 benchmarks/kernels.py --only router,linear,moe --quick --moe-auto-only \
    --json "$OUT/kernels_moe.json"
  step 200 lat_qwen3_moe "${JS[@]}" bench latency Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 --max-num-seqs 16 --max-num-batched-tokens 128 --max-model-len 512 \
    --attention-impl pallas --batch-size 1 16 --input-len 64 --output-len 32 --num-iters 1 \
    --profile-dir /tmp/prof_moe --disable-tqdm --output-json "$OUT/lat_qwen3_moe.json"
}

round12() {   # fourth session, last call: the step and kernels after this session's changes
  step 100 kernels python3 benchmarks/kernels.py --only attention,router --quick \
    --json "$OUT/kernels.json"
  step 150 lat_qwen3_moe "${JS[@]}" bench latency Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 --max-num-seqs 16 --max-num-batched-tokens 128 --max-model-len 512 \
    --attention-impl pallas --batch-size 1 16 --input-len 64 --output-len 32 --num-iters 1 \
    --disable-tqdm --output-json "$OUT/lat_qwen3_moe.json"
  step 150 tput "${JS[@]}" bench throughput "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts 1000 --disable-tqdm \
    --output-json "$OUT/tput.json"
}

round13() {   # fourth session: Qwen3-30B-A3B offline throughput (every MoE path: the sort-free
              # grouping up to 512 rows, argsort above), and the 8B run with the Mosaic kernel declined
  step 240 tput_qwen3_moe "${JS[@]}" bench throughput Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 "${ENGINE[@]}" --attention-impl pallas --dataset-name jsonl --dataset-path "$SHAREGPT" \
    --num-prompts 1000 --disable-tqdm --output-json "$OUT/tput_qwen3_moe.json"
  step 150 tput_no_mgpu "${NO_MGPU[@]}" bench throughput "${LLAMA[@]}" "${ENGINE[@]}" \
    --attention-impl pallas --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts 1000 \
    --disable-tqdm --output-json "$OUT/tput_no_mgpu.json"
}

round14() {   # prepared for the next session: what the fourth session left unmeasured
  # the Qwen3-30B-A3B batch-1 step at the final code, traced (what 4.12 -> 3.61 ms came from)
  step 150 lat_qwen3_moe "${JS[@]}" bench latency Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 --max-num-seqs 16 --max-num-batched-tokens 128 --max-model-len 512 \
    --attention-impl pallas --batch-size 1 --input-len 64 --output-len 32 --num-iters 1 \
    --profile-dir /tmp/prof_moe --disable-tqdm --output-json "$OUT/lat_qwen3_moe.json"
  # offline throughput at that shape: 240 s was not enough for set-up and compiles
  step 420 tput_qwen3_moe "${JS[@]}" bench throughput Qwen3-30B-A3B --load-format dummy --dtype bfloat16 \
    --max-logprobs 0 "${ENGINE[@]}" --attention-impl pallas --dataset-name jsonl --dataset-path "$SHAREGPT" \
    --num-prompts 1000 --disable-tqdm --output-json "$OUT/tput_qwen3_moe.json"
}

round15() {   # fifth session: attention after the split-merge kernel, one-token decode tiles and
              # the new split rule (decode sweep, prefill, cuDNN beside), then the 8B step
  step 420 kernels_attention python3 benchmarks/kernels.py --only attention --sweep \
    --json "$OUT/kernels_attention.json"
}

round16() {   # fifth session: the 8B decode step (batch 1 and 64) at the new attention defaults
  decode_b1_b64
}

round17() {   # fifteenth session: the HTTP server under load with the final code (its skewed
              # decode programs compiled in warm-up's background batch), and the decode table
              # of benchmarks/kernels.py beside cuDNN
  SERVE_PROMPTS=100 serve_run serve_warm --warmup-all
  SERVE_PROMPTS=100 RATES=4 serve_run serve_lp64 --warmup-all --long-prefill-token-threshold 64
  step 200 kernels_decode python3 benchmarks/kernels.py --only decode --json "$OUT/kernels_decode.json"
}

decode_b1_b64() {
  step 240 lat_8b "${JS[@]}" bench latency "${LLAMA[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 2 --profile-dir /tmp/prof \
    --disable-tqdm --output-json "$OUT/lat_8b.json"
  cp "$(ls -t /tmp/prof/batch1-*/plugins/profile/*/*.trace.json.gz /tmp/prof/batch1-*/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -1)" "$OUT/trace_b1.json.gz"
}

serve_run() {   # serve_run NAME [engine flags...]: the server on the 8B shape with Llama-3's
                # tokenizer (a text chunk per token; SERVE_DIR picks another model directory),
                # ShareGPT at request rates $RATES
  local name=$1; shift
  local -n server_cmd=${SERVER:-JS}
  "${server_cmd[@]}" serve "${SERVE_DIR:-.benchdata/llama8b-dummy}" --load-format dummy --dtype bfloat16 --max-logprobs 0 \
    "${ENGINE[@]}" "$@" --port 8011 --log-level warning >"$OUT/$name.log" 2>&1 &
  local server=$!
  step 200 "$name" "${JS[@]}" bench serve --base-url http://127.0.0.1:8011 --wait-for-server 150 \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts "${SERVE_PROMPTS:-150}" \
    --request-rate ${RATES:-4 16} --goodput ttft:100 tpot:50 --disable-tqdm --output-json "$OUT/$name.json"
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
}

setup
for stage in "$@"; do "$stage"; done
echo "=== done ($(date -u +%H:%M:%S))" | tee -a "$LOG"
