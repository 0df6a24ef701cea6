"""Fuzzing the command line: random knob values, sizes, paths and files; every run ends in success (exit 0) or
one line on stderr with exit 2, never a traceback.

    pytest -q tests/test_fuzz_cli.py                              # the default, ~15 s
    SKIPKV_FUZZ_EXAMPLES=400 pytest -q tests/test_fuzz_cli.py     # a longer run (examples per test)

Runs in-process through `skipkv.cli.main`, on `random:qwen2` with a handful of generated tokens, so the
cases that succeed stay cheap; the generators lean towards values that must be refused (nan, inf,
negatives, huge numbers, wrong types, odd strings, missing/binary/file-as-folder paths).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from skipkv.cli import main  # noqa: E402

EXAMPLES = int(os.environ.get("SKIPKV_FUZZ_EXAMPLES", "0"))


def _settings(default: int):
    return settings(max_examples=EXAMPLES or default, deadline=None, derandomize=not EXAMPLES,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# Numbers as the shell would pass them: valid small ones, edges, and the ones to refuse.
_NUMBERS = st.one_of(
    st.sampled_from(["0", "1", "2", "3", "7", "8", "16", "-1", "-3", "nan", "inf", "-inf", "1e308", "0.5", "1.5",
                     "1e-300", "99999999999999999999", "abc", "", " ", "0x10", "１", "True", "None", "3.0"]),
    st.integers(-10**12, 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=6),
)
_SMALL_TOKENS = st.sampled_from(["1", "2", "3"])  # success stays cheap
_TOKENS = st.one_of(_SMALL_TOKENS, _SMALL_TOKENS, st.sampled_from(["0", "-5", "4096", "5000", "1000000000", "nan",
                                                                    "2.5", "x"]))
_STRINGS = st.one_of(st.sampled_from(["max", "mean", "median", "both", "prefill", "decode", "accumulated", "", "MAX",
                                      "../x", "\x00"]), st.text(max_size=8))
# flag -> values; policy knobs come from the registry so a new knob is fuzzed without editing this file.
_KNOB_FLAGS = {
    "--budget": _NUMBERS, "--window": _NUMBERS, "--sink": _NUMBERS, "--interval": _NUMBERS, "--phase": _STRINGS,
    "--variant": _STRINGS, "--mix-lambda": _NUMBERS, "--threshold": _NUMBERS, "--kernel": _NUMBERS,
    "--prefill-window": _NUMBERS, "--pooling": _STRINGS, "--group-reduce": _STRINGS,
}
_SAMPLING_FLAGS = {"--temperature": _NUMBERS, "--top-p": _NUMBERS, "--top-k": _NUMBERS, "--seed": _NUMBERS,
                   "--batch-size": _NUMBERS, "--prefill-chunk": _NUMBERS}
_POLICIES = st.sampled_from(["full", "rkv", "snapkv", "h2o", "streaming_llm", "nope", ""])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Paths of every kind the generators pick from (made once per module)."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "afile").write_text("not a folder")
    (root / "binary.jsonl").write_bytes(b"\x80\x81\xfe\xff\x00garbage")
    (root / "prompts.jsonl").write_text('"hello"\n{"prompt": "two"}\n')
    (root / "badrow.jsonl").write_text('{"prompt": 3}\n')
    (root / "empty.jsonl").write_text("")
    (root / "adir").mkdir()
    (root / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    (root / "noconfig").mkdir()
    # The working directory holds a finished run, so a command that wrongly defaults to "." finds work to do.
    shutil.copytree(Path(__file__).parents[1] / "docs" / "results" / "runs" / "gsm8k" / "full-s0", root / "cwd" / "run",
                    ignore=shutil.ignore_patterns("*.png", "report*"))
    from skipkv.models import load_model

    bundle = load_model("random:qwen2", dtype="fp32")
    bundle.model.save_pretrained(root / "model")
    bundle.tokenizer.save_pretrained(root / "model")
    shutil.copytree(root / "model", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    sweep = root / "sweep.yaml"
    sweep.write_text("model: random:qwen2\ndatasets: [gsm8k]\npolicies: [full]\nout: runs\nlimit: 1\n")
    return {k: str(root / k) for k in ("afile", "binary.jsonl", "prompts.jsonl", "badrow.jsonl", "empty.jsonl",
                                       "adir", "bad.gguf", "noconfig", "model", "truncated", "sweep.yaml", "cwd")} | {
        "root": str(root), "missing": str(root / "missing" / "x"), "below_file": str(root / "afile" / "x"),
        "proc": "/proc/skipkv-fuzz/x"}


def _path(files: dict[str, str], *keys: str):
    return st.sampled_from([files[k] for k in keys] + [""])


def _tree(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).rglob("*"))


def _check(argv: list[str], capsys) -> int:
    """Run the CLI; assert it ended in success or a one-line error with exit 2 and left the working directory
    as it was. Returns the exit code."""
    before = _tree(".")
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse usage errors
        rc = exc.code if isinstance(exc.code, int) else 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, (argv, err)
    assert _tree(".") == before, (argv, "wrote into the working directory")
    if rc == 0:
        return rc
    assert rc == 2, (argv, rc, err)
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]  # tqdm of a model load
    assert len(lines) == 1 and "error:" in lines[0], (argv, err)
    return rc


def _flags(draw, table: dict, k: int) -> list[str]:
    out = []
    for flag in draw(st.lists(st.sampled_from(sorted(table)), max_size=k, unique=True)):
        out += [flag, draw(table[flag])]
    return out


_counter = itertools.count()


@st.composite
def generate_argv(draw, files):
    model = draw(st.one_of(st.just("random:qwen2"), st.just("random:qwen2"), st.sampled_from([
        "random:nope", "random:qwen2:huge", files["missing"], files["afile"], files["adir"], files["noconfig"],
        files["bad.gguf"], files["truncated"], files["binary.jsonl"], "no-such-org/no-such-model", ""])))
    argv = ["generate", "--model", model, "--dtype", draw(st.sampled_from(["fp32", "fp32", "bf16", "int3", ""])),
            "--policy", draw(_POLICIES), "--max-new-tokens", draw(_TOKENS)]
    argv += _flags(draw, _KNOB_FLAGS, 3) + _flags(draw, _SAMPLING_FLAGS, 2)
    if draw(st.booleans()):
        argv += ["--prompts", draw(_path(files, "binary.jsonl", "prompts.jsonl", "badrow.jsonl", "empty.jsonl",
                                         "adir", "missing", "below_file", "afile"))]
    argv += draw(st.lists(st.sampled_from(["hi", "a b c", " ", "ünïcode", "x" * 50]), max_size=2))
    return argv


def test_fuzz_generate(files, capsys, monkeypatch) -> None:
    monkeypatch.chdir(files['cwd'])  # empty, and must stay so: no run writes into the working directory
    @_settings(30)
    @given(generate_argv(files))
    def run(argv: list[str]) -> None:
        _check(argv, capsys)

    run()


@st.composite
def eval_argv(draw, files):
    out = draw(st.sampled_from(["new", "new", "", files["afile"], files["below_file"], files["proc"], files["adir"]]))
    if out == "new":
        out = str(Path(files["root"]) / f"run{next(_counter)}")
    argv = ["eval", "--model", draw(st.sampled_from(["random:qwen2", "random:qwen2", files["missing"]])),
            "--dataset", draw(st.sampled_from(["gsm8k", "gsm8k", "niah", "nope"])), "--out", out, "--quiet",
            "--limit", draw(st.sampled_from(["1", "0", "-1", "x"])), "--max-new-tokens", draw(_TOKENS),
            "--policy", draw(_POLICIES)]
    argv += _flags(draw, {**_KNOB_FLAGS, **_SAMPLING_FLAGS, "--budget-ratio": _NUMBERS, "--samples": _NUMBERS,
                          "--device": st.sampled_from(["cpu", "cuda:7", "meta", "tpu", ""]),
                          "--code-timeout": _NUMBERS, "--lengths": st.sampled_from(["64", "0", "-1", "1,x", "99999"]),
                          "--depths": st.sampled_from(["0.5", "2", "nan", "-1"]),
                          "--data": _path(files, "binary.jsonl", "missing", "adir", "badrow.jsonl")}, 3)
    return argv, out


def test_fuzz_eval(files, capsys, monkeypatch) -> None:
    monkeypatch.chdir(files['cwd'])  # empty, and must stay so: no run writes into the working directory
    @_settings(12)
    @given(eval_argv(files))
    def run(case) -> None:
        argv, out = case
        existed = bool(out) and Path(out).exists()
        rc = _check(argv, capsys)
        if rc == 2 and out and not existed:
            assert not Path(out).exists(), f"a refused run left {out} behind: {argv}"

    run()


@st.composite
def other_argv(draw, files):
    kind = draw(st.sampled_from(["bench", "report", "sweep"]))
    if kind == "bench":
        return ["bench", "decode", "--model", "random:qwen2", "--dtype", "fp32",
                "--policies", draw(st.sampled_from(["full", "rkv", "full,rkv", "nope", ""])),
                "--lengths", draw(st.sampled_from(["2,3", "3", "1", "0", "x", "", "-2,3"]))] + _flags(draw, {
                    "--batch-size": _NUMBERS, "--span": _NUMBERS, "--budget": _NUMBERS, "--interval": _NUMBERS,
                    "--window": _NUMBERS,
                    "--out": _path(files, "afile", "below_file", "adir", "proc", "missing")}, 3)
    if kind == "report":
        return ["report", draw(_path(files, "adir", "missing", "afile", "binary.jsonl", "root")),
                "--format", draw(st.sampled_from(["terminal", "md", "both"]))] + _flags(draw, {
                    "--out": _path(files, "afile", "below_file", "proc", "missing")}, 1)
    # A sweep file with one value fuzzed; --dry-run validates every cell without running one.
    key = draw(st.sampled_from(["limit", "samples", "temperature", "max_new_tokens", "budgets", "out", "options"]))
    value = draw(st.one_of(st.sampled_from([0, -1, 1.5, "x", None, float("nan"), float("inf"), 10**30, [], {},
                                            [0], [float("nan")], {"batch_size": 0}, {"device": "cuda:7"},
                                            {"prompt_style": "odd"}, {"nope": 1}, ""]), st.integers()))
    raw = {"model": "random:qwen2", "datasets": ["gsm8k"], "policies": ["full", "rkv"], "budgets": [16],
           "out": str(Path(files["root"]) / "sweep-runs"), "limit": 1, key: value}
    path = Path(files["root"]) / f"sweep{next(_counter)}.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return ["sweep", str(path), "--dry-run"]


def test_fuzz_bench_report_sweep(files, capsys, monkeypatch) -> None:
    monkeypatch.chdir(files['cwd'])  # empty, and must stay so: no run writes into the working directory
    @_settings(20)
    @given(other_argv(files))
    def run(argv: list[str]) -> None:
        _check(argv, capsys)

    run()
