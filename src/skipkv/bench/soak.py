"""`skipkv bench serve --soak MINUTES`: hostile and normal clients against one server for N minutes, on
this machine only (loopback).

    skipkv serve --model random:qwen2 --policy rkv --budget 64 --read-timeout 5 --port 8000 &
    skipkv bench serve --url http://127.0.0.1:8000 --soak 10 --out soak.json

Clients, each a loop until the time is up (one request at a time):
  normal      streamed and non-streamed completions and chats (8-48 tokens); must end complete with 200
  disconnect  a stream closed after a few chunks, or a non-streamed request given up after 0.1-1 s
  oversized   a body declared past the server's cap (413), or a prompt far past the model's context (400)
  malformed   deep nesting, a 5,000-digit number, a lone surrogate, NaN, broken JSON, wrong types (400/404)
  slow        headers trickled a byte a second (the server closes), or a body that stops half-way (408)
Every request has a client-side deadline (HANG_S): past it, it counts as hung. Reported: requests by kind and
outcome, p50/p99 latency of the normal ones, 5xx and hung counts, the server's resident memory over the run
(from its /metrics) and its KV bytes and requests once the run has drained (all must be 0).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import time
import urllib.parse
from collections import Counter, defaultdict

from skipkv.engine.request import percentile
from skipkv.errors import SkipKVError

HANG_S = 120.0  # a request that has not ended after this long is hung
CLIENTS = {"normal": 4, "disconnect": 2, "oversized": 1, "malformed": 1, "slow": 2}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived a", "2 + 2 =",
           "In the beginning the Universe was created. This has made a lot of people very angry"]


def loopback_url(url: str) -> tuple[str, int]:
    """(host, port) of an http URL on this machine; SkipKVError for any other (the soak never leaves it)."""
    u = urllib.parse.urlparse(url)
    host = u.hostname or ""
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if u.scheme != "http" or not ok:
        raise SkipKVError(f"--soak runs against a server on this machine only (http://127.0.0.1:PORT), got {url!r}")
    return host, u.port or 80


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name with labels: value} (the lines this server writes)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Soak:
    def __init__(self, url: str, model: str, api_key: str, seconds: float, seed: int) -> None:
        self.url, self.model, self.seconds = url, model, seconds
        self.host, self.port = loopback_url(url)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.rng = random.Random(seed)
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.latency: list[float] = []
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.end = 0.0

    # ---------------------------------------------------------------------------------------- clients
    def _body(self, chat: bool, stream: bool, max_tokens: int) -> dict:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        prompt = self.rng.choice(PROMPTS)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def normal(self, h) -> str:
        chat, stream = self.rng.random() < 0.5, self.rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = self._body(chat, stream, self.rng.randint(8, 48))
        t0 = time.perf_counter()
        if stream:
            async with h.stream("POST", self.url + path, json=body, headers=self.headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    return str(r.status_code)
                last = ""
                async for line in r.aiter_lines():
                    last = line or last
                if last != "data: [DONE]":
                    return "incomplete"
        else:
            r = await h.post(self.url + path, json=body, headers=self.headers)
            if r.status_code != 200:
                return str(r.status_code)
            if not r.json().get("choices"):
                return "incomplete"
        self.latency.append(time.perf_counter() - t0)
        return "200"

    async def disconnect(self, h) -> str:
        import httpx

        body = self._body(self.rng.random() < 0.5, True, 256)
        body["ignore_eos"] = True
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        if self.rng.random() < 0.5:  # a stream closed after a few chunks
            async with h.stream("POST", self.url + path, json=body, headers=self.headers) as r:
                if r.status_code != 200:
                    return str(r.status_code)
                n, want = 0, self.rng.randint(1, 20)
                async for _ in r.aiter_lines():
                    n += 1
                    if n >= want:
                        return "disconnected"
                return "200 (finished first)"
        body["stream"] = False
        try:
            r = await h.post(self.url + path, json=body, headers=self.headers, timeout=self.rng.uniform(0.1, 1.0))
            return f"{r.status_code} (answered first)"
        except httpx.TimeoutException:
            return "disconnected"

    async def _raw(self, data: bytes, trickle: bytes = b"", every: float = 1.0) -> bytes:
        """Send `data`, then `trickle` a byte every `every` s; return what the server sent before closing."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        got = b""
        try:
            writer.write(data)
            await writer.drain()
            for b in trickle:
                try:
                    got += await asyncio.wait_for(reader.read(65536), every)
                    if reader.at_eof():
                        return got
                except asyncio.TimeoutError:
                    pass
                writer.write(bytes([b]))
                await writer.drain()
            while chunk := await reader.read(65536):
                got += chunk
            return got
        except (ConnectionResetError, BrokenPipeError):  # the server closed it while we were writing
            return got
        finally:
            writer.close()

    def _request(self, body: bytes, declared: int | None = None, path: str = "/v1/completions") -> bytes:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body) if declared is None else declared}\r\n")
        head += "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        return head.encode() + b"\r\n" + body

    @staticmethod
    def _status(got: bytes) -> str:
        if got.startswith(b"HTTP/1.1 "):
            return got[9:12].decode()
        return "closed" if not got else "garbled"

    async def oversized(self, h) -> str:
        if self.rng.random() < 0.5:  # declared past any sane cap: the server answers before reading it
            return self._status(await self._raw(self._request(b'{"model": ', declared=1 << 30)))
        prompt = "word " * 400_000  # 2 MB: under the default body cap, far past a small model's context
        r = await h.post(self.url + "/v1/completions", json={"model": self.model, "prompt": prompt, "max_tokens": 4},
                         headers=self.headers)
        return str(r.status_code)

    MALFORMED = [b"[" * 100_000 + b"]" * 100_000, b'{"model": "M", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
                 b'{"model": "M", "prompt": "a\\ud800b"}', b'{"model": "M", "prompt": "hi", "temperature": NaN}',
                 b'{"model": "M", "prompt": ', b'"just a string"', b'{"model": "M", "prompt": {"a": 1}}',
                 b'{"model": "M", "messages": "hi"}', b'{"model": "not-this-one", "prompt": "hi"}',
                 b'{"model": "M", "prompt": "hi", "stop": 5}', b"\xff\xfe\x00garbage"]

    async def malformed(self, h) -> str:
        raw = self.rng.choice(self.MALFORMED).replace(b'"M"', json.dumps(self.model).encode())
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        r = await h.post(self.url + path, content=raw, headers={**self.headers, "Content-Type": "application/json"})
        return str(r.status_code)

    async def slow(self, h) -> str:
        if self.rng.random() < 0.5:  # headers that never end, a byte a second
            got = await self._raw(f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\n".encode(),
                                  trickle=b"X-Slow: " + b"a" * 600)
            return self._status(got)
        body = json.dumps({"model": self.model, "prompt": "hi", "max_tokens": 4}).encode()
        return self._status(await self._raw(self._request(body[: len(body) // 2], declared=len(body))))

    # ---------------------------------------------------------------------------------------- the run
    async def _loop(self, kind: str, h) -> None:
        op = getattr(self, kind)
        while time.monotonic() < self.end:
            try:
                outcome = await asyncio.wait_for(op(h), HANG_S)
            except asyncio.TimeoutError:
                outcome = "hung"
            except Exception as exc:  # noqa: BLE001 - a client-side failure is an outcome to count
                outcome = type(exc).__name__
            self.outcomes[kind][outcome] += 1

    async def _poll(self, h) -> None:
        while time.monotonic() < self.end:
            try:
                r = await h.get(self.url + "/metrics")
                self.samples.append((time.monotonic(), parse_metrics(r.text)))
            except Exception:  # noqa: BLE001 - a missed sample is not a failure of the server
                pass
            await asyncio.sleep(2.0)

    async def run(self) -> dict:
        import httpx

        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)  # a connection per request
        async with httpx.AsyncClient(timeout=HANG_S, limits=limits) as h:
            start = parse_metrics((await h.get(self.url + "/metrics")).text)
            t0 = time.monotonic()
            self.end = t0 + self.seconds
            tasks = [self._loop(kind, h) for kind, n in CLIENTS.items() for _ in range(n)]
            await asyncio.gather(self._poll(h), *tasks)
            wall = time.monotonic() - t0
            deadline = time.monotonic() + 60
            while True:  # drain: every request the server still holds ends or is aborted
                end = parse_metrics((await h.get(self.url + "/metrics")).text)
                if (end["skipkv_requests_running"] == 0 and end["skipkv_requests_waiting"] == 0) \
                        or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
        return self._report(start, end, wall)

    def _report(self, start: dict, end: dict, wall: float) -> dict:
        fives = sum(n for c in self.outcomes.values() for o, n in c.items() if o[:1] == "5")
        hung = sum(c["hung"] for c in self.outcomes.values())
        rss = [m.get("skipkv_process_resident_bytes", 0) for _, m in self.samples]
        status = lambda m, code: m.get(f'skipkv_http_responses_total{{code="{code}"}}', 0)  # noqa: E731
        codes = sorted({k[k.index('"') + 1:k.rindex('"')] for k in end if k.startswith("skipkv_http_responses_total")})
        aborts = 'skipkv_requests_total{finish_reason="abort"}'
        aborted = end[aborts] - start[aborts]
        q = lambda p: round(percentile(self.latency, p), 4) if self.latency else None  # noqa: E731
        return {
            "seconds": round(wall, 1), "clients": CLIENTS, "hang_s": HANG_S,
            "outcomes": {k: dict(sorted(c.items())) for k, c in self.outcomes.items()},
            "requests": sum(sum(c.values()) for c in self.outcomes.values()),
            "normal_latency_p50_s": q(0.5), "normal_latency_p99_s": q(0.99), "five_xx": fives, "hung": hung,
            "server_responses_by_code": {c: int(status(end, c) - status(start, c)) for c in codes},
            "server_aborted": int(aborted),
            "rss_start_bytes": int(start.get("skipkv_process_resident_bytes", 0)),
            "rss_first_minute_max_bytes": int(max((m.get("skipkv_process_resident_bytes", 0) for t, m in self.samples
                                                   if t - self.samples[0][0] <= 60), default=0)),
            "rss_peak_bytes": int(max(rss + [end.get("skipkv_process_peak_resident_bytes", 0)], default=0)),
            "rss_end_bytes": int(end.get("skipkv_process_resident_bytes", 0)),
            # the largest sample in each minute: flat after warm-up means bounded
            "rss_by_minute_bytes": [int(max(m.get("skipkv_process_resident_bytes", 0) for t, m in self.samples
                                            if int((t - self.samples[0][0]) // 60) == k))
                                    for k in sorted({int((t - self.samples[0][0]) // 60) for t, _ in self.samples})],
            "end": {k: int(end[k]) for k in ("skipkv_requests_running", "skipkv_requests_waiting",
                                              "skipkv_kv_reserved_bytes", "skipkv_kv_held_bytes",
                                              "skipkv_kv_allocated_bytes")},
        }


def print_table(url: str, model: str, rep: dict) -> None:
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    print(f"\nsoak: {rep['seconds'] / 60:.1f} min against {url} ({model}), clients {rep['clients']}")
    print(f"{'kind':<11} {'requests':>8}  outcomes")
    for kind, c in rep["outcomes"].items():
        print(f"{kind:<11} {sum(c.values()):>8}  " + ", ".join(f"{o}: {n}" for o, n in c.items()))
    f = lambda v: f"{v:.3f} s" if v is not None else "-"  # noqa: E731
    print(f"normal latency p50 {f(rep['normal_latency_p50_s'])}, p99 {f(rep['normal_latency_p99_s'])}")
    print(f"5xx: {rep['five_xx']}   hung: {rep['hung']}   aborted by the server: {rep['server_aborted']}")
    print(f"server responses by code: {rep['server_responses_by_code']}")
    print(f"server RSS: start {mib(rep['rss_start_bytes'])}, max in the first minute "
          f"{mib(rep['rss_first_minute_max_bytes'])}, peak {mib(rep['rss_peak_bytes'])}, "
          f"end {mib(rep['rss_end_bytes'])}")
    per_minute = " ".join(f"{b / 2**20:.0f}" for b in rep["rss_by_minute_bytes"])
    print("server RSS, largest sample per minute (MiB): " + per_minute)
    e = rep["end"]
    print(f"at the end: running {e['skipkv_requests_running']}, waiting {e['skipkv_requests_waiting']}, KV reserved "
          f"{e['skipkv_kv_reserved_bytes']} B, held {e['skipkv_kv_held_bytes']} B, "
          f"allocated {e['skipkv_kv_allocated_bytes']} B")


def run_soak(url: str, minutes: float, api_key: str | None, out: str | None, seed: int = 0) -> dict:
    """Soak the server at `url` (loopback only) for `minutes`; print the table, write JSON to `out`."""
    if not minutes > 0:
        raise SkipKVError(f"--soak takes a positive number of minutes, got {minutes}")
    loopback_url(url)
    import httpx

    url = url.rstrip("/")
    try:
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout=30)
        model = r.json()["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - connection refused, 401, ...: one line
        raise SkipKVError(f"cannot list models at {url}/v1/models: {type(exc).__name__}: {exc}") from None
    rep = asyncio.run(Soak(url, model, api_key or "", minutes * 60, seed).run())
    rep.update(url=url, model=model)
    print_table(url, model, rep)
    if out is not None:
        from skipkv.outputs import check_file, write_atomic

        path = check_file(out, "--out")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(rep, indent=1) + "\n")
    return rep
