"""`jaxserve serve` as a user runs it: vLLM's flags reach the server; SIGTERM with streams in
flight ends each with an error event and [DONE], exit status 0, no traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from jaxserve.server.app import GRACEFUL_SHUTDOWN_S

KEY = "k1"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream_to_the_end(url: str, body: dict, first_chunk: threading.Event, events: list) -> None:
    """Reads one SSE stream into `events` (the data of each event), setting `first_chunk` once
    a choice arrived."""
    with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if '"choices":[{' in line:
                    first_chunk.set()
    first_chunk.set()


def test_serve_flags_and_sigterm_with_open_streams():
    port = _free_port()
    # --no-warmup: only the programs the streams use compile. VLLM_API_KEY: vLLM's variable.
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--max-model-len", "1k",
           "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--no-warmup",
           "--served-model-name", "my-model", "other-name", "--uvicorn-log-level", "info",
           "--disable-log-requests", "--enable-chunked-prefill", "--gpu-memory-utilization", "0.5",
           # vLLM's no-ops (a line each at start) and --enable-log-requests (a line per request)
           "--enforce-eager", "--kv-cache-dtype", "auto", "--swap-space", "4", "--enable-log-requests"]
    proc = subprocess.Popen(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu", "VLLM_API_KEY": KEY},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up within 120 s"
            time.sleep(0.25)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/version").status_code == 200 and httpx.get(url + "/docs").status_code == 200
        models = httpx.get(url + "/v1/models", headers=HEADERS).json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("my-model", 1000),
                                                                          ("other-name", 1000)]

        # Two streams far from their end (ignore_eos, 900 tokens), then SIGTERM.
        streams = []
        for model in ("my-model", "other-name"):
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                    "stream": True}
            first, events = threading.Event(), []
            thread = threading.Thread(target=_stream_to_the_end,
                                      args=(url + "/v1/completions", body, first, events), daemon=True)
            thread.start()
            streams.append((thread, first, events))
        for _, first, _ in streams:
            assert first.wait(120), "no stream started within 120 s"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < GRACEFUL_SHUTDOWN_S + 15
        for thread, _, events in streams:
            thread.join(timeout=10)
            assert not thread.is_alive()
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            # Ended early with an error event (the engine stopped), not cut off.
            assert last["error"]["type"] == "ServiceUnavailableError", last
            assert last["error"]["code"] == "engine_stopped", last
        log = proc.stdout.read()
        assert "engine stopped" in log and "Traceback" not in log, log
        assert "ready in" in log and "loading" in log, log
        assert log.count("accepted for vLLM's command lines and ignored") == 3, log
        assert "--enforce-eager: accepted" in log and "--kv-cache-dtype auto: accepted" in log
        assert log.count("received request") == 2 and "Once upon a time" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_port_in_use_fails_before_loading():
    """A port another socket holds: exit 1 naming host:port, before the model loads (no
    'loading' line) and with no 'serving … on' line."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--load-format", "dummy"]
        done = subprocess.run(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "loading" not in done.stderr and "serving" not in done.stderr, done.stderr
