#!/usr/bin/env bash
# Session 16's last device call: bash benchmarks/results/h200-2026-11-30-session16/run.sh STAGE...
# (carry .whl and .benchdata; logs to $OUT). Stages: cold (the 8B engine's start-up bench: the
# settings of BENCHMARKS.md "Start-up"), warm (the same command again), lp64 (the server with
# --long-prefill-token-threshold 64, 100 ShareGPT prompts at 4 req/s), ref / stored
# (store_check.py with the program store off / on). Run 5: cold warm lp64 (code 29ba299, no
# program store: warm = the persistent compilation cache alone); run 6: ref cold warm stored.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
HERE=benchmarks/results/h200-2026-11-30-session15
bash $HERE/run.sh true > /dev/null   # its set-up only (this checkout installed), for ref/stored
for stage in "$@"; do
  case $stage in
    cold|warm) echo "=== $stage $(date -u +%H:%M:%S)"
      bash $HERE/run.sh cold 2>&1 | grep -v "^=== cold"
      [ "$stage" = cold ] || mv "$OUT/cold-start.json" "$OUT/$stage-start.json" ;;
    ref|stored) echo "=== $stage $(date -u +%H:%M:%S)"
      timeout 200 python3 benchmarks/results/h200-2026-11-30-session16/store_check.py \
        "$([ "$stage" = stored ] && echo 1 || echo 0)" 2>&1 | grep -v Warning | tail -3 ;;
    lp64) (set --; source benchmarks/h200_suite.sh
           SERVE_PROMPTS=100 RATES=4 serve_run serve_lp64 --warmup-all --long-prefill-token-threshold 64) ;;
  esac
  echo "=== $stage exit $? $(date -u +%H:%M:%S)"
done
