"""Arguments at the edge: every count a user gives is bounded (with its reason) before any model loads, text is
checked for what no tokenizer can encode, and outputs go only where asked. Plus a hypothesis fuzz of the bounds.

    python -m pytest tests/test_bounds.py -q
    SKIPKV_FUZZ_EXAMPLES=300 python -m pytest tests/test_bounds.py -q -k fuzz     # a longer fuzz
"""

from __future__ import annotations

import base64
import functools
import json
import os
import zlib
from pathlib import Path

import pytest

import skipkv.models
from skipkv import cli
from skipkv.config import MAX_BATCH, MAX_SAMPLES, MAX_SEED, MAX_TOKENS
from skipkv.errors import SkipKVError

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("SKIPKV_FUZZ_EXAMPLES", "0"))
LOADED = "MODEL-LOADED"  # what the patched load_model raises: the command got past every check


@pytest.fixture()
def no_model(monkeypatch):
    """load_model refuses with a marker, so "refused before any work" is checked and nothing heavy runs."""
    @functools.wraps(skipkv.models.load_model)  # the same signature: EvalConfig reads its defaults from it
    def refuse(*args, **kwargs):
        raise SkipKVError(LOADED)

    monkeypatch.setattr(skipkv.models, "load_model", refuse)


def run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def refused(argv: list[str], capsys, *words: str) -> str:
    rc, err = run(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert LOADED not in err, f"{argv} reached the model load: {err}"
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


GEN = ["generate", "--model", "random:qwen2", "--max-new-tokens", "2"]
EVAL = ["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--max-new-tokens", "2", "--quiet"]
BIG = str(10**30)
COUNTS = [
    (GEN + ["--seed", str(2**64), "hi"], "64-bit"),
    (GEN + ["--seed", "-1", "hi"], "seed"),
    (["generate", "--model", "random:qwen2", "--max-new-tokens", str(10**12), "hi"], "context"),
    (GEN + ["--batch-size", str(10**9), "hi"], "slot store"),
    (GEN + ["--threads", str(10**7), "hi"], "threads"),
    (GEN + ["--top-k", BIG, "hi"], "top_k"),
    (GEN + ["--prefill-chunk", BIG, "hi"], "context"),
    (GEN + ["--kv-memory", "9" * 25, "hi"], "pebibyte"),
    (GEN + ["--kv-memory", "9" * 400, "hi"], "size"),
    (EVAL + ["--force-wait", BIG, "--out", "{tmp}/e"], "force_wait"),
    (EVAL + ["--temperature", "0.7", "--samples", "1000000000", "--out", "{tmp}/e"], "samples"),
    (EVAL + ["--limit", BIG, "--out", "{tmp}/e"], "limit"),
    (EVAL + ["--seed", str(2**64), "--out", "{tmp}/e"], "64-bit"),
    (EVAL + ["--offset", BIG, "--out", "{tmp}/e"], "offset"),
    (EVAL + ["--data-seed", str(2**64), "--out", "{tmp}/e"], "64-bit"),
    (["eval", "--model", "random:qwen2", "--dataset", "niah", "--per-length", "1000000000", "--out", "{tmp}/e"],
     "per-length"),
    (["eval", "--model", "random:qwen2", "--dataset", "niah", "--lengths", "1024,2048", "--per-length", "9000",
      "--depths", "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1", "--out", "{tmp}/e"], "examples"),
    (["bench", "throughput", "--model", "random:qwen2", "--requests", BIG], "--requests"),
    (["bench", "throughput", "--model", "random:qwen2", "--seed", str(2**64)], "64-bit"),
    (["bench", "throughput", "--model", "random:qwen2", "--batch-sweep", "1," + BIG], "--batch-sweep"),
    (["bench", "throughput", "--model", "random:qwen2", "--max-new-tokens", BIG], "context"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--concurrency", "1,100000000"], "connections"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--requests", BIG], "--requests"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--soak", "1e9"], "--soak"),
    (["bench", "decode", "--model", "random:qwen2", "--lengths", "16," + BIG], "--lengths"),
    (["bench", "fidelity", "--model", "random:qwen2", "--examples", BIG], "--examples"),
    (["steer", "build", "--model", "random:qwen2", "--dataset", "math500", "--limit", BIG, "--layers", "0",
      "--out", "{tmp}/v.safetensors"], "--limit"),
    (["steer", "build", "--model", "random:qwen2", "--dataset", "math500", "--limit", "2", "--layers", "0," + BIG,
      "--out", "{tmp}/v.safetensors"], "--layers"),
    (["sweep", "{tmp}/s.yaml"], "samples"),
]


@pytest.mark.parametrize("argv, word", COUNTS, ids=[f"{a[0]}-{i}" for i, (a, _w) in enumerate(COUNTS)])
def test_counts_are_bounded_before_any_work(argv: list[str], word: str, tmp_path: Path, capsys, no_model,
                                            monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text("model: random:qwen2\ndatasets: [gsm8k]\npolicies: [full]\nout: runs\n"
                                     "options: {samples: 100000000, temperature: 0.7}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    refused([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys, word)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


TEXT = [
    (GEN + ["a\udcffb"], "PROMPT 0"),
    (GEN + ["--stop", "x\udcff", "hi"], "--stop"),
    (GEN + ["--prompts", "{tmp}/p.jsonl"], "p.jsonl:2"),
    (EVAL + ["--data", "{tmp}/d.jsonl", "--out", "{tmp}/e"], "d.jsonl:1"),
    (["show", "{tmp}", "--id", "a\udcff"], "--id"),
    (["sweep", "{tmp}/t.yaml"], "t.yaml"),
]


@pytest.mark.parametrize("argv, word", TEXT, ids=[f"{a[0]}-{i}" for i, (a, _w) in enumerate(TEXT)])
def test_text_no_tokenizer_can_encode_is_refused_at_the_edge(argv: list[str], word: str, tmp_path: Path, capsys,
                                                             no_model) -> None:
    (tmp_path / "p.jsonl").write_text('"fine"\n"a\\udcffb"\n')
    (tmp_path / "d.jsonl").write_text('{"id": "a", "problem": "x\\ud800", "answer": "1"}\n')
    (tmp_path / "t.yaml").write_text('model: "a\\udcffb"\ndatasets: [gsm8k]\npolicies: [full]\nout: r\n')
    line = refused([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys, word, "lone surrogate")
    assert "TextEncodeInput" not in line


def _traced_run(root: Path) -> Path:
    root.mkdir(parents=True)
    data = base64.b64encode(zlib.compress(bytes([0xFF] * 3))).decode("ascii")
    trace = {"num_layers": 1, "num_kv_heads": 1, "prompt_len": 2, "prompt_tokens": ["a", "b"], "output_tokens": ["c"],
             "compressions": [], "evicted": {"dtype": "uint8", "shape": [1, 1, 3], "codec": "zlib+base64",
                                             "data": data}}
    (root / "config.json").write_text(json.dumps({"model": "m", "dataset": {"name": "gsm8k"},
                                                  "policy": {"name": "rkv"}}))
    (root / "records.jsonl").write_text(json.dumps({"id": "a", "sample": 0, "generated_tokens": 1}) + "\n")
    (root / "traces.jsonl").write_text(json.dumps({"id": "a", "sample": 0, "trace": trace}) + "\n")
    return root


def test_outputs_go_only_where_asked(tmp_path: Path, capsys, monkeypatch, no_model) -> None:
    run_dir = _traced_run(tmp_path / "run")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "index.html").write_text("mine")
    monkeypatch.chdir(cwd)
    (tmp_path / "afile").write_text("x")
    for out, word in (("", "must name a path"), (" ", "must name a path"), (str(cwd), "holds other files"),
                      (".", "holds other files"), (str(tmp_path / "afile"), "is a file"), (str(run_dir), "other files"),
                      ("a\0b", "NUL")):
        refused(["show", str(run_dir), "--out", out], capsys, "--out", word)
    refused(["show", "", "--out", str(tmp_path / "p")], capsys, "must name a path")
    for argv in (["bench", "serve", "--url", "http://127.0.0.1:9", "--out", ""],
                 ["bench", "serve", "--url", "http://127.0.0.1:9", "--soak", "1", "--out", str(tmp_path / "afile/x")],
                 ["bench", "fidelity", "--model", "random:qwen2", "--out", ""],
                 ["steer", "build", "--model", "random:qwen2", "--dataset", "math500", "--limit", "1", "--layers", "0",
                  "--out", ""]):
        refused(argv, capsys, "--out")
    assert sorted(p.name for p in cwd.iterdir()) == ["index.html"] and (cwd / "index.html").read_text() == "mine"
    # Where it may write: a new folder, its own folder again, and the default RUN_DIR/show.
    for out in (str(tmp_path / "new"), str(tmp_path / "new"), None):
        rc, err = run(["show", str(run_dir)] + (["--out", out] if out else []), capsys)
        assert rc == 0, err
    assert (run_dir / "show" / "index.html").is_file() and (tmp_path / "new" / "a.html").is_file()


# ------------------------------------------------------------------------------------------ fuzz
# (argv before the value, flag, lowest accepted, highest accepted, argv after): a value outside [lo, hi] must be
# refused before the model loads; one inside may go on (to the patched load_model) or be refused for another reason.
_BOUNDS = [
    (GEN, "--seed", 0, MAX_SEED, ["hi"]),
    (GEN, "--batch-size", 1, MAX_BATCH, ["hi"]),
    (["generate", "--model", "random:qwen2"], "--max-new-tokens", 1, MAX_TOKENS, ["hi"]),
    (GEN, "--threads", 0, 1024, ["hi"]),
    (GEN, "--top-k", 0, 2**31, ["hi"]),
    (GEN, "--prefill-chunk", 0, MAX_TOKENS, ["hi"]),
    (EVAL + ["--temperature", "0.5", "--out", "{tmp}/e"], "--samples", 1, MAX_SAMPLES, []),
    (EVAL + ["--out", "{tmp}/e"], "--seed", 0, MAX_SEED, []),
    (EVAL + ["--out", "{tmp}/e"], "--limit", 1, 2**31, []),
    (EVAL + ["--out", "{tmp}/e"], "--offset", 0, 2**31, []),
    (["bench", "throughput", "--model", "random:qwen2"], "--requests", 1, 1 << 20, []),
]
_VALUES = st.one_of(st.integers(-5, 5), st.integers(-2**70, 2**70), st.sampled_from(
    [2**31, 2**31 + 1, 2**63, 2**64 - 1, 2**64, 1024, 1025, 4096, 4097, 1 << 22, (1 << 22) + 1, 10**30]))


@settings(max_examples=EXAMPLES or 30, deadline=None, derandomize=not EXAMPLES,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=st.sampled_from(_BOUNDS), value=_VALUES)
def test_fuzz_count_bounds(case, value: int, tmp_path: Path, capsys, no_model) -> None:
    head, flag, lo, hi, tail = case
    argv = [a.replace("{tmp}", str(tmp_path)) for a in head] + [flag, str(value)] + tail
    rc, err = run(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (argv, err)  # success is impossible: no model
    if not lo <= value <= hi:
        assert LOADED not in lines[0], f"{flag} {value} is outside [{lo}, {hi}] but reached the model: {argv}"
