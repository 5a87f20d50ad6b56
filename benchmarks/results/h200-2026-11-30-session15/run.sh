#!/usr/bin/env bash
# Session 15's device calls: bash benchmarks/results/h200-2026-11-30-session15/run.sh STAGE...
# (carry .whl and .benchdata; logs to $OUT). Stages: cold (the 8B engine's cold start-up, the
# first thing on a fresh machine), probe (stream_probe.py), tput (1,000 ShareGPT prompts).
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
HERE=benchmarks/results/h200-2026-11-30-session15
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
LLAMA=(Llama-3.1-8B --load-format dummy --dtype bfloat16 --max-logprobs 0 --max-num-seqs 256
       --max-num-batched-tokens 2048 --max-model-len 2048 --attention-impl pallas)
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    cold) timeout 200 python3 -m jaxserve.cli bench latency "${LLAMA[@]}" --batch-size 1 \
            --input-len 128 --output-len 16 --num-iters 1 --device-only-iters 0 --disable-tqdm \
            --output-json "$OUT/cold-start.json" 2>&1 | tail -8 ;;
    run2|run3|run4|run5|run6) timeout 420 python3 $HERE/sweeps.py $stage 2>&1 | grep -v Warning ;;
    probe) timeout 330 python3 $HERE/stream_probe.py 2>&1 | grep -v Warning ;;
    tput) timeout 200 python3 -m jaxserve.cli bench throughput "${LLAMA[@]}" --dataset-name jsonl \
            --dataset-path .benchdata/sharegpt1000.jsonl --num-prompts 1000 --disable-tqdm \
            --output-json "$OUT/tput.json" 2>&1 | tail -8 ;;
    *) "$stage" ;;
  esac
  echo "=== $stage exit ${PIPESTATUS[0]} $(date -u +%H:%M:%S)"
done
