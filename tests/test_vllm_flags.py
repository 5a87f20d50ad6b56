"""A vLLM user's `vllm serve` command line: every flag of vLLM's list (tests/data/
vllm_serve_flags.txt) is ours, a no-op with one log line, or refused with one line saying why,
never "unrecognized"; and the flags implemented for it (--tokenizer, --return-tokens-as-token-ids,
--enable-log-requests) do what vLLM's do."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex

import types

import pytest

from jaxserve import cli
from jaxserve.engine import vllm_flags
from jaxserve.engine.args import engine_kwargs
from jaxserve.engine.checks import StartupError
from jaxserve.engine.vllm_flags import OURS, VLLM_FLAGS, noop_notes

DATA = os.path.join(os.path.dirname(__file__), "data", "vllm_serve_flags.txt")
TABLE = {f.name: f for f in VLLM_FLAGS}


def _vllm_lines() -> list[list[str]]:
    with open(DATA, encoding="utf-8") as f:
        return [shlex.split(line, posix=False) for line in f
                if line.strip() and not line.startswith("#")]


LINES = _vllm_lines()


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _parse(argv: list[str], capsys):
    """(namespace, None) or (None, the error's lines) for `jaxserve serve ARGV`."""
    try:
        return _serve_parser().parse_args(argv), None
    except SystemExit:
        return None, capsys.readouterr().err.strip().splitlines()


def test_the_list_is_vllms_and_the_table_covers_it():
    names = {argv[0] for argv in LINES}
    assert len(names) >= 150 and "--enforce-eager" in names and "--kv-cache-dtype" in names
    missing = names - set(OURS) - set(TABLE)
    assert not missing, f"vLLM flags with no handling here: {sorted(missing)}"
    assert not set(OURS) & set(TABLE)     # each flag handled one way


@pytest.mark.parametrize("argv", LINES, ids=[" ".join(a) for a in LINES])
def test_every_vllm_serve_flag_is_ours_a_noop_or_refused_in_one_line(argv, capsys):
    args, error = _parse(argv, capsys)
    flag = TABLE.get(argv[0])
    if flag is None:                   # ours: parses, with vLLM's meaning
        assert error is None, error
        assert not noop_notes(args)
        return
    handling, reason = flag.handling(argv[1] if len(argv) > 1 else None)
    if handling == "no-op":
        assert error is None, error
        (note,) = noop_notes(args)
        assert note.startswith(" ".join(argv)) and reason in note
    else:
        assert args is None
        assert error[-1] == f"jaxserve serve: error: {' '.join(argv)}: {reason}"
        assert error[0].startswith("usage: jaxserve serve")
        assert not any("unrecognized" in line for line in error)


def test_the_issues_command_line_starts(capsys):
    argv = ("--enforce-eager --kv-cache-dtype auto --tokenizer DIR --revision main "
            "--return-tokens-as-token-ids --enable-log-requests --swap-space 4 "
            "--disable-custom-all-reduce --max-seq-len-to-capture 8192 "
            "--distributed-executor-backend mp --async-scheduling --pipeline-parallel-size 1").split()
    args, error = _parse(argv, capsys)
    assert error is None, error
    assert len(noop_notes(args)) == 9           # one line each for the no-ops
    assert args.tokenizer == "DIR" and args.return_tokens_as_token_ids and args.enable_log_requests


def test_refusals_name_what_to_use(capsys):
    _, error = _parse(["--kv-cache-dtype", "fp8"], capsys)
    assert "FP8 KV cache is not implemented" in error[-1] and "leave --kv-cache-dtype out" in error[-1]
    _, error = _parse(["--pipeline-parallel-size", "2"], capsys)
    assert "--tensor-parallel-size" in error[-1]


def test_a_noop_flag_is_logged_at_start_up(monkeypatch, caplog):
    from jaxserve.engine import AsyncEngine
    from jaxserve.server import startup

    def no_engine(**kwargs):
        raise ValueError("stop here")
    monkeypatch.setattr(AsyncEngine, "from_engine_args", no_engine)
    args = _serve_parser().parse_args(["Llama-3.1-8B", "--load-format", "dummy", "--enforce-eager",
                                       "--swap-space", "4"])
    with caplog.at_level(logging.INFO, logger="jaxserve"), pytest.raises(StartupError):
        startup.start_engine(args)
    lines = [r.getMessage() for r in caplog.records if "accepted for vLLM's command lines" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("--enforce-eager:") and "CUDA graphs" in lines[0]


def test_auto_tool_choice_without_a_parser_is_refused_at_start(monkeypatch):
    args = _serve_parser().parse_args(["--enable-auto-tool-choice"])
    with pytest.raises(StartupError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        vllm_flags.check_vllm_combinations(args)
    vllm_flags.check_vllm_combinations(
        _serve_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))


def test_auto_tool_choice_without_a_parser_is_one_line_from_the_command(capsys):
    assert cli.main(["serve", "--enable-auto-tool-choice"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxserve serve: error: --enable-auto-tool-choice needs --tool-call-parser "
                   "(deepseek_v3, deepseek_v31, deepseek_v32, hermes, llama3_json, minimax_m2, mistral, "
                   "pythonic, qwen3_coder, qwen3_xml), as in vLLM: the server must know how to read the "
                   "model's tool calls"]


@pytest.mark.parametrize("flag,name", [("--reasoning-parser", "deepseek"), ("--tool-call-parser", "qwen3")])
def test_unknown_parser_names_are_refused_at_start_listing_the_known_ones(flag, name, capsys):
    args, lines = _parse([flag, name], capsys)
    err = "\n".join(lines)
    assert args is None
    assert f"invalid choice: '{name}'" in err
    known = ("deepseek_r1", "deepseek_v3", "minimax_m2", "minimax_m2_append_think", "qwen3") \
        if flag == "--reasoning-parser" else ("hermes", "qwen3_coder", "deepseek_v32", "minimax_m2", "pythonic")
    assert all(k in err for k in known)


def test_reasoning_parser_and_default_template_kwargs_reach_the_server_context():
    from jaxserve.server.startup import server_context
    args = _serve_parser().parse_args(["--reasoning-parser", "qwen3", "--default-chat-template-kwargs",
                                       '{"enable_thinking": false}'])
    ctx = server_context(types.SimpleNamespace(model_name="m"), args, {})
    assert ctx.reasoning_parser.name == "qwen3"
    assert ctx.template_kwargs({"x": 1}) == {"enable_thinking": False, "x": 1}
    assert ctx.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True}


def test_default_chat_template_kwargs_must_be_a_json_object(capsys):
    _, err = _parse(["--default-chat-template-kwargs", "[1]"], capsys)
    assert "must be a JSON object" in err[-1]


# --- --tokenizer DIR ------------------------------------------------------------------------


def _write_tokenizer(path, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))


def test_tokenizer_from_another_directory(tmp_path):
    from jaxserve.models import loader

    model = tmp_path / "model"                 # a config with no tokenizer files
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
        "vocab_size": 8, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}))
    _, _, own = loader.load_model(str(model), load_format="dummy")
    assert own is None
    _write_tokenizer(tmp_path / "tok", ["hello", "world"])
    _, _, tok = loader.load_model(str(model), load_format="dummy", tokenizer=str(tmp_path / "tok"))
    assert tok.encode("world hello", add_special_tokens=False) == [2, 1]
    with pytest.raises(ValueError, match="tokenizer .*: not a directory with tokenizer files"):
        loader.load_model(str(model), load_format="dummy", tokenizer=str(tmp_path / "missing"))


def test_the_tokenizer_flag_reaches_the_engine():
    args = _serve_parser().parse_args(["--tokenizer", "/some/dir"])
    assert engine_kwargs(args)["tokenizer"] == "/some/dir"
    assert engine_kwargs(_serve_parser().parse_args([]))["tokenizer"] is None
