"""`skipkv serve` through the official `openai` client against an in-process uvicorn server on 127.0.0.1:
answers equal `generate()`'s (greedy, streamed and not, completions and chat), 8 concurrent streams with two
clients disconnecting half-way, and every failure behaviour (400 / 401 / 429 / engine errors)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from conftest import PROMPTS  # noqa: E402
from skipkv import SamplingParams, generate, make_policy  # noqa: E402
from skipkv.config import EngineConfig  # noqa: E402
from skipkv.engine import Engine  # noqa: E402
from skipkv.models import load_model  # noqa: E402
from skipkv.serve.app import create_app  # noqa: E402
from skipkv.serve.guard import Server, server_config  # noqa: E402
from skipkv.serve.protocol import ServerSettings, TextStream  # noqa: E402

MODEL = "random:qwen2"
RKV = dict(budget=32, window=4, interval=8)
KEY = "sekret"
ABORTED = 'skipkv_requests_total{finish_reason="abort"}'
LENGTH = 'skipkv_requests_total{finish_reason="length"}'


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The engine thread, uvicorn's and the test's share the CPU: intra-op threads on top of them only spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextmanager
def serving(app, settings: ServerSettings | None = None, handle: dict | None = None):
    """Run `app` with uvicorn, configured as `skipkv serve` runs it, on a free 127.0.0.1 port in a thread;
    yields the base URL. `handle` receives the uvicorn server and its thread (to stop it in a test)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(server_config(app, settings or ServerSettings(), "127.0.0.1", 0, "warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if handle is not None:
        handle.update(server=server, thread=thread)
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


@pytest.fixture(scope="module")
def main_server():
    """rkv (budget 32), batch 8, no API key. Its own model instance: one open Engine per model."""
    app = create_app(load_model(MODEL, dtype="fp64"), make_policy("rkv", **RKV),
                     EngineConfig(batch_size=8, group_by_length=False),
                     ServerSettings(model_name=MODEL, max_tokens_cap=256))
    with serving(app) as url:
        yield url, app.state.worker


@pytest.fixture(scope="module")
def strict_server():
    """full cache, one slot, one waiting request at most, an API key, 300 KiB of KV memory (1 KiB per entry)."""
    app = create_app(load_model(MODEL, dtype="fp64"), make_policy("full"),
                     EngineConfig(batch_size=1, kv_memory=300 << 10, group_by_length=False),
                     ServerSettings(model_name=MODEL, api_key=KEY, max_queue=1, max_tokens_cap=256))
    with serving(app) as url:
        yield url, app.state.worker


def client(url: str, key: str = "none", cls=None):
    return (cls or openai.OpenAI)(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def chat_text(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


# ------------------------------------------------------------------------------------ (a) correct answers
def test_openai_client_gets_generate_tokens(main_server, tiny):
    url, _ = main_server
    policy = make_policy("rkv", **RKV)
    c = client(url)
    assert [m.id for m in c.models.list().data] == [MODEL]
    sp = SamplingParams(max_new_tokens=60, ignore_eos=True)
    ref_c, ref_chat = generate(tiny, [PROMPTS[1], chat_text(tiny.tokenizer, PROMPTS[0])], sp, policy)
    assert ref_c.compressions > 0  # the answers go through KV compression

    extra = {"ignore_eos": True}
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=60, temperature=0, extra_body=extra)
    assert r.choices[0].text == ref_c.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref_c.prompt_tokens, 60)
    assert r.usage.compressions == ref_c.compressions and r.usage.peak_kv_bytes == ref_c.peak_kv_bytes
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=60, temperature=0, stream=True,
                                       extra_body=extra))
    assert "".join(ch.choices[0].text for ch in chunks) == ref_c.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 60

    msgs = [{"role": "user", "content": PROMPTS[0]}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == ref_chat.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == ref_chat.prompt_tokens and r.usage.compressions == ref_chat.compressions
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0, stream=True,
                                            extra_body=extra, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref_chat.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 60  # OpenAI's usage chunk


def test_stop_seed_and_kv_budget(main_server, tiny):
    url, _ = main_server
    c = client(url)
    policy = make_policy("rkv", **RKV)
    plain = generate(tiny, [PROMPTS[2]], SamplingParams(max_new_tokens=40, ignore_eos=True), policy)[0].text
    stop = next(plain[i:i + 2] for i in range(3, len(plain) - 2) if plain[i:i + 2].isprintable())
    ref = generate(tiny, [PROMPTS[2]], SamplingParams(max_new_tokens=40, ignore_eos=True, stop=(stop, "\x00\x00")),
                   policy)[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    for stream in (False, True):
        out = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                   stop=[stop, "\x00\x00"],
                                   stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        assert "".join(ch.choices[0].text for ch in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == "stop"
    # sampling: temperature, top_p and seed reach the engine (same tokens as generate with the same seed)
    sp = SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True)
    ref = generate(tiny, [PROMPTS[3]], sp, policy)[0]
    for _ in range(2):
        r = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=30, temperature=0.9, top_p=0.8, seed=7,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text
    # per-request kv_budget lowers the server's budget for that request only
    low = generate(tiny, [PROMPTS[3]], SamplingParams(max_new_tokens=50, ignore_eos=True),
                   make_policy("rkv", **dict(RKV, budget=16)))[0]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=50, temperature=0,
                             extra_body={"ignore_eos": True, "kv_budget": 16})
    assert r.choices[0].text == low.text and r.usage.peak_kv_bytes == low.peak_kv_bytes
    assert r.usage.compressions == low.compressions > 0


# ------------------------------------------------------------------------------------ (b) shared batch + disconnects
def test_concurrent_streams_with_two_disconnects(main_server, tiny):
    url, _ = main_server
    policy = make_policy("rkv", **RKV)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    quitters = {2, 5}
    long, short = 100, 40
    alone = {i: generate(tiny, [p], SamplingParams(max_new_tokens=long, ignore_eos=True), policy)[0].text
             for i, p in enumerate(prompts) if i not in quitters}
    before = metrics(url)

    async def run():
        first = [asyncio.Event() for _ in prompts]
        looked = asyncio.Event()
        c = client(url, cls=openai.AsyncOpenAI)

        async def one(i: int):
            stream = await c.completions.create(model=MODEL, prompt=prompts[i], temperature=0, stream=True,
                                                max_tokens=short if i in quitters else long,
                                                extra_body={"ignore_eos": True})
            text, n = "", 0
            async for ch in stream:
                text += ch.choices[0].text
                n += 1
                first[i].set()
                if i in quitters and n == short // 2:
                    await looked.wait()  # all 8 are in the batch, and the metrics of 8 were read
                    await stream.close()  # disconnect half-way
                    return None
            return text

        async def watch():
            await asyncio.gather(*(e.wait() for e in first))
            full = await asyncio.to_thread(metrics, url)
            looked.set()
            deadline = time.monotonic() + 10
            while True:  # the two aborts free their slots and reservations
                m = await asyncio.to_thread(metrics, url)
                if m[ABORTED] - before[ABORTED] == 2:
                    return full, m
                assert time.monotonic() < deadline, (before, m)
                await asyncio.sleep(0.005)

        return await asyncio.gather(watch(), *(one(i) for i in range(len(prompts))))

    (full, after_abort), *texts = asyncio.run(run())
    assert full["skipkv_requests_running"] == 8
    # once prefilled, a request reserves what it may still hold (engine/memory.py): here budget + interval
    # entries in every layer, as what it holds plus its remaining tokens exceeds that
    with Engine(tiny, policy) as eng:
        entry = eng.runner.entry_bytes
    reserve = [entry * (RKV["budget"] + RKV["interval"])] * len(prompts)
    assert full["skipkv_kv_reserved_bytes"] == sum(reserve)
    assert after_abort["skipkv_requests_running"] == 6
    assert after_abort["skipkv_kv_reserved_bytes"] == sum(x for i, x in enumerate(reserve) if i not in quitters)
    assert after_abort["skipkv_kv_held_bytes"] <= after_abort["skipkv_kv_reserved_bytes"]
    for i, text in enumerate(texts):
        assert (text is None) if i in quitters else (text == alone[i]), i
    end = metrics(url)
    assert end["skipkv_requests_running"] == 0 and end["skipkv_kv_held_bytes"] == 0
    assert end["skipkv_kv_allocated_bytes"] == 0 and end["skipkv_kv_reserved_bytes"] == 0
    assert end[ABORTED] - before[ABORTED] == 2
    assert end[LENGTH] - before[LENGTH] == 6


# ------------------------------------------------------------------------------------ (c) failures
def _error(resp, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


def test_bad_requests_get_400(main_server):
    url, _ = main_server
    post = lambda path, body: httpx.post(url + path, json=body, timeout=30)  # noqa: E731
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    r = httpx.post(url + "/v1/completions", content=b'{"model": "x", "prompt": ', timeout=30)
    assert _error(r, 400)["type"] == "invalid_request_error"
    _error(httpx.post(url + "/v1/completions", content=b"[1, 2]", timeout=30), 400)
    for key, value in (("max_tokens", "3"), ("temperature", "hot"), ("top_p", [1]), ("seed", 1.5), ("stop", 5),
                       ("stream", "yes"), ("prompt", {"a": 1}), ("kv_budget", "16"), ("n", 2), ("max_tokens", 0),
                       ("max_tokens", -4), ("max_tokens", 257), ("temperature", 3), ("presence_penalty", 0.5)):
        _error(post("/v1/completions", dict(ok, **{key: value})), 400, key)
    err = _error(post("/v1/completions", dict(ok, prompt="x" * 5000)), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    _error(post("/v1/chat/completions", dict(chat, messages=[])), 400, "messages")
    _error(post("/v1/chat/completions", dict(chat, messages="hi")), 400, "messages")
    _error(post("/v1/chat/completions", dict(chat, messages=[{"role": "user", "content": 3}])), 400)
    _error(post("/v1/chat/completions", dict(chat, messages=[{"role": "wizard", "content": "x"}])), 400)
    _error(post("/v1/completions", dict(ok, model="gpt-4")), 404, "model")
    # refused by the engine itself: a budget above the server's
    _error(post("/v1/completions", dict(ok, kv_budget=64)), 400)
    _error(httpx.get(url + "/nowhere"), 404)
    # nothing else was affected
    assert post("/v1/completions", ok).status_code == 200
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_api_key_queue_limit_and_never_fits(strict_server):
    url, worker = strict_server
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        err = _error(httpx.post(url + "/v1/completions", json=body, headers=headers), 401)
        assert err["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").models.list()
    good = client(url, KEY)
    assert good.completions.create(**body).usage.completion_tokens == 4
    auth = {"Authorization": f"Bearer {KEY}"}
    # never fits under --kv-memory (full cache: prompt + max_tokens entries of 1 KiB): refused by the engine
    err = _error(httpx.post(url + "/v1/completions", json=dict(body, prompt="y" * 100, max_tokens=250), headers=auth),
                 400)
    assert "kv_memory" in err["message"]

    step = worker.engine.step

    def slow_step():  # one slot: A holds it while B waits; slow steps keep A running while we look
        time.sleep(0.01)
        return step()

    worker.engine.step = slow_step
    try:
        with httpx.Client(timeout=30) as h, h.stream("POST", url + "/v1/completions", headers=auth,
                                                     json=dict(body, max_tokens=250, stream=True,
                                                               ignore_eos=True)) as a:
            lines = a.iter_lines()
            assert next(lines).startswith("data: ")  # A is running
            b_result = {}
            b = threading.Thread(target=lambda: b_result.update(r=httpx.post(url + "/v1/completions", json=body,
                                                                              headers=auth, timeout=30)))
            b.start()
            deadline = time.monotonic() + 10
            while metrics(url)["skipkv_requests_waiting"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = httpx.post(url + "/v1/completions", json=body, headers=auth)
            assert _error(r, 429)["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
        # A disconnected: aborted, and B gets the slot
        b.join(30)
        assert b_result["r"].status_code == 200
    finally:
        worker.engine.step = step
    m = metrics(url)
    assert m['skipkv_requests_total{finish_reason="abort"}'] == 1 and m["skipkv_kv_held_bytes"] == 0


def test_engine_error_fails_only_its_step(strict_server):
    url, worker = strict_server
    c = client(url, KEY)
    body = dict(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
    engine = worker.engine

    def boom():
        raise RuntimeError("injected failure")

    engine.step = boom
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        c.completions.create(**body)
    assert worker.engine is not engine  # rebuilt; the thread lives on
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert c.completions.create(**body).usage.completion_tokens == 4
    assert metrics(url)['skipkv_requests_total{finish_reason="error"}'] >= 1


def test_serve_cli_defaults_to_localhost():
    from skipkv.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.api_key is None
    assert build_parser().parse_args(["serve", "--kv-memory", "2GiB"]).kv_memory == 2 << 30


def test_text_stream_holds_back_stop_prefixes_and_partial_utf8(tiny):
    tok = tiny.tokenizer  # byte-level: "é" is two tokens, each ASCII character one
    ts = TextStream(tok, ("STOP",))
    deltas = [ts.add([t]) for t in tok("héllo wSTOP and more", add_special_tokens=False)["input_ids"]]
    assert "".join(deltas) == "héllo w" and not any("\ufffd" in d for d in deltas)
    assert ts.finish("héllo w") == ""
    ts = TextStream(tok, ("STOP",))
    deltas = [ts.add([t]) for t in tok("aSTx", add_special_tokens=False)["input_ids"]]
    assert deltas == ["a", "", "", "STx"]  # "ST" might have begun "STOP": held until "x" says otherwise


def test_bench_serve_reports_each_level(main_server, tmp_path):
    import json

    from skipkv.bench.serve import run_bench

    url, _ = main_server
    out = tmp_path / "serve.json"
    run_bench(url, [1, 2], 2, "gsm8k", 5, None, True, str(out))
    rows = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["completed"], r["errors"], r["completion_tokens"]) == (2, 0, 10)
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["itl_p50_s"] > 0
