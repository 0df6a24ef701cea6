"""Every file skipkv reads goes through one bounded reader (skipkv.files): hostile files give one line naming the
file and line, never a traceback, an unbounded allocation or a silently changed value; what the project writes it
reads back. Each test replays several variants of its class through the real entry points.

    python -m pytest tests/test_files.py -q
"""

from __future__ import annotations

import argparse
import base64
import json
import zlib
from pathlib import Path

import pytest

from skipkv.errors import SkipKVError
from skipkv.eval.data import DataRequest
from skipkv.eval.datasets import get_dataset
from skipkv.eval.records import RecordStore, read_traces
from skipkv.report.runs import load_run, read_records
from skipkv.report.viewer import write_pages
from skipkv.sweep.spec import load_sweep

DEEP = "[" * 100_000 + "]" * 100_000
BIG_INT = "1" * 5000


def tiny_trace(n: int, out: int = 0) -> dict:
    """A valid trace of n prompt tokens and `out` generated ones, no compression."""
    data = base64.b64encode(zlib.compress(bytes([0xFF] * (n + out)))).decode("ascii")
    return {"version": 1, "num_layers": 1, "num_kv_heads": 1, "prompt_len": n, "prompt_tokens": ["x"] * n,
            "output_tokens": ["y"] * out, "compressions": [], "final_state": None,
            "evicted": {"dtype": "uint8", "shape": [1, 1, n + out], "codec": "zlib+base64", "data": data}}


def one_line(exc: BaseException, path: Path | None = None) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < 400, text
    if path is not None:
        assert str(path) in text, text
    return text


def _prompts(path: Path) -> list[str]:
    from skipkv.engine.cli import read_prompts

    return read_prompts(argparse.Namespace(prompt=[], prompts=str(path)))


def _data(path: Path) -> list:
    return get_dataset("gsm8k").load(DataRequest(data=str(path)))


def _code_data(path: Path) -> list:
    return get_dataset("humaneval").load(DataRequest(data=str(path)))


def _store(path: Path) -> list:
    return RecordStore(path).records()


def _report(path: Path) -> list:
    return read_records(path)[0]


def _sweep(path: Path):
    return load_sweep(path)


MATH = {"id": "a", "problem": "1+1?", "answer": "2"}
REC = {"id": "a", "sample": 0, "generated_tokens": 1}
# (reader, file name, content, words the message must hold): a line is given as text and "\n"-terminated.
HOSTILE = [
    (_prompts, "p.jsonl", DEEP, "nested deeper"),
    (_prompts, "p.jsonl", BIG_INT, "number of 5000"),
    (_prompts, "p.jsonl", '{"prompt": ' + BIG_INT + "}", "number of 5000"),
    (_prompts, "p.jsonl", '"' + "a" * (5 << 20) + '"', "longer than 4 MiB"),
    (_prompts, "p.jsonl", '[1, 2]', "expected a JSON object or a string"),
    (_prompts, "p.jsonl", '{"prompt": null}', "prompt"),
    (_prompts, "p.jsonl", '{"prompt": "a", "prompt": "b"}', "given twice"),
    (_prompts, "p.jsonl", '"a\\udcffb"', "lone surrogate"),
    (_prompts, "p.jsonl", '{"text": "ok", "\\ud800": 1}', "lone surrogate"),
    (_data, "d.jsonl", json.dumps([MATH]), "expected a JSON object"),
    (_data, "d.jsonl", json.dumps({**MATH, "problem": None}), "problem"),
    (_data, "d.jsonl", json.dumps({**MATH, "problem": ["x"]}), "problem"),
    (_data, "d.jsonl", '{"id": "a", "problem": "x", "answer": ' + BIG_INT + "}", "number of 5000"),
    (_data, "d.jsonl", json.dumps({**MATH, "problem": "a\udcffb"}), "lone surrogate"),
    (_data, "d.jsonl", DEEP, "nested deeper"),
    (_code_data, "h.jsonl", json.dumps({"id": "h", "prompt": "def f():\n", "entry_point": "f)\nimport os#",
                                        "test": "def check(c): pass"}), "entry_point"),
    (_store, "records.jsonl", json.dumps({"id": "a", "sample": None}) + "\n" + json.dumps(REC), "sample"),
    (_store, "records.jsonl", "{}\n" + json.dumps(REC), "id"),
    (_store, "records.jsonl", json.dumps({"id": "a", "sample": True}), "sample"),
    (_store, "records.jsonl", json.dumps({"id": ["a"], "sample": 0}), "id"),
    (_store, "records.jsonl", json.dumps({"id": "a", "sample": -1}), "sample"),
    (_report, "records.jsonl", "{}\n" + json.dumps(REC), "id"),
    (_report, "records.jsonl", json.dumps({"id": "a", "sample": None}), "sample"),
    (_report, "records.jsonl", '{"id": "a", "sample": ' + BIG_INT + "}\n" + json.dumps(REC), "number of 5000"),
    (_report, "records.jsonl", json.dumps({**REC, "generated_tokens": "9"}), "generated_tokens"),
    (_report, "records.jsonl", DEEP + "\n" + json.dumps(REC), "nested deeper"),
    (read_traces, "traces.jsonl", json.dumps({"id": "a", "sample": 0, "trace": {"n": 1}}), "trace"),
    (read_traces, "traces.jsonl", json.dumps({"id": "a", "sample": 0, "trace": {**tiny_trace(2), "prompt_len": 3}}),
     "prompt_len"),
    (read_traces, "traces.jsonl", json.dumps({"id": "a", "sample": 0, "trace": {
        **tiny_trace(2), "evicted": {**tiny_trace(2)["evicted"], "shape": [1, 1, 9]}}}), "shape"),
    (_sweep, "s.yaml", "a: &x {k: 1}\nb: {<<: *x}\n", "merge keys"),
    (_sweep, "s.yaml", "l0: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"m{i}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(6)), "alias bomb"),
    (_sweep, "s.yaml", "model: m\nmodel: n\n", "given twice"),
    (_sweep, "s.yaml", "base: {model: m}\ncells:\n  - {policy: rkv, policy: h2o}\n", "given twice"),
    (_sweep, "s.yaml", "<<: {model: m}\n", "merge keys"),
    (_sweep, "s.yaml", "seeds: [" + BIG_INT + "]\n", "number of 5000"),
    (_sweep, "s.yaml", "x: " + "[" * 100_000 + "\n", "nested deeper"),
    (_sweep, "s.yaml", 'model: "a\\udcffb"\n', "lone surrogate"),
    (_sweep, "s.yaml", "- a\n- b\n", "mapping"),
    (_sweep, "s.yaml", "a: " + "b" * (5 << 20) + "\n", "larger than 1 MiB"),
]


@pytest.mark.parametrize("reader, name, content, words", HOSTILE,
                         ids=[f"{r.__name__}-{i}" for i, (r, *_rest) in enumerate(HOSTILE)])
def test_hostile_files_are_one_line_errors_naming_the_file(tmp_path: Path, reader, name: str, content: str,
                                                           words: str) -> None:
    path = tmp_path / name
    path.write_text(content + "\n", encoding="utf-8", errors="surrogatepass")
    with pytest.raises(SkipKVError) as info:
        reader(path)
    assert words in one_line(info.value, path), str(info.value)


def test_line_counts_are_bounded(tmp_path: Path, monkeypatch) -> None:
    """A JSON-lines file of many tiny lines is refused before its lines become objects (limit lowered here)."""
    from skipkv.files import LIMITS

    for kind in ("prompts", "data", "records", "traces"):
        monkeypatch.setitem(LIMITS, kind, __import__("dataclasses").replace(LIMITS[kind], lines=3))
    for reader, name, row in ((_prompts, "p.jsonl", {"prompt": "a"}), (_data, "d.jsonl", MATH),
                              (_store, "records.jsonl", REC), (_report, "records.jsonl", REC),
                              (read_traces, "traces.jsonl", {"id": "a", "sample": 0, "trace": tiny_trace(1)})):
        path = tmp_path / name
        path.write_text("".join(json.dumps({**row, "id": f"a{i}"}) + "\n" for i in range(3)))
        reader(path)  # at the limit: read
        path.write_text("".join(json.dumps({**row, "id": f"a{i}"}) + "\n" for i in range(4)))
        with pytest.raises(SkipKVError, match="more than 3 lines") as info:
            reader(path)
        one_line(info.value, path)


def test_non_utf8_and_unreadable_files(tmp_path: Path) -> None:
    for reader, name in ((_prompts, "p.jsonl"), (_data, "d.jsonl"), (_sweep, "s.yaml"), (_report, "records.jsonl")):
        path = tmp_path / name
        path.write_bytes(b'\xff\xfe garbage\n{"id": "a"}\n')  # not the last line: a torn tail is skipped
        with pytest.raises(SkipKVError) as info:
            reader(path)
        assert "UTF-8" in one_line(info.value, path) or "not valid JSON" in str(info.value)
        folder = tmp_path / f"dir-{name}"
        folder.mkdir()
        with pytest.raises(SkipKVError) as info:
            reader(folder)
        one_line(info.value, folder)


def test_what_the_project_writes_it_reads_back(tmp_path: Path) -> None:
    """Line separators that str.splitlines() honours (U+2028, U+2029, U+0085, \\x1c-\\x1e, \\x0b, \\x0c, \\r) are
    text inside a JSON string: records, prompts and data holding them read back unchanged."""
    odd = "a\u2028b\u2029c\x85d\x1ce\x1df\x1eg\x0bh\x0ci\rj"
    store = RecordStore(tmp_path / "records.jsonl")
    store.append({"id": "q1", "sample": 0, "prompt": odd, "output": odd})
    store.append({"id": "q2", "sample": 0, "prompt": "plain"})
    again = RecordStore(tmp_path / "records.jsonl")
    assert [r["prompt"] for r in again.records()] == [odd, "plain"] and not again.dropped_torn_line
    records, notes = read_records(tmp_path / "records.jsonl")
    assert [r["prompt"] for r in records] == [odd, "plain"] and notes == []
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(odd, ensure_ascii=False) + "\n" + json.dumps({"prompt": "x\u2028y"},
                                                                               ensure_ascii=False) + "\n")
    assert _prompts(prompts) == [odd, "x\u2028y"]
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({**MATH, "problem": odd}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert _data(data)[0].inputs["question"] == odd


def _run_dir(root: Path, record: dict, trace: dict) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model": "m", "dataset": {"name": "gsm8k"},
                                                  "policy": {"name": "rkv", "budget": 8}}))
    (root / "records.jsonl").write_text(json.dumps(record) + "\n")
    (root / "traces.jsonl").write_text(json.dumps({"id": record["id"], "sample": 0, "trace": trace}) + "\n")
    return root


def test_traces_are_checked_against_the_run_they_are_drawn_under(tmp_path: Path) -> None:
    good = {"id": "a", "sample": 0, "prompt_tokens": 3, "generated_tokens": 2, "compressions": 0}
    assert len(write_pages([_run_dir(tmp_path / "ok", good, tiny_trace(3, 2))], tmp_path / "pages")) == 1
    # Another run's (model's, tokenizer's) trace under these records: every count that differs is caught.
    for i, (field, trace) in enumerate((("prompt tokens", tiny_trace(4, 2)), ("generated tokens", tiny_trace(3, 5)),
                                        ("compressions", {**tiny_trace(3, 2), "compressions": [
                                            {"generated": 1, "seen": 4}]}))):
        run = _run_dir(tmp_path / f"other{i}", good, trace)
        with pytest.raises(SkipKVError, match=f"trace has .* {field}, its record .* not from this run") as info:
            write_pages([run], tmp_path / f"p{i}")
        one_line(info.value, run)
    # A decompression bomb and a short array: refused, never inflated past the stated shape.
    bomb = {**tiny_trace(3, 2)}
    bomb["evicted"] = {**bomb["evicted"], "data": base64.b64encode(zlib.compress(b"\xff" * (64 << 20))).decode()}
    short = {**tiny_trace(3, 2)}
    short["evicted"] = {**short["evicted"], "data": base64.b64encode(zlib.compress(b"\xff")).decode()}
    for i, trace in enumerate((bomb, short)):
        run = _run_dir(tmp_path / f"bad{i}", good, trace)
        with pytest.raises(SkipKVError, match="evicted data holds"):
            write_pages([run], tmp_path / f"b{i}")


def test_run_files_of_the_wrong_shape_are_one_line(tmp_path: Path) -> None:
    from skipkv.eval.rundir import check_or_write_config

    good = {"id": "a", "sample": 0}
    for i, config in enumerate(([1, 2], {"model": ["m"]}, {"policy": {"name": 3}}, {"environment": [1]},
                                '{"model": "m", "model": "n"}', DEEP)):
        run = tmp_path / f"r{i}"
        run.mkdir()
        (run / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        (run / "records.jsonl").write_text(json.dumps(good) + "\n")
        with pytest.raises(SkipKVError) as info:
            load_run(run)
        one_line(info.value, run / "config.json")
        with pytest.raises(SkipKVError) as info:
            check_or_write_config(run, {"model": "m"})  # a resume reads it too
        one_line(info.value, run / "config.json")


# ------------------------------------------------------------------------------------------ fuzz
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(__import__("os").environ.get("SKIPKV_FUZZ_EXAMPLES", "0"))
_SETTINGS = settings(max_examples=EXAMPLES or 30, deadline=None, derandomize=not EXAMPLES,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=12),
                     st.sampled_from(["id", "sample", "prompt", "problem", "answer", "trace", "model", "policy"]))
_VALUES = st.recursive(_SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.sampled_from(["id", "sample", "prompt", "text", "problem",
                                                                "answer", "trace", "name", "x"]), kids, max_size=5)),
    max_leaves=12)
# Raw lines: JSON of random values, and the hostile shapes (deep, long numbers, escapes, garbage bytes).
_LINES = st.one_of(
    _VALUES.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(90, 6000).map(lambda n: b'{"id": "a", "sample": ' + b"7" * n + b"}"),
    st.sampled_from([b'"\\ud800"', b'{"id": "\\udfff", "sample": 0}', b'{"id": "a", "id": "b"}', b"NaN",
                     b'{"id": "a", "sample": 1e999}', b"\xef\xbb\xbf{}", b'"\xe2\x80\xa8"', b"{" * 70]),
)
_FILES = st.lists(_LINES, max_size=4).map(lambda lines: b"\n".join(lines))


def _readers(tmp: Path) -> list:
    from skipkv.files import read_json, read_yaml

    return [_prompts, _data, _code_data, _store, _report, read_traces, lambda p: read_json(p, "config"),
            lambda p: read_json(p, "summary"), lambda p: read_yaml(p, "sweep"), _sweep]


@_SETTINGS
@given(content=_FILES)
def test_fuzz_every_file_reader(content: bytes, tmp_path: Path) -> None:
    """Any bytes, through every reader: a value or a one-line SkipKVError, never another exception."""
    path = tmp_path / "f"
    for reader in _readers(tmp_path):
        path.write_bytes(content)
        try:
            reader(path)
        except SkipKVError as exc:
            one_line(exc)


_YAML = st.one_of(
    st.text(max_size=60),
    _VALUES.map(lambda v: json.dumps(v)),  # JSON is YAML
    st.lists(st.sampled_from(["a: 1", "a: 2", "b: &x [1]", "c: *x", "<<: {a: 1}", "- 1", "d: !!python/name:os.system",
                              "e: [[[[", "f: " + "9" * 200, "g: {a: 1, a: 2}", "  h: 1", "i: '\\ud800'",
                              'j: "\\ud800"', "k: !!binary aGVsbG8=", "l: 2001-12-14", "? [1]\n: 2"]),
             max_size=5).map("\n".join),
)


@_SETTINGS
@given(text=_YAML)
def test_fuzz_yaml_reader(text: str, tmp_path: Path) -> None:
    from skipkv.files import read_yaml

    path = tmp_path / "s.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        read_yaml(path, "sweep")
        _sweep(path)
    except SkipKVError as exc:
        one_line(exc)


# Any text, with the characters str.splitlines() breaks at drawn often.
_TEXT = st.text(alphabet=st.one_of(st.characters(blacklist_categories=("Cs",)),
                                   st.sampled_from("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")), max_size=30)


@_SETTINGS
@given(records=st.lists(st.fixed_dictionaries({"id": _TEXT, "sample": st.integers(0, 2**40), "prompt": _TEXT,
                                               "output": _TEXT, "n": _VALUES}), max_size=4, unique_by=lambda r:
                        (r["id"], r["sample"])))
def test_fuzz_records_round_trip(records: list[dict], tmp_path: Path) -> None:
    """Whatever text a record holds (any line separator included), RecordStore and report read back what was
    written, and a reopened store appends after it."""
    path = tmp_path / "records.jsonl"
    path.unlink(missing_ok=True)
    store = RecordStore(path)
    for r in records:
        store.append(r)
    assert RecordStore(path).records() == records
    assert read_records(path)[0] == records
