"""Signs of life and plain start-up facts a vLLM user looks for: the periodic statistics
line, warm-up progress, `serve` ready only when nothing is left to compile, the batch
file's progress on a log, and small error messages (issue 69)."""

from __future__ import annotations

import concurrent.futures
import io
import logging
import subprocess
import sys
import threading

import pytest

from jaxserve import cli
from jaxserve.engine.stats_log import StatsLogger
from jaxserve.metrics import EngineMetrics
from jaxserve.server.batch import BatchLine, BatchProgress
from jaxserve.worker.compiling import wait_all


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_stats_line_every_interval_while_working_and_quiet_when_idle():
    metrics, clock = EngineMetrics(), _Clock()
    stats = StatsLogger(metrics.as_dict, interval=10.0, clock=clock)
    clock.now = 9.0
    metrics.inc("generation_tokens", 50)
    assert stats.maybe_log() is None            # not yet time
    clock.now = 10.0
    metrics.inc("prompt_tokens", 200)
    metrics.set("num_requests_running", 2)
    metrics.set("kv_cache_usage_perc", 0.25)
    line = stats.maybe_log()
    assert line == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                    "Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 0.0%"), line
    clock.now = 20.0                            # the counts are since the last line
    metrics.inc("generation_tokens", 100)
    assert "Avg generation throughput: 10.0 tokens/s" in stats.maybe_log()
    metrics.set("num_requests_running", 0)
    clock.now = 40.0
    assert stats.maybe_log() is None            # idle: no line


def test_stats_line_names_the_draft_acceptance_rate():
    metrics, clock = EngineMetrics(), _Clock()
    stats = StatsLogger(metrics.as_dict, interval=1.0, clock=clock)
    metrics.inc("spec_decode_num_draft_tokens", 40)
    metrics.inc("spec_decode_num_accepted_tokens", 30)
    metrics.inc("generation_tokens", 35)
    clock.now = 1.0
    assert stats.maybe_log().endswith("Draft acceptance rate: 75.0%")


def _parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_serve_waits_for_every_program_unless_told_not_to():
    assert _parse("serve").warmup_all is True
    assert _parse("serve", "--no-warmup-all").warmup_all is False
    assert _parse("generate", "--input", "a", "--output", "b").warmup_all is False
    assert _parse("generate", "--input", "a", "--output", "b", "--warmup-all").warmup_all is True


def test_waiting_for_compiles_logs_progress(caplog):
    release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda: None), pool.submit(release.wait)]
        threading.Timer(0.3, release.set).start()
        with caplog.at_level(logging.INFO, logger="jaxserve.worker.compiling"):
            wait_all(futures, log_every=0.1)
    assert "compiling: 1 of 2 step programs done" in caplog.text


def test_batch_progress_on_a_log_also_every_few_seconds():
    stream = io.StringIO()
    progress = BatchProgress(total=1000, every=100, stream=stream, seconds=0.0)
    line = BatchLine(0, "a", "/v1/completions", {}, None, 1)
    progress.update(line, {"error": None})
    progress.update(line, {"error": None})
    assert stream.getvalue().count("requests done") == 2, stream.getvalue()
    quiet = io.StringIO()
    progress = BatchProgress(total=1000, every=100, stream=quiet, seconds=3600.0)
    progress.update(line, {"error": None})
    assert quiet.getvalue() == ""


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    from jaxserve.models.loaders.gguf import load_gguf

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=f"{bad}: not a readable GGUF file"):
        load_gguf(str(bad))


def test_bench_latency_help_shows_its_example_as_written():
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "latency", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    assert "--output-len 64 \\\n" in out and "/work/" not in out, out[:2000]
