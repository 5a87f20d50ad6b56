"""`jaxserve generate`: OpenAI batch files through the CLI, on the default model."""

import asyncio
import json

from jaxserve import cli
from jaxserve.server.batch import BatchLine, parse_line, run_line
from jaxserve.models.loaders.default_model import DEFAULT_MODEL_NAME
from jaxserve.engine import AsyncEngine
from jaxserve.engine.trace import StepTrace

MALFORMED_AT, INVALID_AT = 4, 11
CHOICE_AT, SCHEMA_AT = 6, 9          # structured output: a choice, a JSON schema
CHOICES = ["red", "green", "blue"]


def _batch_lines() -> list[str]:
    lines = []
    for i in range(20):
        if i % 2:
            url = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": f"Name a color, {i}."}],
                    "max_tokens": 4 + i % 5, "temperature": 0}
        else:
            url = "/v1/completions"
            body = {"prompt": f"Counting: {i}, {i + 1},", "max_tokens": 8, "temperature": 0.7,
                    "seed": i}
        if i % 3 == 0:
            body["model"] = DEFAULT_MODEL_NAME
        if i == INVALID_AT:
            body["temperature"] = -1
        if i == CHOICE_AT:
            body["guided_choice"] = CHOICES
        if i == SCHEMA_AT:
            body["max_tokens"] = 12
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["n"], "additionalProperties": False}}}
        line = json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
        lines.append(line[:-7] if i == MALFORMED_AT else line)
    return lines


def test_generate_batch_file_keeps_order_and_reports_bad_lines(tmp_path, monkeypatch, capsys):
    traces = []
    make_engine = AsyncEngine.from_engine_args.__func__

    def traced_engine(cls, *args, **kwargs):      # watch the steps of the engine the CLI makes
        engine = make_engine(cls, *args, **kwargs)
        traces.append(StepTrace.attach(engine.engine))
        return engine

    monkeypatch.setattr(AsyncEngine, "from_engine_args", classmethod(traced_engine))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # A blank first line: messages count the file's lines, blank ones included.
    src.write_text("\n" + "\n".join(_batch_lines()) + "\n")
    rc = cli.main(["generate", "--input", str(src), "--output", str(dst), "--max-num-seqs", "16",
                   "--max-num-batched-tokens", "32", "--max-model-len", "256", "--num-kv-blocks", "64",
                   "--no-warmup", "--progress-every", "5"])
    assert rc == 0
    # stderr is not a terminal here: progress lines instead of a bar, then the summary.
    err = capsys.readouterr().err
    for done in (5, 10, 15):
        assert f"jaxserve batch: {done}/20 requests done" in err, err
    assert "20 requests in" in err and "18 succeeded, 2 failed" in err, err
    assert f"failed: line {MALFORMED_AT + 2}: not valid JSON" in err, err
    assert f"failed: line {INVALID_AT + 2}: invalid request: temperature" in err, err
    out = [json.loads(t) for t in dst.read_text().splitlines()]
    assert len(out) == 20
    errors = [i for i, o in enumerate(out) if o["error"] is not None]
    assert errors == [MALFORMED_AT, INVALID_AT]
    assert out[MALFORMED_AT]["custom_id"] is None          # unreadable line: no custom_id to echo
    assert out[INVALID_AT]["custom_id"] == f"req-{INVALID_AT}"
    for i in errors:
        assert out[i]["response"]["status_code"] == 400 and out[i]["response"]["body"] is None
        assert out[i]["error"]["type"] == "BadRequestError"
    assert out[INVALID_AT]["error"]["param"] == "temperature"
    for i, o in enumerate(out):
        if i in errors:
            continue
        assert o["custom_id"] == f"req-{i}"
        resp = o["response"]
        assert resp["status_code"] == 200
        body = resp["body"]
        assert resp["request_id"] == body["id"]
        assert body["model"] == DEFAULT_MODEL_NAME
        (choice,) = body["choices"]
        if i % 2:
            assert body["object"] == "chat.completion"
            assert choice["message"]["role"] == "assistant"
            assert body["usage"]["completion_tokens"] <= (12 if i == SCHEMA_AT else 4 + i % 5)
            if i == SCHEMA_AT:
                assert list(json.loads(choice["message"]["content"])) == ["n"]
        else:
            assert body["object"] == "text_completion"
            assert isinstance(choice["text"], str)
            assert body["usage"]["completion_tokens"] <= 8
            if i == CHOICE_AT:
                assert choice["text"] in CHOICES
        assert choice["finish_reason"] in ("stop", "length")
    # the lines ran together, not one after another
    (trace,) = traces
    assert max(len(step.chunks) for step in trace.steps) >= 4
    assert len(trace.request_ids()) == 18


def test_parse_line_names_the_problem():
    assert parse_line(0, "[1, 2]").error.status == 400
    assert parse_line(0, '{"url": "/v1/completions", "body": {}}').error.param == "custom_id"
    get = parse_line(0, '{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}')
    assert get.error.param == "method" and get.custom_id == "a"
    embed = parse_line(0, '{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}')
    assert embed.error.param == "url"
    ok = parse_line(3, '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}')
    assert ok.error is None and ok.index == 3 and ok.body == {"prompt": "x"}
    # The input file's line number, not the JSON decoder's "line 1 column 9 (char 8)".
    broken = parse_line(3, '{"custom_id": ', line_number=7)
    assert broken.error.message.startswith("line 7: not valid JSON") and "char" not in broken.error.message
    assert broken.line_number == 7


def test_run_line_refuses_streams_and_invalid_bodies_before_the_engine():
    def run(body):   # ctx=None: these must fail before anything touches the engine
        line = BatchLine(0, "a", "/v1/completions", body)
        return asyncio.run(run_line(None, line))

    stream = run({"prompt": "x", "stream": True})
    assert stream["error"]["param"] == "stream" and stream["response"]["status_code"] == 400
    wrong_type = run({"prompt": "x", "max_tokens": "8"})
    assert wrong_type["error"]["param"] == "max_tokens"
    assert wrong_type["custom_id"] == "a"


def test_unreadable_input_is_exit_code_1(tmp_path, capsys):
    rc = cli.main(["generate", "--input", str(tmp_path / "missing.jsonl"),
                   "--output", str(tmp_path / "out.jsonl")])
    assert rc == 1 and "missing.jsonl" in capsys.readouterr().err
