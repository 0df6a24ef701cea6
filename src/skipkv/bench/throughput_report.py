"""What `skipkv bench throughput` reports: one record per policy run, transformers' reference, the batch
sweep and where it saturates; the table printed and the PNG written (bench/throughput.py runs them).

    python -c "from skipkv.bench.throughput_report import human_bytes; print(human_bytes(48 << 20))"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SATURATION_GAIN = 1.10  # a batch "still scales" while the next one brings >= 10% more tokens/s



@dataclass
class PolicyRun:
    policy: str
    tokens_per_s: float
    requests_per_s: float
    max_batch: int  # most requests holding a slot at once (the transition batch under a cap)
    peak_kv_bytes: int  # peak of the store's allocated bytes
    peak_kv_held_bytes: int
    ttft_p50: float  # seconds
    tpot_p50: float  # seconds between two tokens of one request
    tpot_p99: float
    compress_share: float  # compression time / wall time (requests cut by --max-seconds not counted)
    generated_tokens: int
    requests: int  # finished (all, unless --max-seconds cut the run)
    wall_s: float
    steps: int
    batch_size: int  # the cap given to the engine
    kv_memory: int
    # [seconds since submission, tokens generated so far, requests that got a token in that step], one per
    # `timeline_s` (bench throughput and the vLLM comparison: where a capped batch shrinks or stalls)
    timeline: list[list[float]] = field(default_factory=list)


@dataclass
class HFRun:
    batch: int
    tokens_per_s: float
    generated_tokens: int
    requests: int
    wall_s: float


@dataclass
class SweepPoint:
    policy: str
    batch: int
    tokens_per_s: float  # the median over repeats
    hf_tokens_per_s: float | None = None  # the median over repeats
    engine_runs: list[float] = field(default_factory=list)  # tokens/s of each repeat, in run order
    hf_runs: list[float] = field(default_factory=list)  # interleaved with engine_runs: E, T, E, T, ...
    ratio: float | None = None  # engine / transformers: the median of the per-repeat ratios (pairs ran back to back)


@dataclass
class Report:
    model: str
    dtype: str
    workload: str
    requests: int
    kv_memory: int
    policies: list[PolicyRun] = field(default_factory=list)
    hf_reference: HFRun | None = None
    sweep: list[SweepPoint] = field(default_factory=list)
    saturation_batch: dict[str, int] = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    table: str = ""



def saturation(points: list[SweepPoint]) -> int:
    """The first batch after which tokens/s grows by less than SATURATION_GAIN (the largest if it never stops)."""
    pts = sorted(points, key=lambda p: p.batch)
    for a, b in zip(pts, pts[1:]):
        if b.tokens_per_s < SATURATION_GAIN * a.tokens_per_s:
            return a.batch
    return pts[-1].batch



# --------------------------------------------------------------------------------------------- report
def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def format_table(rep: Report) -> str:
    lines = []
    if rep.policies:
        cap = human_bytes(rep.kv_memory) if rep.kv_memory else "none"
        lines += [f"{rep.workload}, {rep.requests} requests, KV memory cap {cap}", "",
                  "| policy | tokens/s | requests/s | batch reached | saturates at | peak KV alloc MiB "
                  "| peak KV held MiB | TTFT p50 s | TPOT p50 ms | TPOT p99 ms | compress share |", "|" + "---|" * 11]
        for r in rep.policies:
            sat = rep.saturation_batch.get(r.policy)
            lines.append(f"| {r.policy} | {r.tokens_per_s:.1f} | {r.requests_per_s:.3f} | {r.max_batch} | "
                         f"{sat if sat is not None else '-'} | {r.peak_kv_bytes / 2**20:.1f} | "
                         f"{r.peak_kv_held_bytes / 2**20:.1f} | {r.ttft_p50:.2f} | {1000 * r.tpot_p50:.1f} | "
                         f"{1000 * r.tpot_p99:.1f} | {100 * r.compress_share:.1f}% |")
        if rep.hf_reference:
            h = rep.hf_reference
            lines.append(f"| transformers generate (full, batch {h.batch}) | {h.tokens_per_s:.1f} | "
                         f"{h.requests / h.wall_s:.3f} | {h.batch} | - | - | - | - | - | - | - |")
        base = {r.policy: r.tokens_per_s for r in rep.policies}.get("full")
        if base:
            lines += [""] + [f"{r.policy}: {r.tokens_per_s / base:.2f}x full's tokens/s" for r in rep.policies
                             if r.policy != "full"]
    if rep.sweep:
        lines += ["", "batch sweep (no memory cap; B requests at batch B)", "",
                  "| policy | batch | tokens/s | transformers generate tokens/s "
                  "| engine / transformers (each repeat) |",
                  "|---|---|---|---|---|"]
        for p in rep.sweep:
            hf = f"{p.hf_tokens_per_s:.1f}" if p.hf_tokens_per_s else "-"
            ratio = "-"
            if p.hf_runs:
                each = ", ".join(f"{e / h:.2f}" for e, h in zip(p.engine_runs, p.hf_runs))
                ratio = f"{p.ratio:.3f}" + (f" ({each})" if len(p.hf_runs) > 1 else "")
            lines.append(f"| {p.policy} | {p.batch} | {p.tokens_per_s:.1f} | {hf} | {ratio} |")
    return "\n".join(lines)


def plot(rep: Report, path: Path) -> None:
    from matplotlib.figure import Figure

    panels = int(bool(rep.policies)) + int(bool(rep.sweep))
    fig = Figure(figsize=(5.5 * panels, 4))
    axes = [fig.add_subplot(1, panels, i + 1) for i in range(panels)]
    if rep.policies:
        ax = axes.pop(0)
        names = [r.policy for r in rep.policies] + (["hf generate"] if rep.hf_reference else [])
        vals = [r.tokens_per_s for r in rep.policies] + ([rep.hf_reference.tokens_per_s] if rep.hf_reference else [])
        batches = [r.max_batch for r in rep.policies] + ([rep.hf_reference.batch] if rep.hf_reference else [])
        bars = ax.bar(names, vals, color=[f"C{i}" for i in range(len(names))])
        for bar, b in zip(bars, batches):
            ax.annotate(f"batch {b}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        cap = f"{human_bytes(rep.kv_memory)} KV" if rep.kv_memory else "no KV cap"
        ax.set_title(f"{rep.workload}, {rep.requests} requests, {cap}", fontsize=9)
        ax.set_ylabel("generated tokens/s")
    if rep.sweep:
        ax = axes.pop(0)
        for i, name in enumerate(dict.fromkeys(p.policy for p in rep.sweep)):
            pts = [p for p in rep.sweep if p.policy == name]
            ax.plot([p.batch for p in pts], [p.tokens_per_s for p in pts], marker="o", color=f"C{i}", label=name)
            hf = [p for p in pts if p.hf_tokens_per_s]
            if hf and i == 0:
                ax.plot([p.batch for p in hf], [p.hf_tokens_per_s or 0.0 for p in hf], marker="x", linestyle="--",
                        color="gray", label="transformers generate")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (no memory cap)")
        ax.set_ylabel("generated tokens/s")
        ax.set_title("tokens/s vs batch", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
