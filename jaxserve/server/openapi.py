"""/docs and /openapi.json: the request bodies' schemas, which FastAPI cannot see by itself
because the routes read their bodies themselves (app.read_body: size limit, OpenAI errors)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from jaxserve.server.messages_protocol import CountTokensRequest, MessagesRequest
from jaxserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from jaxserve.server.responses_protocol import ResponsesRequest

# route path -> the body model it reads
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
          "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
          "/v1/messages/count_tokens": CountTokensRequest}
_REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in BODIES.values()], ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            for path, model in BODIES.items():
                operation = schema["paths"].get(path, {}).get("post")
                if operation is not None:
                    operation["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
