"""`skipkv serve`: an OpenAI-compatible HTTP server on the step-driven engine.

    skipkv serve --model qwen2.5-coder-0.5b-instruct --policy rkv --budget 128 --kv-memory 2GiB --port 8000
    skipkv serve --model random:qwen2 --api-key secret --max-queue 64 --max-tokens-cap 1024 --shutdown-timeout 5
    skipkv serve --model random:qwen2 --replicas 2 [--ray auto]   # N replicas behind Ray Serve (replicas.py)

Binds 127.0.0.1 unless --host says otherwise (a public address without --api-key gets a warning).
Needs the `serve` extra (pip install -e ".[serve]").
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys

from skipkv.config import EngineConfig
from skipkv.errors import SkipKVError
from skipkv.hardware import set_threads

PREFILL_CHUNK = 256  # the server's default --prefill-chunk, measured: docs/benchmarks.md, "Scenarios"


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"port must be an integer in 1..65535, got {text!r}")
    return int(text)


def public_bind_warning(host: str, api_key: str) -> str | None:
    """The warning for a bind that other machines can reach while no API key is required (None if fine)."""
    if api_key:
        return None
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host == "localhost"
    if local:
        return None
    return (f"warning: serving on {host} without --api-key: anyone who can reach this address can use the "
            f"model (and /health, /metrics are always open)")


def check_api_key(key: str | None) -> str:
    """The key as given ("" when none was), or SkipKVError for one no client could send or that means nothing:
    empty, with leading or trailing whitespace, or with a character outside printable ASCII (HTTP headers carry
    ASCII; a client's library strips or refuses the rest, so such a key could never be matched)."""
    if key is None:
        return ""
    if not key:
        raise SkipKVError("--api-key is empty: give a key, or leave the flag out to serve without authentication")
    if key != key.strip():
        raise SkipKVError("--api-key has leading or trailing whitespace, which clients strip: no request could match")
    bad = next((c for c in key if not " " <= c <= "~"), None)
    if bad is not None:
        raise SkipKVError(f"--api-key holds {bad!r} (U+{ord(bad):04X}); a key must be printable ASCII, which is "
                          f"all an Authorization header carries")
    return key


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (before the model loads), so that a port in use is a one-line error at
    once; uvicorn serves on it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SkipKVError(f"--host {host!r} is not an address of this machine: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise SkipKVError(f"cannot listen on {host}:{port}: {exc.strerror} (is another server running there? "
                          f"choose another --port)") from None
    sock.set_inheritable(True)
    return sock


def startup_line(args: argparse.Namespace, bundle, policy, engine: EngineConfig, api_key: str) -> str:
    """What this server runs, in one line (printed once the model is loaded)."""
    budget = f"budget {policy.budget}" if getattr(policy, "compresses", False) else "full cache"
    kv = f"kv-memory {engine.kv_memory} B" if engine.kv_memory else "kv-memory unbounded"
    return (f"skipkv serve: model {args.model} ({bundle.max_context}-token context), policy {args.policy} "
            f"({budget}), device {bundle.device}, dtype {str(bundle.dtype).removeprefix('torch.')}, {kv}, "
            f"prefill chunk {engine.prefill_chunk or 'whole'}, listening on http://{args.host}:{args.port}"
            f"{'' if api_key else ' (no API key)'}")


def settings_from_args(args: argparse.Namespace):
    from skipkv.serve.protocol import ServerSettings

    return ServerSettings(model_name=args.served_model_name or args.model, api_key=check_api_key(args.api_key),
                          max_tokens_cap=args.max_tokens_cap, max_queue=args.max_queue,
                          max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout,
                          max_connections=args.max_connections, shutdown_timeout=args.shutdown_timeout,
                          request_timeout=args.request_timeout)


def engine_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(batch_size=args.batch_size, prefill_chunk=args.prefill_chunk, kv_memory=args.kv_memory,
                        prefill_budget=args.prefill_budget, group_by_length=False, share_prefix=args.share_prefix,
                        unpad_prefill=not args.no_unpad_prefill, enforce_eager=args.enforce_eager)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from skipkv.serve.app import create_app
        from skipkv.serve.guard import Server, server_config
    except ImportError as exc:
        raise SkipKVError(f"serving needs the serve extra (pip install 'skipkv[serve]'): {exc}") from None
    from skipkv.engine.cli import policy_from_args
    from skipkv.models import load_model

    if args.replicas < 0:
        raise SkipKVError(f"--replicas must be 0 (one server) or more, got {args.replicas}")
    policy = policy_from_args(args)
    # A server must be fair: no batch grouping by prompt length (it could pass over a long prompt forever).
    engine = engine_from_args(args)
    settings = settings_from_args(args)
    warning = public_bind_warning(args.host, settings.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    set_threads(args.threads)  # checks the value too; with --replicas each replica sets its own
    if args.replicas:
        from skipkv.serve.replicas import ReplicaSpec, run_replicas

        spec = ReplicaSpec(args.model, args.dtype, policy, engine, settings, args.threads)
        run_replicas(spec, args.replicas, args.host, args.port, args.ray, args.replica_cpus)
        return 0
    sock = bind_socket(args.host, args.port)  # a port in use fails here, before the model loads
    bundle = load_model(args.model, dtype=args.dtype, device=args.device)
    app = create_app(bundle, policy, engine, settings)
    print(startup_line(args, bundle, policy, engine, settings.api_key), file=sys.stderr, flush=True)
    Server(server_config(app, settings, args.host, args.port, args.log_level)).run(sockets=[sock])
    return 0


def register(sub) -> None:
    from skipkv.engine.cli import add_model_args, add_policy_args, kv_memory_arg
    from skipkv.serve.protocol import ServerSettings

    s = sub.add_parser("serve", help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming)")
    add_model_args(s)  # also --kv-memory and --prefill-budget
    add_policy_args(s)
    # A cap on the batch (with --kv-memory, memory decides), and prompts prefilled PREFILL_CHUNK tokens per step so
    # that a long one cannot stall the running streams (the chunk is chosen by measurement: docs/benchmarks.md).
    s.set_defaults(batch_size=32, prefill_chunk=PREFILL_CHUNK)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: none)")
    s.add_argument("--served-model-name", help="the model id clients pass (default: --model)")
    d = ServerSettings()
    help_ = lambda name: ServerSettings.__dataclass_fields__[name].metadata["help"]  # noqa: E731 - one place per fact
    s.add_argument("--max-queue", type=int, default=d.max_queue, help=help_("max_queue"))
    s.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap, help=help_("max_tokens_cap"))
    s.add_argument("--max-body-bytes", type=kv_memory_arg, default=d.max_body_bytes,
                   help=help_("max_body_bytes") + " (a size: 4MiB, 65536)")
    s.add_argument("--read-timeout", type=float, default=d.read_timeout, help=help_("read_timeout"))
    s.add_argument("--max-connections", type=int, default=d.max_connections, help=help_("max_connections"))
    s.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout, help=help_("shutdown_timeout"))
    s.add_argument("--request-timeout", type=float, default=d.request_timeout, help=help_("request_timeout"))
    s.add_argument("--replicas", type=int, default=0,
                   help="serve N engine replicas behind Ray Serve's HTTP proxy (0 = one server, no Ray)")
    s.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="with --replicas: the Ray cluster to join (auto, or HEAD:6379; default: start a local one)")
    s.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: Ray CPUs reserved per replica")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
