"""`skipkv serve --replicas 2` on Ray Serve, on this machine (a local Ray cluster, 127.0.0.1 only): two
replicas of random:qwen2 answer as one server does, concurrent requests spread over both (each replica's
/metrics), and a replica killed mid-run is replaced while its in-flight requests end with an error, not a hang.

Slow (a Ray cluster and two model replicas start in ~1 minute on 2 cores): run it by hand with
    python -m pytest tests/test_serve_ray.py -m slow -s
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

import skipkv  # noqa: E402
from conftest import PROMPTS  # noqa: E402
from skipkv import SamplingParams, generate, make_policy  # noqa: E402
from skipkv.bench.soak import parse_metrics  # noqa: E402
from skipkv.config import EngineConfig  # noqa: E402
from skipkv.serve.protocol import ServerSettings  # noqa: E402
from skipkv.serve.replicas import REPLICA_HEADER, ReplicaSpec, replica_actor_name, run_replicas  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "random:qwen2"
RKV = dict(budget=32, window=4, interval=8)


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    src = str(Path(skipkv.__file__).resolve().parents[1])  # replicas import skipkv from this checkout
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, old) if p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = ReplicaSpec(MODEL, "fp64", make_policy("rkv", **RKV), EngineConfig(batch_size=8),
                       ServerSettings(model_name=MODEL, max_tokens_cap=3000), threads=1)
    t0 = time.monotonic()
    run_replicas(spec, 2, "127.0.0.1", port, None, blocking=False,
                 init_kwargs={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False})
    print(f"\ncluster and 2 replicas up in {time.monotonic() - t0:.1f} s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def replica_metrics(url: str, want: int = 2, timeout: float = 60) -> dict[str, dict[str, float]]:
    """Each replica's /metrics (the proxy picks a replica per scrape: scrape until `want` were seen)."""
    seen: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < want:
        assert time.monotonic() < deadline, f"saw only replicas {sorted(seen)}"
        r = httpx.get(url + "/metrics", timeout=10)
        seen[r.headers[REPLICA_HEADER]] = parse_metrics(r.text)
    return seen


def test_replicas_answer_as_one_server(cluster, tiny):
    policy = make_policy("rkv", **RKV)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = generate(tiny, [PROMPTS[1]], sp, policy)[0]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    served = set()
    for _ in range(4):
        r = httpx.post(cluster + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
        assert r.json()["usage"]["compressions"] == ref.compressions
        served.add(r.headers[REPLICA_HEADER])
        with httpx.stream("POST", cluster + "/v1/completions", json=dict(body, stream=True), timeout=60) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        import json

        assert lines[-1] == "data: [DONE]"
        assert "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]) == ref.text
    print("replicas that answered:", sorted(served))
    bad = httpx.post(cluster + "/v1/completions", content=b"{", timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_concurrent_requests_spread_over_both_replicas(cluster):
    before = replica_metrics(cluster)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    log: list[tuple[int, str, int, float]] = []

    def one(i: int) -> None:
        t0 = time.monotonic()
        r = httpx.post(cluster + "/v1/completions", json=body, timeout=120)
        log.append((i, r.headers.get(REPLICA_HEADER, "-"), r.status_code, time.monotonic() - t0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    print("\nrequest log (request, replica, status, seconds):")
    for row in sorted(log):
        print(f"  {row[0]:2d} {row[1]} {row[2]} {row[3]:.2f}")
    assert [row[2] for row in log] == [200] * 12
    after = replica_metrics(cluster)
    done = {r: after[r]['skipkv_requests_total{finish_reason="length"}'] -
            before.get(r, {}).get('skipkv_requests_total{finish_reason="length"}', 0) for r in after}
    print("finished per replica (from each replica's /metrics):", done)
    assert sum(done.values()) == 12 and all(n > 0 for n in done.values()), done
    assert {row[1] for row in log} == set(after)


def test_a_killed_replica_is_replaced_and_its_requests_fail_fast(cluster):
    import ray

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2500, "temperature": 0, "ignore_eos": True}
    results: dict[int, list] = {}
    started = threading.Event()

    def stream(i: int) -> None:
        results[i] = ["?", "no answer"]
        try:
            with httpx.stream("POST", cluster + "/v1/completions", json=dict(body, stream=True), timeout=120) as s:
                results[i][0] = s.headers.get(REPLICA_HEADER)
                last = ""
                for ln in s.iter_lines():
                    started.set()
                    last = ln or last
                results[i][1] = "complete" if last == "data: [DONE]" else f"cut after {last[:40]!r}"
        except httpx.HTTPError as exc:
            results[i][1] = f"{type(exc).__name__}: {exc}"

    def plain(i: int) -> None:
        try:
            r = httpx.post(cluster + "/v1/completions", json=body, timeout=120)
            results[i] = [r.headers.get(REPLICA_HEADER), f"HTTP {r.status_code}"]
        except httpx.HTTPError as exc:
            results[i] = ["?", f"{type(exc).__name__}: {exc}"]

    # Before the load: the proxy routes a scrape to the less loaded replica, so under load it may see only one.
    before = set(replica_metrics(cluster))
    threads = [threading.Thread(target=stream if i < 4 else plain, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert started.wait(60)
    time.sleep(1.0)
    victim = next(v[0] for v in results.values() if v[0] not in ("?", None))
    t0 = time.monotonic()
    ray.kill(ray.get_actor(replica_actor_name(victim), namespace="serve"), no_restart=True)
    for t in threads:
        t.join(120)
    took = time.monotonic() - t0
    print(f"\nkilled replica {victim}; all 8 requests ended {took:.1f} s later:")
    for i in sorted(results):
        print(f"  {i} {'stream' if i < 4 else 'plain '} {results[i][0]} {results[i][1][:110]}")
    assert not any(t.is_alive() for t in threads)  # nobody hangs
    outcomes = [r[1] for r in results.values()]
    failed = [o for o in outcomes if o not in ("complete", "HTTP 200")]
    assert failed, "the killed replica held no request"
    # Every request on the killed replica ends in an error: a stream cut before [DONE], or a 5xx.
    assert all(("cut" in o or "Error" in o or o.startswith("HTTP 5")) for o in failed), failed
    for i, (rep, o) in results.items():
        if rep == victim and i < 4:
            assert o != "complete"
    # Ray replaces it: two live replicas again, one of them new, and requests succeed.
    deadline = time.monotonic() + 90
    while True:
        now = set(replica_metrics(cluster))
        if len(now) == 2 and victim not in now:
            break
        assert time.monotonic() < deadline, now
        time.sleep(1)
    print(f"replicas before {sorted(before)}, after {sorted(now)}")
    r = httpx.post(cluster + "/v1/completions", json=dict(body, max_tokens=5), timeout=60)
    assert r.status_code == 200
