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
import sys

from skipkv.config import EngineConfig
from skipkv.errors import SkipKVError
from skipkv.hardware import set_threads


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


def settings_from_args(args: argparse.Namespace):
    from skipkv.serve.protocol import ServerSettings

    return ServerSettings(model_name=args.served_model_name or args.model, api_key=args.api_key or "",
                          max_tokens_cap=args.max_tokens_cap, max_queue=args.max_queue,
                          max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout,
                          max_connections=args.max_connections, shutdown_timeout=args.shutdown_timeout)


def engine_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(batch_size=args.batch_size, prefill_chunk=args.prefill_chunk, kv_memory=args.kv_memory,
                        prefill_budget=args.prefill_budget, group_by_length=False, share_prefix=args.share_prefix,
                        unpad_prefill=not args.no_unpad_prefill)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from skipkv.serve.app import create_app
        from skipkv.serve.guard import server_config
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
    bundle = load_model(args.model, dtype=args.dtype, device=args.device)
    app = create_app(bundle, policy, engine, settings)
    uvicorn.Server(server_config(app, settings, args.host, args.port, args.log_level)).run()
    return 0


def register(sub) -> None:
    from skipkv.engine.cli import add_model_args, add_policy_args, kv_memory_arg
    from skipkv.serve.protocol import ServerSettings

    s = sub.add_parser("serve", help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming)")
    add_model_args(s)  # also --kv-memory and --prefill-budget
    add_policy_args(s)
    s.set_defaults(batch_size=32)  # a cap on the batch; with --kv-memory, memory decides
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
    s.add_argument("--replicas", type=int, default=0,
                   help="serve N engine replicas behind Ray Serve's HTTP proxy (0 = one server, no Ray)")
    s.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="with --replicas: the Ray cluster to join (auto, or HEAD:6379; default: start a local one)")
    s.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: Ray CPUs reserved per replica")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
