"""`skipkv generate` and `skipkv policies`.

    skipkv generate --model random:qwen2 --policy rkv --budget 64 --interval 16 --max-tokens 300 \
        --ignore-eos --json "first prompt" "second, longer prompt"
    skipkv generate --model qwen2.5-coder-0.5b-instruct --policy rkv --budget 128 "What is 17 * 23?"
    skipkv policies

On a terminal, one prompt's text is printed as its tokens come (the summary line then goes to stderr);
`--no-stream`, `--json`, several prompts or output to a pipe or file print each answer when it finishes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from skipkv.config import EngineConfig, SamplingParams, parse_bytes
from skipkv.errors import SkipKVError
from skipkv.hardware import DTYPE_HELP, set_threads

_SAMPLING_DEFAULTS = SamplingParams()
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"  # the offline real model (`skipkv models pull`)
_ENGINE_DEFAULTS = EngineConfig()


def _bool(text: str) -> bool:
    # argparse's type=bool would read "false" as True.
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_policy_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """--policy plus one flag per knob of any registered policy (defaults come from the policy dataclass);
    knobs in `skip` are left to the caller (e.g. `eval` turns --budget-ratio into a per-example budget)."""
    from skipkv.policies import POLICIES

    p.add_argument("--policy", default="full", help=f"one of: {', '.join(POLICIES.names())}")
    seen: dict[str, type] = {}
    for name in POLICIES.names():
        for knob, typ, _default, _help in POLICIES.get(name).knobs():
            seen.setdefault(knob, typ)
    for knob, typ in seen.items():
        if knob in skip:
            continue
        p.add_argument(f"--{knob.replace('_', '-')}", dest=f"knob_{knob}", type=_bool if typ is bool else typ,
                       default=None,
                       help=f"policy knob ({typ.__name__}); default: the policy's own")


def policy_from_args(args: argparse.Namespace):
    from skipkv.policies import make_policy

    knobs = {k[len("knob_"):]: v for k, v in vars(args).items() if k.startswith("knob_")}
    return make_policy(args.policy, **knobs)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = _SAMPLING_DEFAULTS
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int, default=d.max_new_tokens,
                   help=f"tokens to generate at most (default {d.max_new_tokens})")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   help="divide the logits of tokens already in the prompt or output (1 = off)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (benchmarks)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos, stop=tuple(args.stop),
                          repetition_penalty=args.repetition_penalty)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"hub id, local folder, .gguf file, pulled name, or random:<family>[:size] "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's, one per core)")
    p.add_argument("--batch-size", type=int, default=_ENGINE_DEFAULTS.batch_size)
    p.add_argument("--prefill-chunk", type=int, default=_ENGINE_DEFAULTS.prefill_chunk,
                   help="prefill long prompts this many tokens at a time (0 = whole)")
    p.add_argument("--share-prefix", type=int, default=_ENGINE_DEFAULTS.share_prefix, metavar="N",
                   help="prefill a prompt prefix that requests admitted together share once, when it is at least N "
                        "tokens (a system prompt, few-shot exemplars; 0 = off; "
                        f"default {_ENGINE_DEFAULTS.share_prefix})")
    p.add_argument("--no-unpad-prefill", action="store_true",
                   help="run the MLPs of a padded prefill on every position, pads included (default: real tokens "
                        "only, EngineConfig.unpad_prefill)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never compile the decode step (compiled where measured faster: fp32 on packed linears; "
                        "compiling takes ~20 s per process)")
    add_memory_args(p)


def kv_memory_arg(text: str) -> int:
    """argparse type for --kv-memory: a size (2GiB, 512MiB, plain bytes); a bad one is a one-line usage error."""
    try:
        return parse_bytes(text)
    except SkipKVError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_memory_args(p: argparse.ArgumentParser, prefill_budget: bool = True) -> None:
    p.add_argument("--kv-memory", type=kv_memory_arg, default=_ENGINE_DEFAULTS.kv_memory,
                   help="KV cache memory cap, e.g. 2GiB (admission by reservation; 0 = no cap)")
    if prefill_budget:
        p.add_argument("--prefill-budget", type=int, default=_ENGINE_DEFAULTS.prefill_budget,
                       help="prompt tokens prefilled per engine step at most (0 = no limit)")


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of `generate`: arguments, then --prompts lines (skipkv.files: bounded, schema-checked), each
    checked to be encodable text and not empty."""
    from skipkv.files import check_text, read_jsonl

    prompts = [check_text(p, f"prompt {i}") for i, p in enumerate(args.prompt)]
    if args.prompts:
        for _num, row in read_jsonl(Path(args.prompts), "prompts"):
            prompts.append(row if isinstance(row, str) else (row.get("prompt") or row.get("text")))
    if not prompts:
        raise SkipKVError("no prompt given (pass PROMPT... or --prompts FILE.jsonl)")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise SkipKVError(f"prompt {i} is empty")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from skipkv.engine import generate
    from skipkv.models import load_model

    # Validate everything cheap before loading a model.
    policy = policy_from_args(args)
    sampling = sampling_from_args(args)
    engine = EngineConfig(batch_size=args.batch_size, prefill_chunk=args.prefill_chunk, kv_memory=args.kv_memory,
                          prefill_budget=args.prefill_budget, share_prefix=args.share_prefix,
                          unpad_prefill=not args.no_unpad_prefill, enforce_eager=args.enforce_eager)
    prompts = read_prompts(args)
    threads = set_threads(args.threads)
    bundle = load_model(args.model, dtype=args.dtype, device=args.device)
    # What ran, once per request row: the dtype (and, for auto, why this machine got it) and the threads.
    ran = {"dtype": str(bundle.dtype).removeprefix("torch."), "torch_threads": threads,
           "dtype_reason": bundle.dtype_choice.reason if bundle.dtype_choice else "requested"}
    if not args.raw and getattr(bundle.tokenizer, "chat_template", None):
        prompts = [bundle.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in prompts]

    def emit(r) -> None:
        if args.json:
            row = dataclasses.asdict(r)
            row.pop("token_ids")
            row.pop("trace")  # only `generate(..., trace=True)` fills it; the JSON lines stay as they were
            row.update(row.pop("extra"))  # the policy's own figures, flat (e.g. flagged_sentences)
            row.update(ran)
            print(json.dumps(row, ensure_ascii=False), flush=True)

    if not args.json and not args.no_stream and len(prompts) == 1 and sys.stdout.isatty():
        r = _stream_one(bundle, prompts[0], sampling, policy, engine)
        print(_summary(r), file=sys.stderr)
        return 0
    # Several prompts: a bar of finished requests on stderr (stdout keeps only the answers).
    results = generate(bundle, prompts, sampling, policy, engine, on_result=emit,
                       progress=len(prompts) > 1 and not args.no_progress)
    if not args.json:
        for r in results:
            print(_summary(r))
            print(r.text)
    return 0


def _summary(r) -> str:
    return (f"--- [{r.index}] {r.generated_tokens} tokens, peak KV {r.peak_kv_tokens} tokens "
            f"({r.peak_kv_bytes / 2**20:.2f} MiB), {r.compressions} compressions, {r.finish_reason}")


def _stream_one(bundle, prompt: str, sampling: SamplingParams, policy, config: EngineConfig):
    """Generate one completion on the step-driven Engine, writing its text to stdout as tokens come; returns
    its RequestResult. What is written is `r.text` and a newline, exactly what the non-streamed path prints."""
    from skipkv.engine import Engine
    from skipkv.engine.detokenize import TextStream

    out = sys.stdout
    text = TextStream(bundle.tokenizer, sampling.stop)
    at_line_start = True
    try:
        with Engine(bundle, policy, config) as eng:
            rid = eng.add_request(prompt, sampling)
            res = None
            while res is None:
                step = eng.step()
                toks = [t for r, t in step.new_tokens if r == rid]
                res = next((f for f in step.finished if f.request_id == rid), None)
                if res is not None and res.finish_reason == "eos":
                    toks = toks[:-1]  # the result's text leaves out the end-of-sequence token; so does the stream
                delta = text.add(toks) if toks else ""
                if res is not None:
                    delta += text.finish(res.text) + "\n"
                if delta:
                    out.write(delta)
                    out.flush()  # a terminal's stdout is line-buffered: a token without a newline would wait
                    at_line_start = delta.endswith("\n")
    finally:
        if not at_line_start:  # interrupted mid-line: the error message starts on a line of its own
            out.write("\n")
            out.flush()
    return res


def cmd_policies(args: argparse.Namespace) -> int:
    from skipkv.policies import POLICIES, Policy, markdown_table

    if args.markdown:
        print(markdown_table(), end="")
        return 0
    for name in POLICIES.names():
        cls = POLICIES.get(name)
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        # A policy that keeps everything ignores the budget knobs; list only its own (e.g. seal's steering).
        base = set() if cls.compresses else {k for k, *_ in Policy.knobs()}
        knobs = ", ".join(f"{k}={d!r}" for k, _t, d, _h in cls.knobs() if k not in base) or "(no knobs)"
        print(f"{name:14s} {doc}\n{'':14s} {knobs}")
    return 0


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate completions with a compressed KV cache")
    add_model_args(g)
    add_policy_args(g)
    add_sampling_args(g)
    g.add_argument("--json", action="store_true", help="one JSON object per request (as each finishes)")
    g.add_argument("--no-stream", action="store_true",
                   help="on a terminal, print the answer when it finishes instead of as tokens come")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr for several prompts")
    g.add_argument("--prompts", help="JSONL file: one string or {\"prompt\": ...} per line")
    g.add_argument("prompt", nargs="*")
    g.set_defaults(func=cmd_generate)
    p = sub.add_parser("policies", help="list KV-cache policies and their knobs")
    p.add_argument("--markdown", action="store_true", help="print the README's policy table")
    p.set_defaults(func=cmd_policies)
