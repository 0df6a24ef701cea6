"""/metrics through prometheus_client: the engine's gauges and counters (read from the engine thread's last
snapshot at each scrape), HTTP responses by status code, and three latency histograms of what clients see.

    m = ServerMetrics(worker.metrics, statuses, replica="")
    m.ttft.observe(0.12); m.itl.observe(0.03); m.e2e.observe(1.9)
    body, content_type = m.render()

The histograms follow vLLM's (`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:e2e_request_latency_seconds`) under this server's prefix: time from the request's arrival to its first
token, between consecutive token events of a request (one per engine step), and from arrival to the last token.
Each app has its own registry (several apps may live in one process, as in the tests).
"""

from __future__ import annotations

import resource
from collections import Counter
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from skipkv.serve.worker import FINISH_LABELS

GAUGES = [("skipkv_requests_running", "requests holding a slot (decoding or prefilling)", "running"),
          ("skipkv_requests_waiting", "requests waiting for a slot", "waiting"),
          ("skipkv_kv_reserved_bytes", "KV bytes reserved by running requests", "kv_reserved_bytes"),
          ("skipkv_kv_held_bytes", "KV bytes running requests hold now", "kv_held_bytes"),
          ("skipkv_kv_allocated_bytes", "KV slot store as allocated", "kv_allocated_bytes"),
          ("skipkv_kv_cap_bytes", "KV memory cap (0 = none)", "kv_cap_bytes")]
COUNTERS = [("skipkv_generated_tokens", "tokens generated", "generated_tokens"),
            ("skipkv_compressions", "KV compressions (one per request compressed)", "compressions"),
            ("skipkv_engine_steps", "engine steps", "steps")]
# Seconds: from a few ms (a token on a GPU) to minutes (a long prompt on a loaded CPU).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)


def resident_bytes() -> tuple[int, int]:
    """This process's resident memory now and at its peak (Linux; (0, peak) where /proc is missing)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        now = 0
    return now, peak


class _Snapshot:
    """A prometheus_client collector of the engine's figures and the HTTP status counts, read at each scrape."""

    def __init__(self, read: Callable[[], dict[str, int]], statuses: Counter, replica: str) -> None:
        self.read, self.statuses, self.replica = read, statuses, replica

    def collect(self):
        m = self.read()
        for name, help_, key in GAUGES:
            yield GaugeMetricFamily(name, help_, value=m[key])
        for name, help_, key in COUNTERS:
            yield CounterMetricFamily(name, help_, value=m[key])
        rss, peak = resident_bytes()
        yield GaugeMetricFamily("skipkv_process_resident_bytes", "the server process's resident memory", value=rss)
        yield GaugeMetricFamily("skipkv_process_peak_resident_bytes", "the server process's peak resident memory",
                                value=peak)
        fam = CounterMetricFamily("skipkv_requests", "requests finished, by finish reason (eos, stop string, length, "
                                  "abort = client gone, error)", labels=["finish_reason"])
        for k in FINISH_LABELS:
            fam.add_metric([k], m[f"finished_{k}"])
        yield fam
        fam = CounterMetricFamily("skipkv_http_responses", "HTTP responses by status code (4xx: the client's fault "
                                  "or a full queue; 499: the client went away first; 5xx: the server's)",
                                  labels=["code"])
        for code, n in sorted(self.statuses.items()):
            fam.add_metric([str(code)], n)
        yield fam
        if self.replica:
            info = GaugeMetricFamily("skipkv_replica_info", "the replica these figures are from", labels=["replica"])
            info.add_metric([self.replica], 1)
            yield info


class ServerMetrics:
    def __init__(self, read: Callable[[], dict[str, int]], statuses: Counter, replica: str = "") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Snapshot(read, statuses, replica))
        self.ttft = Histogram("skipkv_time_to_first_token_seconds", "seconds from a request's arrival to its first "
                              "token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("skipkv_inter_token_latency_seconds", "seconds between consecutive token events of a "
                             "request (one per engine step)", buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("skipkv_e2e_request_latency_seconds", "seconds from a request's arrival to its last "
                             "token (requests that finished)", buckets=E2E_BUCKETS, registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Timing:
    """One request's token events, observed into the histograms as they reach the handler."""

    def __init__(self, metrics: ServerMetrics, arrived: float) -> None:
        self.metrics, self.arrived, self.last = metrics, arrived, 0.0

    def tokens(self, now: float) -> None:
        if self.last:
            self.metrics.itl.observe(now - self.last)
        else:
            self.metrics.ttft.observe(now - self.arrived)
        self.last = now

    def done(self, now: float) -> None:
        self.metrics.e2e.observe(now - self.arrived)
