"""jaxserve: LLM inference and serving on JAX, with Pallas GPU kernels on the hot paths."""

import os as _os

# transformers is used for tokenizers and chat templates only; silence its "no PyTorch" notice.
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest", "__version__"]


def __getattr__(name):
    # Lazy, so `import jaxserve` stays cheap (the CLI's --help, the server's workers).
    if name == "LLM":
        from jaxserve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from jaxserve.sampling_params import SamplingParams
        return SamplingParams
    if name == "LoRARequest":
        from jaxserve.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
