"""`skipkv serve`: an OpenAI-compatible HTTP server on the step-driven engine.

    skipkv serve --model qwen2.5-coder-0.5b-instruct --policy rkv --budget 128 --kv-memory 2GiB --port 8000
    skipkv serve --model random:qwen2 --api-key secret --max-queue 64 --max-tokens-cap 1024

Binds 127.0.0.1 unless --host says otherwise. Needs the `serve` extra (pip install -e ".[serve]").
"""

from __future__ import annotations

import argparse

from skipkv.config import EngineConfig
from skipkv.errors import SkipKVError
from skipkv.hardware import set_threads

def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"port must be an integer in 1..65535, got {text!r}")
    return int(text)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from skipkv.serve.app import create_app
    except ImportError as exc:
        raise SkipKVError(f"serving needs the serve extra (pip install 'skipkv[serve]'): {exc}") from None
    from skipkv.engine.cli import policy_from_args
    from skipkv.models import load_model
    from skipkv.serve.protocol import ServerSettings

    policy = policy_from_args(args)
    # A server must be fair: no batch grouping by prompt length (it could pass over a long prompt forever).
    engine = EngineConfig(batch_size=args.batch_size, prefill_chunk=args.prefill_chunk, kv_memory=args.kv_memory,
                          prefill_budget=args.prefill_budget, group_by_length=False)
    settings = ServerSettings(model_name=args.served_model_name or args.model, api_key=args.api_key or "",
                              max_tokens_cap=args.max_tokens_cap, max_queue=args.max_queue)
    set_threads(args.threads)
    bundle = load_model(args.model, dtype=args.dtype)
    app = create_app(bundle, policy, engine, settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def register(sub) -> None:
    from skipkv.engine.cli import add_model_args, add_policy_args
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
    s.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests at most; more get HTTP 429")
    s.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap, help="max_tokens allowed per request at most")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
