"""Where each engine's time goes, op by op: vLLM's CPU engine in-process and skipkv, under torch's profiler.

    python benchmarks/vllm_anchor/workload.py --workload gsm8k --requests 16 --max-tokens 128 --out /tmp/w16.json
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 ~/.cache/skipkv/vllm-venv/bin/python benchmarks/vllm_anchor/profile_ops.py \\
        vllm /tmp/w16.json --out docs/results/vllm_anchor/ops_vllm_16x128.json
    python benchmarks/vllm_anchor/profile_ops.py skipkv /tmp/w16.json \\
        --out docs/results/vllm_anchor/ops_skipkv_16x128.json
    python benchmarks/vllm_anchor/profile_ops.py table ops_vllm.json ops_skipkv.json     # the side-by-side table

Runs the same workload file as compare.py (same token ids, greedy, `ignore_eos`), after the same untimed
warm-up, stepping the engine by hand: the steps until every request has its first token are "prefill", the rest
"decode". Each phase is timed without the profiler first (`--rounds` times, ms per step), then profiled once in
its own torch.profiler session, so the two phases' ops are never mixed. vLLM runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0` is set here), so its model's ops are seen; it imports nothing of skipkv and
skipkv nothing of vLLM, so each engine runs in its own venv. Op classes (`CLASSES`) sum self CPU time by name;
"python and other" is the phase's profiled wall time minus every op's self time. The thread placement each
engine ran with (torch threads, the CPU affinity of every thread of the process) is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

# Op classes, first match wins: (class, regex on the profiler's op name).
CLASSES = [
    ("linears", r"linear|onednn_mm|mkldnn|aten::addmm$|aten::mm$|gemm"),
    ("attention", r"attention|attn|aten::bmm|softmax|paged|kv_cache|reshape_and_cache|aten::baddbmm"),
    ("norms, rotary, activation (fused or not)", r"rms|norm|rotary|silu|act_and_mul|rsqrt|aten::pow|aten::mean"
                                                 r"|aten::cos|aten::sin|cpp_fused|Torch-Compiled|inductor"),
    ("sampling", r"argmax|sample|topk|aten::max$|multinomial|sort"),
    ("copies, indexing, elementwise", r"aten::"),
]


def classify(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other ops"


def thread_placement() -> dict:
    """torch's threads and the affinity of every thread of this process (OpenMP binding shows here)."""
    import torch

    tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
    affinity = {}
    for tid in tids:
        try:
            affinity[str(tid)] = sorted(os.sched_getaffinity(tid))
        except OSError:
            continue
    return {"torch_threads": torch.get_num_threads(), "thread_affinity": affinity,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "VLLM_CPU", "GOMP"))}}


def profile_phase(step, n_steps: int) -> dict:
    """Run `step` n_steps times under the profiler; per-class self time in ms per step."""
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n_steps):
            step()
    wall_ms = (time.perf_counter() - t) * 1e3
    classes: dict[str, float] = {}
    ops = []
    for ev in prof.key_averages():
        self_ms = ev.self_cpu_time_total / 1e3
        if self_ms <= 0:
            continue
        classes[classify(ev.key)] = classes.get(classify(ev.key), 0.0) + self_ms / n_steps
        ops.append({"op": ev.key, "calls_per_step": ev.count / n_steps, "self_ms_per_step": self_ms / n_steps})
    ops.sort(key=lambda o: -o["self_ms_per_step"])
    classes["python and other"] = wall_ms / n_steps - sum(classes.values())
    return {"profiled_ms_per_step": wall_ms / n_steps, "classes_ms_per_step": classes, "top_ops": ops[:30]}


def run_vllm(spec: dict, args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model_dir"], dtype=args.dtype, seed=0, gpu_memory_utilization=0.3)
    engine = llm.llm_engine
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:16]} for p in spec["prompt_ids"][:2]], warm, use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    counter = iter(range(10**9))

    def add_all():
        for ids in spec["prompt_ids"]:
            engine.add_request(str(next(counter)), {"prompt_token_ids": ids}, greedy)

    def step() -> int:  # requests that have a token after this step
        return sum(1 for o in engine.step() if o.outputs and o.outputs[0].token_ids)

    def drain():
        while engine.has_unfinished_requests():
            engine.step()

    out = measure(add_all, step, drain, len(spec["prompt_ids"]), args)
    return out | {"engine": "vllm", "version": vllm.__version__}


def run_skipkv(spec: dict, args) -> dict:
    from skipkv.config import EngineConfig, SamplingParams
    from skipkv.engine import Engine
    from skipkv.models import load_model
    from skipkv.policies import make_policy
    from skipkv.version import __version__

    bundle = load_model(spec["model"], dtype=args.dtype if args.dtype != "bfloat16" else "auto")
    engine = Engine(bundle, make_policy("full"), EngineConfig(batch_size=len(spec["prompt_ids"])))
    for p in spec["prompt_ids"][:2]:  # warm-up, as vLLM's
        engine.add_request(p[:16], SamplingParams(max_new_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sp = SamplingParams(max_new_tokens=spec["max_tokens"], ignore_eos=True)
    got: set[int] = set()

    def add_all():
        got.clear()
        for ids in spec["prompt_ids"]:
            engine.add_request(ids, sp)

    def step() -> int:
        out = engine.step()
        got.update(rid for rid, _ in out.new_tokens)
        return len(got)

    def drain():
        while engine.has_unfinished():
            engine.step()

    out = measure(add_all, step, drain, len(spec["prompt_ids"]), args)
    engine.close()
    return out | {"engine": "skipkv", "version": __version__, "dtype": str(bundle.dtype).removeprefix("torch.")}


def measure(add_all, step, drain, n: int, args) -> dict:
    """Time the prefill steps and `args.decode_steps` decode steps `args.rounds` times unprofiled, then profile
    each phase once."""
    rounds = []
    for _ in range(args.rounds):
        add_all()
        t, prefill_steps = time.perf_counter(), 0
        while step() < n:
            prefill_steps += 1
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.decode_steps):
            step()
        rounds.append({"prefill_s": prefill_s, "prefill_steps": prefill_steps + 1,
                       "decode_ms_per_step": (time.perf_counter() - t) * 1e3 / args.decode_steps})
        drain()
    add_all()

    def prefill_phase():
        while step() < n:
            pass

    prefill = profile_phase(prefill_phase, 1)
    decode = profile_phase(step, args.decode_steps)
    drain()
    return {"rounds": rounds, "prefill": prefill, "decode": decode, "threads": thread_placement()}


def table(paths: list[str]) -> None:
    """The side-by-side table (markdown) of profile JSONs."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    labels = [c for c, _ in CLASSES] + ["other ops", "python and other"]
    for phase in ("prefill", "decode"):
        unit = "ms (the whole prefill)" if phase == "prefill" else "ms per step"
        print(f"\n{phase}, {unit} | " + " | ".join(r["engine"] for r in runs))
        print("|---|" + "---:|" * len(runs))
        for label in labels:
            print(f"| {label} | " + " | ".join(f"{r[phase]['classes_ms_per_step'].get(label, 0):.1f}" for r in runs)
                  + " |")
        print("| **profiled total** | " + " | ".join(f"{r[phase]['profiled_ms_per_step']:.1f}" for r in runs) + " |")
        key = "prefill_s" if phase == "prefill" else "decode_ms_per_step"
        scale = 1e3 if phase == "prefill" else 1
        print("| unprofiled (each round) | " + " | ".join(
            ", ".join(f"{x[key] * scale:.1f}" for x in r["rounds"]) for r in runs) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["vllm", "skipkv", "table"])
    ap.add_argument("inputs", nargs="+", help="the workload file (vllm, skipkv) or profile JSONs (table)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.engine == "table":
        return table(args.inputs)
    spec = json.loads(Path(args.inputs[0]).read_text())
    result = (run_vllm if args.engine == "vllm" else run_skipkv)(spec, args)
    result |= {"workload": spec["workload"], "requests": len(spec["prompt_ids"]), "cpu": _cpu()}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("engine", "rounds")}))
    if args.engine == "vllm":
        os._exit(0)  # vLLM's threads can keep a clean exit waiting


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
