"""`--generation-config`: default sampling parameters from a model's generation_config.json,
as vLLM takes them (the model creator's recommended temperature, top_p, ...), used for the
fields a request leaves out.

'auto' reads the model folder's file (a .gguf file has none: no defaults), a folder reads
that folder's, 'vllm' reads nothing.
"""

from __future__ import annotations

import json
import logging
import os

from jaxserve.engine.checks import StartupError

logger = logging.getLogger("jaxserve")

# generation_config.json key -> request field (vLLM reads the same keys).
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def default_sampling(option: str, model: str | None) -> dict[str, float | int]:
    """{request field: default} for the fields generation_config.json sets."""
    if option == "vllm":
        return {}
    if option == "auto":
        if model is None or not os.path.isdir(model):
            return {}
        folder = model
    elif os.path.isdir(option):
        folder = option
    else:
        raise StartupError(f"--generation-config {option!r}: give 'auto', 'vllm' or a folder holding "
                           f"generation_config.json (no such folder)")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if option != "auto":
            raise StartupError(f"--generation-config {option!r}: there is no generation_config.json there")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise StartupError(f"{path}: cannot be read as JSON ({e})") from None
    defaults = {}
    for key, field in KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StartupError(f"{path}: {key} must be a number; got {value!r}")
        defaults[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    if defaults:
        logger.info("default sampling parameters from %s: %s (--generation-config vllm to ignore them)",
                    path, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
