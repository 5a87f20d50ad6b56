"""A stand-in engine for the app's own tests: it answers every request with "ok" and records
the SamplingParams it got, so a 200 means the request went all the way through the app."""

from __future__ import annotations

from types import SimpleNamespace

from jaxserve.outputs import CompletionOutput, RequestOutput


class StubTokenizer:
    vocab_size = 100

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return " ".join(m["content"] for m in messages)


class RecordingEngine:
    model_name = "stub"
    tokenizer = StubTokenizer()
    is_healthy = True
    config = SimpleNamespace(scheduler=SimpleNamespace(max_model_len=64),
                             model=SimpleNamespace(vocab_size=100), max_logprobs=5)

    def __init__(self):
        self.params = []

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        self.params.append(sampling_params)
        yield RequestOutput(request_id, prompt, list(prompt_token_ids),
                            [CompletionOutput(0, "ok", [1], finish_reason="length")], finished=True)

    async def abort(self, request_id):
        pass
