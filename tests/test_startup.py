"""start_engine's glue, with the engine stubbed (no model loads): the flags' checks come before
loading, a load failure is a StartupError, the cache check and --chat-template are applied to
the engine that was built, and an engine that cannot serve is shut down again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve import cli
from jaxserve.engine import AsyncEngine
from jaxserve.engine.checks import StartupError
from jaxserve.server.startup import start_engine


class _FakeTokenizer:
    """The Tokenizer calls start-up makes (trial_render), recorded."""
    def __init__(self):
        self.hf = SimpleNamespace(chat_template="the model's")
        self.calls = []

    def apply_chat_template(self, messages):
        self.calls.append(("template", self.hf.chat_template))
        return "rendered"

    def encode(self, text):
        self.calls.append(("encode", text))
        return [1, 2]

    def decode(self, ids):
        self.calls.append(("decode", ids))
        return "text"


class _FakeEngine:
    def __init__(self, num_blocks: int):
        self.tokenizer = _FakeTokenizer()
        self.config = SimpleNamespace(cache=SimpleNamespace(block_size=16, num_kv_blocks=num_blocks),
                                      scheduler=SimpleNamespace(max_model_len=256))
        self.engine = SimpleNamespace(runner=SimpleNamespace(num_blocks=num_blocks),
                                      startup_seconds={"load": 0.1, "warmup": 0.2})
        self.stopped = False
        self.logging_stats = False

    def log_stats(self):
        self.logging_stats = True

    def shutdown(self):
        self.stopped = True


@pytest.fixture
def built(monkeypatch):
    """Replaces AsyncEngine.from_engine_args; returns the list of engines it made."""
    engines = []

    def fake(cls, model=None, **kwargs):
        if kwargs.get("max_model_len") == 999:
            raise ValueError("max_model_len must be <= the model's max_position_embeddings (256)")
        engines.append(_FakeEngine(kwargs["num_kv_blocks"]))
        return engines[-1]

    monkeypatch.setattr(AsyncEngine, "from_engine_args", classmethod(fake))
    return engines


def _args(tmp_path, *flags):
    (tmp_path / "config.json").write_text("{}")    # any existing folder passes the model check
    return cli.build_parser().parse_args(["serve", str(tmp_path), "--generation-config", "vllm", *flags])


def test_chat_template_reaches_the_tokenizer(tmp_path, built):
    engine, defaults = start_engine(_args(tmp_path, "--num-kv-blocks", "17", "--chat-template", "{{ x }}"))
    assert engine.tokenizer.hf.chat_template == "{{ x }}" and defaults == {} and not engine.stopped
    # the template, tokenizer and detokenizer ran once at start-up, with the template given
    # (trial_render: their first-use costs are not the first request's)
    assert engine.tokenizer.calls == [("template", "{{ x }}"), ("encode", "rendered"), ("decode", [1, 2])]
    assert engine.logging_stats        # vLLM's periodic statistics line, unless turned off
    engine, _ = start_engine(_args(tmp_path, "--num-kv-blocks", "17", "--disable-log-stats"))
    assert not engine.logging_stats


def test_an_engine_that_cannot_serve_is_refused_and_stopped(tmp_path, built):
    with pytest.raises(StartupError, match="at least 17"):
        start_engine(_args(tmp_path, "--num-kv-blocks", "16"))
    assert built[0].stopped


def test_flag_problems_come_before_loading(tmp_path, built):
    with pytest.raises(StartupError, match="--chat-template"):
        start_engine(_args(tmp_path, "--chat-template", "no-such-template.jinja"))
    with pytest.raises(StartupError, match="--generation-config"):
        start_engine(cli.build_parser().parse_args(["serve", str(tmp_path), "--generation-config",
                                                    str(tmp_path / "nowhere")]))
    assert built == []


def test_a_load_failure_is_a_startup_error(tmp_path, built):
    with pytest.raises(StartupError, match="max_position_embeddings"):
        start_engine(_args(tmp_path, "--max-model-len", "999"))


def test_log_lines_go_to_the_stderr_of_the_moment(monkeypatch):
    """jaxserve's handler writes to sys.stderr as it is when a line is logged: a notebook or a
    test that swapped it and closed the old one gets no "--- Logging error ---" lines."""
    import io
    import logging
    import sys

    from jaxserve.server.startup import configure_logging

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info")
    first.close()
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    logging.getLogger("jaxserve.test").info("a line")
    assert "a line" in now.getvalue() and "Logging error" not in now.getvalue()
