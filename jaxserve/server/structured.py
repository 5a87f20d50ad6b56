"""A request's structured-output fields -> one StructuredOutputsParams, and its compile check.

Accepted forms, at most one per request: OpenAI's `response_format` ({"type": "json_schema",
"json_schema": {"schema": ...}} or {"type": "json_object"}; {"type": "text"} asks for
nothing), vLLM's `structured_outputs` object and its older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` fields. The grammar is compiled (or found in the
engine's cache) on the tokenizer thread before the request reaches the engine, so an invalid
or too slow schema is a 400 naming the field, and the event loop never waits for a compile.
"""

from __future__ import annotations

import asyncio

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import bad_request
from jaxserve.server.protocol import SamplingFields
from jaxserve.structured.params import StructuredOutputsParams


def _given_fields(req: SamplingFields) -> list[tuple[str, dict]]:
    """(request field, StructuredOutputsParams fields) of each structured-output field set."""
    given = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              param="response_format")
        given.append(("response_format", {"json": rf.json_schema.json_schema}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            given.append((field, {kind: value}))
    return given


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's StructuredOutputsParams (None: unconstrained); 400 naming a bad field."""
    given = _given_fields(req)
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"give at most one of response_format, structured_outputs and the "
                          f"guided_* fields; got {names}", param=given[1][0])
    if not given:
        return None
    field, fields = given[0]
    try:
        return StructuredOutputsParams.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise bad_request(f"{field}: {e}", param=field) from e


def field_of(req: SamplingFields) -> str:
    given = _given_fields(req)
    return given[0][0] if given else "structured_outputs"


async def check_compiles(ctx: ServerContext, params: SamplingParams, param: str) -> None:
    """Compile the request's grammar off the event loop; a 400 naming `param` if it fails."""
    so = params.structured_outputs
    if so is None:
        return
    grammars = getattr(ctx.engine, "grammars", None)
    if grammars is None:
        raise bad_request(f"{param} needs the model's tokenizer; this model has none", param=param)
    try:
        # NOTE: not the tokenizer thread: a slow compile would hold up other requests' prompts
        await asyncio.get_running_loop().run_in_executor(None, grammars.check, so)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param) from e
