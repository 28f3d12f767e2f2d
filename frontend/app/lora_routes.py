"""vLLM's LoRA routes (main process, --enable-lora): POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, answered as vLLM answers them (200 with a line of text; 400 bad
input, 404 an unknown adapter, 409 one that requests still use, as OpenAI's error object).

Each turns its body into a command of protocol/control.py that every engine replica carries
out between two steps; on success the names requests may use (LoraNames) follow.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from tokenmill.frontend.api.common import ApiError, RequestContext, decode_body
from tokenmill.frontend.api.lora_names import LoraNames
from tokenmill.frontend.engine.client import EngineClient
from tokenmill.protocol.control import ControlReply, LoadLoraAdapter, UnloadLoraAdapter


class LoadLoraBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    # True: an adapter of that name already loaded gets these weights (RL: a new policy)
    load_inplace: bool = False
    # ours: the weight_version its requests' responses carry (default: "1", then one more
    # at each load_inplace)
    weight_version: str | None = None


class UnloadLoraBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # NOTE: vLLM's; names are what identify an adapter here


# route -> (method, summary, body type); /openapi.json lists them with --enable-lora
LORA_ROUTES: dict[str, tuple[str, str, type]] = {
    "/v1/load_lora_adapter": ("post", "Load a PEFT LoRA adapter (or replace one in place)",
                              LoadLoraBody),
    "/v1/unload_lora_adapter": ("post", "Unload a LoRA adapter", UnloadLoraBody),
}  # fmt: skip


class LoraApi:
    def __init__(self, engine: EngineClient, ctx: RequestContext) -> None:
        assert ctx.adapters is not None, "the LoRA routes need the adapters' names"
        self.engine = engine
        self.ctx = ctx
        self.names: LoraNames = ctx.adapters

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read() or b"{}", LoadLoraBody)
        self._check_name(body.lora_name)
        if not body.lora_path:
            raise ApiError("lora_path is empty: give the adapter's directory", "lora_path")
        if body.lora_name in self.names and not body.load_inplace:
            raise ApiError(
                f"The lora adapter '{body.lora_name}' has already been loaded (load_inplace: "
                "true replaces its weights).",
                "lora_name",
            )
        reply = await self.engine.control(
            lambda ctl_id: LoadLoraAdapter(
                ctl_id, body.lora_name, body.lora_path, body.load_inplace
            )
        )
        _raise_refusal(reply)
        self.names.loaded(body.lora_name, body.lora_path, body.weight_version)
        return web.Response(text=reply.message)

    async def unload(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read() or b"{}", UnloadLoraBody)
        self._check_name(body.lora_name)
        reply = await self.engine.control(lambda ctl_id: UnloadLoraAdapter(ctl_id, body.lora_name))
        _raise_refusal(reply)
        self.names.unloaded(body.lora_name)
        return web.Response(text=reply.message)

    def _check_name(self, name: str) -> None:
        if not name:
            raise ApiError("lora_name is empty", "lora_name")
        if name == self.ctx.served_model_name:
            raise ApiError(f"`{name}` is the base model's name", "lora_name")


def _raise_refusal(reply: ControlReply) -> None:
    if reply.status == 200:
        return
    code = {404: "model_not_found", 409: "conflict"}.get(reply.status)
    kind = "server_error" if reply.status >= 500 else "invalid_request_error"
    raise ApiError(reply.message, "lora_name" if reply.status == 404 else None,
                   status=reply.status, type=kind, code=code)  # fmt: skip
