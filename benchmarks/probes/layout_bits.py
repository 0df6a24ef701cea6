"""Do the two layouts of an fp32 linear give the same bits? `F.linear(x, W)` with W (out, in) against
`x @ W^T` with W^T stored (in, out) contiguous (UpcastLinear's layout), on the linear shapes of
Qwen2.5-0.5B (q/o 896x896, k/v 128x896, gate/up 4864x896, down 896x4864, lm_head 151936x896), bf16-valued
inputs and weights, one thread, for 1-64 rows. Prints the row counts where any bit differs, per shape.

It also checks each layout against itself across batch sizes: the first m rows of a 64-row product against the
same m rows multiplied alone, for m = 1-64 (`batch_differ_at_rows`). Where those differ, an fp32 batch's tokens
can differ from its requests' run alone in the last bits (README, "Padding never costs budget").

    OMP_NUM_THREADS=1 python benchmarks/probes/layout_bits.py --out docs/results/upcast/layout_bits_epyc_avx2.json
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from skipkv import hardware
from skipkv.outputs import write_atomic


def _transposed(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x @ wt if b is None else torch.addmm(b, x, wt)


SHAPES = [(896, 896, True), (128, 896, True), (4864, 896, False), (896, 4864, False), (151936, 896, False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    report: dict[str, list[int]] = {}
    batch_report: dict[str, dict[str, list[int]]] = {}
    for n, k, bias in SHAPES:
        w = torch.randn(n, k).bfloat16().float()
        wt = w.t().contiguous()
        b = torch.randn(n).bfloat16().float() if bias else None
        layouts = {"(out, in), F.linear": functools.partial(torch.nn.functional.linear, weight=w, bias=b),
                   "(in, out), addmm": functools.partial(_transposed, wt=wt, b=b)}
        differ = []
        for m in range(1, args.rows + 1):
            x = torch.randn(m, k).bfloat16().float()
            if not torch.equal(*(f(x) for f in layouts.values())):
                differ.append(m)
        name = f"{n}x{k}{'+bias' if bias else ''}"
        report[name] = differ
        print(f"{n} x {k}{' + bias' if bias else ''}: bits differ at rows {differ or 'none'}", flush=True)
        x = torch.randn(args.rows, k).bfloat16().float()
        batch_report[name] = {}
        for layout, f in layouts.items():
            whole = f(x)
            batch_report[name][layout] = [m for m in range(1, args.rows + 1) if not torch.equal(f(x[:m]), whole[:m])]
            print(f"  {layout}: {args.rows}-row batch vs the first m rows alone differ at m = "
                  f"{batch_report[name][layout] or 'none'}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.out), json.dumps({"rows": args.rows, "differ_at_rows": report,
                                                 "batch_differ_at_rows": batch_report,
                                                 "environment": hardware.environment()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
