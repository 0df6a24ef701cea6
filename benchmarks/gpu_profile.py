"""Where a decode step's time goes on a GPU: host-bound or device-bound (benchmarks/gpu.sh's follow-up).

    python benchmarks/gpu_profile.py --out $OUT                                  # on a lent H200
    python benchmarks/gpu_profile.py --size tiny --device cpu --out /tmp/gp      # the CPU-sized variant

gpu.sh found the engine and transformers' generate equally slow on random:qwen2:7b at batch 1 (12.7 vs 12.3
tokens/s, ~79 ms a step, where reading 15 GB of bf16 weights at the H200's bandwidth takes ~3 ms). This
measures, in one process:
1. the machine's launch cost: wall time per tiny kernel (1000 in-place adds of a 1-element tensor, one sync),
   and the same through a captured CUDA graph (one replay of 1000 adds);
2. per decode step of the engine at the full cache, batch 1 and 32 (equal-length rows, after warm-up steps):
   wall time, the GPU's busy time (the sum of the profiler's device kernel times), and the number of kernels
   launched, for `full` and `rkv` (budget 512, compressing from step one: its prompt is over the budget), for
   each step kind: the HF modules (`hf`), the fixed-shape step (`eager`) and the same replayed as CUDA graphs
   (`graph`, engine/graphs.py), with the first decode step's time and memory (the capture) and whether the
   replayed step's greedy tokens equal the eager one's;
3. the same for transformers' own forward at batch 1 with its DynamicCache (the reference path), with torch's
   own SDPA choice and with the engine's (kernels.cuda_sdpa_backends: cuDNN excluded).
Wall time far above device busy time, with (kernels x launch cost) close to the wall time, means the step is
bound by the host's launches, not by the GPU. Writes profile.json (and the profiler's top-op tables) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from skipkv import SamplingParams, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import Engine
from skipkv.kernels import cuda_sdpa_backends
from skipkv.models import load_model

MODELS = {"7b": "random:qwen2:7b", "tiny": "random:qwen2"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def launch_cost(device: torch.device, n: int = 1000) -> dict:
    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1)
    sync(device)
    t = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    sync(device)
    eager = (time.perf_counter() - t) / n
    out = {"eager_us_per_kernel": eager * 1e6}
    if device.type == "cuda":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g):
                for _ in range(n):
                    x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        sync(device)
        t = time.perf_counter()
        g.replay()
        sync(device)
        out["graph_us_per_kernel"] = (time.perf_counter() - t) / n * 1e6
    return out


def device_time_us(prof) -> tuple[float, int]:
    """Sum of device-side kernel self times (us) and the number of device kernels, over the profile."""
    total, count = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.device_time
            count += 1
    return total, count


def profile_steps(fn, steps: int, device: torch.device, out: Path, name: str) -> dict:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    wall = (time.perf_counter() - t) / steps
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    busy, kernels = device_time_us(prof)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    (out / f"ops_{name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=25))
    row = {"wall_ms_per_step": wall * 1e3, "device_busy_ms_per_step": busy / steps / 1e3,
           "kernels_per_step": kernels / steps}
    print(name, json.dumps(row), flush=True)
    return row


def prompt_ids(bundle, n: int = 600) -> list[int]:
    vocab = bundle.model.config.vocab_size
    return [3 + (17 * i) % (vocab - 3) for i in range(n)]


def engine_case(bundle, policy: str, batch: int, steps: int, out: Path, kind: str = "hf") -> dict:
    """The engine's decode step of kind `kind` (plan.with_step: hf, eager, graph). Also records the greedy
    tokens of the timed steps' first row and the first decode step's time and memory (where a graph step captures
    its first graph: engine/graphs.py)."""
    kw = {"budget": 512, "window": 8, "interval": 128} if policy != "full" else {}
    loaded = bundle.plan
    bundle.plan = loaded.with_step(kind)
    try:
        eng = Engine(bundle, make_policy(policy, **kw), EngineConfig(batch_size=batch))
    finally:
        bundle.plan = loaded
    dev = bundle.device
    try:
        prompt = prompt_ids(bundle)  # 600 tokens: over rkv's budget, so it compresses at prefill
        for _ in range(batch):
            eng.add_request(prompt, SamplingParams(max_new_tokens=4 * steps + 16, ignore_eos=True))
        eng.step()  # the prefill
        sync(dev)
        mem0 = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        t = time.perf_counter()
        eng.step()  # the first decode step (a graph step captures here)
        sync(dev)
        first = {"first_decode_ms": (time.perf_counter() - t) * 1e3,
                 "first_decode_mib": ((torch.cuda.memory_allocated() - mem0) / 2**20) if dev.type == "cuda" else 0}
        for _ in range(2):  # decode warm-up
            eng.step()
        tokens: list[int] = []

        def step() -> None:
            tokens.extend(eng.step().new_tokens[:1])

        row = profile_steps(step, steps, dev, out, f"engine_{policy}_b{batch}_{kind}")
        return {**row, **first, "tokens": tokens}
    finally:
        eng.close()


def hf_case(bundle, steps: int, out: Path, name: str = "transformers_b1") -> dict:
    from transformers import DynamicCache

    model = bundle.model
    ids = torch.tensor([prompt_ids(bundle)], device=bundle.device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
    tok = [logits[:, -1:].argmax(-1)]

    def step() -> None:
        with torch.no_grad():
            lg = model(tok[0], past_key_values=cache, use_cache=True).logits
        tok[0] = lg[:, -1:].argmax(-1)

    for _ in range(4):
        step()
    return profile_steps(step, steps, bundle.device, out, name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(MODELS), default="7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--checks", action="store_true", help="also run gpu_run.py's exact and speed parts")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"model": MODELS[args.size], "device": args.device}

    def save() -> None:
        (out / "profile.json").write_text(json.dumps(report, indent=2))

    dev = torch.device(args.device)
    report["launch"] = launch_cost(dev)
    print("launch", json.dumps(report["launch"]), flush=True)
    save()
    bundle = load_model(MODELS[args.size], dtype="bf16", device=args.device)
    report["transformers_b1"] = hf_case(bundle, args.steps, out)
    save()
    backends, why = cuda_sdpa_backends()
    report["engine_sdpa_backends"] = {"backends": [b.name for b in backends], "reason": why}
    if dev.type == "cuda" and backends:  # transformers under the engine's SDPA backends: the like-for-like reference
        with bundle.plan.sdpa_context():
            name = "transformers_b1_engine_backends"
            report[name] = hf_case(bundle, args.steps, out, name)
        save()
    if args.checks:  # gpu_run.py's exactness and engine-vs-transformers speed parts, on this load
        from gpu_run import check_exact, speed

        report["exact"] = check_exact(args.device, bundle)
        print("exact", json.dumps(report["exact"]), flush=True)
        report["speed"] = speed(bundle, args.size)
        save()
    for policy in ("full", "rkv"):
        for batch in (1, 32):
            rows = {}
            for kind in ("hf", "eager", "graph"):  # graph: the fixed step replayed as CUDA graphs (engine/graphs.py)
                rows[kind] = report[f"engine_{policy}_b{batch}_{kind}"] = engine_case(bundle, policy, batch,
                                                                                      args.steps, out, kind)
                save()
            report[f"graph_tokens_equal_eager_{policy}_b{batch}"] = rows["graph"]["tokens"] == rows["eager"]["tokens"]
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
