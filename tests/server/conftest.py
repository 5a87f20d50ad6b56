"""One real engine (the default model, f32, small limits) behind two real HTTP servers.

The engine is built once for the whole tests/server package: compiling its step programs is
what costs time on CPU. Offline reference outputs are computed with `jaxserve.LLM` first, and
then the same LLMEngine is handed to an AsyncEngine thread for the servers, so nothing
compiles twice. `server` has no API keys; `auth_server` shares the engine and requires one
of AUTH_KEYS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

ENGINE_ARGS = dict(dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=16,
                   max_logprobs=5, seed=0)
AUTH_KEYS = ("first-secret-key", "second-secret-key")

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]
# name -> (prompt str | chat messages, SamplingParams): computed offline, compared over HTTP.
REFERENCE_CASES = {
    "completion": ("The capital of France is", SamplingParams(temperature=0, max_tokens=12)),
    "completion_stop": ("One, two, three, four,", SamplingParams(temperature=0, max_tokens=16, stop=[" six"])),
    "completion_logprobs": ("Water boils at", SamplingParams(temperature=0, max_tokens=6, logprobs=3)),
    "chat": (CHAT, SamplingParams(temperature=0, max_tokens=12)),
    "chat_logprobs": (CHAT, SamplingParams(temperature=0, max_tokens=6, logprobs=2)),
}


@dataclass
class Served:
    engine: object
    url: str
    auth_url: str
    model: str
    reference: dict[str, RequestOutput]
    cases = REFERENCE_CASES
    chat = CHAT

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """/metrics as {name: value}; a labelled sample's name with its labels as written:
        'vllm:x_total{model_name="m"}'."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Waits until no request runs or waits and no KV block is in use; returns /metrics."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
                    and m["jaxserve:num_used_blocks"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


def _reference_outputs(llm) -> dict[str, RequestOutput]:
    out = {}
    for name, (prompt, params) in REFERENCE_CASES.items():
        if isinstance(prompt, str):
            out[name] = llm.generate([prompt], params, use_tqdm=False)[0]
        else:
            out[name] = llm.chat(prompt, params, use_tqdm=False)[0]
    return out


@pytest.fixture(scope="package")
def served():
    from jaxserve import LLM
    from jaxserve.engine import AsyncEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.context import ServerContext

    llm = LLM(None, **ENGINE_ARGS)
    reference = _reference_outputs(llm)
    engine = AsyncEngine(llm.engine)    # from here on the engine thread owns the LLMEngine
    names = (engine.model_name,)
    plain = BackgroundServer(build_app(ServerContext(engine, names))).start()
    auth = BackgroundServer(build_app(ServerContext(engine, names, api_keys=AUTH_KEYS))).start()
    try:
        yield Served(engine, plain.url, auth.url, engine.model_name, reference)
    finally:
        plain.stop()
        auth.stop()
        engine.shutdown()
