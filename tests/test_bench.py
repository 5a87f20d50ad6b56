"""Smoke tests of `jaxserve bench` on CPU: the dataset reader, the statistics, and each
benchmark run for real on the default model at tiny sizes (one engine for all of them;
serve talks to that engine behind the real HTTP app on a loopback port)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

import pytest

from jaxserve.bench import datasets, report
from jaxserve.bench.serve import parse_goodput, run_load, summarize

ENGINE_ARGS = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                   num_kv_blocks=64, max_logprobs=0, warmup=False)


# -- datasets -------------------------------------------------------------------------------
def _conversation(i: int, human: str, gpt: str, turns: int = 2) -> dict:
    convs = [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}][:turns]
    return {"id": f"c{i}", "conversations": convs}


def test_json_array_reader_keeps_complete_records_of_a_cut_file(tmp_path):
    records = [_conversation(i, f"question {i} " * 3, "answer " * 5) for i in range(50)]
    text = json.dumps(records, indent=2)
    cut = text[: int(len(text) * 0.7)]          # ends in the middle of a record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    got = list(datasets.iter_json_array(str(path)))
    assert 0 < len(got) < 50
    assert got == records[: len(got)]
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert list(datasets.iter_json_array(str(whole))) == records


def test_json_array_reader_refuses_non_arrays(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="JSON array"):
        list(datasets.iter_json_array(str(path)))


class _WordTokenizer:
    """One token per word, ids from a running vocabulary."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab) + 100) for w in text.split()]


def test_sharegpt_sampling_applies_vllms_filter(tmp_path):
    records = [
        _conversation(0, "one two three four five", "a b c d e f"),      # kept
        _conversation(1, "too short", "a b c d e f"),                      # prompt < 4
        _conversation(2, "one two three four five", "a b"),               # output < 4
        _conversation(3, "w " * 1100, "a b c d e"),                        # prompt > 1024
        _conversation(4, "w " * 1000, "x " * 1100),                        # total > 2048
        _conversation(5, "one two three four five", "a b c d", turns=1),   # < 2 turns
        _conversation(6, "six seven eight nine", "g h i j"),               # kept
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    reqs = datasets.sample_sharegpt(str(path), _WordTokenizer(), 2, vocab_size=200)
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(4, 4), (5, 6)]
    assert all(0 <= t < 200 for r in reqs for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="num_prompts=3"):
        datasets.sample_sharegpt(str(path), _WordTokenizer(), 3)


def test_random_requests_and_jsonl_round_trip(tmp_path):
    reqs = datasets.random_requests(20, 16, 8, vocab_size=5000, range_ratio=0.5, seed=3)
    assert all(8 <= r.prompt_len <= 24 and 4 <= r.output_len <= 12 for r in reqs)
    assert all(0 <= t < 5000 for r in reqs for t in r.prompt_token_ids)
    path = str(tmp_path / "reqs.jsonl")
    datasets.save_requests(path, reqs)
    back = datasets.load_requests(path, 20)
    assert [(r.prompt_token_ids, r.output_len) for r in back] == [(r.prompt_token_ids, r.output_len) for r in reqs]
    with pytest.raises(ValueError, match="range_ratio"):
        datasets.random_requests(1, 4, 4, 100, range_ratio=1.5)


# -- statistics ------------------------------------------------------------------------------
def test_percentile_and_goodput_parsing():
    assert report.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert report.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(report.percentile([], 50))
    assert parse_goodput(["ttft:100", "tpot:50"]) == {"ttft": 0.1, "tpot": 0.05}
    with pytest.raises(SystemExit, match="NAME:MILLISECONDS"):
        parse_goodput(["latency:5"])


def test_bench_cli_dispatch(capsys):
    from jaxserve.bench import main

    assert main(["--help"]) == 0
    assert "latency" in capsys.readouterr().out
    assert main(["nonsense"]) == 2


def test_serve_bench_takes_vllms_random_length_flags():
    from jaxserve.bench.serve import build_parser

    args = build_parser().parse_args(["--dataset-name", "random", "--random-input-len", "32",
                                      "--random-output-len", "8"])
    assert (args.dataset_name, args.input_len, args.output_len) == ("random", 32, 8)
    assert build_parser().parse_args(["--input-len", "7"]).input_len == 7   # our names still work


# -- the benchmarks, on the real default model ----------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from jaxserve import LLM

    return LLM(None, **ENGINE_ARGS)


def test_latency_bench_runs_in_process(llm):
    from jaxserve.bench.latency import bench_batch

    args = argparse.Namespace(input_len=8, output_len=4, num_iters=1, num_iters_warmup=0,
                              device_only_iters=2, hbm_bandwidth=None, profile_dir=None,
                              top_p=0.8, top_k=20, temperature=1.0)   # truncation in the timed steps
    row = bench_batch(llm, 2, args)
    assert row["batch_size"] == 2 and row["latency_mean_s"] > 0
    assert row["num_decode_steps"] >= 1 and row["ms_per_output_token"] > 0
    assert row["decode_tok_per_s"] == pytest.approx(2e3 / row["ms_per_output_token"])
    assert row["step_host_ms"] > 0 and row["step_device_ms"] >= 0     # medians: need not add up
    assert 0 < row["roofline_fraction"] and row["device_only_step_ms"] > 0
    assert 0.1 < row["weight_gb"] < 1.0                  # 135M parameters in f32
    assert not llm.engine.has_unfinished_requests()


def test_latency_bench_says_when_no_step_decoded_the_whole_batch(llm, capsys):
    # 4 prompts of 30 tokens through 32-token steps: the first finishes its 2 tokens before
    # the last leaves prefill, so no decode step holds all 4 and there is nothing to replay
    from jaxserve.bench.latency import bench_batch

    args = argparse.Namespace(input_len=30, output_len=2, num_iters=1, num_iters_warmup=0,
                              device_only_iters=2, hbm_bandwidth=None, profile_dir=None,
                              top_p=1.0, top_k=0, temperature=1.0)
    row = bench_batch(llm, 4, args)
    assert row["latency_mean_s"] > 0 and "device_only_step_ms" not in row
    assert "no decode step held all 4 requests" in capsys.readouterr().err


def test_throughput_bench_runs_in_process(llm):
    from jaxserve.bench.throughput import run_throughput

    reqs = datasets.random_requests(5, 10, 3, llm.engine.config.model.vocab_size, range_ratio=0.3)
    row = run_throughput(llm, reqs, use_tqdm=False)
    assert row["num_requests"] == 5
    assert row["output_tokens"] == sum(r.output_len for r in reqs)
    assert row["requests_per_s"] > 0 and row["output_tok_per_s"] > 0
    assert row["num_steps"] >= max(r.output_len for r in reqs)


def test_serve_bench_against_the_real_http_app(llm):
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    from jaxserve.engine import AsyncEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.context import ServerContext

    engine = AsyncEngine(llm.engine)        # last test: the engine thread owns it from here on
    try:
        with BackgroundServer(build_app(ServerContext(engine, (engine.model_name,)))) as server:
            reqs = datasets.random_requests(4, 6, 3, vocab_size=llm.engine.config.model.vocab_size, seed=1)
            results, duration = asyncio.run(run_load(server.url, engine.model_name, reqs, request_rate=50.0,
                                                     max_concurrency=2, use_tqdm=False))
            bad = asyncio.run(run_load(server.url, "no-such-model", reqs[:1], request_rate=math.inf,
                                       max_concurrency=None, use_tqdm=False))[0]
    finally:
        engine.shutdown()
    assert all(r.success for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [r.output_len for r in reqs]
    assert all(r.ttft > 0 and r.e2el >= r.ttft for r in results)
    row = summarize(results, duration, {"ttft": 60.0})
    assert row["completed"] == 4 and row["failed"] == 0
    assert row["goodput_req_per_s"] == pytest.approx(row["requests_per_s"])
    assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0
    assert not bad[0].success and "404" in bad[0].error


def test_profile_summary_counts_a_windows_device_kernels():
    """summarize_events: device kernels inside each marked window (not the host's, not those
    outside), their busy time as a union, averaged over the windows."""
    from jaxserve.bench.profile import host_time_by_name, summarize_events

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    span = lambda pid, name, ts, dur: {"ph": "X", "pid": pid, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = meta + [span(1, "step", 0, 100), span(1, "step", 200, 100),
                     span(2, "gemm_fusion_dot", 10, 20), span(2, "fusion", 20, 20),   # overlap: 30 busy
                     span(2, "ragged_paged_attention", 210, 10), span(2, "fusion", 150, 10),
                     span(1, "host_thing", 20, 50)]
    s = summarize_events(events, "step")
    assert s["windows"] == 2 and s["kernels_per_window"] == 1.5
    assert s["wall_ms"] == pytest.approx(0.1) and s["device_busy_ms"] == pytest.approx(0.02)
    assert s["device_ms_by_kind"]["attention"] == pytest.approx(0.005)
    # by name: the fusion at 150 is outside both windows
    assert s["top_kernels_launches"] == {"gemm_fusion_dot": 0.5, "fusion": 0.5,
                                         "ragged_paged_attention": 0.5}
    assert s["top_kernels_ms"]["fusion"] == pytest.approx(0.01)
    host = host_time_by_name(events, "step")               # the host's events, per window
    assert host == {"host_thing": pytest.approx(0.025)}


def test_roofline_counts_only_the_experts_a_batch_reaches():
    import numpy as np

    from jaxserve.bench import roofline

    experts = np.zeros((8, 4, 2), np.float32)               # X=8 experts, 64 elements each
    layer = {"router": np.zeros((4, 8), np.float32), "w_up": experts,
             "w_down": (experts[:3], experts[3:])}           # whole and as expert chunks
    dense = 4 * 8 * 4
    # one token, top-2 of 8: 2 experts of each array
    assert roofline.touched_param_bytes([layer], 8, 2, 1) == pytest.approx(dense + 2 * 2 * 8 * 4 * 2 * 4 / 8)
    assert roofline.expected_experts(10_000, 8, 2) == pytest.approx(8)
    assert roofline.touched_param_bytes([layer], 8, 2, 10_000) == pytest.approx(roofline.param_bytes([layer]))
    assert roofline.touched_param_bytes([layer], 0, 0, 1) == roofline.param_bytes([layer])
    # an untied embedding: the step gathers its tokens' rows; tied, it is the LM head, read whole
    embed, head = np.zeros((100, 4), np.float32), np.zeros((4, 100), np.float32)
    untied = {"embed": embed, "lm_head": head, "layers": [layer]}
    assert roofline.decode_weight_bytes(untied, 8, 2, 3) == pytest.approx(
        roofline.touched_param_bytes([layer], 8, 2, 3) + head.nbytes + 3 * 4 * 4)
    tied = {"embed": embed, "layers": [layer]}
    assert roofline.decode_weight_bytes(tied, 8, 2, 3) == pytest.approx(
        roofline.touched_param_bytes([layer], 8, 2, 3) + embed.nbytes)


def test_latency_bench_runs_the_hf_baseline_after_each_timed_iteration(llm, tmp_path, monkeypatch):
    """Interleaved (issue 68): one baseline run after each of ours, medians of both, greedy."""
    from jaxserve.bench import hf_baseline
    from jaxserve.bench.latency import bench_batch

    calls = tmp_path / "calls"
    fake = tmp_path / "fake_hf.py"
    fake.write_text(
        "import json, sys\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "n = len(open(" + repr(str(calls)) + ").readlines())\n"
        "print(json.dumps({'ms_per_output_token': 10.0 * n, 'torch_threads': 2, 'prefill_s': 0.05}))\n")
    monkeypatch.setattr(hf_baseline, "SCRIPT", str(fake))
    monkeypatch.setattr(hf_baseline, "model_gguf", lambda model: "/m/model.gguf")
    args = argparse.Namespace(input_len=8, output_len=4, num_iters=3, num_iters_warmup=1,
                              device_only_iters=0, hbm_bandwidth=None, profile_dir=None,
                              top_p=1.0, top_k=0, temperature=0.0, baseline="hf",
                              baseline_python=sys.executable, model=None)
    row = bench_batch(llm, 1, args)
    runs = calls.read_text().splitlines()
    assert len(runs) == 3 and all("--num-iters 1" in r for r in runs), runs
    assert row["hf_ms_per_output_token"] == 20.0 and row["hf_ttft_ms"] == pytest.approx(50.0)
    assert row["ratio_to_hf"] == pytest.approx(row["ms_per_output_token"] / 20.0)
    assert row["ttft_ms"] > 0
