"""The command line a vLLM user brings: vLLM's flags parse and reach the engine, bad values
and bad models are one line (no traceback), configurations that cannot serve are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from jaxserve import cli
from jaxserve.engine.args import engine_kwargs, served_model_names
from jaxserve.engine.checks import StartupError, check_can_serve, check_model_argument

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "golden", "ckpt", "llama")   # no tokenizer; max_position 256

# (vLLM flags, {engine_kwargs key: value it must give}, or {args attribute: value} for the
# server's own flags). Each must parse for `serve`.
VLLM_FLAGS = [
    (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--enable-chunked-prefill"], {}),
    (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}),
    (["--kv-cache-memory-bytes", "8G"], {"kv_cache_memory_bytes": 8 << 30}),
    (["--dtype", "half"], {"dtype": "float16"}),
    (["--dtype", "float"], {"dtype": "float32"}),
    (["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
    (["--dtype", "auto"], {"dtype": None}),
    (["--max-model-len", "4k"], {"max_model_len": 4000}),
    (["--max-model-len", "4K"], {"max_model_len": 4096}),
    (["--max-model-len", "25.6k"], {"max_model_len": 25600}),
    (["--max-model-len", "2048"], {"max_model_len": 2048}),
    (["--max-num-batched-tokens", "8K"], {"max_num_batched_tokens": 8192}),
    (["--model", "m.gguf"], {"model": "m.gguf"}),
    (["--served-model-name", "a", "b"], {"served_model_name": "a"}),
    (["--tensor-parallel-size", "2"], {"tensor_parallel_size": 2}),
    (["--trust-remote-code"], {}),
    (["--quantization", "fp8"], {"quantization": "fp8"}),
    (["-q", "fp8"], {"quantization": "fp8"}),
]
SERVER_FLAGS = [
    (["--disable-log-requests"], {"disable_log_requests": True}),
    (["--disable-log-stats"], {"disable_log_stats": True}),
    (["--uvicorn-log-level", "warning"], {"log_level": "warning"}),
    (["--disable-uvicorn-access-log"], {"disable_uvicorn_access_log": True}),
    (["--chat-template", "t.jinja"], {"chat_template": "t.jinja"}),
    (["--generation-config", "vllm"], {"generation_config": "vllm"}),
    (["--api-key", "k"], {"api_key": ["k"]}),
]


def _parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("flags,expected", VLLM_FLAGS, ids=[" ".join(f) for f, _ in VLLM_FLAGS])
def test_vllm_engine_flags_reach_the_engine(flags, expected):
    kwargs = engine_kwargs(_parse("serve", *flags))
    for key, value in expected.items():
        assert kwargs[key] == value


@pytest.mark.parametrize("flags,expected", SERVER_FLAGS, ids=[" ".join(f) for f, _ in SERVER_FLAGS])
def test_vllm_server_flags_parse(flags, expected):
    args = _parse("serve", *flags)
    for key, value in expected.items():
        assert getattr(args, key) == value


def test_several_served_names_and_defaults():
    args = _parse("serve", "--served-model-name", "a", "b", "c")
    assert served_model_names(args) == ("a", "b", "c")
    defaults = _parse("serve")
    assert served_model_names(defaults) == () and engine_kwargs(defaults)["enable_prefix_caching"] is True
    assert defaults.generation_config == "auto"      # as vLLM


def test_run_batch_takes_vllm_arguments():
    args = _parse("run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m.gguf")
    assert (args.input, args.output, engine_kwargs(args)["model"]) == ("in.jsonl", "out.jsonl", "m.gguf")
    assert args.func is cli._generate


@pytest.mark.parametrize("flags,text", [
    (["--max-model-len", "lots"], "--max-model-len"),
    (["--max-model-len", "2.5K"], "--max-model-len"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--kv-cache-memory-bytes", "lots"], "number of bytes"),
    (["--block-size", "0"], ">= 1"),
    (["--num-kv-blocks", "1"], ">= 2"),
    (["--dtype", "fp8"], "--dtype"),
    (["--no-enable-chunked-prefill"], "always on"),
])
def test_bad_flag_values_are_one_usage_line(flags, text, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("serve", *flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err


def test_two_different_models_are_refused():
    with pytest.raises(StartupError, match="two models"):
        engine_kwargs(_parse("serve", "a.gguf", "--model", "b.gguf"))


def test_model_argument_messages(tmp_path):
    check_model_argument(None)                       # the default model
    check_model_argument(str(tmp_path))              # exists
    check_model_argument("Qwen3-30B-A3B", "dummy")   # a ready config name
    with pytest.raises(StartupError, match="downloads nothing from a hub") as exc:
        check_model_argument("meta-llama/Llama-3.1-8B")
    assert "jaxserve download" in str(exc.value) and ".gguf" in str(exc.value)
    with pytest.raises(StartupError, match="no such file or directory"):
        check_model_argument(str(tmp_path / "missing.gguf"))


def _config(max_model_len: int, block_size: int = 16, num_kv_blocks: int | None = None):
    return SimpleNamespace(cache=SimpleNamespace(block_size=block_size, num_kv_blocks=num_kv_blocks),
                           scheduler=SimpleNamespace(max_model_len=max_model_len))


def test_check_can_serve_counts_the_reserved_block():
    check_can_serve(_config(2048, num_kv_blocks=129), 129)          # 128 usable = 2048 / 16
    with pytest.raises(StartupError) as exc:
        check_can_serve(_config(2048, num_kv_blocks=128), 128)
    message = str(exc.value)
    assert "127 usable" in message and "at least 129" in message and "at most 2032" in message
    with pytest.raises(StartupError, match="gpu-memory-utilization"):
        check_can_serve(_config(2048), 100)                          # sized from memory


def _run_cli(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _assert_one_line_error(res: subprocess.CompletedProcess, *texts: str) -> None:
    assert res.returncode == 1, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    for text in texts:
        assert text in errors[0], errors[0]


def test_start_up_errors_are_one_line():
    _assert_one_line_error(_run_cli("serve", "meta-llama/Llama-3.1-8B"), "jaxserve serve: error:",
                           "downloads nothing from a hub")
    _assert_one_line_error(_run_cli("generate", "-i", __file__, "-o", os.devnull, "missing-model.gguf"),
                           "no such file or directory")


def test_a_cache_too_small_for_max_model_len_is_refused_at_start_up():
    # 256 tokens in blocks of 16 need 16 blocks; 16 blocks leave 15 (block 0 is reserved).
    res = _run_cli("serve", TINY, "--max-model-len", "256", "--num-kv-blocks", "16", "--no-warmup",
                   "--dtype", "float32", "--port", "0")
    _assert_one_line_error(res, "max_model_len 256 needs 16 KV blocks", "--num-kv-blocks to at least 17")
