"""Connection limits under uvicorn: a cap on open connections and a deadline for each request's headers,
and the uvicorn config that `skipkv serve` (and the tests) run the app with.

    config = server_config(app, ServerSettings(read_timeout=30, max_connections=512), "127.0.0.1", 8000)
    Server(config).run()

uvicorn bounds idle keep-alive connections but not a client that sends its headers slowly or never, nor
the number of connections; both would let a few sockets hold the server (and its graceful shutdown) open.
`GuardedH11` closes a connection whose request headers are not complete `read_timeout` seconds after the
connection opened or its previous response ended, and refuses connections beyond `max_connections` by
closing them at once. The body's deadline is the app's (http.read_body answers 408).

After SIGTERM, `Server` (uvicorn's, with one change) stops accepting connections and lets requests in flight
run for `shutdown_timeout` seconds; those still running then are ended by the app (`app.state.end_in_flight`):
each stream gets an error event, `data: [DONE]` and a terminated body, each non-streamed request a 503 with
OpenAI's error body; only what is still running FLUSH_S seconds later is cancelled, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from skipkv.serve.protocol import ServerSettings

log = logging.getLogger("skipkv.serve")
FLUSH_S = 3.0  # after the requests in flight were ended: how long their answers may take to go out


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (class attributes, set per server
    by `guarded`)."""

    header_timeout: float = 30.0
    max_connections: int = 512

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            log.warning("refusing a connection: %d are open (--max-connections)", len(self.connections) - 1)
            transport.close()  # connection_lost removes it from the set
            return
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        # A request whose headers arrived has a cycle still running: its body has the app's own deadline.
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            log.info("closing a connection that sent no complete request headers in %g s", self.header_timeout)
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers on this keep-alive connection get the same deadline

    def connection_lost(self, exc) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)


class Server(uvicorn.Server):
    """uvicorn's server, whose drain after SIGTERM ends the requests still in flight cleanly (module docstring)."""

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await asyncio.sleep(0.1)
        if not await self._drained(self.config.timeout_graceful_shutdown):
            end = getattr(getattr(self.config.app, "state", None), "end_in_flight", None)
            if end is not None:
                log.warning("ending %d request(s) still running %g s after the shutdown began",
                            len(self.server_state.tasks), self.config.timeout_graceful_shutdown)
                await end()
            if not await self._drained(FLUSH_S):
                log.error("cancelling %d request(s) that did not end", len(self.server_state.tasks))
                for t in self.server_state.tasks:
                    t.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _drained(self, seconds: float | None) -> bool:
        try:
            await asyncio.wait_for(self._wait_tasks_to_complete(), seconds)
            return True
        except asyncio.TimeoutError:
            return False


def guarded(settings: ServerSettings) -> type[GuardedH11]:
    """A GuardedH11 subclass with this server's limits."""
    return type("GuardedH11", (GuardedH11,), {"header_timeout": settings.read_timeout,
                                               "max_connections": settings.max_connections})


def server_config(app, settings: ServerSettings, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn config of a skipkv server: guarded connections and a bounded shutdown drain."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=guarded(settings),
                          timeout_graceful_shutdown=settings.shutdown_timeout)  # type: ignore[arg-type]
