"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics.

Why FastAPI + uvicorn rather than the standard library: handlers are coroutines that wait on
per-request queues, so thousands of open streams cost no thread each; Starlette's streaming
response notices a client that goes away and cancels our generator, whose ``finally`` aborts the
request and frees its pages; uvicorn speaks HTTP/1.1 keep-alive and chunked SSE correctly; and
pydantic v2 (already a dependency) validates the bodies. ``http.server`` would need a thread per
connection, hand-rolled chunked encoding and offers no reliable disconnect signal.

Every error answers with the OpenAI body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from oscar_compile.runtime.async_engine import AsyncEngine, EngineDeadError
from oscar_compile.runtime.metrics import render_metrics
from oscar_compile.runtime.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest,
                                            CompletionRequest)
from oscar_compile.runtime.responses import Choice, Formatter, error_body, sse
from oscar_compile.runtime.sampling_params import RequestError, SamplingParams

logger = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.5
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


def create_app(async_engine: AsyncEngine, model_name: str) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="oscar_compile", lifespan=lifespan)
    server = _Server(async_engine, model_name)
    _add_error_handlers(app)
    app.get("/health")(server.health)
    app.get("/v1/models")(server.models)
    app.get("/metrics")(server.metrics)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    def reply(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(_request, err: ApiError):
        return reply(err.status, str(err), err.type, err.param, err.code)

    @app.exception_handler(RequestError)
    async def _request_error(_request, err: RequestError):
        return reply(400, str(err), "invalid_request_error", err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, err: StarletteHTTPException):
        type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return reply(err.status_code, str(err.detail), type_)

    @app.exception_handler(EngineDeadError)
    async def _dead(_request, err: EngineDeadError):
        return reply(503, str(err), "service_unavailable")

    @app.exception_handler(Exception)
    async def _internal(_request, err: Exception):
        logger.exception("unhandled error")
        return reply(500, f"internal error: {type(err).__name__}", "internal_error")


async def _parse(request: Request, model_cls: type[BaseModel]):
    body = await request.body()
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            raise RequestError(None, f"request body is not valid JSON: {first['msg']}") from None
        param = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("str", "list["))) or None
        what = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        where = f"{param}: " if param else "request body: "
        raise RequestError(param, where + what, code=first["type"]) from None


class _Server:
    def __init__(self, async_engine: AsyncEngine, model_name: str):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = async_engine.engine.tokenizer
        self.model_name = model_name
        self.created = int(time.time())

    async def health(self):
        if not self.async_engine.is_alive:
            raise EngineDeadError("the engine thread is not running")
        return {"status": "ok"}

    async def models(self):
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "oscar_compile", "max_model_len": self.engine.max_model_len}]}

    async def metrics(self):
        return PlainTextResponse(render_metrics(self.async_engine.stats),
                                 media_type="text/plain; version=0.0.4")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def completions(self, request: Request):
        req = await _parse(request, CompletionRequest)
        self._check_model(req.model)
        req.check_unsupported()
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts()]
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        params = req.sampling_params(max_tokens, req.logprobs)
        fmt = Formatter("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name,
                        self.tokenizer, req.logprobs is not None)
        return await self._respond(request, fmt, prompts, params, req.stream, req.stream_options)

    async def chat_completions(self, request: Request):
        req = await _parse(request, ChatCompletionRequest)
        self._check_model(req.model)
        req.check_unsupported()
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("messages", "this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(
            [m.as_template_dict() for m in req.messages], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        max_tokens = req.requested_max_tokens()
        if max_tokens is None:  # like OpenAI: up to the end of the context
            max_tokens = max(self.engine.max_new_tokens(len(ids)), 1)
        params = req.sampling_params(max_tokens, req.num_logprobs())
        fmt = Formatter("chat", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name,
                        self.tokenizer, req.logprobs)
        return await self._respond(request, fmt, [list(ids)], params, req.stream, req.stream_options)

    async def _respond(self, request: Request, fmt: Formatter, prompts: list[list[int]],
                       params: SamplingParams, stream: bool, stream_options):
        for ids in prompts:  # refuse before queueing anything
            self.engine.validate_request(ids, params)
        outputs = self._generate(prompts, params, fmt.request_id)
        if stream:
            include_usage = bool(stream_options and stream_options.include_usage)
            return StreamingResponse(self._stream(fmt, outputs, len(prompts), include_usage),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        task = asyncio.ensure_future(self._collect(outputs, len(prompts)))
        while not task.done():
            await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # closes the generator, which aborts the requests
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return JSONResponse(error_body("client disconnected"), status_code=499)
        return JSONResponse(fmt.full(task.result()))

    async def _generate(self, prompts: list[list[int]], params: SamplingParams,
                        request_id: str) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, RequestOutput) for every prompt; leaving early aborts the unfinished."""
        sink: asyncio.Queue = asyncio.Queue()
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        pending: set[int] = set()
        try:
            for i, prompt in enumerate(prompts):
                self.async_engine.submit(prompt, params, ids[i], sink, tag=i)
                pending.add(i)
            while pending:
                index, item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    pending.discard(index)
                yield index, item
        finally:
            for index in pending:
                self.async_engine.abort(ids[index])

    @staticmethod
    async def _collect(outputs: AsyncIterator[tuple[int, Any]], num_choices: int) -> list[Choice]:
        choices = [Choice(i) for i in range(num_choices)]
        async for index, out in outputs:
            choices[index].add(out)
        return choices

    async def _stream(self, fmt: Formatter, outputs: AsyncIterator[tuple[int, Any]],
                      num_choices: int, include_usage: bool) -> AsyncIterator[str]:
        choices = [Choice(i) for i in range(num_choices)]
        try:
            if fmt.kind == "chat":
                for i in range(num_choices):
                    yield sse(fmt.chunk(i, None, first=True))
            async for index, out in outputs:
                offset = len(choices[index].text)
                choices[index].add(out)
                chunk = fmt.chunk(index, out, text_offset=offset)
                if chunk is not None:
                    yield sse(chunk)
            if include_usage:
                yield sse(fmt.usage_chunk(choices))
        except Exception as err:  # headers are sent: the error can only travel in the stream
            logger.warning("stream %s failed: %s", fmt.request_id, err)
            yield sse(error_body(str(err), "internal_error"))
        finally:
            await outputs.aclose()
        yield sse("[DONE]")
