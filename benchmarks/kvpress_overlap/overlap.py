"""skipkv against NVIDIA's kvpress on the same model weights and token ids: which positions each (layer, kv head)
keeps after the prompt is prefill-compressed, for the methods both implement, as a Jaccard table and one JSON.

    bash benchmarks/kvpress_overlap/setup_venv.sh               # once: kvpress in its own venv
    python benchmarks/kvpress_overlap/overlap.py --out docs/results/kvpress_overlap.json

Methods (skipkv policy <- kvpress press): snapkv <- SnapKVPress, criticalkv_ada <- CriticalAdaKVPress(SnapKVPress),
expected_attention <- ExpectedAttentionPress, kvzip <- KVzipPress. A skipkv policy that `make_policy` refuses
(not runnable yet) is listed as pending instead of failing the run.

Models: tiny random Qwen2 models built from a config, q and k scaled by skipkv's SHARP_SCALE so attention is
peaked (a random model attends almost uniformly, and near-ties make the kept sets arbitrary), saved with
save_pretrained to a temporary folder and loaded from there by both sides, in fp64. `mha` has as many kv heads
as query heads (a GQA group of one); `gqa` groups two query heads per kv head, where skipkv's documented
reductions over a group differ from kvpress's (docs/kvpress_overlap.md). Inputs: random byte ids (seeded). The
whole sequence is compressed (both sides: no question held out), and each side's parameters are set to the same
conventions (`aligned_knobs`): kvpress keeps n_kept = int(n * (1 - ratio)) per head (at least 1), and skipkv
gets budget = n_kept; the rest is in docs/kvpress_overlap.md. kvpress_run.py is kvpress's side, run in its
venv as a subprocess; this script is skipkv's side (its engine's prefill, ModelRunner) and the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from skipkv import SamplingParams, make_policy
from skipkv.bench.kept_overlap import overlap_row
from skipkv.engine.engine import new_request
from skipkv.engine.runner import ModelRunner
from skipkv.errors import SkipKVError
from skipkv.hardware import environment
from skipkv.models import load_model
from skipkv.models.patches import routed
from skipkv.scoring import GROUP_REDUCES

HERE = Path(__file__).resolve().parent
METHODS = ("snapkv", "criticalkv_ada", "expected_attention", "kvzip")
HEADWISE = ("criticalkv_ada", "kvzip")  # kvpress masks keys per head instead of removing them


def default_venv() -> Path:
    return Path(os.environ.get("SKIPKV_HOME", Path.home() / ".cache" / "skipkv")) / "kvpress-venv"


def build_model(folder: Path, kv_heads: int, layers: int, seed: int) -> None:
    """A sharp-attention tiny Qwen2 (skipkv.models.random's recipe, `kv_heads` kv heads) saved to `folder`, with
    the byte tokenizer, its chat template removed (kvpress's KVzip then adds "\\n" after its instruction, as skipkv's
    kvzip does with template plain)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from skipkv.models.random import byte_tokenizer, sharpen

    tok = byte_tokenizer()
    # head_dim written out: kvpress reads config.head_dim
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=kv_heads, head_dim=16, vocab_size=512, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    sharpen(model)
    model.save_pretrained(folder)
    tok.chat_template = None
    tok.save_pretrained(folder)


def n_kept(n: int, ratio: float) -> int:
    """kvpress's kept count per head for a compression ratio (its utils.compute_n_kept, float rounding included)."""
    return max(1, int(n * (1 - ratio)))


def aligned_knobs(method: str, n: int, ratio: float, args: argparse.Namespace, layers: int, heads: int
                  ) -> tuple[dict, dict]:
    """(kvpress press knobs, skipkv policy knobs) with the same conventions, for a sequence of n tokens."""
    keep = n_kept(n, ratio)
    if method == "snapkv":
        return ({"window_size": args.window, "kernel_size": args.kernel},
                dict(budget=keep, prefill_window=args.window, kernel=args.kernel, variant="paper", pooling="avg",
                     group_reduce=args.group_reduce, sink=0, phase="prefill"))
    if method == "criticalkv_ada":
        # kvpress's safeguard: every head keeps its int(n_kept * alpha) best, the window first (it scores the
        # maximum), so max(window, int(n_kept * alpha)) in all; skipkv's floor is window + int(floor_ratio *
        # (budget - window)): the floor_ratio that gives the same count.
        extra = max(0, int(keep * args.alpha) - args.window)
        floor_ratio = min(1.0, (extra + 0.5) / (keep - args.window))
        return ({"window_size": args.window, "kernel_size": args.kernel, "alpha_safeguard": args.alpha,
                 "first_stage_ratio": 0.5, "epsilon": 1e-4},
                dict(budget=keep, prefill_window=args.window, kernel=args.kernel, variant="paper", pooling="avg",
                     group_reduce=args.group_reduce, sink=0, floor_ratio=floor_ratio, first_stage_ratio=0.5,
                     epsilon=1e-4))
    if method == "expected_attention":
        # kvpress's query statistics: every prompt token after the sink; the future starts after the prompt.
        return ({"n_future_positions": 512, "n_sink": 4},
                dict(budget=keep, sink=4, window=1, stats_window=n - 4, future_positions=512, phase="prefill"))
    if method == "kvzip":
        # kvpress (layerwise=False) prunes int(L * H * n * ratio) entries model-wide; skipkv's budget is per kv
        # head (budget * L * H model-wide): the nearest whole budget.
        units = layers * heads
        total = units * n - int(units * n * ratio)
        return ({"layerwise": False, "n_sink": 4},
                dict(budget=total // units, sink=4, window=1, allocation="model", template="plain"))
    raise ValueError(method)


def skipkv_kept(bundle, policy, ids: list[int]) -> list[list[list[int]]]:
    """Prefill `ids` through skipkv's engine runner under `policy`; the sorted positions each (layer, kv head)
    holds after the prefill's compression, [L][H]."""
    r = new_request(bundle, ids, SamplingParams(max_new_tokens=1, ignore_eos=True), policy, 0, frozenset(),
                    "overlap sequence")
    runner = ModelRunner(bundle, policy, num_slots=1)
    with routed(bundle.model), torch.inference_mode():
        runner.prefill([r])
    store = runner.store
    out = []
    for layer in range(store.model_layers):
        row = []
        for h in range(store.model_kv_heads):
            u, hh = (layer * store.split + h, 0) if store.head_split else (layer, h)
            row.append(sorted(store.pos[u][0, hh, : int(store.lengths[u, 0])].tolist()))
        out.append(row)
    return out


def run_model(name: str, kv_heads: int, args: argparse.Namespace, folder: Path) -> dict:
    build_model(folder, kv_heads, args.layers, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in args.lengths]
    runs, knobs, pending = [], {}, {}
    for method in args.methods:
        for ratio in args.ratios:
            for i, ids in enumerate(seqs):
                press_knobs, policy_knobs = aligned_knobs(method, len(ids), ratio, args, args.layers, kv_heads)
                try:
                    make_policy(method, **policy_knobs)
                except SkipKVError as exc:
                    pending[method] = str(exc)
                    break
                runs.append({"method": method, "ratio": ratio, "seq": i, "params": press_knobs})
                knobs[(method, ratio, i)] = policy_knobs
    plan = folder / "plan.json"
    plan.write_text(json.dumps({"model_dir": str(folder), "dtype": "float64", "sequences": seqs, "runs": runs}))
    theirs = folder / "kvpress_out.json"
    subprocess.run([str(args.venv / "bin" / "python"), str(HERE / "kvpress_run.py"), str(plan), str(theirs)],
                   check=True)
    kv = json.loads(theirs.read_text())
    bundle = load_model(str(folder), dtype="fp64")
    table: dict = {}
    for run in kv["runs"]:
        key = (run["method"], run["ratio"], run["seq"])
        ours = skipkv_kept(bundle, make_policy(run["method"], **knobs[key]), seqs[run["seq"]])
        table.setdefault((run["method"], run["ratio"]), ([], []))
        table[(run["method"], run["ratio"])][0].append(run["kept"])
        table[(run["method"], run["ratio"])][1].append(ours)
    if args.dump:  # every kept set, both sides, for looking into a difference
        Path(f"{args.dump}.{name}.json").write_text(json.dumps({f"{m}/{r}": v for (m, r), v in table.items()}))
    rows = []
    for (method, ratio), (theirs_kept, ours_kept) in table.items():
        row = overlap_row(theirs_kept, ours_kept)
        # skipkv-only positions other than each sequence's newest (which skipkv's window keeps and kvpress may not)
        row["skipkv_only_not_newest"] = sum(len(set(hb) - set(ha) - {len(seqs[s]) - 1})
                                            for s, (A, B) in enumerate(zip(theirs_kept, ours_kept))
                                            for la, lb in zip(A, B) for ha, hb in zip(la, lb))
        rows.append({"model": name, "method": method, "ratio": ratio, **row})
        print(f"{name:4s} {method:20s} ratio {ratio:.2f}: mean {row['mean']:.3f} min {row['min']:.3f} "
              f"identical {row['identical']}/{row['units']} kept kvpress {row['kept_a']} skipkv {row['kept_b']}",
              flush=True)
    sample = next((k for k in knobs if k[2] == 0), None)
    return {"rows": rows, "pending": pending, "versions": {k: kv[k] for k in ("kvpress", "transformers", "torch")},
            "skipkv_knobs_seq0": {f"{m}@{r}": knobs[(m, r, 0)] for (m, r, s) in knobs if s == 0} if sample else {}}


def markdown(rows: list[dict], pending: dict) -> str:
    lines = ["| model | method | kept | mean Jaccard | min | identical layer-heads | kept entries kvpress / skipkv "
             "| skipkv-only, not the newest |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['method']} | {1 - r['ratio']:.0%} | {r['mean']:.3f} | {r['min']:.3f} | "
                     f"{r['identical']}/{r['units']} | {r['kept_a']} / {r['kept_b']} | {r['skipkv_only_not_newest']} |")
    for method, why in pending.items():
        lines.append(f"| all | {method} | - | pending | - | - | - | skipkv refuses it: {why} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=default_venv())
    ap.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    ap.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")], default=[0.9, 0.75],
                    help="kvpress compression ratios (share evicted); skipkv's budget follows")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[240, 360, 480])
    ap.add_argument("--models", type=lambda s: s.split(","), default=["mha", "gqa"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=16, help="SnapKV's observation window, both sides")
    ap.add_argument("--kernel", type=int, default=5, help="SnapKV's pooling kernel, both sides")
    ap.add_argument("--alpha", type=float, default=0.2, help="AdaKV's safeguard (kvpress alpha_safeguard)")
    ap.add_argument("--group-reduce", default="probs", choices=GROUP_REDUCES,
                    help="skipkv's GQA reduction for snapkv and criticalkv_ada (probs: kvpress's; mean: their default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dump", help="also write both sides' kept positions to DUMP.MODEL.json (per method/ratio)")
    args = ap.parse_args()
    if bad := set(args.methods) - set(METHODS):
        sys.exit(f"overlap.py: error: unknown methods {sorted(bad)}; choose from {', '.join(METHODS)}")
    if not (args.venv / "bin" / "python").exists():
        sys.exit(f"overlap.py: error: no kvpress venv at {args.venv}; run benchmarks/kvpress_overlap/setup_venv.sh")
    results = {}
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix="kvpress_overlap_") as tmp:
            results[name] = run_model(name, {"mha": 4, "gqa": 2}[name], args, Path(tmp))
    rows = [r for res in results.values() for r in res["rows"]]
    pending = {m: why for res in results.values() for m, why in res["pending"].items()}
    report = {"command": " ".join(["python", "benchmarks/kvpress_overlap/overlap.py", *sys.argv[1:]]),
              "lengths": args.lengths, "ratios": args.ratios, "layers": args.layers, "window": args.window,
              "kernel": args.kernel, "alpha": args.alpha, "group_reduce": args.group_reduce, "seed": args.seed,
              "rows": rows, "pending": pending,
              "kvpress_side": next(iter(results.values()))["versions"],
              "skipkv_knobs_seq0": {n: res["skipkv_knobs_seq0"] for n, res in results.items()},
              "environment": environment()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(markdown(rows, pending))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
