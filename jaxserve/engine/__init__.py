"""The engine, cut by role: input processing (input_processor.py), the engine core's step loop
(core.py), output processing (output_processor.py), the synchronous LLMEngine that ties them
(llm_engine.py), the builder that assembles its parts from loaded weights or from the options
(builder.py) and the AsyncEngine front for the server (async_engine.py)."""

from jaxserve.engine.async_engine import AbortRequest, AddRequest, AsyncEngine
from jaxserve.engine.llm_engine import (EngineDeadError, EngineOverloadedError, LLMEngine,
                                        enable_compilation_cache)

__all__ = ["AbortRequest", "AddRequest", "AsyncEngine", "EngineDeadError", "EngineOverloadedError",
           "LLMEngine", "enable_compilation_cache"]
