"""Sweep expansion, validation, per-cell dispatch (local and Ray) and the `skipkv sweep` CLI; no model runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from skipkv import cli
from skipkv.errors import SkipKVError
from skipkv.sweep import CellResult, expand_sweep, load_sweep, run_local, run_ray, to_eval_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sweep_gsm8k.yaml"


def grid(**over) -> dict:
    raw = {
        "model": "random:qwen2",
        "datasets": ["gsm8k", {"name": "niah", "label": "niah4k", "lengths": [4096]}],
        "policies": ["full", "h2o", {"name": "rkv", "window": 8}],
        "budgets": [64, 128],
        "budget_ratios": [0.25],
        "seeds": [0, 1],
        "max_new_tokens": 32,
        "out": "sweep_out",
    }
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not None}


def test_expansion_is_the_cross_product(tmp_path):
    cells = expand_sweep(grid(), tmp_path)
    # per dataset: full x 2 seeds + 2 budgeted policies x 3 budgets x 2 seeds
    assert len(cells) == 2 * (2 + 2 * 3 * 2)
    dirs = [c["out_dir"] for c in cells]
    assert len(set(dirs)) == len(dirs)
    names = [c["name"] for c in cells if c["dataset"] == "gsm8k"]
    assert names == ["full-s0", "full-s1",
                     "h2o-b64-s0", "h2o-b64-s1", "h2o-b128-s0", "h2o-b128-s1", "h2o-r0.25-s0", "h2o-r0.25-s1",
                     "rkv-b64-s0", "rkv-b64-s1", "rkv-b128-s0", "rkv-b128-s1", "rkv-r0.25-s0", "rkv-r0.25-s1"]
    cell = next(c for c in cells if c["name"] == "rkv-b128-s1" and c["dataset"] == "niah")
    assert cell["out_dir"] == str((tmp_path / "sweep_out" / "niah4k" / "rkv-b128-s1").resolve())
    assert (cell["policy"], cell["policy_knobs"], cell["budget"], cell["budget_ratio"], cell["seed"]) == \
        ("rkv", {"window": 8}, 128, None, 1)
    assert cell["dataset_options"] == {"lengths": [4096]} and cell["max_new_tokens"] == 32
    ratio_cell = next(c for c in cells if c["name"] == "h2o-r0.25-s0")
    assert ratio_cell["budget"] is None and ratio_cell["budget_ratio"] == 0.25
    full = [c for c in cells if c["policy"] == "full"]
    assert all(c["budget"] is None and c["budget_ratio"] is None for c in full) and len(full) == 4


def test_unset_settings_stay_unset(tmp_path):
    # Defaults live in the runner's config; the sweep must not invent them (no seed suffix without seeds).
    cells = expand_sweep(grid(seeds=None, max_new_tokens=None, budget_ratios=None), tmp_path)
    assert [c["name"] for c in cells[:3]] == ["full", "h2o-b64", "h2o-b128"]
    assert all("max_new_tokens" not in c and "temperature" not in c and c["seed"] is None for c in cells)


def test_distinct_labels_make_variants_of_one_policy(tmp_path):
    cells = expand_sweep(grid(policies=[{"name": "rkv", "label": "rkv-w8", "window": 8},
                                        {"name": "rkv", "label": "rkv-w32", "window": 32}],
                              datasets=["gsm8k"], budget_ratios=None, seeds=None), tmp_path)
    assert [c["name"] for c in cells] == ["rkv-w8-b64", "rkv-w8-b128", "rkv-w32-b64", "rkv-w32-b128"]
    assert {c["policy"] for c in cells} == {"rkv"}


@pytest.mark.parametrize("over, message", [
    ({"budgetz": [1]}, "unknown key 'budgetz'"),
    ({"budgets": []}, "'budgets' is an empty list"),
    ({"policies": []}, "'policies' is an empty list"),
    ({"budgets": "128"}, "'budgets' must be a list"),
    ({"budgets": [128, "256"]}, "'budgets' items must be positive integers"),
    ({"budgets": [True]}, "'budgets' items must be positive integers"),
    ({"budgets": [64, 64]}, "lists 64 twice"),
    ({"budget_ratios": [1.5]}, "numbers in (0, 1]"),
    ({"seeds": [0.5]}, "'seeds' items must be integers"),
    ({"model": None}, "missing required key 'model'"),
    ({"model": 3}, "'model' must be a non-empty string"),
    ({"limit": 0}, "'limit' must be a positive integer"),
    ({"temperature": -1}, "'temperature' must be a number >= 0"),
    ({"policies": [{"window": 8}]}, "needs a string 'name'"),
    ({"policies": [{"name": "rkv", "budget": 64}]}, "list budgets at the top level"),
    ({"policies": ["rkv", "rkv"]}, "'policies' lists 'rkv' twice"),
    ({"policies": ["rkv", {"name": "rkv", "window": 4}]}, "two entries labelled 'rkv'"),
    ({"policies": [{"name": "rkv", "label": "a/b"}]}, "not a safe directory name"),
    ({"datasets": [{"name": "gsm8k", "label": ".."}]}, "not a safe directory name"),
    ({"budget_ratios": [0.25, 0.2500001]}, "two cells share the output dir"),
    ({"budgets": None, "budget_ratios": None}, "policy 'h2o' needs 'budgets' or 'budget_ratios'"),
    ({"options": {"seed": 3}}, "'options' may not set 'seed'"),
    ({"options": [1]}, "'options' must be a mapping"),
    ({"ray": {"cpus": 2}}, "unknown key 'ray.cpus'"),
    ({"policies": ["rkvv"]}, "unknown policy 'rkvv'; choose one of: "),
    ({"datasets": ["gsm8kk"]}, "unknown dataset 'gsm8kk'; choose one of: "),
    ({"datasets": [{"name": "niah", "lenghts": [1024]}]}, "dataset 'niah' has no option 'lenghts'"),
    ({"policies": ["h2o"]}, "budget_ratios on 'gsm8k' are fractions of a full-cache run's generation length"),
    ({"options": {"out": "x"}}, "'options' may not set 'out'"),
    ({"policies": [{"name": "rkv", "windw": 8}]}, "policy 'rkv' has no knob 'windw'"),
])
def test_validation_errors_are_one_line(tmp_path, over, message):
    raw = grid(**{k: v for k, v in over.items() if v is not None})
    for key in (k for k, v in over.items() if v is None):
        raw.pop(key, None)
    with pytest.raises(SkipKVError) as err:
        expand_sweep(raw, tmp_path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_only_full_needs_no_budgets(tmp_path):
    cells = expand_sweep(grid(policies=["full"], budgets=None, budget_ratios=None), tmp_path)
    assert [c["name"] for c in cells] == ["full-s0", "full-s1"] * 2


def test_example_yaml_expands(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # `out` is relative to the current directory
    raw, cells = load_sweep(EXAMPLE)
    assert cells and len({c["out_dir"] for c in cells}) == len(cells)
    assert all(c["out_dir"].startswith(str(tmp_path.resolve() / raw["out"])) for c in cells)
    assert cells[0]["name"] == "full-s0"


def test_bad_yaml_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(SkipKVError, match="not valid YAML"):
        load_sweep(bad)
    with pytest.raises(SkipKVError, match="cannot read"):
        load_sweep(tmp_path / "missing.yaml")


def test_cells_become_real_eval_configs(tmp_path):
    from skipkv.eval import runner
    cells = expand_sweep(grid(options={"batch_size": 4}), tmp_path)
    configs = {(c["dataset"], c["name"]): to_eval_config(c) for c in cells}
    cfg = configs[("gsm8k", "rkv-b64-s1")]
    assert (cfg.model, cfg.dataset, cfg.policy) == ("random:qwen2", "gsm8k", "rkv")
    assert cfg.out == str((tmp_path / "sweep_out" / "gsm8k" / "rkv-b64-s1").resolve())
    assert (dict(cfg.policy_knobs), cfg.budget, cfg.budget_ratio, cfg.seed) == ({"window": 8}, 64, None, 1)
    assert (cfg.max_new_tokens, cfg.batch_size, cfg.reference) == (32, 4, None)
    # what the YAML does not set keeps the runner's default (one place per default)
    assert cfg.temperature == runner.EvalConfig.__dataclass_fields__["temperature"].default
    # a ratio on gsm8k is a fraction of the full-cache cell's generation length: same dataset, same seed
    ratio = configs[("gsm8k", "h2o-r0.25-s1")]
    assert ratio.budget_ratio == 0.25 and ratio.budget is None
    assert ratio.reference == str((tmp_path / "sweep_out" / "gsm8k" / "full-s1").resolve())
    # on a long-context set it is a fraction of the prompt length: no reference
    assert configs[("niah", "h2o-r0.25-s1")].reference is None
    assert dict(configs[("niah", "full-s0")].dataset_options) == {"lengths": [4096]}
    with pytest.raises(SkipKVError, match="cell full-s0: .*batch_sise"):
        to_eval_config(expand_sweep(grid(options={"batch_sise": 4}), tmp_path)[0])
    # a sweep's cells run blind (no running accuracy) unless its options say otherwise
    assert all(c.blind for c in configs.values())
    assert not to_eval_config(expand_sweep(grid(options={"blind": False}), tmp_path)[0]).blind


def _fake(cell: dict) -> str:
    # Module-level, so it also pickles by reference for the local path; fails on purpose for one cell.
    if cell["name"].startswith("h2o-b128"):
        raise RuntimeError("boom\nsecond line")
    Path(cell["out_dir"]).mkdir(parents=True)
    (Path(cell["out_dir"]) / "done").write_text(cell["name"])
    return cell["out_dir"]


def test_local_dispatch_reports_failures_per_cell(tmp_path):
    cells = expand_sweep(grid(datasets=["gsm8k"], budget_ratios=None, seeds=[0]), tmp_path)
    seen: list[CellResult] = []
    results = run_local(cells, fn=_fake, on_done=seen.append)
    assert [r.name for r in results] == [c["name"] for c in cells] == [r.name for r in seen]
    failed = [r for r in results if not r.ok]
    assert [r.name for r in failed] == ["h2o-b128-s0"]
    assert failed[0].error == "RuntimeError: boom" and "Traceback" in failed[0].detail
    # the cells after the failing one still ran
    assert (Path(cells[-1]["out_dir"]) / "done").read_text() == cells[-1]["name"]


def test_local_dispatch_runs_references_first(tmp_path):
    # `full` is listed last, but the ratio cell needs its run: it must go first, and a failed
    # reference means the dependent cell is not run at all.
    cells = expand_sweep(grid(datasets=["gsm8k"], policies=["h2o", "full"], budgets=None, budget_ratios=[0.5],
                              seeds=[0]), tmp_path)
    assert [c["name"] for c in cells] == ["h2o-r0.5-s0", "full-s0"]
    calls: list[str] = []
    results = run_local(cells, fn=lambda cell: calls.append(cell["name"]))
    assert calls == ["full-s0", "h2o-r0.5-s0"] and all(r.ok for r in results)
    assert [r.name for r in results] == ["h2o-r0.5-s0", "full-s0"]  # reported in cell order

    def full_fails(cell: dict) -> None:
        calls.append(cell["name"])
        if cell["policy"] == "full":
            raise RuntimeError("no model")

    calls.clear()
    results = run_local(cells, fn=full_fails)
    assert calls == ["full-s0"]
    assert results[0].error == "not run: its reference cell full-s0 failed"


def test_ray_dispatch_runs_cells_as_tasks(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    import skipkv

    cells = expand_sweep(grid(datasets=["gsm8k"], policies=["full", "h2o"], budgets=[64], budget_ratios=[0.5],
                              seeds=[0]), tmp_path)
    assert [c["name"] for c in cells] == ["full-s0", "h2o-b64-s0", "h2o-r0.5-s0"]

    def fake(cell: dict) -> str:
        # Defined inside the test so Ray ships it by value; it runs in a worker process, not here.
        import os as os_
        import time as time_
        from pathlib import Path as P

        if cell["budget"] == 64:
            raise ValueError("bad cell")
        if cell["reference"]:  # must only start once its full-cache reference has finished
            if not (P(cell["reference"]) / "pid").exists():
                raise RuntimeError("ran before its reference")
        else:
            time_.sleep(1.5)  # a slow reference: without the dependency the ratio cell would overtake it
        P(cell["out_dir"]).mkdir(parents=True)
        (P(cell["out_dir"]) / "pid").write_text(str(os_.getpid()))
        return cell["out_dir"]

    # Workers must import skipkv from this checkout even when it is not pip-installed; the local cluster
    # inherits this environment (cheaper than a runtime_env, which starts an agent).
    src = str(Path(skipkv.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    results = run_ray(cells, fn=fake, num_cpus=1,
                      init_kwargs={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False})
    assert [r.name for r in results] == ["full-s0", "h2o-b64-s0", "h2o-r0.5-s0"]
    assert [r.error for r in results] == [None, "ValueError: bad cell", None]
    pid = int((Path(cells[0]["out_dir"]) / "pid").read_text())
    assert pid != os.getpid()  # it really ran in a Ray worker


def _main(monkeypatch, argv: list[str]) -> int:
    # Only this feature's subcommands: the test must not depend on other subcommand modules.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["skipkv.sweep", "skipkv.report.cli"])
    return cli.main(argv)


def test_cli_dry_run_lists_cells(monkeypatch, tmp_path, capsys):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump(grid(datasets=["gsm8k"], budget_ratios=None, seeds=[0])))
    monkeypatch.chdir(tmp_path)
    assert _main(monkeypatch, ["sweep", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "5 cells" in out and "rkv-b128-s0" in out
    assert not (tmp_path / "sweep_out").exists()  # a dry run creates nothing


def test_cli_runs_cells_and_exits_1_on_a_failed_cell(monkeypatch, tmp_path, capsys):
    import skipkv.sweep.run as sweep  # where run_unit finds run_cell

    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump(grid(datasets=["gsm8k"], budget_ratios=None, seeds=[0])))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep, "run_cell", _fake)
    assert _main(monkeypatch, ["sweep", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert "4/5 cells finished" in out and "h2o-b128-s0" in out
    assert (tmp_path / "sweep_out" / "gsm8k" / "rkv-b64-s0" / "done").exists()


def test_cli_bad_config_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump(grid(budgets=[])))
    assert _main(monkeypatch, ["sweep", str(cfg), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == "skipkv: error: sweep: 'budgets' is an empty list\n"


def test_share_prefill_groups_the_cells_that_can_share(tmp_path):
    from skipkv.sweep import expand_results, shared_units

    raw = grid(datasets=["gsm8k", {"name": "niah", "lengths": [4096]}],
               policies=["full", {"name": "snapkv", "phase": "prefill"}, "h2o", "laprox"],
               budgets=[64], budget_ratios=[0.1], seeds=[0], share_prefill=True, options={"batch_size": 1})
    cells = expand_sweep(raw, tmp_path)
    units = shared_units(cells)
    groups = [[c["name"] for c in u["group"]] for u in units if "group" in u]
    # niah: every cell; gsm8k: the token-budget cells, not the ratio cells (they refer to the full cell, which
    # stays a cell of its own so it runs first).
    assert groups == [["snapkv-b64-s0", "h2o-b64-s0", "laprox-b64-s0"],
                      ["full-s0", "snapkv-b64-s0", "snapkv-r0.1-s0", "h2o-b64-s0", "h2o-r0.1-s0", "laprox-b64-s0",
                       "laprox-r0.1-s0"]]
    alone = [u["name"] for u in units if "group" not in u]
    assert alone == ["full-s0", "snapkv-r0.1-s0", "h2o-r0.1-s0", "laprox-r0.1-s0"]
    per_cell = expand_results(units, [CellResult(u["name"], u["out_dir"], 1.0, "E" if "group" in u else None)
                                      for u in units])
    assert sorted(r.out_dir for r in per_cell) == sorted(c["out_dir"] for c in cells)
    assert sum(r.error == "E" for r in per_cell) == 10
    unshared = shared_units(expand_sweep({**raw, "options": {"batch_size": 2}}, tmp_path))
    assert not any("group" in u for u in unshared)  # batch 2 prefills two examples at once: no sharing
    with pytest.raises(SkipKVError, match="'share_prefill' must be true or false"):
        expand_sweep({**raw, "share_prefill": "yes"}, tmp_path)


def test_cli_share_prefill_runs_a_group(monkeypatch, tmp_path, capsys):
    """End to end on a tiny model: the dry run shows the group, the run writes every cell's dir."""
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": "random:qwen2:sharp", "datasets": [{"name": "niah", "lengths": [500], "depths": [0.5]}],
        "policies": ["full", {"name": "snapkv", "phase": "prefill"}, "laprox", "skipkv"], "budget_ratios": [0.2],
        "max_new_tokens": 6, "temperature": 0.0, "out": "o", "share_prefill": True,
        "options": {"batch_size": 1, "quiet": True}}))
    monkeypatch.chdir(tmp_path)
    assert _main(monkeypatch, ["sweep", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "shared prefill" in out and out.count("group 1") == 3
    assert _main(monkeypatch, ["sweep", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "4/4 cells finished" in out and "3 cells sharing a prefill" in out
    for name in ("full", "snapkv-r0.2", "laprox-r0.2", "skipkv-r0.2"):
        assert (tmp_path / "o" / "niah" / name / "summary.json").exists()
    import json

    def execution(cell: str) -> dict:
        return json.loads((tmp_path / "o" / "niah" / cell / "config.json").read_text())["execution"]

    assert execution("laprox-r0.2")["shared_prefill"]
    assert "shared_prefill" not in execution("skipkv-r0.2")


def test_a_dataset_entry_can_run_a_subset_of_the_cells(tmp_path):
    datasets = [{"name": "gsm8k", "label": "all", "limit": 4},
                {"name": "gsm8k", "label": "key", "offset": 4, "limit": 4, "cells": ["full-*", "rkv-b64-*"]}]
    cells = expand_sweep(grid(datasets=datasets, budget_ratios=None), tmp_path)
    by = {}
    for c in cells:
        by.setdefault(Path(c["out_dir"]).parent.name, []).append(c["name"])
    assert len(by["all"]) == 2 + 2 * 2 * 2
    assert by["key"] == ["full-s0", "full-s1", "rkv-b64-s0", "rkv-b64-s1"]
    key = next(c for c in cells if Path(c["out_dir"]).parent.name == "key")
    assert key["dataset_options"] == {"offset": 4} and key["limit"] == 4
    with pytest.raises(SkipKVError, match="pattern 'rkv-b99-\\*' matches no cell"):
        expand_sweep(grid(datasets=[{"name": "gsm8k", "cells": ["rkv-b99-*"]}]), tmp_path)


# ------------------------------------------------------------------------------------------- --status
def _records(out: Path, n: int, torn: bool = False) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": f"gsm8k-test-{i:04d}", "sample": 0, "correct": True}) + "\n" for i in range(n)]
    (out / "records.jsonl").write_text("".join(lines) + ('{"id": "gsm8k-te' if torn else ""))


def test_lock_holders_reads_flock_lines_only(tmp_path):
    from skipkv.sweep.status import lock_holders

    locks = tmp_path / "locks"
    locks.write_text("1: FLOCK  ADVISORY  WRITE 12988 fe:00:5351085 0 EOF\n"
                     "1: -> FLOCK  ADVISORY  WRITE 4242 fe:00:5351085 0 EOF\n"  # waiting: holds nothing
                     "2: POSIX  ADVISORY  WRITE 777 08:01:99 0 EOF\n"
                     "3: FLOCK  ADVISORY  READ 13 103:0a:12 0 EOF\n")
    assert lock_holders(locks) == {(0xfe, 0, 5351085): 12988, (0x103, 0x0a, 12): 13}
    assert lock_holders(tmp_path / "missing") == {}


def test_cell_status_reads_without_touching(tmp_path):
    import json

    from skipkv.sweep.status import cell_status

    def status(name: str, limit: int | None = 4):
        return cell_status({"name": name, "out_dir": str(tmp_path / name)}, limit, 1, {})

    assert status("none").state == "not started" and status("none").done == 0
    _records(tmp_path / "torn", 2, torn=True)
    before = (tmp_path / "torn" / "records.jsonl").read_bytes()
    s = status("torn")
    assert (s.done, s.target, s.state) == (2, 4, "partial")
    # A torn last line may be a record a running process is writing: a status read must not cut it.
    assert (tmp_path / "torn" / "records.jsonl").read_bytes() == before
    _records(tmp_path / "all", 4)
    assert status("all").state == "complete"
    # Without a limit only summary.json can say complete, and only for the records it counted.
    _records(tmp_path / "nolimit", 3)
    assert status("nolimit", None).state == "partial"
    (tmp_path / "nolimit" / "summary.json").write_text(json.dumps({"n": 3, "complete": True}))
    assert status("nolimit", None).state == "complete"
    (tmp_path / "nolimit" / "summary.json").write_text(json.dumps({"n": 2, "complete": True}))
    assert status("nolimit", None).state == "partial"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "records.jsonl").write_text('{"id": "a", "sample": 0}\nnot json\n{"id": "b", "sample": 0}\n')
    assert status("bad").state.startswith("damaged: ") and "not valid JSON" in status("bad").state


def test_cell_status_names_the_process_holding_the_lock(tmp_path):
    from skipkv.eval.rundir import locked
    from skipkv.sweep.status import PROC_LOCKS, cell_status, lock_holders

    if not PROC_LOCKS.exists():
        pytest.skip("no /proc/locks here")
    cell = {"name": "c", "out_dir": str(tmp_path / "c")}
    _records(tmp_path / "c", 1)
    with locked(tmp_path / "c"):
        s = cell_status(cell, 4, 1, lock_holders())
        assert (s.writer, s.state) == (os.getpid(), f"running (pid {os.getpid()})")
    assert cell_status(cell, 4, 1, lock_holders()).state == "partial"


def test_cli_status_is_blind_and_counts(monkeypatch, tmp_path, capsys):
    import json

    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump(grid(datasets=["gsm8k"], budget_ratios=None, seeds=[0], limit=4)))
    monkeypatch.chdir(tmp_path)
    cells = load_sweep(cfg)[1]
    _records(Path(cells[0]["out_dir"]), 4)
    (Path(cells[0]["out_dir"]) / "summary.json").write_text(json.dumps({"n": 4, "complete": True,
                                                                       "accuracy": 0.8125}))
    _records(Path(cells[1]["out_dir"]), 1)
    capsys.readouterr()
    assert _main(monkeypatch, ["sweep", str(cfg), "--status"]) == 0
    out = capsys.readouterr().out
    assert "1 of 5 cells complete, 0 running, 5 of 20 records" in " ".join(out.split())
    assert "4/4" in out and "1/4" in out and "not started" in out
    assert "0.8125" not in out and "81.2" not in out  # a sweep runs blind: no accuracy
    assert not (Path(cells[2]["out_dir"])).exists()  # reads, creates nothing
    assert _main(monkeypatch, ["sweep", str(cfg), "--status", "--ray"]) == 2
    assert capsys.readouterr().err == "skipkv: error: sweep: --status reads the run dirs here; it takes no --ray\n"
    with pytest.raises(SystemExit):
        _main(monkeypatch, ["sweep", str(cfg), "--status", "--dry-run"])
