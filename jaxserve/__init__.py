"""jaxserve: LLM inference and serving on JAX, with Pallas GPU kernels on the hot paths."""

import os as _os

# transformers is used for tokenizers and chat templates only; silence its "no PyTorch" notice.
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# In a source checkout the subpackages jaxserve.models, .pallas_kernels, .sharding and .server
# live in top-level folders beside this one (pyproject maps them). An editable install maps
# them too, but not every installer does (older setuptools' "develop" mode only adds the
# checkout to sys.path), so a checkout also finds them through this package's __path__.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and \
        _os.path.isfile(_os.path.join(_checkout, "models", "llama.py")):
    __path__.append(_checkout)  # noqa: F821 (a package's __path__)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name):
    # Lazy, so `import jaxserve` stays cheap (the CLI's --help, the server's workers).
    if name == "LLM":
        from jaxserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from jaxserve.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
