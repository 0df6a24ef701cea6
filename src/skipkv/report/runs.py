"""Finding and reading run directories (config.json + records.jsonl [+ summary.json]); never runs a model.

    runs = load_runs([Path("runs/sweep_gsm8k")])     # every run dir below, sorted by path
    runs[0].dataset, runs[0].policy, runs[0].budget, len(runs[0].records)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skipkv.errors import SkipKVError

CONFIG_FILE = "config.json"
RECORDS_FILE = "records.jsonl"
SUMMARY_FILE = "summary.json"
SESSIONS_FILE = "sessions.jsonl"
# Policy names that keep the whole cache: drawn as the reference line, not as a budget curve.
FULL_POLICIES = frozenset({"full", "fullkv", "full_kv"})
# The runner's config.json `budget_mode` -> what a budget ratio is a fraction of (for axis labels).
RATIO_OF = {"reference": "the full-cache generation length", "prompt_length": "the prompt length"}


def _name(value: Any) -> str:
    """`"gsm8k"` or `{"name": "gsm8k", ...}` -> "gsm8k" (config.json may store either form)."""
    if isinstance(value, dict):
        value = value.get("name", value.get("path", "?"))
    return str(value) if value is not None else "?"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


@dataclass(frozen=True)
class Run:
    """One run directory: its resolved config, its finished records, and what was odd while reading it."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def dataset(self) -> str:
        return _name(self.config.get("dataset"))

    @property
    def model(self) -> str:
        return _name(self.config.get("model"))

    @property
    def policy_config(self) -> dict[str, Any]:
        policy = self.config.get("policy")
        return dict(policy) if isinstance(policy, dict) else {"name": _name(policy)}

    @property
    def policy(self) -> str:
        return _name(self.policy_config)

    @property
    def budget(self) -> int | None:
        """KV budget in tokens, or None (full cache, or a run sized by a ratio).

        A ratio run may record the tokens its ratio resolved to (ratio x the reference's generation length);
        it is still reported on the ratio axis, where it sits next to the other ratios.
        """
        if self.is_full or self.ratio is not None:
            return None
        value = _number(self.policy_config.get("budget", self.config.get("budget")))
        return int(value) if value is not None else None

    @property
    def ratio(self) -> float | None:
        """KV budget as a ratio, for runs sized that way (of what: see `ratio_of`)."""
        for src in (self.policy_config, self.config):
            for key in ("budget_ratio", "ratio"):
                value = _number(src.get(key))
                if value is not None:
                    return float(value)
        return None

    @property
    def ratio_of(self) -> str:
        """What a budget ratio is a fraction of, from the runner's `budget_mode`."""
        return RATIO_OF.get(str(self.config.get("budget_mode")), "the full cache")

    @property
    def is_full(self) -> bool:
        """A full-cache run: the `full` policy, or a policy given neither a budget nor a ratio."""
        if self.policy.lower() in FULL_POLICIES:
            return True
        has_budget = _number(self.policy_config.get("budget", self.config.get("budget"))) is not None
        return not has_budget and self.ratio is None

    @property
    def sampling(self) -> dict[str, Any]:
        sampling = self.config.get("sampling")
        return dict(sampling) if isinstance(sampling, dict) else {}

    @property
    def seed(self) -> Any:
        return self.sampling.get("seed", self.config.get("seed"))


def read_records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Parse records.jsonl -> (records, notes).

    A torn last line (the run was killed mid-write) is skipped with a note; a bad line anywhere else
    means the file is corrupt and raises. A record repeated by (id, sample) keeps its last copy, so a
    resumed run that re-finished an example is not counted twice.
    """
    from skipkv.files import exists

    notes: list[str] = []
    if not exists(path):
        return [], [f"{path.parent}: no {RECORDS_FILE}"]
    from skipkv.files import count_lines, parse_json, read_bytes, split_lines
    from skipkv.files.schemas import validate

    data = read_bytes(path, "records")
    count_lines(data, path, "records")
    by_key: dict[tuple[str, Any], dict[str, Any]] = {}
    for num, pos, line in split_lines(data):
        where = f"{path}:{num}"
        try:
            value = parse_json(line, where, "records")
        except SkipKVError as exc:
            # The last non-blank line is the only one a crash can tear.
            if not data[pos + len(line):].strip():
                notes.append(f"{path}: skipped a torn last line ({num})")
                continue
            raise SkipKVError(f"{exc}; the file is damaged") from None
        record = validate("records", value, where)
        key = (record["id"], record.get("sample", 0))
        if key in by_key:
            notes.append(f"{path}: record {key[0]} sample {key[1]} appears twice; kept the last")
        by_key[key] = record
    return list(by_key.values()), notes


def _read_json(path: Path, kind: str) -> dict[str, Any]:
    from skipkv.files import read_json

    return read_json(path, kind)


def is_run_dir(path: Path) -> bool:
    # config.json alone is not enough: a saved HF model folder has one too.
    from skipkv.files import exists

    return (path / CONFIG_FILE).is_file() and (exists(path / RECORDS_FILE) or (path / SUMMARY_FILE).exists())


def find_run_dirs(paths: Iterable[Path]) -> list[Path]:
    """Run dirs among `paths` and below them (searched recursively for config.json), deduplicated, sorted."""
    found: set[Path] = set()
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise SkipKVError(f"report: {path} does not exist")
        if is_run_dir(path):
            found.add(path.resolve())
            continue
        found.update(cfg.parent.resolve() for cfg in path.rglob(CONFIG_FILE) if is_run_dir(cfg.parent))
    return sorted(found)


def load_run(path: Path) -> Run:
    config = _read_json(path / CONFIG_FILE, "config")
    records, notes = read_records(path / RECORDS_FILE)
    summary = None
    if (path / SUMMARY_FILE).exists():
        try:
            summary = _read_json(path / SUMMARY_FILE, "summary")
        except SkipKVError as exc:  # the summary is a convenience; the records are the truth
            notes.append(str(exc))
    notes += _processor_notes(path, records)
    if summary is not None and isinstance(summary.get("n"), int) and summary["n"] != len(records):
        notes.append(f"{path}: summary.json says n={summary['n']}, records hold {len(records)}; using records")
    return Run(path=path, config=config, records=records, summary=summary, notes=tuple(notes))


def _processor(environment: dict[str, Any]) -> str:
    machine = environment.get("machine") or {}
    flags = ",".join(machine.get("cpu_flags") or []) or "no flags recorded"
    return f"{machine.get('cpu', '?')} ({flags})"


def _processor_notes(path: Path, records: list[dict[str, Any]]) -> list[str]:
    """A note when the run's records were generated on more than one processor (sessions.jsonl): the figures
    then mix machines (speed always; bits only where the kernels differ, which resuming refuses in 16-bit)."""
    file = path / SESSIONS_FILE
    if not file.exists():
        return []
    by_session: dict[Any, str] = {}
    from skipkv.files import parse_json_line, read_bytes, split_lines

    try:
        data = read_bytes(file, "sessions")
    except SkipKVError as exc:
        return [str(exc)]
    for num, _pos, line in split_lines(data):
        try:
            entry = parse_json_line(line, file, num, "sessions")
            by_session[entry.get("session")] = _processor(entry["environment"])
        except (SkipKVError, TypeError, AttributeError):
            continue  # a torn or foreign line: the records are the truth
    counts: dict[str, int] = {}
    for r in records:
        cpu = by_session.get(r.get("session"), "an unlogged session")
        counts[cpu] = counts.get(cpu, 0) + 1
    if len(counts) < 2:
        return []
    return [f"{path}: records from {len(counts)} processors: "
            + "; ".join(f"{n} on {cpu}" for cpu, n in sorted(counts.items()))]


def load_runs(paths: Iterable[Path]) -> list[Run]:
    """Every run dir at or below `paths`. Raises when there is none."""
    paths = list(paths)
    dirs = find_run_dirs(paths)
    if not dirs:
        where = ", ".join(str(p) for p in paths)
        raise SkipKVError(f"report: no run dirs (config.json + records.jsonl) at or below {where}")
    return [load_run(d) for d in dirs]
