"""The HTTP API of the frontend (main process): aiohttp routes over an `EngineClient`.

Each request is parsed into GenerateRequests (one per prompt and choice), which run
concurrently; their outputs merge into one response or one SSE stream. A client that goes
away cancels its handler (run with `handler_cancellation=True`, see `make_runner`), which
closes the engine's iterators and aborts whatever had not finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from tokenmill.frontend.api.chat_template import ChatTemplate, template_source
from tokenmill.frontend.api.common import ApiError, Choice, ParsedRequest, RequestContext
from tokenmill.frontend.api.constraints import GrammarValidator
from tokenmill.frontend.api.lora_names import LoraNames
from tokenmill.frontend.api.native_requests import parse_generate
from tokenmill.frontend.api.native_responses import NativeResponder
from tokenmill.frontend.api.openai_requests import ChatMessage, parse_chat, parse_completion
from tokenmill.frontend.api.openai_responses import (
    ChatResponder,
    CompletionResponder,
    Responder,
    sse,
)
from tokenmill.frontend.api.rerank_prompt import rerank_prompt
from tokenmill.frontend.api.responses_output import ResponsesResponder
from tokenmill.frontend.api.responses_requests import ResponsesJob, parse_responses
from tokenmill.frontend.api.scoring import (
    ScoredItems,
    ScoringJob,
    generative_scoring_response,
    parse_generative_scoring,
    parse_rerank,
    parse_score,
    rerank_response,
    score_response,
)
from tokenmill.frontend.api.tokenize import detokenize, tokenize
from tokenmill.frontend.app.auth import auth_middleware
from tokenmill.frontend.app.control_routes import ControlApi
from tokenmill.frontend.app.lora_routes import LoraApi
from tokenmill.frontend.app.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenmill.frontend.app.metrics import ApiMetrics
from tokenmill.frontend.app.openapi import openapi_document
from tokenmill.frontend.app.response_store import ResponseStore
from tokenmill.frontend.engine.client import EngineClient, EngineDeadError
from tokenmill.frontend.server_config import ServerConfig
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.protocol.outputs import NO_ADAPTER, DetokenizedOutput

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
RETRY_AFTER_S = 1  # NOTE: a full queue drains in seconds; a client should not wait longer
PARSE_INLINE_BYTES = 64 * 1024  # larger bodies are parsed and tokenized in a worker thread
DEFAULT_MAX_MODEL_LEN_CAP = 8192
_SHUTTING_DOWN = ApiError(
    "the server is shutting down", status=503, type="server_error", code="shutting_down"
)
_INTERNAL = ApiError("internal server error", status=500, type="server_error")

Parser = Callable[[bytes, RequestContext], ParsedRequest]
ScoringParser = Callable[[bytes, RequestContext], ScoringJob]
ScoringResponder = Callable[[ScoringJob, ScoredItems], Any]


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )


def error_response(error: ApiError) -> web.Response:
    response = json_response(error.body(), status=error.status)
    response.headers.update(error.headers)
    return response


async def _pump(
    engine: EngineClient, choice: Choice, queue: asyncio.Queue[tuple[int, Any]]
) -> None:
    """Feeds one request's outputs into the shared queue; an exception goes there too."""
    outputs = engine.generate(choice.request)
    try:
        async for out in outputs:
            queue.put_nowait((choice.index, out))
            if out.finish_reason is not None:
                return
        queue.put_nowait((choice.index, RuntimeError("engine output ended without a finish")))
    except Exception as e:
        queue.put_nowait((choice.index, e))
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()


def merge_outputs(
    engine: EngineClient, choices: list[Choice], metrics: ApiMetrics
) -> AsyncGenerator[tuple[int, DetokenizedOutput], None]:
    """(choice index, output) of all choices as they come; when left early (an error, a
    client gone), the unfinished requests are cancelled and aborted."""
    if len(choices) == 1:
        return _one_choice(engine, choices[0], metrics)
    return _merged(engine, choices, metrics)


async def _merged(
    engine: EngineClient, choices: list[Choice], metrics: ApiMetrics
) -> AsyncGenerator[tuple[int, DetokenizedOutput], None]:
    """merge_outputs of several choices: a task per choice feeds one queue."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(engine, c, queue)) for c in choices]
    running = {c.index for c in choices}
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                running.discard(index)
            yield index, item
    finally:
        # NOTE: counted before any await: a second cancellation may cut the rest short.
        metrics.on_aborted(len(running))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in choices:
            if c.index in running:
                await _abort(engine, c.request.req_id)


async def _one_choice(
    engine: EngineClient, choice: Choice, metrics: ApiMetrics
) -> AsyncGenerator[tuple[int, DetokenizedOutput], None]:
    """merge_outputs of one choice (most requests): the engine's outputs as they come, with
    no task and queue between (with them, the frontend's CPU over a batch-64 top-5 run was
    ~25% higher)."""
    outputs = engine.generate(choice.request)
    finished = False
    try:
        async for out in outputs:
            finished = out.finish_reason is not None
            yield choice.index, out
            if finished:
                return
        raise RuntimeError("engine output ended without a finish")
    finally:
        if not finished:
            metrics.on_aborted(1)
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()
        if not finished:
            await _abort(engine, choice.request.req_id)


async def _abort(engine: EngineClient, req_id: str) -> None:
    try:
        await engine.abort(req_id)
    except Exception:
        logger.warning("abort of %s failed", req_id, exc_info=True)


class HttpApi:
    """The route handlers; one per server."""

    def __init__(self, config: ServerConfig, engine: EngineClient, ctx: RequestContext) -> None:
        self.config = config
        self.engine = engine
        self.ctx = ctx
        self.metrics = ApiMetrics(lambda: engine.stats, ctx.served_model_name)
        self.created = int(time.time())
        self.openapi_json = msgspec.json.encode(
            openapi_document(config.http.enable_rl_control, config.lora.enable_lora)
        )
        self.stored = ResponseStore(config.http.max_stored_responses)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat, ChatResponder)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion, CompletionResponder)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_generate, NativeResponder)

    async def score(self, request: web.Request) -> web.Response:
        return await self._score(request, parse_score, score_response)

    async def generative_scoring(self, request: web.Request) -> web.Response:
        return await self._score(request, parse_generative_scoring, generative_scoring_response)

    async def rerank(self, request: web.Request) -> web.Response:
        return await self._score(request, parse_rerank, rerank_response)

    async def tokenize(self, request: web.Request) -> web.Response:
        return json_response(await self._parse(request, tokenize))

    async def detokenize(self, request: web.Request) -> web.Response:
        return json_response(await self._parse(request, detokenize))

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.ctx.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tokenmill",
            "root": self.config.model.model or self.ctx.served_model_name,
            "max_model_len": self.ctx.max_model_len,
        }
        # NOTE: vLLM's entries for adapters: the adapter's path as root, the base as parent
        adapters = self.ctx.adapters.paths if self.ctx.adapters is not None else {}
        data = [model] + [
            {**model, "id": name, "root": path, "parent": self.ctx.served_model_name}
            for name, path in adapters.items()
        ]
        return json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.stats.healthy() and not self.engine.draining:
            return json_response({"status": "ok"})
        return json_response({"status": "unavailable"}, status=503)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self.openapi_json, content_type="application/json")

    async def prometheus(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.render())
        response.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return response

    async def _parse(
        self, request: web.Request, parse: Callable[[bytes, RequestContext], Any]
    ) -> Any:
        if self.engine.draining:
            raise _SHUTTING_DOWN
        body = await request.read()
        # NOTE: a long prompt takes a while to tokenize (the tokenizer releases the GIL):
        # parsing off the event loop keeps every other request streaming meanwhile.
        if len(body) > PARSE_INLINE_BYTES:
            parsed = await asyncio.to_thread(parse, body, self.ctx)
        else:
            parsed = parse(body, self.ctx)
        if not self.engine.stats.alive:
            raise EngineDeadError("the engine is not running")
        return parsed

    async def _score(
        self, request: web.Request, parse: ScoringParser, respond: ScoringResponder
    ) -> web.Response:
        """Runs every item of a scoring request at once; answers with their label logprobs."""
        job: ScoringJob = await self._parse(request, parse)
        self.metrics.on_start(len(job.parsed.choices), True)
        scored = ScoredItems.empty(len(job.parsed.choices))
        async with aclosing(self._outputs(job.parsed)) as outputs:
            async for index, out in outputs:
                if out.logprobs:
                    scored.logprobs[index] = out.logprobs[0].token_ids_logprobs
                scored.cached_tokens[index] = max(
                    scored.cached_tokens[index], out.num_cached_tokens
                )
        return json_response(respond(job, scored))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        def parse(raw: bytes, ctx: RequestContext) -> ResponsesJob:
            return parse_responses(raw, ctx, self._history)

        job: ResponsesJob = await self._parse(request, parse)

        def on_done(response: dict[str, Any], conversation: list[ChatMessage]) -> None:
            if job.body.store is not False:
                self.stored.put(response, conversation)

        return await self._run(
            request, job.parsed, ResponsesResponder(job, self.ctx.tokenizer, on_done)
        )

    def _history(self, response_id: str) -> list[ChatMessage]:
        return self.stored.get(response_id, "previous_response_id").conversation

    async def stored_response(self, request: web.Request) -> web.Response:
        stored = self.stored.get(request.match_info["response_id"])
        return json_response(stored.response)

    async def delete_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        self.stored.delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def _serve(
        self, request: web.Request, parse: Parser, responder_cls: type[Responder]
    ) -> web.StreamResponse:
        parsed: ParsedRequest = await self._parse(request, parse)
        return await self._run(request, parsed, responder_cls(parsed, self.ctx.tokenizer))

    async def _run(
        self, request: web.Request, parsed: ParsedRequest, responder: Responder
    ) -> web.StreamResponse:
        self.metrics.on_start(len(parsed.choices), parsed.wants_logprobs)
        stats, adapters = self.engine.stats, self.ctx.adapters
        responder.weight_version = lambda: stats.weight_version
        if adapters is not None and parsed.model in adapters:
            # NOTE: an adapter's requests carry its own version (its load_inplace's)
            name = parsed.model
            responder.weight_version = lambda: adapters.versions.get(name, "")
        if parsed.stream:
            return await self._stream(request, parsed, responder)
        async with aclosing(self._outputs(parsed)) as outputs:
            async for index, out in outputs:
                responder.add(index, out)
        return json_response(responder.response())

    async def _outputs(
        self, parsed: ParsedRequest
    ) -> AsyncGenerator[tuple[int, DetokenizedOutput], None]:
        """Merged outputs, counted in the metrics; a request the engine failed raises."""
        start = time.monotonic()
        first_token: dict[int, float] = {}
        async with aclosing(merge_outputs(self.engine, parsed.choices, self.metrics)) as merged:
            async for index, out in merged:
                now = time.monotonic()
                first = index not in first_token
                if first and out.token_ids:
                    first_token[index] = now
                self.metrics.on_output(out, now - start, first)
                if out.finish_reason in (
                    "error",
                    "rejected",
                    "queue_timeout",
                    "paused",
                    NO_ADAPTER,
                ):
                    raise _engine_refusal(out)
                if out.finish_reason is not None and out.num_output_tokens > 1:
                    tpot = (now - first_token.get(index, now)) / (out.num_output_tokens - 1)
                    self.metrics.on_tpot(tpot)
                yield index, out

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, responder: Responder
    ) -> web.StreamResponse:
        async with aclosing(self._outputs(parsed)) as outputs:
            # NOTE: the headers wait for the engine's first answer, so that a request it turns
            # away (a full queue, a queue timeout) gets its status, not an error event.
            first = await anext(outputs, None)
            response = web.StreamResponse(headers={"Cache-Control": "no-cache"})
            response.content_type = "text/event-stream"
            await response.prepare(request)
            try:
                await self._stream_body(response, first, outputs, responder, parsed.response_id)
                if responder.done_marker is not None:
                    await response.write(responder.done_marker)
                await response.write_eof()
            except ConnectionResetError:
                logger.info("client of %s went away; request aborted", parsed.response_id)
        return response

    async def _stream_body(
        self,
        response: web.StreamResponse,
        first: tuple[int, DetokenizedOutput] | None,
        outputs: AsyncGenerator[tuple[int, DetokenizedOutput], None],
        responder: Responder,
        response_id: str,
    ) -> None:
        """The chunks; after the headers went out, an error becomes an error event."""
        error: ApiError | None = None
        try:
            if first is not None:
                for chunk in responder.add(*first):
                    await response.write(responder.encode(chunk))
                async for index, out in outputs:
                    for chunk in responder.add(index, out):
                        await response.write(responder.encode(chunk))
            for chunk in responder.final_chunks():
                await response.write(responder.encode(chunk))
        except ApiError as e:
            error = e
        except EngineDeadError as e:
            error = _engine_dead(e)
        except Exception as e:
            if isinstance(e, ConnectionResetError):
                raise
            logger.exception("request %s failed while streaming", response_id)
            error = _INTERNAL
        if error is not None:
            self.metrics.on_error(error.status)
            await response.write(sse(error.body()))


def _engine_dead(e: EngineDeadError) -> ApiError:
    message = str(e) or "the engine is not running"
    return ApiError(message, status=503, type="server_error", code="engine_dead")


def _engine_refusal(out: DetokenizedOutput) -> ApiError:
    """What a request the engine failed, turned away or timed out in its queue becomes."""
    if out.finish_reason == "rejected":
        return ApiError(
            f"the server is overloaded: {out.finish_detail}; retry later",
            status=429,
            type="rate_limit_exceeded",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if out.finish_reason == "paused":
        message = f"the request was {out.finish_detail}"
        return ApiError(message, status=503, type="server_error", code="generation_paused")
    if out.finish_reason == NO_ADAPTER:
        return ApiError(str(out.finish_detail), "model", status=404, code="model_not_found")
    if out.finish_reason == "queue_timeout":
        message = f"the server is overloaded: the request was {out.finish_detail}"
        return ApiError(message, status=503, type="server_error", code="queue_timeout")
    message = f"the engine failed the request: {out.finish_detail}"
    return ApiError(message, status=500, type="server_error")


def _error_middleware(metrics: ApiMetrics) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        """Every failure becomes OpenAI's error object; never a stack trace."""
        try:
            return await handler(request)
        except ApiError as e:
            error = e
        except EngineDeadError as e:
            error = _engine_dead(e)
        except web.HTTPException as e:
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            error = ApiError(e.reason, status=e.status, type=kind)
        except Exception:
            logger.exception("unexpected error in %s %s", request.method, request.path)
            error = _INTERNAL
        metrics.on_error(error.status)
        return error_response(error)

    return middleware


def resolve_max_model_len(config: ServerConfig, tokenizer: Tokenizer) -> int:
    if config.model.max_model_len > 0:
        return config.model.max_model_len
    checkpoint = tokenizer.max_position_embeddings or DEFAULT_MAX_MODEL_LEN_CAP
    return min(checkpoint, DEFAULT_MAX_MODEL_LEN_CAP)


def grammar_validator(tokenizer: Tokenizer) -> GrammarValidator | None:
    """Constraints are checked against the checkpoint's tokenizer.json (the controller's
    source too); a tokenizer without one (a test's fake) serves none."""
    if not (Path(tokenizer.model_dir) / "tokenizer.json").is_file():
        return None
    return GrammarValidator(tokenizer.model_dir, tokenizer.num_logits, tokenizer.eos_token_ids)


def build_app(
    config: ServerConfig,
    engine: EngineClient,
    tokenizer: Tokenizer,
    *,
    max_model_len: int | None = None,
) -> web.Application:
    """The aiohttp application; run it with `make_runner` (or `web.run_app(...,
    handler_cancellation=True)`) so that a client disconnect aborts its request."""
    template = None
    source = template_source(config.http.chat_template, tokenizer.chat_template)
    if source is not None:
        template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)
    ctx = RequestContext(
        tokenizer=tokenizer,
        chat_template=template,
        served_model_name=config.served_model_name,
        max_model_len=max_model_len or resolve_max_model_len(config, tokenizer),
        max_logprobs=config.scheduler.max_logprobs,
        max_score_items=config.scoring.max_score_items,
        rerank=rerank_prompt(config.scoring, tokenizer),
        grammar=grammar_validator(tokenizer),
        tool_call_parser=config.http.tool_call_parser,
        logprobs_mode=config.scheduler.logprobs_mode,
        reasoning_parser=config.http.reasoning_parser,
        routed_experts=config.scheduler.enable_return_routed_experts,
        adapters=LoraNames.of(config.lora.modules()) if config.lora.enable_lora else None,
    )
    api = HttpApi(config, engine, ctx)
    middlewares = [_error_middleware(api.metrics)]
    if config.http.api_key:
        http = config.http
        middlewares.append(auth_middleware(http.api_key, http.api_key_protect_metrics))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/generate", api.generate)
    app.router.add_post("/v1/score", api.score)
    app.router.add_post("/generative_scoring", api.generative_scoring)
    app.router.add_post("/v1/rerank", api.rerank)
    app.router.add_post("/rerank", api.rerank)
    app.router.add_post("/v1/responses", api.responses)
    app.router.add_get("/v1/responses/{response_id}", api.stored_response)
    app.router.add_delete("/v1/responses/{response_id}", api.delete_response)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.prometheus)
    app.router.add_get("/openapi.json", api.openapi)
    if config.http.enable_rl_control:
        ControlApi(engine, ctx.adapters).add_routes(app)
    if config.lora.enable_lora:
        LoraApi(engine, ctx).add_routes(app)
    return app


def make_runner(app: web.Application) -> web.AppRunner:
    """A runner whose handlers are cancelled when their client disconnects."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None)


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serves `app` on host:port until `await runner.cleanup()`; port 0 picks a free one
    (see `bound_port`)."""
    runner = make_runner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    logger.info("serving HTTP on %s", ", ".join(map(str, runner.addresses)))
    return runner


def bound_port(runner: web.AppRunner) -> int:
    return int(runner.addresses[0][1])
