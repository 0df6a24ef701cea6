"""`skipkv steer build`: build a steering vector file from the model's own generations.

    skipkv steer build --model qwen2.5-coder-0.5b-instruct --dataset math500 --offset 400 --limit 20 \\
        --layers 8,12,16 --max-tokens 256 --out benchmarks/steering/qwen2.5-coder-0.5b-math500.safetensors
"""

from __future__ import annotations

import argparse
import json

from skipkv.hardware import DTYPE_HELP


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def cmd_build(args: argparse.Namespace) -> int:
    from skipkv.eval.steering import build

    meta = build(args.model, args.dataset, args.layers, args.out, args.limit, args.offset, args.max_new_tokens,
                 args.prompt_style, args.dtype, args.batch_size, args.force_wait)
    print(f"{args.out}: layers {sorted(set(args.layers))}, best {meta['best_layer']}, "
          f"steps {json.dumps(meta['counts'])}, held-out separability {json.dumps(meta['separability'])}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("steer", help="steering vectors (SEAL / SkipKV)")
    s = p.add_subparsers(dest="steer_command", required=True, parser_class=type(p))
    b = s.add_parser("build", help="build a steering vector from full-cache generations")
    b.add_argument("--model", required=True)
    b.add_argument("--dataset", required=True, help="e.g. math500 (use --offset to keep clear of evaluated examples)")
    b.add_argument("--limit", type=int, required=True, help="number of examples")
    b.add_argument("--offset", type=int, default=0,
                   help="first example index (e.g. 400: disjoint from math500's first 100)")
    b.add_argument("--layers", type=_layers, required=True, help="comma-separated decoder layers, e.g. 8,12,16")
    b.add_argument("--out", required=True, help="output .safetensors file")
    b.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int, default=256)
    b.add_argument("--prompt-style", "--prompt", default="chat", choices=("chat", "raw", "r1think"),
                   help="the eval prompt recipe (r1think: the reflective testbed, eval/prompts.py)")
    b.add_argument("--force-wait", type=int, default=0, help="s1 budget forcing, as in eval (default 0: off)")
    b.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    b.add_argument("--batch-size", type=int, default=8)
    b.set_defaults(func=cmd_build)
