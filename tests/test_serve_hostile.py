"""`skipkv serve` against hostile clients, on 127.0.0.1: clients that disconnect while waiting for a
non-streamed answer, oversized or slow bodies, slow headers, too many connections, malformed JSON (and a
hypothesis fuzz of the JSON layer), bursts on an idle server, long stop strings, huge echoed fields, and a
shutdown with a client that never finishes its request. Each test fails on the server before its fix."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from skipkv import make_policy  # noqa: E402
from skipkv.config import EngineConfig  # noqa: E402
from skipkv.models import load_model  # noqa: E402
from skipkv.serve import protocol  # noqa: E402
from skipkv.serve.app import create_app  # noqa: E402
from skipkv.serve.protocol import APIError, Limits, ServerSettings, StopMatcher, TextStream  # noqa: E402

# main_server: test_serve's server (rkv, batch 8, default limits); one_torch_thread: its torch thread setting
from test_serve import MODEL, RKV, _error, main_server, metrics, one_torch_thread, serving  # noqa: E402,F401

SMALL = dict(model_name=MODEL, max_tokens_cap=256, max_body_bytes=64 << 10, read_timeout=2.0, max_connections=8,
             max_queue=1)


def slowed(worker, seconds: float):
    """Make every engine step of `worker` take at least `seconds` (returns the undo)."""
    step = worker.engine.step

    def slow():
        time.sleep(seconds)
        return step()

    worker.engine.step = slow
    return lambda: setattr(worker.engine, "step", step)


@pytest.fixture(scope="module")
def guarded_server():
    """rkv, batch 8, small limits: 64 KiB bodies, 2 s to send headers or a body, 8 connections, queue 1."""
    s = ServerSettings(**SMALL)
    app = create_app(load_model(MODEL, dtype="fp64"), make_policy("rkv", **RKV),
                     EngineConfig(batch_size=8, group_by_length=False), s)
    with serving(app, s) as url:
        yield url, app.state.worker


def port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port(url)), timeout=timeout)
    return sock


def post_bytes(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data)) + data


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Read until the server closes the connection; (closed in time, what it sent)."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        pass
    return True, got


def counter(m: dict, reason: str) -> float:
    return m[f'skipkv_requests_total{{finish_reason="{reason}"}}']


# ----------------------------------------------------------------------------- disconnects, non-streamed
def test_non_streaming_client_that_disconnects_is_aborted_at_once(guarded_server):
    url, worker = guarded_server
    undo = slowed(worker, 0.01)  # a token every ~10 ms: the engine has an event for the handler every step
    try:
        before = metrics(url)
        sock = connect(url)
        sock.sendall(post_bytes({"model": MODEL, "prompt": "hello", "max_tokens": 256, "temperature": 0,
                                 "ignore_eos": True}))
        deadline = time.monotonic() + 10
        while metrics(url)["skipkv_requests_running"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock.close()
        gone = time.monotonic()
        while counter(metrics(url), "abort") == counter(before, "abort"):
            assert time.monotonic() - gone < 1.0, "the request was not aborted within 1 s of the disconnect"
            time.sleep(0.01)
        after = metrics(url)
    finally:
        undo()
    assert counter(after, "length") == counter(before, "length")  # it did not run to its end
    assert after["skipkv_generated_tokens_total"] - before["skipkv_generated_tokens_total"] < 256
    assert after["skipkv_requests_running"] == 0 and after["skipkv_kv_reserved_bytes"] == 0


# ----------------------------------------------------------------------------- bodies, headers, connections
def test_body_cap_413_before_reading(guarded_server):
    url, _ = guarded_server
    sock = connect(url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000000\r\n\r\n")  # 100 MB declared, none sent
    done, got = closed_within(sock, 5)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "request_too_large" and set(err) == {"message", "type", "param", "code"}
    sock.close()
    # No Content-Length (chunked): cut once the cap is passed.
    r = httpx.post(url + "/v1/completions", content=iter([b"x" * 40000] * 3), timeout=10)
    assert _error(r, 413)["code"] == "request_too_large"
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_slow_headers_slow_body_and_connection_cap(guarded_server):
    url, _ = guarded_server
    t0 = time.monotonic()
    slow_head = connect(url)
    slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
    slow_body = connect(url)
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"")
    done, got = closed_within(slow_head, 5)
    assert done and got == b"" and time.monotonic() - t0 < 4
    done, got = closed_within(slow_body, 5)
    assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got
    # The cap: 8 open connections, the 9th is closed at once (read_timeout would close it only after 2 s).
    idle = [connect(url) for _ in range(8)]
    time.sleep(0.1)
    extra = connect(url)
    done, got = closed_within(extra, 0.5)
    assert done and got == b""
    for s in idle + [extra, slow_head, slow_body]:
        s.close()
    time.sleep(0.2)
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_bounded_shutdown_with_a_client_that_never_sends_its_body():
    s = ServerSettings(model_name=MODEL, read_timeout=60.0, shutdown_timeout=1.0)
    app = create_app(load_model(MODEL, dtype="fp64"), make_policy("full"), EngineConfig(batch_size=2), s)
    handle: dict = {}
    with serving(app, s, handle) as url:
        sock = connect(url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)
        t0 = time.monotonic()
        handle["server"].should_exit = True  # what SIGTERM does
        handle["thread"].join(10)
        took = time.monotonic() - t0
        sock.close()
    assert not handle["thread"].is_alive() and took < 6, took  # shutdown_timeout 1 s, then the engine thread stops
    assert not app.state.worker.alive


# ----------------------------------------------------------------------------- tokenizing off the event loop
def test_tokenizing_does_not_block_the_event_loop(guarded_server, monkeypatch):
    url, _ = guarded_server
    real = protocol.encode_prompt

    def slow_encode(tokenizer, prompt):
        time.sleep(3.0)  # a huge prompt on a real tokenizer
        return real(tokenizer, prompt)

    monkeypatch.setattr(protocol, "encode_prompt", slow_encode)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=20)))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert time.monotonic() - t0 < 1.5  # not behind the 3 s tokenization
    t.join(20)
    assert result["r"].status_code == 200


def test_prompt_beyond_the_context_is_refused_before_the_full_encode(tiny, monkeypatch):
    limits = Limits(MODEL, tiny.max_context, 256, protocol.max_token_chars(tiny.tokenizer))
    monkeypatch.setattr(protocol, "encode_prompt", lambda *a: pytest.fail("encoded the whole prompt"))
    text = "x" * (limits.max_context * limits.max_token_chars * protocol.NORMALIZER_SLACK + 3)
    with pytest.raises(APIError) as e:
        protocol.parse_completion({"model": MODEL, "prompt": text}, tiny.tokenizer, limits)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_prefix_bound_on_a_regex_pretokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["a", "b", "ab", "<|s|>"])}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    limits = Limits("m", 64, 16, protocol.max_token_chars(tok))
    calls = []
    real = protocol.encode_prompt
    # 400 tokens in 799 characters: under the bound of characters (64 x 5 x 3), but its first 8 x 64
    # characters already hold 256 tokens: refused without encoding the whole.
    over = " ".join(["a"] * 400)
    # 60 long unknown words (60 tokens) in 659 characters: the prefix holds fewer than 64, so the whole is encoded.
    under = " ".join(["zzzzzzzzzz"] * 60)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(protocol, "encode_prompt", lambda *a: calls.append(1) or real(*a))
        with pytest.raises(APIError, match="more than"):
            protocol.encode_bounded(tok, over, limits, "prompt")
        assert calls == []
        assert len(protocol.encode_bounded(tok, under, limits, "prompt")) == 60 and calls == [1]


# ----------------------------------------------------------------------------- the queue limit
def test_a_burst_on_an_idle_server_gets_no_429(guarded_server):
    url, worker = guarded_server
    # One request runs; its steps are slow, so a burst lands while the engine is busy (in the inbox).
    undo = slowed(worker, 0.2)
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as h:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
                first = asyncio.ensure_future(h.post(url + "/v1/completions", json=dict(body, max_tokens=8)))
                await asyncio.sleep(0.3)
                rest = await asyncio.gather(*(h.post(url + "/v1/completions", json=body) for _ in range(6)))
                return [await first] + list(rest)

        codes = [r.status_code for r in asyncio.run(burst())]
    finally:
        undo()
    assert codes == [200] * 7  # 7 requests, 8 free slots, --max-queue 1: nobody truly waited


# ----------------------------------------------------------------------------- malformed input
@pytest.mark.parametrize("raw, word", [
    (b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    (b'{"model": "%s", "prompt": "hi", "max_tokens": ' % MODEL.encode() + b"7" * 5000 + b"}", "JSON"),
    (b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(), "surrogate"),
    (b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(), "JSON"),
    (b'{"model": "\\udfff", "prompt": "hi"}', "surrogate"),
    (b"\xff\xfe{}", "JSON"),
])
def test_malformed_json_gets_400(main_server, raw, word):
    url, _ = main_server
    r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    err = _error(r, 400)
    assert err["type"] == "invalid_request_error" and word in err["message"], err
    assert len(r.content) < 2000


def test_error_bodies_quote_at_most_a_little_of_the_input(main_server):
    url, _ = main_server
    for body, status in (({"model": "m" * 1_000_000, "prompt": "hi"}, 404),
                         ({"model": MODEL, "prompt": "hi", "max_tokens": "9" * 1_000_000}, 400),
                         ({"model": MODEL, "prompt": "hi", "stop": ["s" * 500_000] * 5}, 400),
                         ({"model": MODEL, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(50_000)}}, 400)):
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert len(_error(r, status)["message"]) < 400, len(r.content)
    # A message built by the engine (its own repr of a 3,000-digit budget) is cut as a whole.
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "kv_budget": 10**3000}, timeout=30)
    assert "budget" in _error(r, 400)["message"] and len(r.content) < 1200, len(r.content)


def test_http_status_counters_in_metrics(main_server):
    url, _ = main_server
    before = metrics(url)
    code = lambda m, c: m.get(f'skipkv_http_responses_total{{code="{c}"}}', 0)  # noqa: E731
    httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    httpx.post(url + "/v1/completions", content=b"{")
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    after = metrics(url)
    assert code(after, 404) - code(before, 404) == 1 and code(after, 400) - code(before, 400) == 1
    assert code(after, 200) - code(before, 200) >= 1


# ----------------------------------------------------------------------------- fuzz the JSON layer
JSON_LEAF = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-10**80, max_value=10**80)
             | st.floats(allow_nan=False) | st.text(st.characters(codec=None, exclude_categories=()), max_size=8))
JSON = st.recursive(JSON_LEAF,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)
KEYS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                        "seed", "stop", "n", "stream", "stream_options", "kv_budget", "ignore_eos", "user", "logprobs",
                        "logit_bias", "content", "role"])


@pytest.fixture(scope="module")
def fuzz_limits(tiny):
    return Limits(MODEL, tiny.max_context, 256, protocol.max_token_chars(tiny.tokenizer))


def _parse_any(raw: bytes, tokenizer, limits) -> None:
    """Every input ends in a Parsed request or an APIError with a 4xx status and an encodable body."""
    for chat in (False, True):
        try:
            body = protocol.load_body(raw)
            (protocol.parse_chat if chat else protocol.parse_completion)(body, tokenizer, limits)
        except APIError as exc:
            assert 400 <= exc.status < 500
            json.dumps(exc.body(), ensure_ascii=False).encode("utf-8")
            assert len(exc.body()["error"]["message"]) <= protocol.MAX_MESSAGE_CHARS + 3


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=st.fixed_dictionaries({}, optional={"prompt": st.just("hi"), "max_tokens": st.just(3),
                                                "messages": st.just([{"role": "user", "content": "hi"}])}),
       extra=st.dictionaries(KEYS, JSON, max_size=4), model=st.sampled_from([MODEL, None]))
def test_fuzz_json_fields(tiny, fuzz_limits, base, extra, model):
    body = {**base, **extra}
    if model:
        body["model"] = model
    _parse_any(json.dumps(body).encode(), tiny.tokenizer, fuzz_limits)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_fuzz_raw_bodies(tiny, fuzz_limits, raw):
    _parse_any(raw, tiny.tokenizer, fuzz_limits)


# ----------------------------------------------------------------------------- stop strings
def test_stop_matching_is_linear(tiny):
    tok = tiny.tokenizer  # byte-level: one token per ASCII character
    n = 12_000
    ids = tok("ab" * (n // 2), add_special_tokens=False)["input_ids"]
    ts = TextStream(tok, ("x" * 20_000, "ab" * 9_999 + "c"))  # the second keeps almost all the text held back
    t0 = time.perf_counter()
    out = "".join(ts.add([t]) for t in ids)
    took = time.perf_counter() - t0
    # Linear: ~0.2 s here. Before: every prefix of the first stop string tried against the text at every
    # token (~n^2 / 2 characters copied per token): ~2 s for 4,000 tokens, ~20 s for 12,000.
    assert out == "" and took < 3, took
    assert ts.finish("ab" * (n // 2)) == "ab" * (n // 2)


def test_stop_strings_longer_than_the_cap_are_refused(main_server):
    url, _ = main_server  # the engine's own check decodes len(stop) tokens a step: the server bounds len(stop)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(url + "/v1/completions", json=dict(body, stop=["x" * (protocol.MAX_STOP_CHARS + 1)]), timeout=30)
    assert "512 characters at most" in _error(r, 400, "stop")["message"]
    r = httpx.post(url + "/v1/completions", json=dict(body, stop=["x" * protocol.MAX_STOP_CHARS]), timeout=30)
    assert r.status_code == 200


@settings(max_examples=400, deadline=None)
@given(text=st.text("abc", max_size=40), stops=st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=3))
def test_stop_matcher_equals_naive_search(text, stops):
    ms = [StopMatcher(s) for s in stops]
    for i in range(0, len(text), 3):  # fed in pieces, as tokens arrive
        for m in ms:
            m.feed(text[i:i + 3])
    for m, s in zip(ms, stops):
        at = text.find(s)
        assert m.found == (at if at >= 0 else None)
        if at < 0:  # held back: the longest suffix of the text that begins s
            assert m.held == max(k for k in range(min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k]))


# ----------------------------------------------------------------------------- a public bind without a key
def test_public_bind_without_a_key_warns(monkeypatch, capsys):
    import uvicorn

    from skipkv import cli
    from skipkv.serve.cli import public_bind_warning

    assert public_bind_warning("0.0.0.0", "") and public_bind_warning("192.168.1.5", "") and public_bind_warning("::",
                                                                                                                 "")
    for host, key in (("127.0.0.1", ""), ("127.0.0.2", ""), ("::1", ""), ("localhost", ""), ("0.0.0.0", "k")):
        assert public_bind_warning(host, key) is None, host
    ran = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: ran.append(self.config.host))
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        p = str(free.getsockname()[1])
        free.close()
        assert cli.main(["serve", "--model", MODEL, "--host", host, "--port", p, "--log-level", "warning"]) == 0
        err = capsys.readouterr().err
        assert ("without --api-key" in err) == warned, err
    assert ran == ["0.0.0.0", "127.0.0.1"]


# ----------------------------------------------------------------------------- the soak benchmark
def test_soak_mode_runs_every_client_kind_and_finds_the_server_clean(capsys):
    from skipkv.bench.soak import CLIENTS, loopback_url, run_soak
    from skipkv.errors import SkipKVError

    for url in ("http://10.1.2.3:8000", "http://example.com", "https://127.0.0.1:8000"):
        with pytest.raises(SkipKVError, match="this machine only"):
            loopback_url(url)
    s = ServerSettings(model_name=MODEL, max_tokens_cap=256, read_timeout=1.0)
    app = create_app(load_model(MODEL, dtype="fp32"), make_policy("rkv", **RKV), EngineConfig(batch_size=8), s)
    with serving(app, s) as url:
        rep = run_soak(url, 0.15, None, None)
    out = capsys.readouterr().out
    assert "soak:" in out and "normal latency p50" in out
    assert set(rep["outcomes"]) == set(CLIENTS)
    assert rep["five_xx"] == 0 and rep["hung"] == 0
    assert rep["outcomes"]["normal"].get("200", 0) > 0 and set(rep["outcomes"]["normal"]) == {"200"}
    assert set(rep["outcomes"]["malformed"]) <= {"400", "404"}
    assert set(rep["outcomes"]["oversized"]) <= {"400", "413"}
    assert set(rep["outcomes"]["slow"]) <= {"closed", "408"}
    assert rep["end"] == {k: 0 for k in rep["end"]}


def test_scenario_tool_refuses_other_machines_and_unknown_names():
    from skipkv.bench.scenarios import flood_body, run_scenario, token_prompt
    from skipkv.errors import SkipKVError

    with pytest.raises(SkipKVError, match="this machine only"):
        run_scenario("flood", "http://10.1.2.3:8000", None, None)
    with pytest.raises(SkipKVError, match="long-prompt, flood, sigterm"):
        run_scenario("melt", "http://127.0.0.1:8000", None, None)
    body = json.loads(flood_body("m", 100_000))
    assert 99_000 < len(flood_body("m", 100_000)) <= 100_000 and body["model"] == "m"
    assert all(m == {"role": "user", "content": ""} for m in body["messages"]) and len(body["messages"]) > 3000
    assert len(token_prompt(6000)) == 6000 and max(token_prompt(6000)) < 256
