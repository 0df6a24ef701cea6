"""PNG plots of a report section: metric vs KV budget (one line per policy, full cache as a reference line)
and, for needle datasets, a needle-depth x context-length accuracy heatmap per policy.

    plots = plot_section(section, Path("report"), prefix="gsm8k")   # -> [Plot(path, caption), ...]

Figures are built with the object API (`matplotlib.figure.Figure`), not pyplot: no global figure state and
no backend switch at import, so this is safe inside a CLI, a test or a notebook.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator

from skipkv.report.aggregate import Row, Section, layer_shares, natural_key, needle_grid
from skipkv.report.runs import FULL_POLICIES

DPI = 130
MARKERS = "osD^vPX*"
PANELS_PER_ROW = 4  # needle heatmaps: budgets per row of panels


@dataclass(frozen=True)
class Plot:
    path: Path
    caption: str


def slug(text: str) -> str:
    """A file-name-safe version of a label: `rkv (window=8)` -> `rkv_window-8`."""
    text = re.sub(r"[=:/\\]", "-", text)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.") or "x"


def _colors(labels: list[str]) -> dict[str, tuple]:
    # One colour per policy label of the whole section, so a policy keeps its colour across its plots.
    cmap = colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(sorted(labels, key=natural_key))}


def _fmt_tokens(n: float) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{int(n) // 1024}K"
    return f"{int(n)}" if float(n).is_integer() else f"{n:g}"


@dataclass(frozen=True)
class _Metric:
    key: str
    name: str  # file-name part
    ylabel: str
    title: str
    scale: float = 1.0
    is_fraction: bool = False


METRICS = (
    _Metric("accuracy", "accuracy", "accuracy (%)", "accuracy vs KV budget", 100.0, True),
    _Metric("mean_generated_tokens", "gen_len", "mean generated length (tokens)", "generated length vs KV budget"),
)


def _budget_plot(section: Section, metric: _Metric, by_ratio: bool, path: Path) -> bool:
    """One line per policy over its budgets; full-cache rows as horizontal lines. False if nothing to draw."""
    x_of: Callable[[Row], float | None] = (lambda r: r.ratio) if by_ratio else (lambda r: r.budget)
    curves: dict[str, list[tuple[float, float, int]]] = {}
    for row in section.rows:
        x = x_of(row)
        y = getattr(row, metric.key)
        if row.is_full or x is None or math.isnan(y):
            continue
        curves.setdefault(row.policy, []).append((float(x), y * metric.scale, row.n))
    if not curves:
        return False
    full = [r for r in section.full if not math.isnan(getattr(r, metric.key))]
    colors = _colors(sorted({r.policy for r in section.rows if not r.is_full}))

    fig = Figure(figsize=(7.5, 4.6), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    xs_all = sorted({x for pts in curves.values() for x, _, _ in pts})
    for k, (label, pts) in enumerate(sorted(curves.items(), key=lambda kv: natural_key(kv[0]))):
        pts.sort()
        # A marker shape per policy as well as a colour: coinciding points (e.g. two at 0 %) stay visible.
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=MARKERS[k % len(MARKERS)], linewidth=1.8,
                markersize=6, markerfacecolor="none" if k % 2 else colors[label], color=colors[label], label=label)
    for i, row in enumerate(full):
        y = getattr(row, metric.key) * metric.scale
        value = f"{y:.1f}%" if metric.is_fraction else f"{y:.0f}"
        ax.axhline(y, color="0.25", linestyle=(0, (5, 3)) if i == 0 else ":", linewidth=1.3,
                   label=f"{'full cache' if row.policy.lower() in FULL_POLICIES else row.policy}: {value} (n={row.n})")

    # Budgets usually double from one point to the next: a log2 axis spaces them evenly.
    if not by_ratio and len(xs_all) > 1 and xs_all[-1] / xs_all[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(xs_all))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{x:.0%}" if by_ratio else f"{x:g}" for x in xs_all])  # as in the table
    if len(xs_all) == 1:  # a single budget: give the point some room instead of a zero-width axis
        ax.set_xlim(xs_all[0] * 0.5, xs_all[0] * 1.5)
    if metric.is_fraction:
        ax.set_ylim(-3, 103)
    else:
        ax.set_ylim(bottom=0)
        ys = [p[1] for pts in curves.values() for p in pts] + [getattr(r, metric.key) * metric.scale for r in full]
        top = max(ys)
        ax.set_ylim(0, top * 1.12 if top > 0 else 1)
    if by_ratio:
        of = sorted({r.ratio_of for r in section.rows if r.ratio is not None and not r.is_full})
        ax.set_xlabel(f"KV budget ratio (of {' / '.join(of)})")
    else:
        ax.set_xlabel("KV budget (tokens per kv head)")
    ax.set_ylabel(metric.ylabel)
    n_pts = sorted({p[2] for pts in curves.values() for p in pts})
    n_txt = f"n={n_pts[0]}" if len(n_pts) == 1 else f"n={n_pts[0]}–{n_pts[-1]}"
    ax.set_title(f"{section.dataset}: {metric.title}\n{section.model}, {n_txt} per point", fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.savefig(path)
    return True


def _needle_plot(section: Section, policy: str, rows: list[Row], path: Path) -> None:
    """Heatmap panels (one per budget) of accuracy by needle depth (rows) and context length (columns)."""
    grids = [needle_grid(r.records) for r in rows]
    n = len(rows)
    ncols = min(n, PANELS_PER_ROW)  # wrap many budgets onto more rows rather than one very wide figure
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(1.2 + 3.6 * ncols, 0.6 + 3.6 * nrows), dpi=DPI, layout="constrained")
    grid_axes = fig.subplots(nrows, ncols, squeeze=False)
    axes = list(grid_axes.flat[:n])
    for spare in grid_axes.flat[n:]:
        spare.set_visible(False)
    cmap = colormaps["RdYlGn"].with_extremes(bad="0.85")
    image = None
    for ax, row, grid in zip(axes, rows, grids):
        acc = np.array(grid.accuracy, dtype=float).reshape(len(grid.depths), len(grid.lengths)) * 100
        image = ax.imshow(np.ma.masked_invalid(acc), cmap=cmap, vmin=0, vmax=100, aspect="auto")
        as_percent = all(d <= 1 for d in grid.depths)  # depth stored as a fraction of the context
        ax.set_yticks(range(len(grid.depths)),
                      [f"{d * 100:.0f}" if as_percent else f"{d:g}" for d in grid.depths])
        ax.set_xticks(range(len(grid.lengths)), [_fmt_tokens(x) for x in grid.lengths])
        for i in range(acc.shape[0]):
            for j in range(acc.shape[1]):
                v = acc[i, j]
                # Dark text on the pale middle of the colour map, white on its saturated ends.
                color = "black" if math.isnan(v) or 25 <= v <= 80 else "white"
                ax.text(j, i, "—" if math.isnan(v) else f"{v:.0f}", ha="center", va="center",
                        fontsize=8, color=color)
        ax.set_xlabel("context length (tokens)")
        ax.set_title("full cache" if row.is_full else f"budget {row.budget_label}"
                     + ("" if row.is_full or row.budget is None else " tok"), fontsize=10)
    depth_label = "needle depth (% of context)" if all(d <= 1 for g in grids for d in g.depths) else "needle depth"
    for row_axes in grid_axes:
        row_axes[0].set_ylabel(depth_label)
    if image is not None:
        fig.colorbar(image, ax=axes, label="accuracy (%)", shrink=0.9)
    per_cell = sorted({c for g in grids for line in g.counts for c in line if c})
    n_txt = f"n={per_cell[0]}" if len(per_cell) == 1 else f"n={per_cell[0]}–{per_cell[-1]}" if per_cell else "n=0"
    shown = "full cache" if policy.lower() in FULL_POLICIES else policy
    fig.suptitle(f"{section.dataset}: needle accuracy by depth and length — {shown}\n"
                 f"{section.model}, {n_txt} per cell", fontsize=11)
    fig.savefig(path)


def _layer_plot(section: Section, path: Path) -> bool:
    """Per budget a panel: the share of the prompt each layer kept, one line per policy (LaProx's Figure 6).

    Drawn only when some policy gave its layers different lengths (a uniform policy is a flat line, shown
    beside them for reference). False if there is nothing to draw.
    """
    panels: dict[str, list[tuple[str, list[float], int]]] = {}
    order: dict[str, Row] = {}
    uneven = False
    for row in section.rows:
        shares = None if row.is_full else layer_shares(row.records)
        if shares is None:
            continue
        uneven |= max(shares) - min(shares) > 1e-9
        panels.setdefault(row.budget_label, []).append((row.policy, shares, row.n))
        order.setdefault(row.budget_label, row)
    if not uneven:
        return False
    labels = sorted(panels, key=lambda b: _budget_order_key(order[b]))
    colors = _colors(sorted({p for lines in panels.values() for p, _, _ in lines}))
    fig = Figure(figsize=(1.0 + 5.2 * len(labels), 4.4), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(labels), squeeze=False)[0]
    for ax, label in zip(axes, labels):
        for k, (policy, shares, n) in enumerate(sorted(panels[label], key=lambda t: natural_key(t[0]))):
            ax.plot(range(len(shares)), [100 * v for v in shares], marker=MARKERS[k % len(MARKERS)], markersize=4,
                    linewidth=1.6, color=colors[policy], label=f"{policy} (n={n})")
        ax.set_xlabel("layer")
        ax.set_ylabel("entries kept (% of the prompt)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"budget {label}" + ("" if order[label].budget is None else " tok"), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{section.dataset}: what each layer kept (mean over examples)\n{section.model}", fontsize=11)
    fig.savefig(path)
    return True


def _budget_order_key(row: Row) -> tuple:
    return (0, float(row.budget)) if row.budget is not None else (1, row.ratio if row.ratio is not None else math.inf)


def plot_section(section: Section, out_dir: Path, prefix: str) -> list[Plot]:
    """Write the section's PNGs under `out_dir` as `<prefix>_*.png`; returns them with captions."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: list[Plot] = []
    for by_ratio in (False, True):
        for metric in METRICS:
            name = f"{prefix}_{metric.name}{'_ratio' if by_ratio else ''}.png"
            if _budget_plot(section, metric, by_ratio, out_dir / name):
                plots.append(Plot(out_dir / name, f"{section.dataset}: {metric.title}"
                                  + (" (budget as a ratio)" if by_ratio else "")))
    name = f"{prefix}_layer_budgets.png"
    if _layer_plot(section, out_dir / name):
        plots.append(Plot(out_dir / name, f"{section.dataset}: entries each layer kept, as a share of the prompt"))
    if section.is_needle:
        policies: dict[str, list[Row]] = {}
        for row in section.rows:
            if row.is_needle:
                policies.setdefault(row.policy, []).append(row)
        for policy, rows in policies.items():
            name = f"{prefix}_needle_{slug(policy)}.png"
            _needle_plot(section, policy, rows, out_dir / name)
            plots.append(Plot(out_dir / name, f"{section.dataset}: needle accuracy (%) by depth x length, {policy}"))
    return plots
