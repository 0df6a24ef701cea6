"""`skipkv bench serve --scenario NAME`: one hostile situation against a server on this machine, measured.

    skipkv serve --model random:qwen2:0.5b --policy rkv --budget 128 --port 18770 --threads 1 2> serve.log &
    skipkv bench serve --url http://127.0.0.1:18770 --scenario long-prompt --out long.json
    skipkv bench serve --url http://127.0.0.1:18770 --scenario flood --out flood.json
    skipkv bench serve --url http://127.0.0.1:18770 --scenario sigterm --pid $! --log serve.log --out term.json

long-prompt  streams run; a 6,000-token prompt arrives: the longest gap between two chunks of a running stream
             while it prefills, and its latency; then another long prompt whose client gives up after 2 s: how
             long until the server counts it aborted (its /metrics) and the streams' longest gap meanwhile.
flood        normal requests (a one-token completion, one at a time) alone, then beside 16 clients posting ~4 MB
             chat bodies of empty messages: the normal requests' p50/p99 latency both ways, the flood's statuses.
sigterm      streams (some short enough to end within the drain, most not) and non-streamed requests in flight,
             then SIGTERM to the server's pid: how each ended ([DONE], an error event, a cut body; the status and
             body of the non-streamed ones) and the tracebacks in the server's log (--log).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from skipkv.bench.soak import loopback_url, parse_metrics
from skipkv.engine.request import percentile
from skipkv.errors import SkipKVError

SCENARIOS = ("long-prompt", "flood", "sigterm")
ABORTED = 'skipkv_requests_total{finish_reason="abort"}'
LENGTH = 'skipkv_requests_total{finish_reason="length"}'


def token_prompt(n: int) -> list[int]:
    """n token ids valid in any vocabulary of 256+ entries (a prompt of exactly n tokens, whatever the tokenizer)."""
    return [32 + (i * 7) % 200 for i in range(n)]


class Stream:
    """One streamed completion, recording when each chunk arrived and how the stream ended."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.ending, self.error_event = max_tokens, "", False
        self.times: list[float] = []

    async def run(self, h, url: str, body: dict, headers: dict) -> None:
        import httpx

        body = dict(body, stream=True, max_tokens=self.max_tokens, ignore_eos=True)
        last = ""
        try:
            async with h.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    self.ending = f"status {r.status_code}"
                    return
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    self.times.append(time.monotonic())
                    last = line
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        self.error_event = True
            self.ending = "[DONE]" if last == "data: [DONE]" else "ended without [DONE]"
        except httpx.RemoteProtocolError:
            self.ending = "cut (body not terminated)"
        except (httpx.ReadError, httpx.ConnectError) as exc:
            self.ending = f"cut ({type(exc).__name__})"

    def longest_gap(self, t0: float, t1: float) -> float:
        ts = [t0] + [t for t in self.times if t0 <= t <= t1] + [t1]
        return max(b - a for a, b in zip(ts, ts[1:]))


async def _metric(h, url: str, name: str) -> float:
    return parse_metrics((await h.get(url + "/metrics")).text).get(name, 0.0)


async def _started(streams: list[Stream], n: int = 3, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(len(s.times) >= n for s in streams):
        if time.monotonic() > deadline:
            raise SkipKVError("the streams did not start within 300 s")
        await asyncio.sleep(0.05)


async def long_prompt(h, url: str, model: str, headers: dict, tokens: int = 6000, streams: int = 4) -> dict:
    running = [Stream(4000) for _ in range(streams)]
    tasks = [asyncio.ensure_future(s.run(h, url, {"model": model, "prompt": "The quick brown fox"}, headers))
             for s in running]
    await _started(running)
    big = {"model": model, "prompt": token_prompt(tokens), "max_tokens": 1}
    t0 = time.monotonic()
    r = await h.post(url + "/v1/completions", json=big, headers=headers, timeout=900)
    t1 = time.monotonic()
    out = {"prompt_tokens": tokens, "streams": streams, "long_prompt_status": r.status_code,
           "long_prompt_seconds": round(t1 - t0, 2),
           "longest_stream_gap_s": round(max(s.longest_gap(t0, t1) for s in running), 2)}
    # A second long prompt whose client gives up after 2 s: when does the server let it go?
    before = [await _metric(h, url, ABORTED), await _metric(h, url, LENGTH)]
    t0 = time.monotonic()
    try:
        await h.post(url + "/v1/completions", json=big, headers=headers, timeout=2.0)
        out["abandoned"] = "answered within 2 s"
    except Exception:  # noqa: BLE001 - the timeout is the point: the client disconnects
        t_gone = time.monotonic()
        while True:  # until the server aborts it, or it runs to its end regardless
            now = [await _metric(h, url, ABORTED), await _metric(h, url, LENGTH)]
            if now != before or time.monotonic() - t_gone > 900:
                break
            await asyncio.sleep(0.1)
        t1 = time.monotonic()
        out["abandoned"] = "aborted" if now[0] > before[0] else "ran to its end" if now[1] > before[1] else "neither"
        out["abandoned_ended_after_disconnect_s"] = round(t1 - t_gone, 2)
        out["longest_stream_gap_while_abandoned_s"] = round(max(s.longest_gap(t0, t1) for s in running), 2)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return out


def flood_body(model: str, size: int) -> bytes:
    msg = b'{"role":"user","content":""},'
    n = (size - 100) // len(msg)
    return b'{"model":' + json.dumps(model).encode() + b',"max_tokens":1,"messages":[' + msg * n + msg[:-1] + b"]}"


async def _normals(h, url: str, model: str, headers: dict, seconds: float) -> tuple[list[float], list[str]]:
    lat, bad = [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        r = await h.post(url + "/v1/completions", headers=headers,
                         json={"model": model, "prompt": "2 + 2 =", "max_tokens": 1, "temperature": 0})
        if r.status_code == 200:
            lat.append(time.monotonic() - t0)
        else:
            bad.append(str(r.status_code))
    return lat, bad


async def flood(h, url: str, model: str, headers: dict, clients: int = 16, size: int = 4_000_000,
                seconds: float = 30.0) -> dict:
    q = lambda xs, p: round(percentile(xs, p), 4) if xs else None  # noqa: E731
    alone, _ = await _normals(h, url, model, headers, seconds / 3)
    body, stop = flood_body(model, size), asyncio.Event()
    statuses: dict[str, int] = {}

    async def flooder() -> None:
        while not stop.is_set():
            try:
                r = await h.post(url + "/v1/chat/completions", content=body,
                                 headers={**headers, "Content-Type": "application/json"})
                key = str(r.status_code)
            except Exception as exc:  # noqa: BLE001 - counted
                key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1

    floods = [asyncio.ensure_future(flooder()) for _ in range(clients)]
    await asyncio.sleep(1.0)
    beside, bad = await _normals(h, url, model, headers, seconds)
    stop.set()
    await asyncio.gather(*floods, return_exceptions=True)
    return {"flood_clients": clients, "flood_body_bytes": len(body), "flood_statuses": statuses,
            "normal_alone": {"requests": len(alone), "p50_s": q(alone, 0.5), "p99_s": q(alone, 0.99)},
            "normal_beside_flood": {"requests": len(beside), "p50_s": q(beside, 0.5), "p99_s": q(beside, 0.99),
                                    "errors": bad}}


async def sigterm(h, url: str, model: str, headers: dict, pid: int, log: str | None) -> dict:
    if not pid:
        raise SkipKVError("--scenario sigterm needs --pid (the server's process id on this machine)")
    lengths = [8, 4000, 4000, 4000, 4000]
    streams = [Stream(n) for n in lengths]
    base = {"model": model, "prompt": "Once upon a time"}
    tasks = [asyncio.ensure_future(s.run(h, url, base, headers)) for s in streams]
    await _started(streams[1:])

    async def plain() -> dict:
        try:
            r = await h.post(url + "/v1/completions", json=dict(base, max_tokens=4000, ignore_eos=True),
                             headers=headers)
        except Exception as exc:  # noqa: BLE001 - a cut connection is an ending to report
            return {"ending": type(exc).__name__}
        try:
            shaped = set(r.json().get("error", {})) >= {"message", "type", "param", "code"}
        except ValueError:
            shaped = False
        return {"status": r.status_code, "openai_error_json": shaped, "body": r.text[:120]}

    plains = [asyncio.ensure_future(plain()) for _ in range(2)]
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    await asyncio.gather(*tasks, return_exceptions=True)
    ends = [await p for p in plains]
    out: dict = {"streams": [{"max_tokens": s.max_tokens, "ending": s.ending, "error_event": s.error_event,
                        "ended_after_sigterm_s": round((s.times[-1] if s.times else t0) - t0, 2)} for s in streams],
           "non_streamed": ends}
    if log:
        time.sleep(3.0)  # the server's last lines
        text = Path(log).read_text(errors="replace")
        out["log_tracebacks"] = text.count("Traceback (most recent call last)")
    return out


def run_scenario(name: str, url: str, api_key: str | None, out: str | None, pid: int = 0,
                 log: str | None = None) -> dict:
    if name not in SCENARIOS:
        raise SkipKVError(f"--scenario must be one of {', '.join(SCENARIOS)}, got {name!r}")
    loopback_url(url)
    import httpx

    url, headers = url.rstrip("/"), ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - connection refused, 401, ...: one line
        raise SkipKVError(f"cannot list models at {url}/v1/models: {type(exc).__name__}: {exc}") from None

    async def go() -> dict:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=600, limits=limits) as h:
            if name == "long-prompt":
                return await long_prompt(h, url, model, headers)
            if name == "flood":
                return await flood(h, url, model, headers)
            return await sigterm(h, url, model, headers, pid, log)

    rep = dict(asyncio.run(go()), scenario=name, url=url, model=model)
    print(json.dumps(rep, indent=1))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(rep, indent=1) + "\n")
    return rep
