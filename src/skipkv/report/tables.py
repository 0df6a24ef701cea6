"""Tables: one per section (dataset, model), policy x budget -> accuracy, lengths, KV use; Markdown or rich.

    print(markdown_table(section))
    Console().print(rich_table(section))
"""

from __future__ import annotations

import math
from typing import Callable

from rich.table import Table

from skipkv.report.aggregate import Row, Section

def _num(value: float, digits: int) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


# (header, cell formatter, right-aligned). One list, so the Markdown and the terminal tables agree.
COLUMNS: list[tuple[str, Callable[[Row], str], bool]] = [
    ("policy", lambda r: r.policy, False),
    ("budget", lambda r: r.budget_label, True),
    ("acc (%)", lambda r: _num(100 * r.accuracy, 1), True),
    ("95% CI", lambda r: f"{_num(100 * r.accuracy_ci[0], 1)}–{_num(100 * r.accuracy_ci[1], 1)}", True),
    ("gen len (tok)", lambda r: _num(r.mean_generated_tokens, 1), True),
    ("KV mean (tok)", lambda r: _num(r.mean_kv_tokens, 1), True),
    ("KV peak (tok)", lambda r: _num(r.peak_kv_tokens, 0), True),
    ("KV decode (tok)", lambda r: _num(r.mean_decode_kv_tokens, 1), True),
    ("KV peak (MiB)", lambda r: _num(r.peak_kv_mib, 2), True),
    ("n", lambda r: str(r.n), True),
    ("runs", lambda r: str(r.num_runs), True),
]

COLUMN_NOTE = ("acc: pass@1 (per example the mean over its samples, then the mean over examples, pooled over "
               "seeds); 95% CI: Wilson score interval over examples (a seeded bootstrap when scores are fractional); gen len: mean generated tokens; KV mean: the mean over examples of each example's peak KV "
               "length per kv head, as the engine measured it (it can include a prompt before its first compression); "
               "KV peak: the maximum; KV decode: the mean of each example's peak over decode steps only (after a "
               "long prompt was compressed); budget: "
               "tokens per request per kv head, or in % a budget ratio; runs: run dirs pooled (seeds).")


def section_title(section: Section) -> str:
    return f"{section.dataset} — {section.model}"


def markdown_table(section: Section) -> str:
    """A GitHub-flavoured Markdown table of the section's rows."""
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "|".join("---:" if right else ":---" for _, _, right in COLUMNS) + "|"]
    for row in section.rows:
        # A '|' inside a label (e.g. a knob value) would split the cell.
        lines.append("| " + " | ".join(fmt(row).replace("|", "\\|") for _, fmt, _ in COLUMNS) + " |")
    return "\n".join(lines)


def rich_table(section: Section) -> Table:
    """The same table for the terminal; the full-cache rows are dimmed as the reference."""
    table = Table(title=section_title(section), title_justify="left")
    for header, _, right in COLUMNS:
        # Labels and budgets never wrap (a wrapped "streaming_llm" is unreadable); numbers may.
        table.add_column(header, justify="right" if right else "left", no_wrap=header in ("policy", "budget"))
    for row in section.rows:
        table.add_row(*(fmt(row) for _, fmt, _ in COLUMNS), style="dim" if row.is_full else None)
    return table
