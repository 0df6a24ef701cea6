"""Reports from synthetic run dirs: aggregation numbers, torn lines, run-dir discovery, tables, PNGs, needle
heatmaps and the `skipkv report` CLI. Nothing here loads a model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from skipkv import cli
from skipkv.errors import SkipKVError
from skipkv.report.aggregate import aggregate, layer_shares, needle_grid
from skipkv.report.build import build_report
from skipkv.report.runs import find_run_dirs, load_runs, read_records
from skipkv.report.tables import markdown_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(i: int, correct: bool, gen: int, kv: int, kv_bytes: int | None = None, **extra) -> dict:
    return {"id": f"q{i}", "sample": 0, "prompt": "p", "output": "o", "reference": "1", "extracted": "1",
            "correct": correct, "generated_tokens": gen, "prompt_tokens": 10, "peak_kv_tokens": kv,
            "peak_kv_bytes": kv * 1024 if kv_bytes is None else kv_bytes, "compressions": 0, "seconds": 0.5,
            **extra}


def write_run(path: Path, records: list[dict], dataset: str = "gsm8k", policy: str = "rkv",
              budget: int | None = 128, seed: int = 0, tail: str = "", summary: dict | None = None,
              extra: dict | None = None, **knobs) -> Path:
    # The layout of the runner's config.json: dataset and policy as mappings, the ratio at the top level.
    path.mkdir(parents=True)
    config = {"model": "random:qwen2", "dataset": {"name": dataset, "source": "local"},
              "policy": {"name": policy, "budget": budget, "window": 8, "sink": 0, **knobs},
              "budget_mode": "tokens", "budget_ratio": None,
              "sampling": {"temperature": 0.0, "max_new_tokens": 64, "seed": seed}, **(extra or {})}
    (path / "config.json").write_text(json.dumps(config))
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    (path / "summary.json").write_text(json.dumps(summary or {"n": len(records), "accuracy": 0.0}))
    return path


@pytest.fixture
def sweep(tmp_path) -> Path:
    root = tmp_path / "sweep"
    # rkv @128 over two seeds: 3 + 2 records, 3 correct; pooled into one row.
    write_run(root / "gsm8k" / "rkv-b128-s0", [record(0, True, 100, 120), record(1, False, 200, 128),
                                                record(2, True, 300, 128, kv_bytes=3 << 20)])
    write_run(root / "gsm8k" / "rkv-b128-s1", [record(0, True, 50, 90), record(1, False, 150, 110)], seed=1)
    write_run(root / "gsm8k" / "rkv-b64-s0", [record(0, False, 80, 64), record(1, False, 90, 64)], budget=64)
    write_run(root / "gsm8k" / "full-s0", [record(0, True, 100, 110), record(1, True, 120, 130)],
              policy="full", budget=None)
    return root


def test_rows_are_recomputed_from_records(sweep):
    (section,) = aggregate(load_runs([sweep]))
    assert (section.dataset, section.model) == ("gsm8k", "random:qwen2")
    assert [(r.policy, r.budget_label) for r in section.rows] == [("full", "full"), ("rkv", "64"), ("rkv", "128")]
    full, b64, b128 = section.rows
    assert full.is_full and full.accuracy == 1.0 and full.n == 2
    assert b64.accuracy == 0.0 and b64.mean_generated_tokens == 85.0
    assert (b128.n, b128.num_runs) == (5, 2)
    assert b128.accuracy == pytest.approx(3 / 5)
    assert b128.mean_generated_tokens == pytest.approx((100 + 200 + 300 + 50 + 150) / 5)
    assert b128.mean_kv_tokens == pytest.approx((120 + 128 + 128 + 90 + 110) / 5)
    assert b128.peak_kv_tokens == 128
    assert b128.peak_kv_mib == pytest.approx(3.0)  # the explicit 3 MiB record beats 128 * 1 KiB
    # summary.json said accuracy 0.0: the records win, and the mismatch is not silently trusted.
    assert b128.accuracy != 0.0


def test_accuracy_is_pass_at_1_over_examples(tmp_path):
    # q0 has 3 samples (1 correct), q1 one correct sample: pass@1 = (1/3 + 1) / 2, not 2/4
    recs = [dict(record(0, c, 10, 5), sample=k) for k, c in enumerate([True, False, False])] + [record(1, True, 10, 5)]
    write_run(tmp_path / "r", recs)
    (section,) = aggregate(load_runs([tmp_path]))
    assert section.rows[0].accuracy == pytest.approx((1 / 3 + 1) / 2) and section.rows[0].n == 4


def test_torn_last_line_is_skipped_with_a_note(tmp_path):
    run = write_run(tmp_path / "r", [record(0, True, 10, 5), record(1, False, 20, 6)],
                    tail='{"id": "q2", "correct": tr')
    records, notes = read_records(run / "records.jsonl")
    assert [r["id"] for r in records] == ["q0", "q1"]
    assert len(notes) == 1 and "torn last line" in notes[0]
    (section,) = aggregate(load_runs([run]))
    assert section.rows[0].n == 2 and section.rows[0].accuracy == 0.5


def test_corrupt_middle_line_raises(tmp_path):
    run = write_run(tmp_path / "r", [record(0, True, 10, 5)], tail="garbage\n" + json.dumps(record(1, True, 1, 1)))
    with pytest.raises(SkipKVError, match=r"records.jsonl:2: not valid JSON"):
        read_records(run / "records.jsonl")


def test_resumed_duplicates_count_once(tmp_path):
    run = write_run(tmp_path / "r", [record(0, False, 10, 5), record(0, True, 10, 5)])
    records, notes = read_records(run / "records.jsonl")
    assert len(records) == 1 and records[0]["correct"] is True and "twice" in notes[0]


def test_run_dir_discovery(sweep, tmp_path):
    model_dir = sweep / "models" / "tiny"  # an HF model folder also has a config.json: not a run
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    dirs = find_run_dirs([sweep])
    assert [d.name for d in dirs] == ["full-s0", "rkv-b128-s0", "rkv-b128-s1", "rkv-b64-s0"]
    # a run dir given directly, twice, plus its parent: no duplicates
    assert find_run_dirs([sweep / "gsm8k" / "full-s0", sweep / "gsm8k" / "full-s0"]) == [dirs[0]]
    assert len(find_run_dirs([sweep, sweep / "gsm8k"])) == 4
    with pytest.raises(SkipKVError, match="no run dirs"):
        load_runs([model_dir])
    with pytest.raises(SkipKVError, match="does not exist"):
        load_runs([tmp_path / "nope"])


def test_policy_variants_get_distinct_labels(tmp_path):
    write_run(tmp_path / "a", [record(0, True, 10, 5)], window=8)
    write_run(tmp_path / "b", [record(0, False, 10, 5)], window=32)
    (section,) = aggregate(load_runs([tmp_path]))
    assert [r.policy for r in section.rows] == ["rkv (window=8)", "rkv (window=32)"]  # numbers sort by value


def test_ratio_runs_and_datasets_are_grouped(tmp_path):
    # a ratio run records the tokens its ratio resolved to; it still belongs on the ratio axis
    write_run(tmp_path / "m" / "r25", [record(0, True, 10, 5)], dataset="math500", budget=7,
              extra={"budget_mode": "reference", "budget_ratio": 0.25})
    write_run(tmp_path / "g" / "b64", [record(0, True, 10, 5)], budget=64)
    sections = aggregate(load_runs([tmp_path]))
    assert [s.dataset for s in sections] == ["gsm8k", "math500"]
    (row,) = sections[1].rows
    assert (row.is_full, row.budget, row.ratio, row.budget_label) == (False, None, 0.25, "25%")


def test_report_writes_markdown_and_plots(sweep, tmp_path):
    out = tmp_path / "report"
    report = build_report([sweep], out, fmt="md")
    md = (out / "report.md").read_text()
    assert "## gsm8k — random:qwen2" in md
    assert "| rkv | 128 | 60.0 | 23.1–88.2 | 160.0 | 115.2 | 128 | — | 3.00 | — | — | 5 | 2 |" in md
    assert "| full | full | 100.0 |" in md
    names = sorted(p.path.name for p in report.plots)
    assert names == ["gsm8k_accuracy.png", "gsm8k_gen_len.png"]
    for plot in report.plots:
        data = plot.path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
        assert f"]({plot.path.name})" in md  # linked relative to report.md


def needle_records(policy_strength: float) -> list[dict]:
    recs = []
    for length in (1024, 4096):
        for depth in (0.0, 0.5, 1.0):
            for k in range(2):
                # correct on the first try only when the depth is shallow enough for this policy
                correct = depth <= policy_strength or k == 0
                recs.append(record(len(recs), correct, 8, min(length, 256), depth=depth, length=length))
    return recs


def test_needle_grid_and_heatmaps(tmp_path):
    root = tmp_path / "needle"
    write_run(root / "full", needle_records(1.0), dataset="niah", policy="full", budget=None)
    write_run(root / "snap", needle_records(0.0), dataset="niah", policy="snapkv", budget=256)
    runs = load_runs([root])
    (section,) = aggregate(runs)
    assert section.is_needle
    grid = needle_grid(next(r for r in section.rows if r.policy == "snapkv").records)
    assert grid.depths == (0.0, 0.5, 1.0) and grid.lengths == (1024, 4096)
    assert grid.accuracy == ((1.0, 1.0), (0.5, 0.5), (0.5, 0.5))
    assert grid.counts == ((2, 2), (2, 2), (2, 2))
    report = build_report([root], tmp_path / "rep", fmt="md")
    heatmaps = sorted(p.path.name for p in report.plots if "needle" in p.path.name)
    assert heatmaps == ["niah_needle_full.png", "niah_needle_snapkv.png"]
    for name in heatmaps:
        data = (tmp_path / "rep" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_random_depths_are_binned():
    # multi-key needles sit at random depths: 40 distinct depths must not become 40 heatmap rows
    recs = [record(i, i % 2 == 0, 8, 64, depth=i / 40 + 0.001, length=2048) for i in range(40)]
    grid = needle_grid(recs)
    assert grid.depths == tuple(round(0.1 * k, 1) for k in range(11))
    assert sum(c for line in grid.counts for c in line) == 40


def test_missing_stats_show_as_dash(tmp_path):
    rec = record(0, True, 10, 5)
    del rec["peak_kv_tokens"], rec["peak_kv_bytes"]
    write_run(tmp_path / "r", [rec])
    (section,) = aggregate(load_runs([tmp_path]))
    assert math.isnan(section.rows[0].mean_kv_tokens)
    md = build_report([tmp_path], tmp_path / "rep", fmt="md").markdown_path.read_text()
    assert "| rkv | 128 | 100.0 | 20.7–100.0 | 10.0 | — | — | — | — | — | — | 1 | 1 |" in md


def _main(monkeypatch, argv: list[str]) -> int:
    # Only this feature's subcommands: the test must not depend on other subcommand modules.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["skipkv.sweep", "skipkv.report.cli"])
    return cli.main(argv)


def test_cli_report_prints_and_writes(monkeypatch, sweep, capsys):
    assert _main(monkeypatch, ["report", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "gsm8k" in out and "60.0" in out and "wrote" in out
    assert (sweep / "report" / "report.md").exists()


def test_cli_report_terminal_only_writes_nothing(monkeypatch, sweep, tmp_path, capsys):
    assert _main(monkeypatch, ["report", str(sweep), str(sweep), "--format", "terminal"]) == 0
    assert "rkv" in capsys.readouterr().out
    assert not (sweep / "report").exists()


def test_cli_report_errors_are_one_line(monkeypatch, sweep, tmp_path, capsys):
    assert _main(monkeypatch, ["report", str(tmp_path / "empty_nothing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert _main(monkeypatch, ["report", str(sweep), str(sweep)]) == 2
    assert "give --out" in capsys.readouterr().err


def test_intervals_and_mcnemar_against_known_values():
    from skipkv.report.stats import bootstrap, interval, mcnemar_exact, wilson

    lo, hi = wilson(7, 100)
    assert lo == pytest.approx(0.0343, abs=5e-4) and hi == pytest.approx(0.1375, abs=5e-4)
    assert wilson(0, 10) == (0.0, pytest.approx(0.2775, abs=5e-4))
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64) and mcnemar_exact(3, 3) == 1.0
    assert interval([1.0, 0.0, 0.0, 1.0]) == wilson(2, 4)
    frac = [0.5, 1.0, 0.0, 0.25, 0.75] * 8
    assert interval(frac) == bootstrap(frac)
    lo, hi = interval(frac)
    assert lo < sum(frac) / len(frac) < hi


def ref_holm_rejects(pvalues, alpha):
    """Holm's procedure as stated: walk the sorted p-values, reject while p_(k) <= alpha / (m - k), stop at the
    first that fails."""
    m = len(pvalues)
    rejected = set()
    for k, i in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        if pvalues[i] > alpha / (m - k):
            break
        rejected.add(i)
    return rejected


@pytest.mark.parametrize("seed", range(20))
def test_holm_adjusted_p_rejects_what_the_step_down_procedure_rejects(seed):
    import random

    from skipkv.report.stats import holm

    rng = random.Random(seed)
    ps = [round(rng.random() ** 3, 3) for _ in range(rng.randrange(1, 12))]  # ties and small p-values
    adj = holm(ps)
    assert all(a >= p for a, p in zip(adj, ps)) and max(adj) <= 1
    for alpha in (0.01, 0.05, 0.1, 0.2):
        assert {i for i, a in enumerate(adj) if a <= alpha} == ref_holm_rejects(ps, alpha)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_report_rows_carry_the_interval(tmp_path):
    from skipkv.report.stats import wilson

    recs = [{"id": str(i), "correct": i < 3, "generated_tokens": 10} for i in range(10)]
    write_run(tmp_path / "r", recs, budget=64)
    section = aggregate(load_runs([tmp_path]))[0]
    row = section.rows[0]
    assert row.accuracy == pytest.approx(0.3) and row.accuracy_ci == wilson(3, 10)
    lo, hi = wilson(3, 10)
    assert f"| 30.0 | {100 * lo:.1f}–{100 * hi:.1f} |" in markdown_table(section)


def test_layer_budgets_are_plotted_when_layers_differ(tmp_path):
    # LaProx-like run: layers keep different shares; SnapKV-like run: every layer the same
    uneven = [record(i, True, 4, 40, prompt_tokens=100, layer_kv_tokens=[40 - 10 * i, 20, 10 + 10 * i],
                     decode_peak_kv_bytes=(2 + i) << 20, compress_seconds=0.5 * (i + 1)) for i in range(2)]
    even = [record(i, True, 4, 20, prompt_tokens=100, layer_kv_tokens=[20, 20, 20]) for i in range(2)]
    write_run(tmp_path / "r" / "laprox", uneven, dataset="niah", policy="laprox", budget=20)
    write_run(tmp_path / "r" / "snapkv", even, dataset="niah", policy="snapkv", budget=20)
    (section,) = aggregate(load_runs([tmp_path / "r"]))
    lap = next(r for r in section.rows if r.policy == "laprox")
    # naive: per layer, the mean over records of kept / prompt
    expect = [sum(rec["layer_kv_tokens"][layer] / 100 for rec in uneven) / 2 for layer in range(3)]
    assert layer_shares(lap.records) == pytest.approx(expect) == [0.35, 0.2, 0.15]
    assert lap.mean_decode_kv_mib == pytest.approx(2.5) and lap.mean_compress_seconds == pytest.approx(0.75)
    report = build_report([tmp_path / "r"], tmp_path / "rep", fmt="md")
    assert "niah_layer_budgets.png" in [p.path.name for p in report.plots]
    assert "| laprox | 20 | 100.0 | 34.2–100.0 | 4.0 | 40.0 | 40 | — | 0.04 | 2.50 | 0.75 | 2 | 1 |" in \
        report.markdown_path.read_text()
    # only uniform layers: no per-layer plot
    report = build_report([tmp_path / "r" / "snapkv"], tmp_path / "rep2", fmt="md")
    assert "niah_layer_budgets.png" not in [p.path.name for p in report.plots]
    # layers disagree in number (records from two models): no shares rather than a wrong mean
    assert layer_shares([uneven[0], {**even[0], "layer_kv_tokens": [20, 20]}]) is None


def test_a_run_resumed_on_another_processor_is_noted(tmp_path):
    """sessions.jsonl ties each record's session to a processor: records from two processors get a note naming
    both and the count from each; records of a session that was not logged are counted as such; one processor,
    or no sessions.jsonl, gives no note."""
    def env(flags: list[str]) -> dict:
        return {"machine": {"cpu": "AMD EPYC", "cpu_flags": flags}}

    rows = [record(0, True, 10, 10, session=1.0), record(1, True, 10, 10, session=2.0),
            record(2, True, 10, 10, session=2.0), record(3, True, 10, 10, session=3.0)]
    run = write_run(tmp_path / "run", rows)
    assert load_runs([run])[0].notes == ()
    sessions = [{"session": 1.0, "environment": env(["avx2"])}, {"session": 2.0, "environment": env(["avx2"])}]
    (run / "sessions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sessions))
    (note,) = load_runs([run])[0].notes
    assert note.endswith("records from 2 processors: 3 on AMD EPYC (avx2); 1 on an unlogged session")
    sessions.append({"session": 3.0, "environment": env(["avx2", "avx512_bf16"])})
    (run / "sessions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sessions) + '{"torn')
    (note,) = load_runs([run])[0].notes
    assert note.endswith("3 on AMD EPYC (avx2); 1 on AMD EPYC (avx2,avx512_bf16)")
    (run / "sessions.jsonl").write_text(json.dumps(sessions[0]) + "\n")
    rows = [record(0, True, 10, 10, session=1.0)]
    (run / "records.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (run / "summary.json").write_text(json.dumps({"n": 1, "accuracy": 1.0}))
    assert load_runs([run])[0].notes == ()
