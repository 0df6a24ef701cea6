"""Decode-step time of the random 0.5B shape in bf16 and fp32 at batch 1..32, one thread, HF's own cache.

    OMP_NUM_THREADS=1 python benchmarks/probes/cpu_dtype_step.py

Why `skipkv bench throughput --dtype auto` picks fp32 on CPU: without native bf16 matmul (AVX512-BF16/AMX)
torch emulates it and a bf16 decode step stops gaining from batching at about batch 4 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from skipkv.models import load_model


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    print("| dtype | batch | step ms | tokens/s |\n|---|---:|---:|---:|")
    for dtype in ("bf16", "fp32"):
        model = load_model("random:qwen2:0.5b", dtype=dtype).model
        for batch in (1, 2, 4, 8, 16, 32):
            ids = torch.randint(0, 200, (batch, 64))
            with torch.inference_mode():
                cache = DynamicCache()
                nxt = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                times = []
                for _ in range(6):
                    t0 = time.perf_counter()
                    model(nxt, past_key_values=cache, use_cache=True)
                    times.append(time.perf_counter() - t0)
            step = statistics.median(times)
            print(f"| {dtype} | {batch} | {1000 * step:.0f} | {batch / step:.1f} |", flush=True)


if __name__ == "__main__":
    main()
