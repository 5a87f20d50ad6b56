import os as _os

# --- tiny HF checkpoints (tests/golden/ckpt, made by tests/golden/make_golden.py) ---
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


# --- a worker's compiled programs freed before it runs out of memory mappings ---
# XLA:CPU maps a few memory regions per compiled (or cache-loaded) executable, and Linux allows
# a process 65,530 (vm.max_map_count). A worker running half the suite kept every module's
# programs alive through JAX's jit caches (and the engines those caches held), passed ~65k maps
# and died inside XLA with a segfault ("LLVM compilation error: Cannot allocate memory" first;
# seen in backend_compile_and_load and in the persistent cache's get/put of executables:
# reproduced by lowering the limit). After a module, past a third of the limit, JAX's caches
# are cleared (not after every module: recompiling what later modules share cost minutes).
# JAXSERVE_TEST_MAPS_LOG=FILE records the count per module.
MAPS_TO_CLEAR_AT = 20_000


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@_pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs(request):
    yield
    import gc
    import sys
    if _mapped_regions() > MAPS_TO_CLEAR_AT and "jax" in sys.modules:
        gc.collect()
        sys.modules["jax"].clear_caches()
        gc.collect()
    log = _os.environ.get("JAXSERVE_TEST_MAPS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{_os.getpid()} {_mapped_regions()} {request.module.__name__}\n")
