"""Build a report from run dirs: tables in the terminal (rich) and/or report.md with PNG plots.

    build_report([Path("runs/sweep_gsm8k")], out_dir=Path("runs/sweep_gsm8k/report"), fmt="both")

Reads config.json / records.jsonl / summary.json only; never loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from skipkv.errors import SkipKVError
from skipkv.outputs import check_dir, write_atomic
from skipkv.report.aggregate import Section, aggregate
from skipkv.report.plots import Plot, plot_section, slug
from skipkv.report.runs import Run, load_runs
from skipkv.report.tables import COLUMN_NOTE, Format, markdown_table, rich_table, section_title

REPORT_FILE = "report.md"


@dataclass(frozen=True)
class Report:
    runs: list[Run]
    sections: list[Section]
    plots: list[Plot]
    markdown_path: Path | None


def _prefix(section: Section, sections: list[Section]) -> str:
    # The model joins the file name only when one dataset appears with several models.
    same = [s for s in sections if s.dataset == section.dataset]
    return slug(section.dataset) if len(same) == 1 else f"{slug(section.dataset)}_{slug(section.model)}"


def _budget_text(run: Run) -> str:
    if run.is_full:
        return "full"
    return str(run.budget) if run.budget is not None else f"{run.ratio:.0%} of {run.ratio_of}"


def render_markdown(runs: list[Run], sections: list[Section], plots: dict[str, list[Plot]], out_dir: Path) -> str:
    """report.md: per section a table and its plots (linked relative to `out_dir`), then the notes."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# skipkv evaluation report", "",
             f"{len(runs)} run dirs, {sum(len(r.records) for r in runs)} records; generated {when}.", "",
             f"_{COLUMN_NOTE}_", ""]
    for section in sections:
        lines += [f"## {section_title(section)}", "", markdown_table(section), ""]
        for plot in plots.get(section_title(section), []):
            rel = plot.path.relative_to(out_dir) if plot.path.is_relative_to(out_dir) else plot.path
            lines += [f"![{plot.caption}]({rel.as_posix()})", ""]
    lines += ["## Run dirs", ""]
    lines += [f"- `{_shown(r.path)}`: {r.dataset}, {r.policy}, budget {_budget_text(r)}, seed {r.seed}, "
              f"n={len(r.records)}" for r in runs]
    notes = [note for r in runs for note in r.notes]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def build_report(paths: list[Path], out_dir: Path | None, fmt: Format = "both",
                 console: Console | None = None) -> Report:
    """Load the runs at or below `paths`, print and/or write the report. `out_dir` is needed unless terminal-only."""
    if fmt in ("md", "both") and out_dir is not None:
        out_dir = check_dir(out_dir, "report --out")  # before any run is read: a bad --out fails at once
    runs = load_runs(paths)
    sections = aggregate(runs)
    plots: dict[str, list[Plot]] = {}
    md_path = None
    if fmt in ("terminal", "both"):
        console = console or Console()
        for section in sections:
            console.print(rich_table(section))
        for note in (n for r in runs for n in r.notes):
            console.print(f"note: {note}", style="yellow", highlight=False)
    if fmt in ("md", "both"):
        if out_dir is None:
            raise SkipKVError("report: an output folder is needed to write report.md")
        out_dir.mkdir(parents=True, exist_ok=True)
        for section in sections:
            plots[section_title(section)] = plot_section(section, out_dir, _prefix(section, sections))
        md_path = out_dir / REPORT_FILE
        write_atomic(md_path, render_markdown(runs, sections, plots, out_dir))
        if console is not None:
            console.print(f"wrote {md_path} and {sum(len(p) for p in plots.values())} plots", highlight=False)
    return Report(runs, sections, [p for ps in plots.values() for p in ps], md_path)


def _shown(path: Path) -> str:
    """A run dir as the reader would type it: relative to the working directory when it lies below it."""
    cwd = Path.cwd().resolve()
    return path.relative_to(cwd).as_posix() if path.is_relative_to(cwd) else str(path)
