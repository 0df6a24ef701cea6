"""`skipkv serve --replicas N`: N engine replicas behind Ray Serve's HTTP proxy, each running the same app.

    skipkv serve --model random:qwen2 --replicas 2                        # a local Ray cluster on this machine
    ray start --head --port 6379                                          # a real cluster: on the head node,
    ray start --address HEAD_IP:6379                                      # on every other node,
    skipkv serve --model qwen2.5-coder-0.5b-instruct --replicas 8 --ray auto --host 0.0.0.0 --api-key KEY

Each replica is a Ray Serve deployment replica that loads the model and serves `create_app`'s FastAPI app
(the same routes, streaming, limits and metrics as one `skipkv serve`); Ray Serve's proxy owns the port and
routes each request to the less loaded of two replicas it samples (power of two choices on ongoing requests).
A replica takes up to `batch_size + max_queue` requests at once, so the engine's own queue limit (429) still
decides past that. Every response names its replica in the `x-skipkv-replica` header, and each replica's
`/metrics` carry `skipkv_replica_info{replica=...}`. Ray restarts a replica that dies; the requests it held end
with an error from the proxy (a 5xx, or a stream cut before `data: [DONE]`), never a hang.

skipkv must be importable on every node (installed, or on PYTHONPATH); Ray starts a local cluster when no
--ray address is given. The connection limits of guard.py belong to skipkv's own uvicorn server, which Ray's
proxy replaces: behind Ray, header timeouts and connection caps are the proxy's (Ray's own settings).
"""

from __future__ import annotations

import dataclasses
import logging

from skipkv.config import EngineConfig
from skipkv.errors import SkipKVError
from skipkv.serve.protocol import ServerSettings

APP_NAME = "skipkv"
DEPLOYMENT = "EngineReplica"
REPLICA_HEADER = "x-skipkv-replica"

log = logging.getLogger("skipkv.serve")


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What one replica needs to build its app (shipped to the replica by value)."""

    model: str
    dtype: str
    policy: object  # a Policy dataclass
    engine: EngineConfig
    settings: ServerSettings
    threads: int = 0  # torch CPU threads per replica (0 = torch's default)


def _deployment():
    """The Ray Serve deployment class (built lazily: importing this module must not need Ray)."""
    from ray import serve

    @serve.deployment(name=DEPLOYMENT)
    @serve.ingress()
    class EngineReplica:
        def __init__(self, spec: ReplicaSpec) -> None:
            self.spec = spec

        def __serve_build_asgi_app__(self):
            # Runs on the replica: the model is loaded there, never on the driver.
            from skipkv.hardware import set_threads
            from skipkv.models import load_model
            from skipkv.serve.app import create_app

            spec = self.spec
            set_threads(spec.threads)
            replica = serve.get_replica_context().replica_id.unique_id
            bundle = load_model(spec.model, dtype=spec.dtype)
            return create_app(bundle, spec.policy, spec.engine, spec.settings, replica=replica)

    return EngineReplica


def application(spec: ReplicaSpec, replicas: int, replica_cpus: float = 1.0):
    """The bound Ray Serve application: `replicas` copies of the engine app."""
    if replicas < 1:
        raise SkipKVError(f"--replicas must be at least 1, got {replicas}")
    per_replica = spec.engine.batch_size + spec.settings.max_queue  # running + truly waiting: the app's 429 decides
    return _deployment().options(
        num_replicas=replicas, max_ongoing_requests=per_replica, max_queued_requests=-1,
        ray_actor_options={"num_cpus": replica_cpus}, graceful_shutdown_timeout_s=spec.settings.shutdown_timeout,
        # A dead replica is replaced; health is the engine thread's (/health answers 503 once it has stopped).
        health_check_period_s=2, health_check_timeout_s=10,
    ).bind(spec)


def replica_actor_name(replica_id: str) -> str:
    """The Ray actor name of a replica (as `x-skipkv-replica` names it), e.g. to kill it in a test."""
    return f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#{replica_id}"


def run_replicas(spec: ReplicaSpec, replicas: int, host: str, port: int, address: str | None,
                 replica_cpus: float = 1.0, blocking: bool = True, init_kwargs: dict | None = None):
    """Start (or join) a Ray cluster, start Serve's proxy on host:port and deploy the replicas; with
    `blocking`, serve until interrupted and then tear the application down."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise SkipKVError(f"--replicas needs Ray Serve (pip install 'skipkv[ray]'): {exc}") from None
    if not ray.is_initialized():
        ray.init(address=address or None, **dict(init_kwargs or {}))
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(application(spec, replicas, replica_cpus), name=APP_NAME, route_prefix="/",
                       blocking=False)
    print(f"skipkv: {replicas} replicas of {spec.model} behind Ray Serve at http://{host}:{port}", flush=True)
    if not blocking:
        return handle
    import signal
    import time

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # SIGTERM tears down like Ctrl-C: replicas drain, then stop
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
    return None
