"""HTTP plumbing of the app: a streaming response that notices the client's disconnect, a status-counting
middleware, a bounded body reader and the parsing lanes (a large body never delays a small one).

    raw = await read_body(request, limit=4 << 20, timeout=30)      # 413 past the limit, 408 past the timeout
    lanes = Lanes(tokenizer); lanes.admit(client); work = lanes.submit(parse, raw, chat, client=client)
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import StreamingResponse

from skipkv.serve.protocol import APIError

RETRY_AFTER_S = 1  # what a 429 tells the client to wait
SMALL_BODY = 64 << 10  # bodies up to this many bytes parse on their own thread, never behind larger ones
LARGE_PER_CLIENT = 2  # larger bodies being read or parsed at once, per client address
LARGE_QUEUED = 8  # ... and in all


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
            aclose = getattr(self.body_iterator, "aclose", None)  # an async generator's; the type does not say
            if aclose is not None:
                await aclose()
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


async def read_body(request: Request, limit: int, timeout: float, closing: asyncio.Event | None = None) -> bytes:
    """The request body: 413 past `limit` bytes (before reading, when Content-Length says so), 408 if it does
    not arrive within `timeout` seconds, 503 once `closing` is set (the server is shutting down)."""
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

    work = asyncio.ensure_future(asyncio.wait_for(gather(), timeout))
    if closing is not None:
        shut = asyncio.ensure_future(closing.wait())
        try:
            await asyncio.wait([work, shut], return_when=asyncio.FIRST_COMPLETED)
        finally:
            shut.cancel()
        if not work.done():
            work.cancel()
            raise APIError(503, "the server is shutting down", None, "shutting_down", type="server_error")
    try:
        return await work
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", None, "request_timeout") from None


class Lanes:
    """Two parsing threads: bodies up to SMALL_BODY bytes on one, larger ones on the other, so that normal
    requests never queue behind large ones; a client (by address) has at most LARGE_PER_CLIENT large bodies
    being read or parsed, and the server LARGE_QUEUED, past which a large body gets 429 before it is read."""

    def __init__(self, tokenizer) -> None:
        # Tokenizers are not thread-safe: each thread parses with its own copy.
        self.small, self.large = (ThreadPoolExecutor(1, thread_name_prefix=f"skipkv-parse-{n}") for n in ("s", "l"))
        self.tokenizers = {id(self.small): copy.deepcopy(tokenizer), id(self.large): copy.deepcopy(tokenizer)}
        self.pending: Counter[str] = Counter()

    def admit(self, client: str) -> None:
        if self.pending[client] >= LARGE_PER_CLIENT or sum(self.pending.values()) >= LARGE_QUEUED:
            raise APIError(429, f"too many large request bodies in flight (over {SMALL_BODY} bytes: at most "
                           f"{LARGE_PER_CLIENT} per client, {LARGE_QUEUED} in all); retry later", None,
                           "too_many_large_bodies", type="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.pending[client] += 1

    def release(self, client: str) -> None:
        self.pending[client] -= 1
        if self.pending[client] <= 0:
            del self.pending[client]

    def submit(self, fn, raw: bytes, *args, client: str | None = None) -> asyncio.Future:
        """Run fn(raw, tokenizer, *args) on the lane for raw's size; `client`: release its large-body slot once
        the thread is done with it (not when the handler stops waiting: the work goes on until then)."""
        pool = self.large if len(raw) > SMALL_BODY else self.small
        work = pool.submit(fn, raw, self.tokenizers[id(pool)], *args)
        if client is not None:
            loop = asyncio.get_running_loop()

            def done(_) -> None:
                try:
                    loop.call_soon_threadsafe(self.release, client)
                except RuntimeError:  # the loop is closed: the server is gone
                    pass

            work.add_done_callback(done)
        return asyncio.wrap_future(work)

    def shutdown(self) -> None:
        for pool in (self.small, self.large):
            pool.shutdown(wait=False, cancel_futures=True)


async def gone_or_late(receive, seconds: float | None) -> str:
    """"gone" once the client has gone, "late" once `seconds` have passed (None: never)."""
    try:
        await asyncio.wait_for(_disconnected(receive), seconds)
        return "gone"
    except asyncio.TimeoutError:
        return "late"
