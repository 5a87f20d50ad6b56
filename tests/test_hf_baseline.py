"""`jaxserve bench latency --baseline hf`: the prompts and lengths reach the transformers
script (a stand-in here: jaxserve's environment has no torch) and its JSON row comes back."""

from __future__ import annotations

import json
import sys

import pytest

from jaxserve.bench import hf_baseline, latency


def test_prompts_and_lengths_reach_the_baseline_script(tmp_path, monkeypatch):
    fake = tmp_path / "fake_hf.py"
    fake.write_text(
        "import argparse, json\n"
        "p = argparse.ArgumentParser()\n"
        "for a in ('--gguf', '--prompt-ids', '--output-len', '--num-iters'): p.add_argument(a)\n"
        "a = p.parse_args()\n"
        "ids = json.load(open(a.prompt_ids))\n"
        "print('loading...')\n"
        "print(json.dumps({'ms_per_output_token': 42.0, 'torch_threads': 2, 'ids': ids,\n"
        "                  'gguf': a.gguf, 'output_len': int(a.output_len)}))\n")
    monkeypatch.setattr(hf_baseline, "SCRIPT", str(fake))
    row = hf_baseline.run_hf_baseline(sys.executable, "/m/model.gguf", [[5, 6, 7]], 64, 2)
    assert row == {"ms_per_output_token": 42.0, "torch_threads": 2, "ids": [[5, 6, 7]],
                   "gguf": "/m/model.gguf", "output_len": 64}


def test_only_gguf_models_have_a_baseline():
    with pytest.raises(SystemExit, match="GGUF"):
        hf_baseline.model_gguf("some/hf_dir")


def test_the_latency_flags_parse():
    args = latency.build_parser().parse_args(["--engine-defaults", "--baseline", "hf",
                                              "--baseline-python", "/x/python"])
    assert args.engine_defaults and args.baseline == "hf" and args.baseline_python == "/x/python"
    assert latency.build_parser().parse_args([]).baseline is None
