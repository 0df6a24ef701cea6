"""`skipkv bench serve`: load-test a running OpenAI-compatible server with the official `openai` async client.

    skipkv serve --model random:qwen2:0.5b --policy rkv --budget 64 --kv-memory 24MiB &
    skipkv bench serve --url http://127.0.0.1:8000 --concurrency 1,4,16 --requests 16 --dataset gsm8k \
        --max-tokens 96 --ignore-eos --out rkv.json

For each concurrency level, `--requests` chat requests (the dataset's questions in its prompt template, in
order) are sent by that many concurrent clients, each streaming. Reported per level: requests/s and
generated tokens/s over the level's wall time, time to first token and inter-token latency (p50/p99; the
server sends one chunk per token), errors, and the largest batch and KV bytes the server's /metrics showed
while the level ran (polled every 0.1 s).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from skipkv.engine.request import percentile
from skipkv.errors import SkipKVError


def dataset_messages(name: str, n: int) -> list[str]:
    """The first `n` user messages of dataset `name` (cycled if it has fewer)."""
    from skipkv.eval.datasets import DataRequest, get_dataset
    from skipkv.eval.prompts import template

    examples = get_dataset(name).load(DataRequest())
    if not examples:
        raise SkipKVError(f"dataset {name!r} has no examples")
    return [template(ex.task).message("chat", ex.inputs) for ex in (examples * (n // len(examples) + 1))[:n]]


def _scrape(url: str) -> dict[str, float]:
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out


async def _one(client, model: str, message: str, max_tokens: int, ignore_eos: bool) -> dict:
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": message}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True} if ignore_eos else None)
    async for ch in stream:
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
        # a token's chunk: not the opening role chunk, not the closing finish chunk, not the usage chunk
        if ch.choices and ch.choices[0].delta.role is None and ch.choices[0].finish_reason is None:
            stamps.append(time.perf_counter())
    if not stamps:
        raise SkipKVError("the server streamed no tokens")
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens}


async def run_level(url: str, api_key: str, model: str, messages: list[str], concurrency: int, max_tokens: int,
                    ignore_eos: bool) -> dict:
    """Send every message with `concurrency` clients; return the level's figures."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=3600)
    todo = list(enumerate(messages))
    results: list[dict] = []
    errors: list[str] = []
    peak = {"running": 0.0, "kv_held_bytes": 0.0, "kv_allocated_bytes": 0.0}
    done = asyncio.Event()

    async def worker() -> None:
        while todo:
            _, msg = todo.pop(0)
            try:
                results.append(await _one(client, model, msg, max_tokens, ignore_eos))
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
                errors.append(f"{type(exc).__name__}: {exc}")

    async def poll() -> None:
        while not done.is_set():
            m = await asyncio.to_thread(_scrape, url)
            peak["running"] = max(peak["running"], m.get("skipkv_requests_running", 0))
            peak["kv_held_bytes"] = max(peak["kv_held_bytes"], m.get("skipkv_kv_held_bytes", 0))
            peak["kv_allocated_bytes"] = max(peak["kv_allocated_bytes"], m.get("skipkv_kv_allocated_bytes", 0))
            await asyncio.sleep(0.1)

    poller = asyncio.create_task(poll())
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    done.set()
    await poller
    await client.close()
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    q = lambda xs, p: round(percentile(xs, p), 4) if xs else None  # noqa: E731
    return {"concurrency": concurrency, "requests": len(messages), "completed": len(results), "errors": len(errors),
            "seconds": round(wall, 3), "requests_per_s": round(len(results) / wall, 4),
            "tokens_per_s": round(tokens / wall, 2), "completion_tokens": tokens,
            "ttft_p50_s": q(ttft, 0.5), "ttft_p99_s": q(ttft, 0.99), "itl_p50_s": q(itl, 0.5),
            "itl_p99_s": q(itl, 0.99),
            "peak_running": int(peak["running"]), "peak_kv_held_bytes": int(peak["kv_held_bytes"]),
            "peak_kv_allocated_bytes": int(peak["kv_allocated_bytes"]), "error_messages": errors[:5]}


def run_bench(url: str, concurrency: list[int], requests: int, dataset: str, max_tokens: int, api_key: str | None,
              ignore_eos: bool, out: str | None) -> dict:
    try:
        from openai import OpenAI
    except ImportError:
        raise SkipKVError("the serving benchmark needs the openai client (pip install 'skipkv[serve]')") from None
    url = url.rstrip("/")
    key = api_key or "none"
    try:
        model = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30).models.list().data[0].id
    except Exception as exc:  # noqa: BLE001 - connection refused, 401, ...: one line
        raise SkipKVError(f"cannot list models at {url}/v1/models: {type(exc).__name__}: {exc}") from None
    messages = dataset_messages(dataset, requests)
    rows = []
    for c in concurrency:
        row = asyncio.run(run_level(url, key, model, messages, c, max_tokens, ignore_eos))
        rows.append(row)
        print(f"  concurrency {c:3d}: {row['completed']}/{row['requests']} ok in {row['seconds']:.1f}s", flush=True)
    print(f"\n{model} at {url}  ({dataset}, {requests} requests per level, max_tokens {max_tokens})")
    print(f"{'conc':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'batch':>5} {'KV held MiB':>11} {'errors':>6}")
    for r in rows:
        f = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
        print(f"{r['concurrency']:>5} {r['requests_per_s']:>7.3f} {r['tokens_per_s']:>8.1f} {f(r['ttft_p50_s']):>9} "
              f"{f(r['ttft_p99_s']):>9} {f(r['itl_p50_s']):>8} {f(r['itl_p99_s']):>8} {r['peak_running']:>5} "
              f"{r['peak_kv_held_bytes'] / 2**20:>11.1f} {r['errors']:>6}")
    report = {"url": url, "model": model, "dataset": dataset, "requests": requests, "max_tokens": max_tokens,
              "ignore_eos": ignore_eos, "server_metrics_end": _scrape(url), "results": rows}
    if out is not None:
        from skipkv.outputs import check_file, write_atomic

        path = check_file(out, "--out")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(report, indent=1) + "\n")
    return report
