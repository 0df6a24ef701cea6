"""The ASGI app (FastAPI): OpenAI's /v1/models, /v1/completions and /v1/chat/completions, /health, /metrics.

    app = create_app(load_model("random:qwen2"), make_policy("rkv", budget=64), EngineConfig(kv_memory=1 << 30),
                     ServerSettings(model_name="random:qwen2"))
    guard.Server(server_config(app, ServerSettings(), "127.0.0.1", 8000)).run()   # or: skipkv serve

Handlers validate (protocol.py), enqueue a Job on the engine thread (worker.py) and read its events; they
never touch the Engine. Streaming answers are server-sent events in OpenAI's chunk format ending with
`data: [DONE]`; a client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its
request aborted at once: a listener on the connection races the engine's events. Errors have OpenAI's body
{"error": {"message", "type", "param", "code"}}, whatever the cause. The server only tokenizes and
detokenizes text; it never evaluates model output.

What a hostile client cannot do: send a body over `max_body_bytes` (413 before it is read), take longer than
`read_timeout` for its body (408) or its headers (closed, see guard.py), stall the event loop with a huge
prompt (parsing and tokenizing run on worker threads, bounded by the model's context, see
protocol.encode_bounded), queue normal requests behind large bodies (http.Lanes), hold a request open past
`request_timeout` (504, or an error event), or make the stop-string check quadratic (protocol.StopMatcher).
Every request's TTFT, inter-token gaps and end-to-end time go to /metrics' histograms (metrics.py).
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import time
from collections import Counter
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from skipkv.config import EngineConfig
from skipkv.serve import protocol
from skipkv.serve.http import (
    RETRY_AFTER_S,
    SMALL_BODY,
    DisconnectAwareStream,
    Lanes,
    ResponseTap,
    gone_or_late,
    read_body,
)
from skipkv.serve.metrics import ServerMetrics, Timing
from skipkv.serve.protocol import APIError, Limits, ServerSettings, TextStream
from skipkv.serve.worker import EngineWorker, Job, Stopping

CLIENT_CLOSED = 499  # nginx's status for "the client went away"; the client never sees it
SHUTDOWN_JOIN_S = 5.0  # how long ending the requests in flight waits for the engine thread's current step


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(bundle, policy, engine_config: EngineConfig, settings: ServerSettings | None = None,
               replica: str = "") -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it (finishing nothing in flight).
    The engine admits first come, first served whatever `engine_config.group_by_length` says. `replica`: this
    copy's name when several serve one endpoint (replicas.py): every response says it in `x-skipkv-replica`.
    `app.state.end_in_flight()` (guard.Server calls it when the drain after SIGTERM runs out) ends every request
    still in flight with an error."""
    settings = settings or ServerSettings()
    model_name = settings.model_name or bundle.name
    worker = EngineWorker(bundle, policy, engine_config, settings.max_queue)
    # The engine thread uses the bundle's tokenizer, each parsing thread its own copy and the event loop
    # (streamed detokenizing) another.
    stream_tokenizer = copy.deepcopy(bundle.tokenizer)
    limits = Limits(model_name, bundle.max_context, settings.max_tokens_cap, protocol.max_token_chars(bundle.tokenizer))
    created = int(time.time())
    lanes = Lanes(bundle.tokenizer)  # parsing and tokenizing cost these threads time, never the event loop's
    statuses: Counter = Counter()
    metrics = ServerMetrics(worker.metrics, statuses, replica)
    timeout = settings.request_timeout or None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)
            lanes.shutdown()

    app = FastAPI(title="skipkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.statuses = statuses
    closing = asyncio.Event()

    async def end_in_flight() -> None:
        closing.set()  # bodies still arriving: 503
        await asyncio.to_thread(worker.stop, SHUTDOWN_JOIN_S)  # requests in the engine: an error event each

    app.state.end_in_flight = end_in_flight
    app.add_middleware(ResponseTap, counts=statuses,
                       headers=[(b"x-skipkv-replica", replica.encode())] if replica else [])

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):  # a bug: OpenAI's body all the same (logged with traceback)
        return JSONResponse(protocol.error_body(f"internal error: {type(exc).__name__}", "server_error"),
                            status_code=500)

    def authorize(request: Request) -> None:
        if not settings.api_key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", None,
                           "invalid_api_key", type="authentication_error")

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_():
        body, kind = metrics.render()
        return Response(body, media_type=kind)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "skipkv", "max_model_len": bundle.max_context}]}

    def given_up(gone: asyncio.Future) -> Response:
        """The answer once `gone` is done: nothing for a client that has gone, 504 when its time is up."""
        if gone.result() == "late":
            raise APIError(504, _late_message(settings.request_timeout), None, "request_timeout", type="server_error")
        return Response(status_code=CLIENT_CLOSED)

    def parse(raw: bytes, tokenizer, chat: bool) -> protocol.Parsed:
        return protocol.parse_request(raw, tokenizer, limits, chat)

    async def read_and_parse(request: Request, chat: bool, arrived: float):
        """(the request parsed or None, `gone`: done once the client has gone or the request's time is up)."""
        declared = request.headers.get("content-length", "")
        client = request.client.host if request.client else ""
        large = not declared.isdigit() or int(declared) > SMALL_BODY
        if large:
            lanes.admit(client)
        try:
            raw = await read_body(request, settings.max_body_bytes, settings.read_timeout, closing)
            work = lanes.submit(parse, raw, chat, client=client if large else None)
            large = False  # released by the lane from now on
        finally:
            if large:
                lanes.release(client)
        # The body is read: only a disconnect is left to receive.
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - arrived))
        gone = asyncio.ensure_future(gone_or_late(request.receive, left))
        try:
            return await _race(work, gone), gone
        except BaseException:
            gone.cancel()
            raise

    async def answer(request: Request, chat: bool):
        arrived = time.monotonic()
        authorize(request)
        parsed, gone = await read_and_parse(request, chat, arrived)
        try:
            if parsed is None:
                return given_up(gone)
            rid = protocol.new_id(chat)
            job = Job(rid, parsed.prompt_ids, parsed.sampling, parsed.kv_budget, asyncio.get_running_loop())
            try:
                worker.submit(job)
            except Stopping as exc:
                raise APIError(503, str(exc), None, "shutting_down", type="server_error") from None
            try:
                first = await _race(job.events.get(), gone)  # accepted, or refused (400, 429)
                if first is None:
                    worker.abort(rid)
                    return given_up(gone)
                if first[0] == "error":
                    raise _event_error(first)
                ts = int(time.time())
                if not parsed.stream:
                    return await _wait(job, chat, ts, gone, Timing(metrics, arrived))
            except asyncio.CancelledError:
                worker.abort(rid)
                raise
        finally:
            gone.cancel()
        # The stream listens for the disconnect itself (the listener above is cancelled: one reader at a time).
        state = {"done": False}
        left = None if timeout is None else timeout - (time.monotonic() - arrived)
        return DisconnectAwareStream(_stream(job, parsed, chat, ts, state, Timing(metrics, arrived), left),
                                     lambda: None if state["done"] else worker.abort(rid))

    async def _wait(job: Job, chat: bool, ts: int, gone: asyncio.Future, timing: Timing):
        while True:
            try:
                ev = job.events.get_nowait()  # no task per event while events are queued
            except asyncio.QueueEmpty:
                ev = await _race(job.events.get(), gone)
            if ev is None:  # the client went away, or the time is up: free its slot now, not after its last token
                worker.abort(job.request_id)
                return given_up(gone)
            if ev[0] == "tokens":
                timing.tokens(time.monotonic())
            elif ev[0] == "done":
                timing.done(time.monotonic())
                return protocol.final(job.request_id, model_name, chat, ev[1], ts)
            elif ev[0] == "error":
                raise _event_error(ev)

    async def _stream(job: Job, parsed, chat: bool, ts: int, state: dict, timing: Timing, left: float | None):
        rid = job.request_id
        text = TextStream(stream_tokenizer, parsed.sampling.stop)
        deadline = None if left is None else time.monotonic() + left
        if chat:
            yield _sse(protocol.chunk(rid, model_name, chat, None, role=True, created=ts))
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), None if deadline is None else deadline - time.monotonic())
            except asyncio.TimeoutError:
                ev = ("error", 504, _late_message(settings.request_timeout))
                worker.abort(rid)
            if ev[0] == "tokens":
                timing.tokens(time.monotonic())
                # One chunk per token, even while its text is held back (an incomplete UTF-8 sequence, a
                # possible stop string): clients count tokens and inter-token latency by chunks.
                for tok in ev[1]:
                    yield _sse(protocol.chunk(rid, model_name, chat, text.add([tok]), created=ts))
            elif ev[0] == "done":
                state["done"] = True
                timing.done(time.monotonic())
                res = ev[1]
                use = protocol.usage(res)  # the last chunk: the held-back rest of the text, finish reason, usage
                yield _sse(protocol.chunk(rid, model_name, chat, text.finish(res.text),
                                          protocol.OPENAI_FINISH[res.finish_reason], usage_=use, created=ts))
                if parsed.include_usage:  # OpenAI's own usage chunk: no choices
                    yield _sse(protocol.chunk(rid, model_name, chat, None, usage_=use, created=ts))
                break
            else:
                state["done"] = True
                yield _sse(_event_error(ev).body())
                break
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    return app


def _late_message(seconds: float) -> str:
    return f"the request did not finish within {seconds:g} s (--request-timeout); it was aborted"


async def _race(work, gone: asyncio.Future):
    """`work`'s result, or None once the client has gone (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    return None


def _event_error(ev: tuple) -> APIError:
    """The APIError for an engine thread's ("error", status, message) event."""
    status, message = ev[1], ev[2]
    if status == 429:
        return APIError(429, f"server busy: {message}; retry later", None, "queue_full", type="rate_limit_error",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    code = {503: "shutting_down", 504: "request_timeout"}.get(status)
    return APIError(status, message, None, code, type="invalid_request_error" if status < 500 else "server_error")
