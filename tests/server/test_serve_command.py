"""`jaxserve serve` as a user runs it: flags reach the server, SIGTERM ends it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_flags_and_clean_sigterm():
    port = _free_port()
    # --no-warmup: nothing is compiled, as no request is generated here.
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--max-model-len", "128",
           "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--no-warmup",
           "--served-model-name", "my-model", "--api-key", "k1", "--api-key", "k2", "--log-level", "info"]
    proc = subprocess.Popen(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
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
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k2"}).json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("my-model", 128)]
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises SIGTERM once it has shut down, so the parent sees the signal.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        log = proc.stdout.read()
        assert "engine stopped" in log and "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
