"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models[/{id}],
/health, /metrics, /version, and vLLM's /tokenize, /detokenize, /tokenizer_info.

Why FastAPI + uvicorn rather than the standard library: handlers are coroutines that wait on
per-request queues, so thousands of open streams cost no thread each; Starlette's streaming
response notices a client that goes away and cancels our generator, whose ``finally`` aborts the
request and frees its pages; uvicorn speaks HTTP/1.1 keep-alive and chunked SSE correctly; and
pydantic v2 (already a dependency) validates the bodies. ``http.server`` would need a thread per
connection, hand-rolled chunked encoding and offers no reliable disconnect signal.

Every error answers with the OpenAI body ``{"error": {"message", "type", "param", "code"}}``.
What may come in is decided in layers, cheapest first: the API key and the body size in ASGI
middleware (gate.py), then whether the server admits requests at all (admission.py: draining, a
full queue), then the body's fields (protocol.py), then what needs the tokenized prompt (its
length against the context, ``max_tokens``). Tokenizing and the chat template run on one worker
thread, so a long prompt does not stall the event loop that serves every other client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from oscar_compile.kernels import jit_watch
from oscar_compile.runtime.async_engine import AsyncEngine
from oscar_compile.runtime.core.errors import EngineDeadError
from oscar_compile.runtime.core.sampling_params import RequestError
from oscar_compile.runtime.input_processor import EngineRequest
from oscar_compile.runtime.server.admission import Admission, Refused
from oscar_compile.runtime.server.gate import ApiKeyGate, BodyLimit
from oscar_compile.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from oscar_compile.runtime.server.parsing import IgnoredFields, parse_body
from oscar_compile.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from oscar_compile.runtime.server.requests import chat_requests, completion_requests
from oscar_compile.runtime.server.responses import Choice, Formatter, error_body, sse
from oscar_compile.runtime.server.server_config import ServerConfig
from oscar_compile.runtime.server.tokenization import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    render_chat,
    tokenize,
    tokenizer_info,
)
from oscar_compile.runtime.server.tool_calls import plan_tool_calls
from oscar_compile.runtime.server.tool_parsers import get_tool_parser
from oscar_compile.runtime.structured_output import GrammarEngineUnavailable, grammar_engine_installed

logger = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.5
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


def create_app(async_engine: AsyncEngine, model_name: str | Sequence[str], config: ServerConfig | None = None
               ) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the engine thread. ``app.state.admission``
    is what a graceful shutdown drains (shutdown.py). ``model_name``: the served name, or several
    (a request may name any; responses report the first, as vLLM's ``--served-model-name``)."""
    config = config or ServerConfig()
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(names):
        raise ValueError(f"served model names must be non-empty, got {names!r}")
    jit_watch.install()  # compiles made while serving stall the running requests: warn about each
    if not grammar_engine_installed():
        logger.warning("structured output (response_format, structured_outputs, tool_choice 'required' or a named "
                       "function) is off: its grammar engine, xgrammar, is not installed. Such requests get 501 "
                       "until it is: pip install 'oscar-compile[serve]'")
    admission = Admission(async_engine, config.max_waiting_requests)
    server = _Server(async_engine, names, config, admission)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.latency_observers += (server.server_metrics.observe,)
        async_engine.start()
        jit_watch.mark_serving()
        try:
            yield
        finally:
            jit_watch.mark_serving(False)
            async_engine.latency_observers = tuple(
                f for f in async_engine.latency_observers if f != server.server_metrics.observe)
            async_engine.shutdown()
            server.close()
            _log_final_stats(async_engine.stats, admission)

    # no redirect of "/v1/completions/" to "/v1/completions": a client gets a 404 it can read
    app = FastAPI(title="oscar_compile", lifespan=lifespan, redirect_slashes=False)
    app.state.admission = admission
    app.state.metrics = server.server_metrics  # this app's registry (server/metrics.py)
    _add_error_handlers(app)
    app.get("/health")(server.health)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model_id:path}")(server.model)
    app.get("/metrics")(server.metrics)
    app.get("/version")(server.version)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    # vLLM's tokenizer routes, at the root as vLLM serves them: --api-key guards /v1/* only
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    app.get("/tokenizer_info")(server.tokenizer_info)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key is not None:  # added last: outermost, so a 401 never reads the body
        app.add_middleware(ApiKeyGate, api_key=config.api_key, metrics_require_key=config.metrics_require_key)
    return app


def _log_final_stats(stats: dict[str, float], admission: Admission) -> None:
    logger.info("stopped: %d HTTP requests admitted, %d refused; %d requests (one per prompt) finished "
                "(%d aborted); KV pages in use: %d window, %d quant", admission.num_admitted, admission.num_refused,
                stats["num_requests_finished"], stats["num_requests_aborted"],
                stats["window_pages_used"], stats["quant_pages_used"])


def _add_error_handlers(app: FastAPI) -> None:
    def reply(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(_request, err: ApiError):
        return reply(err.status, str(err), err.type, err.param, err.code)

    @app.exception_handler(Refused)
    async def _refused(_request, err: Refused):
        return JSONResponse(error_body(str(err), err.type, None, err.code), status_code=err.status,
                            headers=err.headers)

    @app.exception_handler(RequestError)
    async def _request_error(_request, err: RequestError):
        return reply(400, str(err), "invalid_request_error", err.param, err.code)

    @app.exception_handler(GrammarEngineUnavailable)
    async def _no_grammar_engine(_request, err: GrammarEngineUnavailable):
        return reply(501, str(err), "server_error", None, "structured_output_unavailable")

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


def _error_kind(err: Exception) -> tuple[str, str | None]:
    """(type, code) of the OpenAI error body for ``err``, as its exception handler would answer."""
    if isinstance(err, ApiError):
        return err.type, err.code
    if isinstance(err, RequestError):
        return "invalid_request_error", err.code
    if isinstance(err, EngineDeadError):
        return "service_unavailable", None
    if isinstance(err, GrammarEngineUnavailable):
        return "server_error", "structured_output_unavailable"
    return "internal_error", None


class _ReleasingStream(StreamingResponse):
    """A stream that releases its admission when it ends, however it ends (a client that
    leaves included), and closes its generator at once so its requests are aborted now."""

    def __init__(self, content, release: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._release()


class _Server:
    def __init__(self, async_engine: AsyncEngine, model_names: list[str], config: ServerConfig,
                 admission: Admission):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = async_engine.engine.tokenizer
        self.model_names = model_names
        self.model_name = model_names[0]  # the one responses report
        self.ignored_fields = IgnoredFields()
        # this app's own registry: the latency histograms are labelled with the name responses report
        self.server_metrics = ServerMetrics(lambda: async_engine.stats, self.ignored_fields.counts, self.model_name)
        self.config = config
        self.admission = admission
        self.created = int(time.time())
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="oscar-tokenize")
        self.tool_parser = get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def health(self):
        if not self.async_engine.is_alive:
            raise EngineDeadError("the engine thread is not running")
        if self.admission.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable", code="shutting_down")
        return {"status": "ok"}

    def _model_card(self, name: str) -> dict[str, Any]:
        # vLLM's card: root is the model every served name points at
        return {"id": name, "object": "model", "created": self.created, "owned_by": "oscar_compile",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.max_model_len}

    async def models(self):
        return {"object": "list", "data": [self._model_card(name) for name in self.model_names]}

    async def model(self, model_id: str):
        self._check_model(model_id)
        return self._model_card(model_id)

    async def version(self):
        from oscar_compile._version import __version__

        return {"version": __version__}

    async def metrics(self):
        return Response(self.server_metrics.render(), media_type=CONTENT_TYPE)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    async def _parse(self, request: Request, schema: type[BaseModel]):
        return parse_body(await request.body(), schema, self.config.strict_fields, self.ignored_fields)

    async def tokenize(self, request: Request):
        req = await self._parse(request, TokenizeRequest)
        self._check_model(req.model)
        req.check()
        return await self._in_tokenizer_thread(
            lambda: tokenize(self.tokenizer, req, self.config.chat_template, self.engine.max_model_len))

    async def detokenize(self, request: Request):
        req = await self._parse(request, DetokenizeRequest)
        self._check_model(req.model)
        return await self._in_tokenizer_thread(
            lambda: detokenize(self.tokenizer, req, self.engine.runner.vocab_size))

    async def tokenizer_info(self):
        return tokenizer_info(self.tokenizer, self.config.chat_template)

    def _deadline(self, arrival: float) -> float | None:
        timeout = self.config.request_timeout_s
        return None if timeout is None else arrival + timeout

    async def _in_tokenizer_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn)

    async def _accept(self, request: Request, schema):
        """(parsed request, arrival) of a generation request, refused early when the server is
        draining, the body does not validate or names another model. ``arrival``
        (``time.monotonic()``) starts the request timeout and the latency histograms' clocks."""
        self.admission.check_open()
        arrival = time.monotonic()
        req = await self._parse(request, schema)
        self._check_model(req.model)
        req.check()
        return req, arrival

    async def completions(self, request: Request):
        req, arrival = await self._accept(request, CompletionRequest)
        texts = req.prompts()
        prompts = await self._in_tokenizer_thread(
            lambda: [self.tokenizer.encode(p) if isinstance(p, str) else p for p in texts])
        request_id = f"cmpl-{uuid.uuid4().hex}"
        requests = completion_requests(self.engine.input_processor, req, prompts, request_id, arrival)
        fmt = Formatter("completion", request_id, int(time.time()), self.model_name,
                        self.tokenizer, req.logprobs is not None, echo=req.echo, prompt_logprobs=req.prompt_logprobs,
                        n=req.n)
        return await self._respond(request, fmt, requests, req.stream, req.stream_options)

    async def chat_completions(self, request: Request):
        req, arrival = await self._accept(request, ChatCompletionRequest)
        tool_plan, constraint = plan_tool_calls(req, self.tool_parser, self.config.enable_auto_tool_choice)
        ids = await self._in_tokenizer_thread(lambda: render_chat(
            self.tokenizer, req.messages, self.config.chat_template, req.chat_template_kwargs,
            tools=req.template_tools()))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        requests = chat_requests(self.engine.input_processor, req, ids, constraint,
                                 self.config.default_chat_max_tokens, request_id, arrival)
        fmt = Formatter("chat", request_id, int(time.time()), self.model_name,
                        self.tokenizer, req.logprobs, prompt_logprobs=req.prompt_logprobs, tool_calls=tool_plan,
                        n=req.n)
        return await self._respond(request, fmt, requests, req.stream, req.stream_options)

    async def _respond(self, request: Request, fmt: Formatter, requests: list[EngineRequest], stream: bool,
                       stream_options):
        """Serve validated requests (``server/requests.py``), one per prompt, all with the same params."""
        params = requests[0].params
        if params.structured_output is not None:  # a bad schema or regex is a 400 now (compiled once, cached)
            await asyncio.wrap_future(self.engine.structured_output.compile(params.structured_output))
        release = self.admission.enter()
        prompts = [r.prompt_token_ids for r in requests]
        outputs = self._generate(requests)
        if stream:
            include_usage = bool(stream_options and stream_options.include_usage)
            return _ReleasingStream(self._stream(fmt, outputs, prompts, include_usage), release,
                                    media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            task = asyncio.ensure_future(self._collect(outputs, prompts, params.n))
            while not task.done():
                await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()  # closes the generator, which aborts the requests
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return JSONResponse(error_body("client disconnected"), status_code=499)
            return JSONResponse(fmt.full(task.result()))
        finally:
            release()

    async def _generate(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, RequestOutput) for every prompt and choice (prompt ``i``'s choice ``j``
        is choice ``i * n + j``, as OpenAI numbers them); leaving early (the client gone, the
        deadline passed) aborts the unfinished requests, every choice of them, which frees their
        pages."""
        deadline = self._deadline(requests[0].arrival_time)
        n = requests[0].params.n
        sink: asyncio.Queue = asyncio.Queue()
        pending: set[int] = set()
        try:
            for i, engine_request in enumerate(requests):
                self.async_engine.submit(engine_request, sink, tag=i)
                pending.add(i)
            while pending:
                index, item = await self._next(sink, deadline)
                if isinstance(item, BaseException):
                    raise item
                if item.request_finished:
                    pending.discard(index)
                yield index * n + item.index, item
        finally:
            for index in pending:
                self.async_engine.abort(requests[index].request_id)

    async def _next(self, sink: asyncio.Queue, deadline: float | None):
        if deadline is None:
            return await sink.get()
        try:
            return await asyncio.wait_for(sink.get(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request ran past this server's request timeout of "
                           f"{self.config.request_timeout_s:g} s and was aborted", "timeout_error",
                           code="request_timeout") from None

    @staticmethod
    def _choices(prompts: list[list[int]], n: int) -> list[Choice]:
        return [Choice(i * n + j, prompt_token_ids=ids) for i, ids in enumerate(prompts) for j in range(n)]

    async def _collect(self, outputs: AsyncIterator[tuple[int, Any]], prompts: list[list[int]], n: int
                       ) -> list[Choice]:
        choices = self._choices(prompts, n)
        async for index, out in outputs:
            choices[index].add(out)
        return choices

    async def _stream(self, fmt: Formatter, outputs: AsyncIterator[tuple[int, Any]],
                      prompts: list[list[int]], include_usage: bool) -> AsyncIterator[str]:
        choices = self._choices(prompts, fmt.n)
        started = [False] * len(choices)  # a completion's first chunk carries the echoed prompt
        try:
            if fmt.kind == "chat":
                for i in range(len(choices)):
                    yield sse(fmt.chunk(i, None, first=True))
            async for index, out in outputs:
                offset = len(choices[index].text) + fmt.echo_offset(choices[index])
                choices[index].add(out)
                prompt = None if started[index] else choices[index]
                started[index] = True
                chunk = fmt.chunk(index, out, text_offset=offset, prompt=prompt)
                if chunk is not None:
                    yield sse(chunk)
            if include_usage:
                yield sse(fmt.usage_chunk(choices))
        except Exception as err:  # headers are sent: the error can only travel in the stream
            logger.warning("stream %s failed: %s", fmt.request_id, err)
            type_, code = _error_kind(err)
            yield sse(error_body(str(err), type_, None, code))
        finally:
            await outputs.aclose()
        yield sse("[DONE]")
