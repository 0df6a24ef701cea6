"""Run a workload file (workload.py) through vLLM's CPU engine and print one JSON line of rates.

    ~/.cache/skipkv/vllm-venv/bin/python benchmarks/vllm_anchor/vllm_run.py /tmp/w.json [--window-s 300]
        [--dtype bfloat16] [--kv-space-gib 1]

Runs in vLLM's own venv (setup_venv.sh), never imports skipkv. vLLM keeps its defaults except what is given:
--kv-space-gib sets VLLM_CPU_KVCACHE_SPACE (1 is its smallest CPU KV space). All requests are added at once
and the engine is stepped until they finish or --window-s passes; the rates cover what was timed. Model loading
and a short warm-up are outside the timed part, as on the skipkv side. "max_batch" is the most requests that
received a token in one step; "timeline" notes [seconds, tokens so far, requests that got a token in that step]
every 30 s; "stalls" counts the times a request that got a token in one step got none in the next while
unfinished (a preemption: vLLM frees its KV blocks and recomputes it later).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--window-s", type=float)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-space-gib", type=float, help="VLLM_CPU_KVCACHE_SPACE (default: vLLM's)")
    ap.add_argument("--max-num-seqs", type=int, help="vLLM's max_num_seqs (default: vLLM's)")
    # On the CPU backend this is the share of the machine's memory vLLM checks is free at start (default 0.92):
    # on a machine where other jobs hold memory its default refuses to start, so it is lowered; the KV space
    # itself is VLLM_CPU_KVCACHE_SPACE.
    ap.add_argument("--memory-utilization", type=float, default=0.3)
    args = ap.parse_args()
    if args.kv_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_space_gib:g}"
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    spec = json.loads(open(args.workload).read())
    t0 = time.perf_counter()
    kwargs = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    kwargs["gpu_memory_utilization"] = args.memory_utilization
    llm = LLM(model=spec["model_dir"], dtype=args.dtype, seed=0, **kwargs)
    load_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:16]} for p in spec["prompt_ids"][:2]], warm, use_tqdm=False)

    engine = llm.llm_engine
    tokens: dict[str, int] = {}
    finished = max_batch = steps = stalls = 0
    timeline: list[list[float]] = []
    previous: set[str] = set()
    noted = float("-inf")  # when the last timeline row was taken (unrounded)
    t0 = time.perf_counter()
    for i, ids in enumerate(spec["prompt_ids"]):
        engine.add_request(str(i), {"prompt_token_ids": ids}, greedy)
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        moved: set[str] = set()
        done: set[str] = set()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > tokens.get(o.request_id, 0):
                moved.add(o.request_id)
            tokens[o.request_id] = n
            if o.finished:
                finished += 1
                done.add(o.request_id)
        if moved:  # a step that advanced nothing (an empty or all-prefill output) is no evidence of preemption
            stalls += len(previous - moved - done)
            previous = moved - done
        max_batch = max(max_batch, len(moved))
        now = time.perf_counter() - t0
        if moved and now - noted >= 30:
            noted = now
            timeline.append([round(now, 1), sum(tokens.values()), len(moved)])
        if args.window_s is not None and time.perf_counter() - t0 > args.window_s:
            break
    wall = time.perf_counter() - t0
    generated = sum(tokens.values())
    print(json.dumps({"engine": "vllm", "vllm": vllm.__version__, "torch": torch.__version__, "dtype": args.dtype,
                      "kv_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                      "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
                      "memory_utilization": args.memory_utilization, "threads": torch.get_num_threads(),
                      "load_s": round(load_s, 1), "tokens_per_s": generated / wall, "generated_tokens": generated,
                      "wall_s": wall, "max_batch": max_batch, "finished": finished, "steps": steps,
                      "stalls": stalls, "timeline": timeline}))
    # vLLM's engine-core and worker processes can keep a clean exit waiting, and outlive os._exit: end them first.
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(0)


if __name__ == "__main__":
    main()
