"""The server's LoRA adapters by name: --lora-modules, /v1/models, and vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter.

A request picks an adapter by its `model` (ServerContext.check_model). Each adapter gets a new
int id when it is added (so a name unloaded and loaded again from another path never meets
the old one's slot or prefix-cache blocks). The engine reads and checks the weights when the
adapter is added: a bad path or an unsupported adapter is a 400 there, and the server goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from jaxserve.lora.request import LoRARequest
from jaxserve.server.errors import APIError, bad_request


def lora_module(text: str) -> dict:
    """One --lora-modules entry: NAME=PATH, or vLLM's JSON {"name", "path", "base_model_name"}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON ({e})") from None
        extra = sorted(set(entry) - {"name", "path", "base_model_name"})
        if not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str) or extra:
            raise argparse.ArgumentTypeError(
                '--lora-modules JSON takes "name" and "path" (strings) and optionally '
                f'"base_model_name"; got {text}')
        return entry
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH or a JSON object; got {text!r}")
    return {"name": name, "path": path}


class LoadLoRABody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False      # vLLM's: replace an adapter of that name


class UnloadLoRABody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body has it; the name decides here


class LoRAModules:
    def __init__(self, engine, base_name: str, served_names: tuple[str, ...]):
        self.engine = engine            # AsyncEngine (add_lora / remove_lora)
        self.base_name = base_name
        self.served_names = served_names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def add(self, name: str, path: str, base_model_name: str | None = None,
            replace: bool = False) -> LoRARequest:
        """Register an adapter; ValueError (the caller's 400) if the name is taken or the
        engine cannot serve it."""
        if name in self.served_names:
            raise ValueError(f"lora_name {name!r} is the base model's name; choose another")
        with self._lock:
            if name in self._by_name and not replace:
                raise ValueError(f"lora_name {name!r} is already loaded; unload it first "
                                 "(or pass load_inplace: true)")
            lora = LoRARequest(name, next(self._ids), path, base_model_name)
        self.engine.add_lora(lora)      # reads and checks the weights (ValueError)
        with self._lock:
            old = self._by_name.get(name)
            self._by_name[name] = lora
        if old is not None:
            self.engine.remove_lora(old.lora_int_id)
        return lora

    def remove(self, name: str) -> None:
        with self._lock:
            lora = self._by_name.pop(name, None)
        if lora is None:
            raise APIError(404, f"LoRA adapter {name!r} is not loaded; loaded: {self.names}",
                           param="lora_name", code="model_not_found")
        self.engine.remove_lora(lora.lora_int_id)

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """/v1/models entries: each adapter with its parent (vLLM's fields)."""
        return [{"id": lora.lora_name, "object": "model", "created": created, "owned_by": "jaxserve",
                 "root": lora.lora_path, "parent": lora.base_model_name or self.base_name,
                 "max_model_len": max_model_len} for lora in self._by_name.values()]


def install_lora_routes(app: FastAPI, ctx, read_body) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers)."""

    def modules() -> LoRAModules:
        if ctx.lora is None:
            raise bad_request("this server serves no LoRA adapters; start it with --enable-lora")
        return ctx.lora

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await read_body(ctx, request, LoadLoRABody)
        loras = modules()
        try:     # (reads the weights: off the event loop)
            await asyncio.to_thread(loras.add, body.lora_name, body.lora_path, None, body.load_inplace)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await read_body(ctx, request, UnloadLoRABody)
        modules().remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
