# --- tiny HF checkpoints (tests/golden/ckpt, made by tests/golden/make_golden.py) ---
import os as _os

import pytest as _pytest

GOLDEN_DIR = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "golden")
TINY_CHECKPOINTS = ("llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe",
                    "deepseek_v3", "deepseek_v32", "deepseek_v3_noqlora", "qwen3_next", "qwen3_5_moe", "qwen3_5", "deepseek_v4")


@_pytest.fixture
def tiny_checkpoint():
    """Factory: tiny_checkpoint("qwen3") -> path of that tiny random-weight HF checkpoint dir."""
    def path(name: str) -> str:
        if name not in TINY_CHECKPOINTS:
            raise ValueError(f"no tiny checkpoint {name!r}; have: {', '.join(TINY_CHECKPOINTS)}")
        return _os.path.join(GOLDEN_DIR, "ckpt", name)
    return path


# --- `gpu`-marked tests run only where JAX's default backend is a GPU ---
def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return                      # jax's backend is only asked when a gpu test is collected
    import jax
    if jax.default_backend() == "gpu":
        return
    skip = _pytest.mark.skip(reason=f"needs an NVIDIA GPU (JAX backend: {jax.default_backend()})")
    for item in gpu_items:
        item.add_marker(skip)
