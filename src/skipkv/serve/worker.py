"""The engine thread: owns the `Engine`; HTTP handlers only enqueue requests/aborts and read events.

    worker = EngineWorker(load_model("random:qwen2"), make_policy("rkv", budget=64), EngineConfig(), max_queue=64)
    worker.start(); worker.submit(job); ...; worker.stop()

The thread loops: drain new requests and aborts (a thread-safe inbox under a condition variable), then
`step()` while there is work, else wait on the condition. Every request's events go to its own asyncio
queue through `loop.call_soon_threadsafe`: ("accepted",), ("tokens", [ids]), ("done", RequestResult) or
("error", status, message). Concurrent clients share the engine's batch (continuous batching).

The queue limit counts only requests that truly wait for a slot: a new request is judged after the engine
step that follows its arrival (the step admits what fits). Admission is first come, first served (the server turns batch grouping off),
so the engine's W waiting requests are the W newest live ones; a new one among them beyond `max_queue` is
dropped with HTTP 429, any other is accepted. Requests that merely sat in the inbox while the engine
stepped, or that a free slot takes at once, never count.

Nothing but this thread touches the Engine (it is not thread-safe); the handlers keep their own copy of
the tokenizer. An abort is applied before the next step, so a disconnected client's slot and memory are
freed within one engine step. A request the engine refuses (a budget it cannot run, a reservation that
can never fit under kv_memory) fails alone with HTTP 400; an exception inside a step fails the requests
of that step (their states are unknown) with HTTP 500, and the engine is rebuilt so the server lives on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine import Engine, StepOutput
from skipkv.errors import SkipKVError

log = logging.getLogger("skipkv.serve")
FINISH_LABELS = ("eos", "stop", "length", "abort", "error")  # the label values of skipkv_requests_total


@dataclass(eq=False)
class Job:
    """One HTTP request on its way through the engine."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    kv_budget: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: bool = False  # engine thread only: past the queue limit check

    def push(self, event: tuple) -> bool:
        """Hand an event to the request's event loop; False if that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
            return True
        except RuntimeError:  # the loop was closed (server shutting down)
            return False


class Stopping(Exception):
    """The server is shutting down: no new requests."""


class EngineWorker:
    def __init__(self, bundle, policy, config: EngineConfig, max_queue: int) -> None:
        # First come, first served: fair to long prompts, and what the queue accounting relies on.
        config = dataclasses.replace(config, group_by_length=False)
        self.bundle, self.policy, self.config, self.max_queue = bundle, policy, config, max_queue
        self.engine = Engine(bundle, policy, config)  # built here so a bad policy/config fails at startup
        self._cond = threading.Condition()
        self._inbox: list[Job] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._jobs: dict[str, Job] = {}  # engine thread only: requests inside the engine, in arrival order
        self._metrics: dict[str, int] = {}
        self._finished: Counter = Counter()
        self._base = Counter()  # cumulative counters of engines replaced after a failure
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name="skipkv-engine", daemon=True)
        self._publish()

    # ------------------------------------------------------------------------------- handler side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, job: Job) -> None:
        """Hand a request to the engine thread (its first event says whether it was accepted); Stopping
        once the server shuts down."""
        with self._cond:
            if self._stopping:
                raise Stopping("the server is shutting down")
            self._inbox.append(job)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def metrics(self) -> dict[str, int]:
        with self._cond:
            return dict(self._metrics)

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._aborts or self._stopping or self.engine.has_unfinished()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    new, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for job in new:
                    self._add(job)
                for rid in aborts:
                    if self.engine.abort(rid):
                        self._jobs.pop(rid, None)
                        self._finished["abort"] += 1
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
        finally:
            for job in list(self._jobs.values()) + self._inbox:
                job.push(("error", 503, "the server is shutting down"))
            self._jobs.clear()
            self.engine.close()

    def _add(self, job: Job) -> None:
        try:
            self.engine.add_request(job.prompt_ids, job.sampling, request_id=job.request_id, budget=job.kv_budget)
        except SkipKVError as exc:
            self._reject(job, 400, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the engine thread
            log.exception("adding request %s failed", job.request_id)
            self._reject(job, 500, f"engine error: {exc}")
            return
        self._jobs[job.request_id] = job

    def _reject(self, job: Job, status: int, message: str) -> None:
        self._finished["error"] += 1
        job.push(("error", status, message))

    def _step(self) -> None:
        try:
            out = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("engine step failed; failing %d requests and rebuilding the engine", len(self._jobs))
            failed = list(self._jobs.values())
            self._jobs.clear()
            stats = self.engine.stats()
            self._base["generated"] += stats.generated_tokens
            self._base["compressions"] += stats.compressions
            self.engine.close()
            self.engine = Engine(self.bundle, self.policy, self.config)
            self._finished["error"] += len(failed)
            for job in failed:  # after the rebuild: a client told of the failure finds a working server
                job.push(("error", 500, f"engine error: {exc}"))
            return
        self._steps += 1
        self._dispatch(out)

    def _dispatch(self, out: StepOutput) -> None:
        tokens: dict[str, list[int]] = {}
        for rid, tok in out.new_tokens:
            tokens.setdefault(rid, []).append(tok)
        done: dict[str, tuple[Job, object]] = {}
        for res in out.finished:
            self._finished[res.finish_reason] += 1
            job = self._jobs.pop(res.request_id, None)
            if job is not None:
                done[res.request_id] = (job, res)
        self._judge(out.stats.waiting, [job for job, _ in done.values()])
        # Metrics first: a client that has its answer reads /metrics that already count it.
        self._publish()
        for rid, toks in tokens.items():
            if rid in done:
                done[rid][0].push(("tokens", toks))
                continue
            job = self._jobs.get(rid)
            if job is not None and not job.push(("tokens", toks)):
                self.engine.abort(rid)  # nobody is listening any more
                self._jobs.pop(rid)
                self._finished["abort"] += 1
        for job, res in done.values():
            job.push(("done", res))

    def _judge(self, waiting: int, finished: list[Job]) -> None:
        """Accept the new requests this step tried to admit, or refuse (429) those queued past max_queue."""
        live = list(self._jobs.values())
        queued = live[len(live) - waiting:] if waiting else []  # FIFO admission: the newest are the waiting
        for pos, job in enumerate(queued):
            if not job.accepted and pos >= self.max_queue:
                self.engine.abort(job.request_id)
                del self._jobs[job.request_id]
                job.push(("error", 429, f"{self.max_queue} requests already wait for a slot (--max-queue)"))
        for job in list(self._jobs.values()) + finished:
            if not job.accepted:
                job.accepted = True
                if not job.push(("accepted",)) and job.request_id in self._jobs:  # nobody is listening any more
                    self.engine.abort(job.request_id)
                    del self._jobs[job.request_id]
                    self._finished["abort"] += 1

    def _publish(self) -> None:
        s = self.engine.stats()
        m = {"running": s.running, "kv_reserved_bytes": s.kv_reserved_bytes, "kv_held_bytes": s.kv_held_bytes,
             "kv_allocated_bytes": s.kv_allocated_bytes, "kv_cap_bytes": s.kv_cap_bytes,
             "generated_tokens": self._base["generated"] + s.generated_tokens,
             "compressions": self._base["compressions"] + s.compressions, "steps": self._steps}
        m.update({f"finished_{k}": self._finished[k] for k in FINISH_LABELS})
        m["waiting"] = s.waiting
        with self._cond:
            self._metrics = m
