"""A fair, bounded server: a long prompt does not stall running streams and its client's disconnect aborts it,
large bodies never delay small ones, every request answers within --request-timeout, prompts that cannot fit
are refused before any work, SIGTERM ends every request cleanly, odd API keys and a port in use are refused at
start-up, and /metrics (prometheus_client) carries latency histograms. Each test fails on the server before
its fix."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
prometheus_client = pytest.importorskip("prometheus_client")

from skipkv import cli, make_policy  # noqa: E402
from skipkv.config import EngineConfig  # noqa: E402
from skipkv.models import load_model  # noqa: E402
from skipkv.serve import protocol  # noqa: E402
from skipkv.serve.app import create_app  # noqa: E402
from skipkv.serve.http import SMALL_BODY  # noqa: E402
from skipkv.serve.protocol import ServerSettings  # noqa: E402
from test_serve import MODEL, RKV, _error, metrics, one_torch_thread, serving  # noqa: E402,F401
from test_serve_hostile import counter, slowed  # noqa: E402

CHUNK = 64


@pytest.fixture(scope="module")
def fair_server():
    """rkv, batch 8, prompts prefilled CHUNK tokens per step, 8 MiB bodies."""
    s = ServerSettings(model_name=MODEL, max_tokens_cap=4096, max_body_bytes=8 << 20)
    app = create_app(load_model(MODEL, dtype="fp64"), make_policy("rkv", **RKV),
                     EngineConfig(batch_size=8, prefill_chunk=CHUNK, group_by_length=False), s)
    with serving(app, s) as url:
        yield url, app.state.worker


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def sse(url: str, body: dict, path: str = "/v1/completions", on_line=None) -> list[str]:
    """The data lines of a stream (raises httpx.RemoteProtocolError if the chunked body is not terminated)."""
    lines = []
    with httpx.stream("POST", url + path, json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if on_line:
                    on_line(line[6:])
    return lines


# ----------------------------------------------------------------------------- start-up checks
def no_load(monkeypatch) -> None:
    """Make loading a model fail the test (its signature kept: the CLI reads load_model's defaults)."""
    import functools

    import skipkv.models

    @functools.wraps(skipkv.models.load_model)
    def fail(*a, **k):
        pytest.fail("the model was loaded")

    monkeypatch.setattr(skipkv.models, "load_model", fail)


@pytest.mark.parametrize("key", ["", " k3y", "k3y ", "k3y\t", "k\u00e9y", "\u043a\u043b\u044e\u0447", "key\n",
                                 "\u200bkey"])
def test_unusable_api_keys_are_refused_before_the_model_loads(monkeypatch, capsys, key):
    no_load(monkeypatch)
    assert cli.main(["serve", "--model", MODEL, "--port", str(free_port()), "--api-key", key]) == 2
    err = capsys.readouterr().err.strip()
    assert "--api-key" in err and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("host,held", [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"),
                                       ("0.0.0.0", "0.0.0.0"), ("127.0.0.1", "0.0.0.0")])
def test_a_port_in_use_fails_before_the_model_loads(monkeypatch, capsys, host, held):
    no_load(monkeypatch)
    taken = socket.socket()
    taken.bind((held, 0))
    taken.listen(1)
    try:
        t0 = time.monotonic()
        assert cli.main(["serve", "--model", MODEL, "--host", host, "--port", str(taken.getsockname()[1])]) == 2
        assert time.monotonic() - t0 < 5
    finally:
        taken.close()
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the public-bind warning, if any
    assert err.startswith("skipkv: error: cannot listen on")


def test_startup_line_names_what_is_served(monkeypatch, capsys):
    from skipkv.serve import guard
    from skipkv.serve.cli import PREFILL_CHUNK

    ran = []
    monkeypatch.setattr(guard.Server, "run", lambda self, sockets=None: ran.append(sockets))
    p = free_port()
    assert cli.main(["serve", "--model", MODEL, "--policy", "rkv", "--budget", "48", "--port", str(p),
                     "--dtype", "fp32", "--api-key", "k-1"]) == 0
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("skipkv serve:")]
    assert len(line) == 1 and len(ran) == 1 and ran[0][0].getsockname()[1] == p
    for part in (f"model {MODEL}", "policy rkv", "budget 48", "device cpu", "dtype float32",
                 f"http://127.0.0.1:{p}", f"prefill chunk {PREFILL_CHUNK}"):
        assert part in line[0], (part, line[0])
    ran[0][0].close()


def test_serve_prefills_in_chunks_by_default():
    from skipkv.serve.cli import PREFILL_CHUNK, engine_from_args

    args = cli.build_parser().parse_args(["serve"])
    assert engine_from_args(args).prefill_chunk == PREFILL_CHUNK > 0
    assert cli.build_parser().parse_args(["generate", "x"]).prefill_chunk == 0  # generate keeps its own default


# ----------------------------------------------------------------------------- a long prompt beside streams
def test_a_long_prompt_does_not_stall_streams_and_its_disconnect_aborts_it(fair_server):
    url, worker = fair_server
    undo = slowed(worker, 0.03)
    got: list[float] = []
    stream = threading.Thread(target=sse, args=(url, {"model": MODEL, "prompt": "hi", "max_tokens": 600,
                                                      "ignore_eos": True}), kwargs={"on_line": lambda _: got.append(1)})
    try:
        stream.start()
        while len(got) < 3:
            time.sleep(0.01)
        for n in (1500, 2400, 3900):  # prompts of 24-61 chunks: the stream gets a token at every step of them
            before = len(got)
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * n, "max_tokens": 1},
                           timeout=120)
            assert r.status_code == 200
            # (half: the client's reading may lag behind the server; unchunked, the stream gets 1 token)
            assert len(got) - before >= n // CHUNK // 2, (n, len(got) - before)
        # A long prompt whose client gives up mid-prefill is aborted at once, not after its prefill.
        m0 = metrics(url)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [7] * 3900, "max_tokens": 1},
                       timeout=0.5)
        gone = time.monotonic()
        while counter(metrics(url), "abort") == counter(m0, "abort"):
            assert time.monotonic() - gone < 1.5, "not aborted within 1.5 s of the disconnect"
            time.sleep(0.02)
        assert counter(metrics(url), "length") == counter(m0, "length")  # it never produced its token
    finally:
        undo()
    stream.join(60)
    assert len(got) >= 600  # the stream ran to its end


# ----------------------------------------------------------------------------- large bodies vs small ones
def _large_bodies() -> list[dict]:
    many = [{"role": "user", "content": ""}] * 2000
    return [{"model": MODEL, "messages": many + [{"role": "user", "content": "x" * 200_000}], "max_tokens": 1},
            {"model": MODEL, "prompt": " " * 300_000, "max_tokens": 1},
            {"model": MODEL, "prompt": [5] * 40_000, "max_tokens": 1}]


def test_large_bodies_are_bounded_per_client_and_never_delay_small_ones(fair_server):
    url, _ = fair_server
    port = int(url.rsplit(":", 1)[1])
    for big in _large_bodies():
        path = "/v1/completions" if "prompt" in big else "/v1/chat/completions"
        data = json.dumps(big).encode()
        # Two large bodies from this client, still arriving (half sent): they hold its two large-body slots.
        held = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data[: len(data) // 2])
            held.append(sock)
        time.sleep(0.5)
        try:
            third = httpx.post(url + path, json=big, timeout=60)  # refused before its body is read
            assert third.status_code == 429 and third.headers["retry-after"] and _error(third, 429)
            for _ in range(3):  # small requests go straight on
                t0 = time.monotonic()
                r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "2 + 2 =", "max_tokens": 1},
                               timeout=60)
                assert r.status_code == 200 and time.monotonic() - t0 < 1.5
        finally:
            for sock in held:
                sock.close()  # their reads fail: the slots are free again
        deadline = time.monotonic() + 10
        while (r := httpx.post(url + path, json=big, timeout=60)).status_code == 429:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert r.status_code in (200, 400), r.text


def test_large_bodies_parse_beside_small_ones(fair_server, monkeypatch):
    url, _ = fair_server
    real = protocol.load_body

    def slow_for_large(raw: bytes) -> dict:
        if len(raw) > SMALL_BODY:
            time.sleep(2.0)
        return real(raw)

    monkeypatch.setattr(protocol, "load_body", slow_for_large)
    results: list[int] = []

    def post(big: dict) -> None:
        path = "/v1/completions" if "prompt" in big else "/v1/chat/completions"
        results.append(httpx.post(url + path, json=big, timeout=60).status_code)

    posts = [threading.Thread(target=post, args=(big,)) for big in _large_bodies()[:2]]
    for t in posts:
        t.start()
    time.sleep(0.3)
    for _ in range(3):  # while the large ones parse (4 s), small requests are answered at once
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "2 + 2 =", "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 200 and time.monotonic() - t0 < 1.5
    for t in posts:
        t.join(60)
    assert sorted(results) and all(s in (200, 400) for s in results), results


# ----------------------------------------------------------------------------- bounds on every request
@pytest.mark.parametrize("text", [" ", "\n", "a ", "\u6f22", "\U0001f600", "\t\r\n"])
def test_a_huge_prompt_is_refused_fast(fair_server, text):
    url, _ = fair_server
    prompt = text * ((4 << 20) // len(json.dumps(text, ensure_ascii=False).encode()))  # a body of about 4 MiB
    t0 = time.monotonic()
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": prompt}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prompt}]})):
        err = _error(httpx.post(url + path, json=body, timeout=60), 400)
        assert err["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("n", [4095, 4090, 4081])
def test_a_prompt_that_leaves_no_room_for_the_default_max_tokens_is_refused(fair_server, n):
    url, _ = fair_server
    err = _error(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * n}, timeout=60), 400,
                 "prompt")
    assert err["code"] == "context_length_exceeded" and "defaults to 16" in err["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 4000}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16


def test_too_many_messages_are_refused(fair_server):
    url, _ = fair_server
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * (protocol.MAX_MESSAGES + 1)}
    assert _error(httpx.post(url + "/v1/chat/completions", json=body, timeout=60), 400, "messages")


def test_every_request_ends_within_the_request_timeout():
    s = ServerSettings(model_name=MODEL, max_tokens_cap=4096, request_timeout=3.0)
    app = create_app(load_model(MODEL, dtype="fp64"), make_policy("full"), EngineConfig(batch_size=4), s)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3000, "ignore_eos": True}
    with serving(app, s) as url:
        slowed(app.state.worker, 0.05)  # 3,000 tokens would take 150 s
        m0 = metrics(url)
        t0 = time.monotonic()
        err = _error(httpx.post(url + "/v1/completions", json=body, timeout=60), 504)
        assert err["code"] == "request_timeout" and 2.9 < time.monotonic() - t0 < 6
        for path, b in (("/v1/completions", body), ("/v1/chat/completions",
                                                    {**body, "messages": [{"role": "user", "content": "hi"}]})):
            lines = sse(url, b, path)
            assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "request_timeout"
        deadline = time.monotonic() + 5  # the engine applies an abort before its next step
        while counter(metrics(url), "abort") - counter(m0, "abort") < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)


# ----------------------------------------------------------------------------- /metrics
def test_metrics_parse_with_prometheus_client_and_carry_latency_histograms(fair_server):
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = fair_server
    before = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
    httpx.post(url + "/v1/completions", json=body, timeout=60)
    sse(url, body)
    sse(url, {**body, "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    kinds = {"skipkv_requests_running": "gauge", "skipkv_requests_waiting": "gauge",
             "skipkv_kv_reserved_bytes": "gauge", "skipkv_kv_held_bytes": "gauge",
             "skipkv_kv_allocated_bytes": "gauge", "skipkv_kv_cap_bytes": "gauge",
             "skipkv_generated_tokens": "counter", "skipkv_compressions": "counter", "skipkv_engine_steps": "counter",
             "skipkv_process_resident_bytes": "gauge", "skipkv_process_peak_resident_bytes": "gauge",
             "skipkv_requests": "counter", "skipkv_http_responses": "counter",
             "skipkv_time_to_first_token_seconds": "histogram", "skipkv_inter_token_latency_seconds": "histogram",
             "skipkv_e2e_request_latency_seconds": "histogram"}
    for name, kind in kinds.items():
        assert fams[name].type == kind, name
    reasons = {s.labels["finish_reason"] for s in fams["skipkv_requests"].samples}
    assert reasons == {"eos", "stop", "length", "abort", "error"}

    def count(fs, name: str) -> float:
        return next((s.value for s in fs[name].samples if s.name == name + "_count"), 0.0) if name in fs else 0.0

    for name, least in (("skipkv_time_to_first_token_seconds", 3), ("skipkv_e2e_request_latency_seconds", 3),
                        ("skipkv_inter_token_latency_seconds", 12)):
        assert count(fams, name) - count(before, name) >= least, name
        buckets = [s for s in fams[name].samples if s.name == name + "_bucket"]
        values = [s.value for s in buckets]
        assert values == sorted(values) and buckets[-1].labels["le"] == "+Inf" and values[-1] == count(fams, name)


# ----------------------------------------------------------------------------- SIGTERM
def test_sigterm_ends_every_request_cleanly(tmp_path):
    p = free_port()
    log = tmp_path / "serve.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from skipkv.cli import main; sys.exit(main())",
                                 "serve", "--model", MODEL, "--port", str(p), "--shutdown-timeout", "1",
                                 "--threads", "1", "--batch-size", "8"], stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{p}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        long_ = {"model": MODEL, "max_tokens": 4000, "ignore_eos": True}
        started = threading.Semaphore(0)
        ends: dict[str, object] = {}

        def stream(name: str, path: str, body: dict) -> None:
            try:
                ends[name] = sse(url, body, path, on_line=lambda _: started.release())
            except Exception as exc:  # noqa: BLE001 - recorded, then checked
                ends[name] = exc

        def plain(name: str, path: str, body: dict) -> None:
            ends[name] = httpx.post(url + path, json=body, timeout=60)

        chat = {**long_, "messages": [{"role": "user", "content": "hi"}]}
        jobs = [threading.Thread(target=stream, args=("s1", "/v1/completions", {**long_, "prompt": "a"})),
                threading.Thread(target=stream, args=("s2", "/v1/chat/completions", chat)),
                threading.Thread(target=stream, args=("s3", "/v1/completions", {
                    **long_, "prompt": "b", "stream_options": {"include_usage": True}})),
                threading.Thread(target=plain, args=("p1", "/v1/completions", {**long_, "prompt": "c"})),
                threading.Thread(target=plain, args=("p2", "/v1/chat/completions", chat))]
        for j in jobs:
            j.start()
        for _ in range(9):  # every stream is under way
            assert started.acquire(timeout=60)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        for j in jobs:
            j.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    for name in ("s1", "s2", "s3"):
        lines = ends[name]
        assert isinstance(lines, list), (name, lines)  # the chunked body was terminated
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["type"] == "server_error", lines[-3:]
    for name in ("p1", "p2"):
        r = ends[name]
        assert isinstance(r, httpx.Response) and _error(r, 503)["code"] == "shutting_down"
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
