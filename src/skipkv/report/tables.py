"""Tables: one per section (dataset, model), policy x budget -> accuracy, lengths, KV use; Markdown or rich.

    print(markdown_table(section))
    Console().print(rich_table(section))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, get_args

from rich.table import Table

from skipkv.report.aggregate import Row, Section

# What `skipkv report --format` accepts: print tables, write report.md + PNGs, or both.
Format = Literal["md", "terminal", "both"]
FORMATS: tuple[str, ...] = get_args(Format)

def _num(value: float, digits: int) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


# (header, cell formatter, right-aligned, in the terminal table). One list, so the Markdown and the terminal
# tables agree; the terminal shows the columns that fit 80 characters, report.md all of them.
COLUMNS: list[tuple[str, Callable[[Row], str], bool, bool]] = [
    ("policy", lambda r: r.policy, False, True),
    ("budget", lambda r: r.budget_label, True, True),
    ("acc (%)", lambda r: _num(100 * r.accuracy, 1), True, True),
    ("95% CI", lambda r: f"{_num(100 * r.accuracy_ci[0], 1)}–{_num(100 * r.accuracy_ci[1], 1)}", True, True),
    ("gen len (tok)", lambda r: _num(r.mean_generated_tokens, 1), True, True),
    ("KV mean (tok)", lambda r: _num(r.mean_kv_tokens, 1), True, False),
    ("KV peak (tok)", lambda r: _num(r.peak_kv_tokens, 0), True, False),
    ("KV decode (tok)", lambda r: _num(r.mean_decode_kv_tokens, 1), True, True),
    ("KV peak (MiB)", lambda r: _num(r.peak_kv_mib, 2), True, False),
    ("KV held (MiB)", lambda r: _num(r.mean_decode_kv_mib, 2), True, True),
    ("compress (s)", lambda r: _num(r.mean_compress_seconds, 2), True, False),
    ("n", lambda r: str(r.n), True, True),
    ("runs", lambda r: str(r.num_runs), True, False),
]

COLUMN_NOTE = ("acc: pass@1 (per example the mean over its samples, then the mean over examples, pooled over "
               "seeds); 95% CI: Wilson score interval over examples (a seeded bootstrap when scores are "
               "fractional); gen len: mean generated tokens; KV mean: the mean over examples of each example's peak KV "
               "length per kv head, as the engine measured it (it can include a prompt before its first compression); "
               "KV peak: the maximum; KV decode: the mean of each example's peak over decode steps only (after a "
               "long prompt was compressed); KV peak (MiB): the most K/V bytes any example held at any moment; "
               "KV held (MiB): the mean of each example's K/V bytes peak over decode steps (what it keeps once "
               "compressed); compress (s): mean wall time per example spent in the policy's compression; budget: "
               "tokens per request per kv head, or in % a budget ratio; runs: run dirs pooled (seeds).")


def section_title(section: Section) -> str:
    return f"{section.dataset} — {section.model}"


def markdown_table(section: Section) -> str:
    """A GitHub-flavoured Markdown table of the section's rows."""
    lines = ["| " + " | ".join(h for h, _, _, _ in COLUMNS) + " |",
             "|" + "|".join("---:" if right else ":---" for _, _, right, _ in COLUMNS) + "|"]
    for row in section.rows:
        # A '|' inside a label (e.g. a knob value) would split the cell.
        lines.append("| " + " | ".join(fmt(row).replace("|", "\\|") for _, fmt, _, _ in COLUMNS) + " |")
    return "\n".join(lines)


def rich_table(section: Section) -> Table:
    """The same table for the terminal; the full-cache rows are dimmed as the reference."""
    table = Table(title=section_title(section), title_justify="left")
    shown = [c for c in COLUMNS if c[3]]
    for header, fmt, right, _ in shown:
        # No cell is cut or wrapped ("8,20…" is unreadable): the columns are as wide as their widest cell, and a
        # narrow terminal wraps the headers instead. Labels, budgets and intervals never wrap.
        width = max((len(fmt(row)) for row in section.rows), default=0)
        table.add_column(header, justify="right" if right else "left", min_width=width,
                         no_wrap=header in ("policy", "budget", "95% CI"))
    for row in section.rows:
        table.add_row(*(fmt(row) for _, fmt, _, _ in shown), style="dim" if row.is_full else None)
    return table
