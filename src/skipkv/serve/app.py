"""The ASGI app (FastAPI): OpenAI's /v1/models, /v1/completions and /v1/chat/completions, /health, /metrics.

    app = create_app(load_model("random:qwen2"), make_policy("rkv", budget=64), EngineConfig(kv_memory=1 << 30),
                     ServerSettings(model_name="random:qwen2"))
    uvicorn.run(app, host="127.0.0.1", port=8000)          # or: skipkv serve --model random:qwen2

Handlers validate (protocol.py), enqueue a Job on the engine thread (worker.py) and read its events; they
never touch the Engine. Streaming answers are server-sent events in OpenAI's chunk format ending with
`data: [DONE]`; a client that disconnects mid-stream (or while waiting for a non-streamed answer) has its
request aborted. Errors have OpenAI's body {"error": {"message", "type", "param", "code"}}. The server
only tokenizes and detokenizes text; it never evaluates model output.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from skipkv.config import EngineConfig
from skipkv.serve import protocol
from skipkv.serve.protocol import APIError, Limits, ServerSettings, TextStream
from skipkv.serve.worker import FINISH_LABELS, EngineWorker, Job, QueueFull

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class DisconnectAwareStream(StreamingResponse):
    """Streams the body while listening for the client's disconnect (whatever the ASGI version), and calls
    `on_exit` once the response ends for any reason, so an abandoned request is aborted at once."""

    def __init__(self, body, on_exit) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_exit = on_exit

    async def __call__(self, scope, receive, send) -> None:
        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(self.stream_response(send)), asyncio.ensure_future(listen())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)  # an async generator's; the type does not say
            if aclose is not None:
                await aclose()
            self.on_exit()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _prometheus(m: dict[str, int]) -> str:
    """/metrics in Prometheus' text format."""
    rows = [("skipkv_requests_running", "gauge", "requests holding a slot (decoding or prefilling)", m["running"]),
            ("skipkv_requests_waiting", "gauge", "requests queued for admission", m["waiting"]),
            ("skipkv_kv_reserved_bytes", "gauge", "KV bytes reserved by running requests", m["kv_reserved_bytes"]),
            ("skipkv_kv_held_bytes", "gauge", "KV bytes running requests hold now", m["kv_held_bytes"]),
            ("skipkv_kv_allocated_bytes", "gauge", "KV slot store as allocated", m["kv_allocated_bytes"]),
            ("skipkv_kv_cap_bytes", "gauge", "KV memory cap (0 = none)", m["kv_cap_bytes"]),
            ("skipkv_generated_tokens_total", "counter", "tokens generated", m["generated_tokens"]),
            ("skipkv_compressions_total", "counter", "KV compressions (one per request compressed)", m["compressions"]),
            ("skipkv_engine_steps_total", "counter", "engine steps", m["steps"])]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    out += ["# HELP skipkv_requests_total requests finished, by finish reason (eos, stop string, length, "
            "abort = client gone, error)", "# TYPE skipkv_requests_total counter"]
    out += [f'skipkv_requests_total{{finish_reason="{k}"}} {m[f"finished_{k}"]}' for k in FINISH_LABELS]
    return "\n".join(out) + "\n"


def create_app(bundle, policy, engine_config: EngineConfig, settings: ServerSettings | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it (finishing nothing in flight)."""
    settings = settings or ServerSettings()
    model_name = settings.model_name or bundle.name
    worker = EngineWorker(bundle, policy, engine_config, settings.max_queue)
    # The handlers' own tokenizer: the engine thread uses the bundle's, and a tokenizer is not thread-safe.
    tokenizer = copy.deepcopy(bundle.tokenizer)
    limits = Limits(model_name, bundle.max_context, settings.max_tokens_cap)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="skipkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(exc.detail), kind), status_code=exc.status_code)

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
        return PlainTextResponse(_prometheus(worker.metrics()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "skipkv", "max_model_len": bundle.max_context}]}

    async def answer(request: Request, chat: bool):
        authorize(request)
        body = protocol.load_body(await request.body())
        parsed = (protocol.parse_chat if chat else protocol.parse_completion)(body, tokenizer, limits)
        rid = protocol.new_id(chat)
        job = Job(rid, parsed.prompt_ids, parsed.sampling, parsed.kv_budget, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"server busy: {exc}; retry later", None, "queue_full", type="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        try:
            first = await job.events.get()  # the engine accepted it, or refused it (HTTP 400)
        except asyncio.CancelledError:
            worker.abort(rid)
            raise
        if first[0] == "error":
            raise APIError(first[1], first[2], None, None,
                           type="invalid_request_error" if first[1] == 400 else "server_error")
        ts = int(time.time())
        if parsed.stream:
            state = {"done": False}
            return DisconnectAwareStream(_stream(job, parsed, chat, ts, state),
                                         lambda: None if state["done"] else worker.abort(rid))
        return await _wait(request, job, chat, ts)

    async def _wait(request: Request, job: Job, chat: bool, ts: int):
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        worker.abort(job.request_id)
                        return Response(status_code=499)
                    continue
                if ev[0] == "done":
                    return protocol.final(job.request_id, model_name, chat, ev[1], ts)
                if ev[0] == "error":
                    return JSONResponse(protocol.error_body(ev[2], "server_error"), status_code=ev[1])
        except asyncio.CancelledError:
            worker.abort(job.request_id)
            raise

    async def _stream(job: Job, parsed, chat: bool, ts: int, state: dict):
        rid = job.request_id
        text = TextStream(tokenizer, parsed.sampling.stop)
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
