"""The ASGI app (FastAPI): OpenAI's /v1/models, /v1/completions and /v1/chat/completions, /health, /metrics.

    app = create_app(load_model("random:qwen2"), make_policy("rkv", budget=64), EngineConfig(kv_memory=1 << 30),
                     ServerSettings(model_name="random:qwen2"))
    uvicorn.Server(server_config(app, ServerSettings(), "127.0.0.1", 8000)).run()   # or: skipkv serve

Handlers validate (protocol.py), enqueue a Job on the engine thread (worker.py) and read its events; they
never touch the Engine. Streaming answers are server-sent events in OpenAI's chunk format ending with
`data: [DONE]`; a client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its
request aborted at once: a listener on the connection races the engine's events. Errors have OpenAI's body
{"error": {"message", "type", "param", "code"}}, whatever the cause. The server only tokenizes and
detokenizes text; it never evaluates model output.

What a hostile client cannot do: send a body over `max_body_bytes` (413 before it is read), take longer than
`read_timeout` for its body (408) or its headers (closed, see guard.py), stall the event loop with a huge
prompt (parsing and tokenizing run on a worker thread, bounded by the model's context, see
protocol.encode_bounded), or make the stop-string check quadratic (protocol.StopMatcher).
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from skipkv.config import EngineConfig
from skipkv.serve import protocol
from skipkv.serve.protocol import APIError, Limits, ServerSettings, TextStream
from skipkv.serve.worker import FINISH_LABELS, EngineWorker, Job, Stopping

RETRY_AFTER_S = 1  # what a 429 tells the client to wait
CLIENT_CLOSED = 499  # nginx's status for "the client went away"; the client never sees it


class DisconnectAwareStream(StreamingResponse):
    """Streams the body while listening for the client's disconnect (whatever the ASGI version), and calls
    `on_exit` once the response ends for any reason, so an abandoned request is aborted at once."""

    def __init__(self, body, on_exit) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_exit = on_exit

    async def __call__(self, scope, receive, send) -> None:
        tasks = [asyncio.ensure_future(self.stream_response(send)), asyncio.ensure_future(_disconnected(receive))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()
            self.on_exit()


async def _disconnected(receive) -> None:
    """Returns once the client has gone (call it only after the body was read: it consumes messages)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ResponseTap:
    """ASGI middleware counting responses by status code (for /metrics) and adding `headers` to each; an
    exception that escapes the app counts as the 500 the server will send."""

    def __init__(self, app, counts: Counter, headers: list[tuple[bytes, bytes]]) -> None:
        self.app, self.counts, self.headers = app, counts, headers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tapped_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counts[message["status"]] += 1
                if self.headers:
                    message = {**message, "headers": list(message.get("headers", [])) + self.headers}
            await send(message)

        try:
            await self.app(scope, receive, tapped_send)
        except Exception:
            if not started:
                self.counts[500] += 1
            raise


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body: 413 past `limit` bytes (before reading, when Content-Length says so), 408 if it does
    not arrive within `timeout` seconds."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; this server takes at most {limit}", None,
                       "request_too_large")

    async def gather() -> bytes:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(413, f"the request body exceeds {limit} bytes", None, "request_too_large")
            parts.append(part)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(gather(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", None, "request_timeout") from None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _resident_bytes() -> tuple[int, int]:
    """This process's resident memory now and at its peak (Linux; (0, peak) where /proc is missing)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        now = 0
    return now, peak


def _prometheus(m: dict[str, int], statuses: Counter, replica: str = "") -> str:
    """/metrics in Prometheus' text format."""
    rss, peak_rss = _resident_bytes()
    rows = [("skipkv_requests_running", "gauge", "requests holding a slot (decoding or prefilling)", m["running"]),
            ("skipkv_requests_waiting", "gauge", "requests waiting for a slot", m["waiting"]),
            ("skipkv_kv_reserved_bytes", "gauge", "KV bytes reserved by running requests", m["kv_reserved_bytes"]),
            ("skipkv_kv_held_bytes", "gauge", "KV bytes running requests hold now", m["kv_held_bytes"]),
            ("skipkv_kv_allocated_bytes", "gauge", "KV slot store as allocated", m["kv_allocated_bytes"]),
            ("skipkv_kv_cap_bytes", "gauge", "KV memory cap (0 = none)", m["kv_cap_bytes"]),
            ("skipkv_generated_tokens_total", "counter", "tokens generated", m["generated_tokens"]),
            ("skipkv_compressions_total", "counter", "KV compressions (one per request compressed)", m["compressions"]),
            ("skipkv_engine_steps_total", "counter", "engine steps", m["steps"]),
            ("skipkv_process_resident_bytes", "gauge", "the server process's resident memory", rss),
            ("skipkv_process_peak_resident_bytes", "gauge", "the server process's peak resident memory", peak_rss)]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    out += ["# HELP skipkv_requests_total requests finished, by finish reason (eos, stop string, length, "
            "abort = client gone, error)", "# TYPE skipkv_requests_total counter"]
    out += [f'skipkv_requests_total{{finish_reason="{k}"}} {m[f"finished_{k}"]}' for k in FINISH_LABELS]
    out += ["# HELP skipkv_http_responses_total HTTP responses by status code (4xx: the client's fault or a full "
            "queue; 499: the client went away first; 5xx: the server's)", "# TYPE skipkv_http_responses_total counter"]
    out += [f'skipkv_http_responses_total{{code="{code}"}} {n}' for code, n in sorted(statuses.items())]
    if replica:
        out += ["# HELP skipkv_replica_info the replica these figures are from", "# TYPE skipkv_replica_info gauge",
                f'skipkv_replica_info{{replica="{replica}"}} 1']
    return "\n".join(out) + "\n"


def create_app(bundle, policy, engine_config: EngineConfig, settings: ServerSettings | None = None,
               replica: str = "") -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it (finishing nothing in flight).
    The engine admits first come, first served whatever `engine_config.group_by_length` says. `replica`: this
    copy's name when several serve one endpoint (replicas.py): every response says it in `x-skipkv-replica`."""
    settings = settings or ServerSettings()
    model_name = settings.model_name or bundle.name
    worker = EngineWorker(bundle, policy, engine_config, settings.max_queue)
    # Tokenizers are not thread-safe: the engine thread uses the bundle's, the parsing thread one copy and the
    # event loop (streamed detokenizing) another.
    parse_tokenizer, stream_tokenizer = copy.deepcopy(bundle.tokenizer), copy.deepcopy(bundle.tokenizer)
    limits = Limits(model_name, bundle.max_context, settings.max_tokens_cap, protocol.max_token_chars(bundle.tokenizer))
    created = int(time.time())
    # One thread parses and tokenizes: a large prompt costs that thread time, never the event loop's.
    parser = ThreadPoolExecutor(1, thread_name_prefix="skipkv-parse")
    statuses: Counter = Counter()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)
            parser.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="skipkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.statuses = statuses
    app.add_middleware(ResponseTap, counts=statuses, headers=[(b"x-skipkv-replica", replica.encode())] if replica else [])

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):  # a bug: OpenAI's body all the same (logged with traceback)
        return JSONResponse(protocol.error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

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
    async def metrics():
        return PlainTextResponse(_prometheus(worker.metrics(), statuses, replica), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "skipkv", "max_model_len": bundle.max_context}]}

    def parse(raw: bytes, chat: bool) -> protocol.Parsed:
        body = protocol.load_body(raw)
        return (protocol.parse_chat if chat else protocol.parse_completion)(body, parse_tokenizer, limits)

    async def answer(request: Request, chat: bool):
        authorize(request)
        raw = await read_body(request, settings.max_body_bytes, settings.read_timeout)
        gone = asyncio.ensure_future(_disconnected(request.receive))  # the body is read: only a disconnect is left
        try:
            parsed = await _race(asyncio.get_running_loop().run_in_executor(parser, parse, raw, chat), gone)
            if parsed is None:
                return Response(status_code=CLIENT_CLOSED)
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
                    return Response(status_code=CLIENT_CLOSED)
                if first[0] == "error":
                    raise _event_error(first)
                ts = int(time.time())
                if not parsed.stream:
                    return await _wait(job, chat, ts, gone)
            except asyncio.CancelledError:
                worker.abort(rid)
                raise
        finally:
            gone.cancel()
        # The stream listens for the disconnect itself (the listener above is cancelled: one reader at a time).
        state = {"done": False}
        return DisconnectAwareStream(_stream(job, parsed, chat, ts, state),
                                     lambda: None if state["done"] else worker.abort(rid))

    async def _wait(job: Job, chat: bool, ts: int, gone: asyncio.Future):
        while True:
            try:
                ev = job.events.get_nowait()  # no task per event while events are queued
            except asyncio.QueueEmpty:
                ev = await _race(job.events.get(), gone)
            if ev is None:  # the client went away: free its slot now, not after its last token
                worker.abort(job.request_id)
                return Response(status_code=CLIENT_CLOSED)
            if ev[0] == "done":
                return protocol.final(job.request_id, model_name, chat, ev[1], ts)
            if ev[0] == "error":
                raise _event_error(ev)

    async def _stream(job: Job, parsed, chat: bool, ts: int, state: dict):
        rid = job.request_id
        text = TextStream(stream_tokenizer, parsed.sampling.stop)
        if chat:
            yield _sse(protocol.chunk(rid, model_name, chat, None, role=True, created=ts))
        while True:
            ev = await job.events.get()
            if ev[0] == "tokens":
                # One chunk per token, even while its text is held back (an incomplete UTF-8 sequence, a
                # possible stop string): clients count tokens and inter-token latency by chunks.
                for tok in ev[1]:
                    yield _sse(protocol.chunk(rid, model_name, chat, text.add([tok]), created=ts))
            elif ev[0] == "done":
                state["done"] = True
                res = ev[1]
                use = protocol.usage(res)  # the last chunk: the held-back rest of the text, finish reason, usage
                yield _sse(protocol.chunk(rid, model_name, chat, text.finish(res.text),
                                          protocol.OPENAI_FINISH[res.finish_reason], usage_=use, created=ts))
                if parsed.include_usage:  # OpenAI's own usage chunk: no choices
                    yield _sse(protocol.chunk(rid, model_name, chat, None, usage_=use, created=ts))
                break
            else:
                state["done"] = True
                yield _sse(protocol.error_body(ev[2], "server_error"))
                break
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    return app


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
    return APIError(status, message, None, None, type="invalid_request_error" if status < 500 else "server_error")
