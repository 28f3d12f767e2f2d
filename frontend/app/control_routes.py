"""The RL control routes (main process), served with `--enable-rl-control` only: SGLang's
request shapes (its "SGLang for RL" routes), answered with `success`, `message` and the
`weight_version` in force, or OpenAI's error object (400 bad input, 409 not now).

Each route turns its body into one command of protocol/control.py and waits for the
engine's reply; the controller carries commands out between two steps, one at a time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from tokenmill.frontend.api.common import ApiError, decode_body
from tokenmill.frontend.api.lora_names import LoraNames
from tokenmill.frontend.engine.client import EngineClient
from tokenmill.protocol.control import (
    MEMORY_TAGS,
    ContinueGeneration,
    ControlCommand,
    ControlReply,
    FlushCache,
    GetWeightVersion,
    JoinWeightsGroup,
    LeaveWeightsGroup,
    LoadWeights,
    PauseGeneration,
    ReceiveWeights,
    ReleaseMemory,
    ResumeMemory,
)

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


class PauseBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: str = "abort"  # abort | retract | in_place


class UpdateFromDiskBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_path: str
    weight_version: str | None = None
    # NOTE: accepted for SGLang's clients; the prefix cache is emptied on every update, so
    # that nothing computed with the old weights is reused (docs/rl.md)
    flush_cache: bool = True
    load_format: str | None = None  # auto / safetensors only
    abort_all_requests: bool = False  # True: requests in flight fail instead of retracting


class InitGroupBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str | None = None  # gloo (CPU) or nccl (CUDA); default: the device's


class UpdateDistributedBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    weight_version: str | None = None
    flush_cache: bool = True  # NOTE: as for UpdateFromDiskBody
    abort_all_requests: bool = False
    # ours (--enable-lora): the tensors are this loaded adapter's, the whole of it, by PEFT's
    # names; its weight_version the one its responses carry (docs/lora.md)
    lora_name: str | None = None


class GroupBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    group_name: str = DEFAULT_GROUP


class MemoryBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tags: list[str] | None = None  # kv_cache, weights; default both


class ControlResponse(msgspec.Struct, forbid_unknown_fields=True):
    success: bool
    message: str
    weight_version: str
    paused: str | None = None
    num_retracted: int = 0


Handler = Callable[[web.Request], Awaitable[web.Response]]
# route -> (method, summary, body type or None); /openapi.json lists them when they are on
CONTROL_ROUTES: dict[str, tuple[str, str, type | None]] = {
    "/pause_generation": ("post", "Pause generation: mode abort, retract or in_place", PauseBody),
    "/continue_generation": ("post", "Continue generation after a pause", None),
    "/flush_cache": ("post", "Empty the prefix cache (409 while requests hold entries)", None),
    "/get_weight_version": ("get", "The weight version in force", None),
    "/update_weights_from_disk": ("post", "New weights from a checkpoint directory",
                                  UpdateFromDiskBody),
    "/init_weights_update_group": ("post", "Join a torch.distributed group with a trainer",
                                   InitGroupBody),
    "/update_weights_from_distributed": ("post", "New weights broadcast by the trainer",
                                         UpdateDistributedBody),
    "/destroy_weights_update_group": ("post", "Leave the trainer's group", GroupBody),
    "/release_memory_occupation": ("post", "Free the KV cache and / or the weights",
                                   MemoryBody),
    "/resume_memory_occupation": ("post", "Take the KV cache and / or the weights back",
                                  MemoryBody),
}  # fmt: skip


class ControlApi:
    def __init__(self, engine: EngineClient, adapters: LoraNames | None = None) -> None:
        """adapters: --enable-lora's names, whose versions a trainer's adapter updates set."""
        self.engine = engine
        self.adapters = adapters

    def add_routes(self, app: web.Application) -> None:
        handlers: dict[str, Handler] = {
            "/pause_generation": self.pause,
            "/continue_generation": self.simple(ContinueGeneration),
            "/flush_cache": self.simple(FlushCache),
            "/get_weight_version": self.simple(GetWeightVersion),
            "/update_weights_from_disk": self.from_disk,
            "/init_weights_update_group": self.init_group,
            "/update_weights_from_distributed": self.from_trainer,
            "/destroy_weights_update_group": self.destroy_group,
            "/release_memory_occupation": self.memory(ReleaseMemory),
            "/resume_memory_occupation": self.memory(ResumeMemory),
        }
        for path, handler in handlers.items():
            method = CONTROL_ROUTES[path][0]
            app.router.add_route(method.upper(), path, handler)
            if path == "/flush_cache":  # NOTE: SGLang takes GET too
                app.router.add_get(path, handler)

    async def _run(self, make: Callable[[str], ControlCommand]) -> web.Response:
        reply: ControlReply = await self.engine.control(make)
        if reply.status != 200:
            code = {409: "conflict", 500: None}.get(reply.status, "invalid_request")
            kind = "server_error" if reply.status >= 500 else "invalid_request_error"
            raise ApiError(reply.message, status=reply.status, type=kind, code=code)
        body = ControlResponse(
            True, reply.message, reply.weight_version, reply.paused, reply.num_retracted
        )
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    def simple(self, kind: Any) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            return await self._run(lambda ctl_id: kind(ctl_id))

        return handler

    async def pause(self, request: web.Request) -> web.Response:
        body = await _body(request, PauseBody)
        return await self._run(lambda ctl_id: PauseGeneration(ctl_id, body.mode))

    async def from_disk(self, request: web.Request) -> web.Response:
        body = await _body(request, UpdateFromDiskBody)
        if body.load_format not in (None, "auto", "safetensors"):
            raise ApiError(f"load_format {body.load_format!r}: use auto", "load_format")
        return await self._run(
            lambda ctl_id: LoadWeights(
                ctl_id, body.model_path, body.weight_version, body.abort_all_requests
            )
        )

    async def init_group(self, request: web.Request) -> web.Response:
        b = await _body(request, InitGroupBody)
        if b.backend not in (None, "gloo", "nccl"):
            raise ApiError(f"backend {b.backend!r}: use gloo (CPU) or nccl (CUDA)", "backend")
        return await self._run(
            lambda ctl_id: JoinWeightsGroup(
                ctl_id, b.master_address, b.master_port, b.rank_offset, b.world_size,
                b.group_name, b.backend or "",
            )
        )  # fmt: skip

    async def from_trainer(self, request: web.Request) -> web.Response:
        b = await _body(request, UpdateDistributedBody)
        shapes = tuple(tuple(s) for s in b.shapes)

        def make(ctl_id: str) -> ReceiveWeights:
            names, dtypes = tuple(b.names), tuple(b.dtypes)
            return ReceiveWeights(
                ctl_id, names, dtypes, shapes, b.group_name,
                None if b.lora_name else b.weight_version, b.abort_all_requests,
                lora_name=b.lora_name or "",
            )  # fmt: skip

        adapters = self.adapters
        if b.lora_name and (adapters is None or b.lora_name not in adapters):
            raise ApiError(f"The lora adapter '{b.lora_name}' cannot be found.", "lora_name",
                           status=404, code="model_not_found")  # fmt: skip
        response = await self._run(make)
        if b.lora_name and adapters is not None:
            adapters.loaded(b.lora_name, adapters.paths[b.lora_name], b.weight_version)
        return response

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await _body(request, GroupBody)
        return await self._run(lambda ctl_id: LeaveWeightsGroup(ctl_id, body.group_name))

    def memory(self, kind: Any) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            body = await _body(request, MemoryBody)
            tags = tuple(body.tags) if body.tags is not None else MEMORY_TAGS
            return await self._run(lambda ctl_id: kind(ctl_id, tags))

        return handler


async def _body(request: web.Request, kind: type[Any]) -> Any:
    raw = await request.read()
    return decode_body(raw or b"{}", kind)
