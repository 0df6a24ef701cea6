"""`skipkv eval`: run a policy on a benchmark, append graded records, write a summary; re-running resumes.

    skipkv eval --model random:qwen2 --dataset gsm8k --limit 6 --policy rkv --budget 32 --interval 8 \\
        --max-tokens 40 --out runs/smoke --quiet
    skipkv eval --model qwen2.5-coder-0.5b-instruct --dataset math500 --policy full --out runs/m-full
    skipkv eval --model qwen2.5-coder-0.5b-instruct --dataset math500 --policy rkv --reference-share 0.2 \\
        --reference runs/m-full --out runs/m-rkv-0.2
    skipkv eval --model qwen2.5-coder-0.5b-instruct --dataset niah --lengths 2048,4096 --depths 0,0.5,1 \\
        --policy snapkv --budget-ratio 0.25 --out runs/niah-snapkv

Flags without a value given fall back to EvalConfig's defaults (skipkv/eval/plan.py), which in turn come
from SamplingParams, EngineConfig, load_model and the dataset class. Policy knobs are built from the policy
dataclasses (shared with `skipkv generate`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _list_of(kind: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None

    return parse


def _defaults() -> dict[str, Any]:
    from skipkv.eval.runner import EvalConfig

    out = {}
    for f in dataclasses.fields(EvalConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _budget_ratio(args: argparse.Namespace) -> float | None:
    """EvalConfig.budget_ratio: --reference-share (with --reference), or --budget-ratio (a share of the prompt;
    with --reference, the older spelling of --reference-share)."""
    from skipkv.errors import SkipKVError

    if args.reference_share is None:
        return args.budget_ratio
    if args.budget_ratio is not None:
        raise SkipKVError("give either --budget-ratio or --reference-share, not both")
    if args.reference is None:
        raise SkipKVError("--reference-share needs --reference DIR (a full-cache run of the same model and dataset)")
    return args.reference_share


def cmd_eval(args: argparse.Namespace) -> int:
    from skipkv.eval.runner import SUMMARY_FILE, EvalConfig, run_eval
    from skipkv.hardware import set_threads

    set_threads(args.threads)
    knobs = {k[len("knob_"):]: v for k, v in vars(args).items() if k.startswith("knob_") and v is not None}
    budget = knobs.pop("budget", None)
    data_options = {"source": args.source, "data": args.data, "lengths": args.lengths, "depths": args.depths,
                    "per_length": args.per_length, "seed": args.data_seed, "offset": args.offset}
    given = {
        "budget": budget, "budget_ratio": _budget_ratio(args), "reference": args.reference, "limit": args.limit,
        "samples": args.samples, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "seed": args.seed, "max_new_tokens": args.max_new_tokens, "force_wait": args.force_wait,
        "batch_size": args.batch_size,
        "prefill_chunk": args.prefill_chunk, "share_prefix": args.share_prefix, "kv_memory": args.kv_memory,
        "unpad_prefill": False if args.no_unpad_prefill else None,
        "prompt_style": args.prompt_style,
        "dtype": args.dtype,
        "device": args.device,
    }
    cfg = EvalConfig(
        model=args.model, dataset=args.dataset, policy=args.policy, out=args.out, policy_knobs=knobs,
        dataset_options={k: v for k, v in data_options.items() if v is not None},
        grader_options={k: v for k, v in (("timeout_s", args.code_timeout), ("isolation", args.sandbox))
                        if v is not None},
        quiet=args.quiet, blind=args.blind, trace=args.trace, **{k: v for k, v in given.items() if v is not None},
    )
    out = run_eval(cfg)
    from skipkv.files import read_json

    s = read_json(Path(out) / SUMMARY_FILE, "summary")
    if not args.quiet and not s["n"]:
        print(f"{cfg.dataset} / {cfg.policy}: no records -> {out}")
    elif not args.quiet:
        accuracy = "" if args.blind else f"accuracy {s['accuracy']:.3f} over "
        print(f"{cfg.dataset} / {cfg.policy}: {accuracy}{s['n_examples']} examples "
              f"({s['n']} records), {s['mean_generated_tokens']:.1f} generated tokens, "
              f"peak KV {s['peak_kv_tokens']} tokens / {s['peak_kv_bytes'] / 2**20:.2f} MiB -> {out}")
    return 0


def register(sub) -> None:
    from skipkv.engine.cli import add_policy_args, kv_memory_arg
    from skipkv.eval.datasets import dataset_names
    from skipkv.eval.prompts import STYLES
    from skipkv.eval.sandbox import ISOLATION_LEVELS

    d = _defaults()
    p = sub.add_parser("eval", help="evaluate a policy on a benchmark (resumable)",
                       description="Evaluate a KV-cache policy on a benchmark; re-running the command resumes.")
    p.add_argument("--model", required=True, help="hub id, local folder, .gguf, pulled name, or random:<family>[:size]")
    p.add_argument("--dataset", required=True, help=f"one of: {', '.join(dataset_names())}")
    p.add_argument("--out", required=True, help="run directory (config.json, records.jsonl, summary.json)")
    # --policy and one flag per policy knob (--budget, --window, --sink, --interval, ...); --budget-ratio is
    # eval's own: it becomes each example's token budget (for LaProx, the mean per-layer budget)
    add_policy_args(p, skip=("budget_ratio",))
    p.add_argument("--budget-ratio", type=float, help="budget as a fraction of each example's prompt length in "
                   "tokens (long-context sets), as LaProx's knob means everywhere else")
    p.add_argument("--reference-share", type=float, metavar="F",
                   help="budget = F x the mean generation length of --reference (a full-cache run); "
                        "`--budget-ratio F --reference DIR` is the older spelling")
    p.add_argument("--reference", help="run dir of a full-cache run of the same model and dataset")
    p.add_argument("--limit", type=int, help="only the first N examples (default: all)")
    p.add_argument("--offset", type=int, help="skip the first N examples (--limit counts from there)")
    p.add_argument("--samples", type=int, help=f"samples per example; pass@1 is averaged (default {d['samples']})")
    p.add_argument("--temperature", type=float, help=f"0 = greedy (default {d['temperature']})")
    p.add_argument("--top-p", type=float, help=f"default {d['top_p']}")
    p.add_argument("--top-k", type=int, help=f"0 = off (default {d['top_k']})")
    p.add_argument("--seed", type=int, help=f"sampling seed (default {d['seed']}); each (example, sample) "
                   "derives its own from it")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int,
                   help="generation cap (default: the dataset's)")
    p.add_argument("--force-wait", type=int, help="s1 budget forcing: replace an end of thinking (EOS or "
                   "</think>) by 'Wait' up to K times (default 0: off)")
    p.add_argument("--batch-size", type=int, help=f"default {d['batch_size']}")
    p.add_argument("--prefill-chunk", type=int,
                   help=f"prefill N tokens at a time, 0 = whole (default {d['prefill_chunk']})")
    p.add_argument("--share-prefix", type=int, metavar="N",
                   help="prefill a prompt prefix that a batch shares once, when it is at least N tokens (e.g. "
                        "r1think's exemplars; 0 = off; part of the run's identity when on; "
                        f"default {d['share_prefix']})")
    p.add_argument("--no-unpad-prefill", action="store_true",
                   help="run the MLPs of a padded prefill on every position, pads included, as before unpadding "
                        "existed (a 16-bit run dir written before then resumes only with this flag)")
    p.add_argument("--kv-memory", type=kv_memory_arg, help="KV cache memory cap, e.g. 2GiB (default: no cap)")
    p.add_argument("--prompt-style", "--prompt", choices=STYLES,
                   help=f"chat, raw, or r1think (math: thinking exemplars that re-check themselves); "
                        f"default {d['prompt_style']}")
    p.add_argument("--dtype", help=f"default {d['dtype']}: bf16 on CUDA and on CPUs with AVX512-BF16 or AMX, else fp32")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's, one per core)")
    p.add_argument("--device", help=f"default {d['device']}")
    p.add_argument("--source", choices=("local", "hub"), help="local (packaged or --data) or hub (needs `datasets`)")
    p.add_argument("--data", help="a JSONL in the packaged schema, or a haystack .txt for long-context sets")
    p.add_argument("--lengths", type=_list_of(int, "integers"),
                   help="long context: prompt lengths in tokens, e.g. 4096,8192")
    p.add_argument("--depths", type=_list_of(float, "fractions"), help="niah: needle depths in [0, 1], e.g. 0,0.5,1")
    p.add_argument("--per-length", type=int, help="long context: examples per length (niah: per length x depth)")
    p.add_argument("--data-seed", type=int, help="seed of the long-context generators (default 0)")
    p.add_argument("--code-timeout", type=float, help="seconds per generated program (humaneval)")
    p.add_argument("--sandbox", choices=ISOLATION_LEVELS,
                   help="isolation of generated code (humaneval): namespaces (default; the run stops if this "
                        "machine cannot provide it) or unsafe-basic (an audit hook only; not a security boundary)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary line")
    p.add_argument("--blind", action="store_true",
                   help="no running accuracy on the progress bar (sweeps always run blind)")
    p.add_argument("--trace", action="store_true", help="also record what each compression kept (traces.jsonl) "
                   "for `skipkv show`; results are unchanged")
    p.set_defaults(func=cmd_eval)
