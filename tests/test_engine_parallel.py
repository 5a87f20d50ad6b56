"""Tensor and expert parallel engines (8 fake CPU devices, in a subprocess so the device
count does not leak into other tests) generate what one device generates."""

import json
import os
import subprocess
import sys

import pytest

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "ckpt")

SCRIPT = r"""
import json, sys
from jaxserve import LLM, SamplingParams
path, tp, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(path, dtype="float32", tensor_parallel_size=tp, expert_parallel_size=ep, max_num_seqs=4,
          max_num_batched_tokens=32, max_model_len=64, warmup=False)
prompts = [{"prompt_token_ids": [3, 17, 42, 9, 100][: n]} for n in (2, 5)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def run(name, tp, ep):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SCRIPT, os.path.join(GOLDEN, name), str(tp), str(ep)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name,tp,ep", [("llama", 2, 1), ("qwen3_moe", 2, 2)])
def test_parallel_engine_matches_one_device(name, tp, ep):
    assert run(name, tp, ep) == run(name, 1, 1)
