"""`jaxserve bench latency --baseline hf`: the same prompts through Hugging Face transformers
on the CPU (benchmarks/hf_cpu_baseline.py, run by an interpreter that has torch, which
jaxserve's own environment need not have), so the ratio of the two is measured in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "benchmarks", "hf_cpu_baseline.py")


def model_gguf(model: str | None) -> str:
    """The GGUF file transformers reads for `model` (None: jaxserve's default model)."""
    if model is None:
        from jaxserve.models.loaders import default_model
        return default_model.ensure_default_model()
    if not model.endswith(".gguf"):
        raise SystemExit(f"--baseline hf reads a GGUF file (or the default model); got {model!r}")
    return model


def run_hf_baseline(python: str, model: str | None, prompts: list[list[int]], output_len: int,
                    num_iters: int) -> dict:
    """benchmarks/hf_cpu_baseline.py's JSON row for `prompts` (token ids, one per sequence)."""
    if not os.path.isfile(SCRIPT):
        raise SystemExit(f"--baseline hf needs {SCRIPT} (a source checkout of jaxserve)")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    try:
        cmd = [python, SCRIPT, "--gguf", model_gguf(model), "--prompt-ids", f.name,
               "--output-len", str(output_len), "--num-iters", str(num_iters)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"--baseline hf: {' '.join(cmd)} exited with {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])
