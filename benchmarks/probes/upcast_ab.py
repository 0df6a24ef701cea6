"""bf16 on a CPU without a bf16 matmul: torch's emulated bf16 linears vs fp32 products of upcast weights
(kernels.upcast_linears, models/packed.py UpcastLinear), on the real model through the public `generate`.

    OMP_NUM_THREADS=1 python benchmarks/probes/upcast_ab.py --prompt-tokens 256 --new-tokens 16 --batches 1,8 \
        --rounds 2 --out docs/results/upcast/upcast_ab_epyc_avx2.json
    OMP_NUM_THREADS=1 python benchmarks/probes/upcast_ab.py --variants upcast-rowmajor,upcast --batches 1,4,16,48 ...

`--variants A,B` picks the two compared (B's speedup over A): `emulated` (SKIPKV_UPCAST_LINEARS=0), `upcast`
(UpcastLinear as it is: the fp32 weight stored (in, out)) and `upcast-rowmajor` (the same products with the
fp32 weight stored (out, in) and multiplied by `F.linear`, the layout UpcastLinear had first); and for an fp32
model, `fp32` (torch.nn.Linear, SKIPKV_TRANSPOSED_LINEARS=0) and `fp32-transposed` (every linear a
TransposedLinear, the weight stored (in, out): SKIPKV_TRANSPOSED_LINEARS=1, the default on an AVX2-only CPU),
and `fp32-packed` (PackedLinear: oneDNN-prepacked fp32 weights, SKIPKV_PACKED_LINEARS=1, opt-in).

Both models are loaded in this process from the same weights, and each round runs every case and variant in
turn, so a slow spell on this shared machine hits both alike. Batch-1 decode streams every weight from memory once
per token, and there the model loaded second ran slower than the first, whichever variant it was (fp32 against
fp32-transposed on the AVX2-only EPYC, 2026-12-04: 0.87x with fp32 loaded first, 1.13x with it loaded second).
`--fresh` runs each variant of each round in a process of its own instead, A then B in odd rounds and B then A
in even ones. Cases: the prefill of one `--prompt-tokens` prompt (time to first token), and decode at each batch
from a 32-token prompt (tokens/s after the first token); full cache, greedy, `ignore_eos`; medians over rounds,
and the share of greedy tokens on which the two variants agree (they round differently, so a near-tie may flip).
On a CPU with a bf16 matmul in oneDNN
the default is prepacked linears, not this; the script says so and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from skipkv import SamplingParams, generate, hardware, kernels, load_model, make_policy
from skipkv.config import EngineConfig
from skipkv.errors import SkipKVError
from skipkv.models.packed import UpcastLinear
from skipkv.outputs import write_atomic

TEXT = ("The committee met on a grey morning to review the harbour accounts, line by line, and found that the "
        "figures for the spring quarter did not match the ledger kept by the harbour master. ")


VARIANTS = ("emulated", "upcast", "upcast-rowmajor", "fp32", "fp32-transposed", "fp32-packed")


def rowmajor(model: torch.nn.Module) -> None:
    """Give every UpcastLinear of `model` the first layout: the fp32 weight (out, in), multiplied by F.linear."""
    for m in model.modules():
        if isinstance(m, UpcastLinear):
            m.weight32 = m.weight32_t.t().contiguous()
            del m.weight32_t
            m.forward = (lambda x, m=m: torch.nn.functional.linear(x.float(), m.weight32, m.bias32).to(x.dtype))


def run(bundle, prompt_ids: list[int], batch: int, new_tokens: int) -> tuple[float, float, list[list[int]]]:
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    results = generate(bundle, [prompt_ids] * batch, sp, make_policy("full"), EngineConfig(batch_size=batch))
    ttft = max(r.ttft_seconds for r in results)
    decode = max(r.seconds for r in results) - ttft
    return ttft, batch * (new_tokens - 1) / decode, [r.token_ids for r in results]


def load(name: str, model: str):
    """The model of variant `name` (VARIANTS), its linears as that variant has them."""
    os.environ[kernels.UPCAST_ENV] = "0" if name == "emulated" else "1"
    os.environ[kernels.TRANSPOSE_ENV] = "1" if name == "fp32-transposed" else "0"
    os.environ[kernels.PACK_ENV] = "1" if name == "fp32-packed" else "0"
    try:
        bundle = load_model(model, dtype="fp32" if name.startswith("fp32") else "bf16")
    finally:
        os.environ.pop(kernels.UPCAST_ENV, None)
        os.environ.pop(kernels.TRANSPOSE_ENV, None)
        os.environ.pop(kernels.PACK_ENV, None)
    if name == "upcast-rowmajor":
        rowmajor(bundle.model)
    return bundle


def measure(bundle, kind: str, batch: int, args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    """One case: (seconds to the first token of one --prompt-tokens prompt, or decode tokens/s at `batch` from a
    32-token prompt; the greedy tokens)."""
    ids = bundle.tokenizer.encode(TEXT * (args.prompt_tokens // 20 + 1))[:args.prompt_tokens]
    if kind == "prefill":
        ttft, _, toks = run(bundle, ids, 1, 2)
        return ttft, toks
    _, tps, toks = run(bundle, ids[:32], batch, args.new_tokens)
    return tps, toks


def _passed(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
            "--batches", args.batches]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default="emulated,upcast", help=f"two of {', '.join(VARIANTS)}: A,B")
    p.add_argument("--fresh", action="store_true", help="each variant of each round in a process of its own")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if min(batches) < 1 or args.prompt_tokens < 1 or args.new_tokens < 2 or args.rounds < 1:
            raise ValueError
    except ValueError:
        print("upcast_ab: --batches must be positive integers (e.g. 1,8), --prompt-tokens, --rounds >= 1 and "
              "--new-tokens >= 2", file=sys.stderr)
        return 2
    variants = args.variants.split(",")
    if args.one and len(variants) == 1 and variants[0] in VARIANTS:
        pass
    elif len(variants) != 2 or len(set(variants)) != 2 or not set(variants) <= set(VARIANTS):
        print(f"upcast_ab: --variants must name two different ones of {', '.join(VARIANTS)} (got {args.variants!r})",
              file=sys.stderr)
        return 2
    if kernels.packed_linears(torch.bfloat16, "cpu")[0] and not all(v.startswith("fp32") for v in variants):
        print("upcast_ab: this CPU multiplies bf16 in oneDNN (prepacked linears run, not upcast); nothing to compare",
              file=sys.stderr)
        return 1
    cases = [("prefill", 1)] + [("decode", b) for b in batches]
    values: dict[tuple[str, int, str], list[float]] = {}
    tokens: dict[tuple[str, int, str], list[list[int]]] = {}
    try:
        if args.one:  # a child of --fresh: one variant, one round, its results as JSON on stdout
            bundle = load(variants[0], args.model)
            print(json.dumps([[kind, batch, *measure(bundle, kind, batch, args)] for kind, batch in cases]))
            return 0
        bundles = {} if args.fresh else {name: load(name, args.model) for name in variants}
    except SkipKVError as exc:
        print(f"upcast_ab: {exc}", file=sys.stderr)
        return 1
    first, second = variants
    for rnd in range(args.rounds):
        if args.fresh:
            for name in (variants if rnd % 2 == 0 else variants[::-1]):
                child = subprocess.run([sys.executable, __file__, "--one", "--variants", name, *_passed(args)],
                                       capture_output=True, text=True)
                if child.returncode != 0:
                    print(f"upcast_ab: the {name} process failed: {child.stderr.strip().splitlines()[-1:]}",
                          file=sys.stderr)
                    return 1
                for kind, batch, value, toks in json.loads(child.stdout.strip().splitlines()[-1]):
                    values.setdefault((kind, batch, name), []).append(value)
                    tokens[(kind, batch, name)] = toks
                    print(f"round {rnd + 1} {kind} batch {batch} {name} (own process): {value:.2f} "
                          + ("s to first token" if kind == "prefill" else "tok/s"), flush=True)
            continue
        for kind, batch in cases:
            for name, bundle in bundles.items():
                value, toks = measure(bundle, kind, batch, args)
                values.setdefault((kind, batch, name), []).append(value)
                tokens[(kind, batch, name)] = toks
                print(f"round {rnd + 1} {kind} batch {batch} {name}: {value:.2f} "
                      + ("s to first token" if kind == "prefill" else "tok/s"), flush=True)
    rows = []
    print(f"\n| case | {first} | {second} | {second} speedup | greedy tokens agreeing |\n|---|---:|---:|---:|---:|")
    for kind, batch in cases:
        a_value, b_value = (statistics.median(values[(kind, batch, n)]) for n in variants)
        speedup = a_value / b_value if kind == "prefill" else b_value / a_value
        a, b = tokens[(kind, batch, first)], tokens[(kind, batch, second)]
        agree = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)
        unit = "s to first token" if kind == "prefill" else "tok/s"
        label = f"prefill {args.prompt_tokens} tokens" if kind == "prefill" else f"decode batch {batch}"
        rows.append({"case": label, "unit": unit, first: a_value, second: b_value, "speedup": speedup,
                     "tokens_agreeing": agree, "rounds": {n: values[(kind, batch, n)] for n in variants}})
        print(f"| {label} ({unit}) | {a_value:.2f} | {b_value:.2f} | {speedup:.2f}x | {agree:.3f} |")
    if args.out:
        report = {"model": args.model, "variants": variants, "prompt_tokens": args.prompt_tokens,
                  "new_tokens": args.new_tokens, "rounds": args.rounds, "fresh_processes": args.fresh,
                  "threads": torch.get_num_threads(), "rows": rows, "environment": hardware.environment()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.out), json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
