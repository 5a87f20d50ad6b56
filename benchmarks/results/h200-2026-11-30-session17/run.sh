#!/usr/bin/env bash
# Session 17's device calls: bash benchmarks/results/h200-2026-11-30-session17/run.sh STAGE...
# (carry .whl and .benchdata; logs to $OUT). Stages: mosaic (mosaic_load.py save, bare,
# prepared: three processes); stages (stages.py); paged (paged_cudnn.py); tput16, tput64
# (bench throughput, session 15's tput, with --block-size 16 / 64); cold, warm, warm2 (the 8B engine's start-up
# bench, the command of BENCHMARKS.md "Start-up", its json kept as $OUT/start-STAGE.json);
# ref, stored (session 16's store_check.py with the program store off / on, through session
# 16's run.sh).
# Run 1: session 16's run.sh cold warm ref stored (code 21fd184). Run 2: this script's
# mosaic cold warm warm2 ref stored (code 07137fb), when every stage but mosaic went to
# session 16's run.sh: warm2 ran as a second "warm" there (run2.txt's second "=== warm"
# block) and only its json was kept. Run 3: stages (code afae747). Run 4: cold warm ref stored
# (code f99c0ef). Run 5: paged (code 2957ebe). Run 6: tput16 tput64 (2957ebe with these stages).
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
HERE=benchmarks/results/h200-2026-11-30-session17
bash benchmarks/results/h200-2026-11-30-session15/run.sh true > /dev/null   # set-up only
for stage in "$@"; do
  case $stage in
    mosaic) for s in save bare prepared; do
              echo "=== mosaic $s $(date -u +%H:%M:%S)"
              timeout 200 python3 $HERE/mosaic_load.py $s 2>&1 | grep -v Warning | tail -4
            done ;;
    stages) echo "=== stages $(date -u +%H:%M:%S)"
            timeout 500 python3 $HERE/stages.py 2>&1 | grep -v Warning
            echo "=== stages exit ${PIPESTATUS[0]} $(date -u +%H:%M:%S)" ;;
    paged) echo "=== paged $(date -u +%H:%M:%S)"
           timeout 500 python3 $HERE/paged_cudnn.py 2>&1 | grep -v Warning
           echo "=== paged exit ${PIPESTATUS[0]} $(date -u +%H:%M:%S)" ;;
    tput16|tput64) echo "=== $stage $(date -u +%H:%M:%S)"   # 1,000 ShareGPT prompts, KV blocks of 16 / 64
      timeout 280 python3 -m jaxserve.cli bench throughput Llama-3.1-8B --load-format dummy \
        --dtype bfloat16 --max-logprobs 0 --max-num-seqs 256 --max-num-batched-tokens 2048 \
        --max-model-len 2048 --attention-impl pallas --block-size ${stage#tput} \
        --dataset-name jsonl --dataset-path .benchdata/sharegpt1000.jsonl --num-prompts 1000 \
        --disable-tqdm --output-json "$OUT/$stage.json" 2>&1 | tail -4
      echo "=== $stage exit ${PIPESTATUS[0]} $(date -u +%H:%M:%S)" ;;
    cold|warm|warm2) echo "=== $stage $(date -u +%H:%M:%S)"
      bash benchmarks/results/h200-2026-11-30-session15/run.sh cold 2>&1 \
        | sed "s/^=== cold exit/=== $stage exit/" | grep -v "^=== cold [0-9]"
      mv "$OUT/cold-start.json" "$OUT/start-$stage.json" ;;   # the next stage writes cold-start.json again
    *) bash benchmarks/results/h200-2026-11-30-session16/run.sh "$stage" ;;
  esac
done
