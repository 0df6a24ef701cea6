"""Retention traces and the viewer: tracing off changes nothing (and records nothing), a trace decodes to
exactly what the store held after each compression, traces survive resumption, and `skipkv show` pages
render in headless Chromium with both runs, their tokens, flags and the replay slider."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import PROMPTS
from skipkv import SamplingParams, generate, make_policy
from skipkv.cli import main
from skipkv.config import EngineConfig
from skipkv.engine.runner import ModelRunner
from skipkv.engine.trace import decode_evicted, kept_positions, token_texts
from skipkv.errors import SkipKVError
from skipkv.eval.records import TraceFile, read_traces
from skipkv.eval.runner import EvalConfig, run_eval
from skipkv.policies import POLICIES
from skipkv.policies.rkv import RKV
from skipkv.report.viewer import write_pages

CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                    "(apt-get install -y chromium) to load the page headless")
TIMING = {"seconds", "compress_seconds", "session", "finished_at"}


# ------------------------------------------------------------------------------------ test double
@dataclass(frozen=True)
class FlaggingDouble(RKV):
    """TEST DOUBLE, not a method: R-KV whose `trace_state` reports fixed sentences (a check sentence, and
    one flagged redundant) at output positions, so the viewer's flag rendering is tested before the SkipKV
    policy (which reports real ones) exists."""

    def init_state(self, prompt_ids, tokenizer):
        return {"prompt_len": len(prompt_ids)}

    def trace_state(self, state):
        p = state["prompt_len"]
        return {"sentences": [[p, p + 3, "check"], [p + 4, p + 7, "other"]], "flagged": [[p + 4, p + 7, 0.97]]}


@pytest.fixture
def double_registered(monkeypatch):
    monkeypatch.setitem(POLICIES._items, "flagging_double", FlaggingDouble)


# ------------------------------------------------------------------------------------ engine
def _spy(monkeypatch) -> list:
    calls: list = []
    original = ModelRunner._record_trace

    def spy(self, slots):
        calls.append(list(slots))
        original(self, slots)

    monkeypatch.setattr(ModelRunner, "_record_trace", spy)
    return calls


def test_trace_off_is_identical_and_never_records(tiny, monkeypatch) -> None:
    calls = _spy(monkeypatch)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    policy = make_policy("h2o", budget=16, interval=4)
    off = generate(tiny, PROMPTS[:3], sp, policy, EngineConfig(batch_size=2))
    assert calls == []  # no recording code ran
    on = generate(tiny, PROMPTS[:3], sp, policy, EngineConfig(batch_size=2), trace=True)
    assert calls  # the spy does see the recorder when tracing
    for a, b in zip(off, on):
        assert a.trace is None and b.trace is not None
        assert (a.token_ids, a.text, a.compressions, a.peak_kv_tokens) == (b.token_ids, b.text, b.compressions,
                                                                          b.peak_kv_tokens)
        assert len(b.trace["compressions"]) == b.compressions


def test_trace_decodes_to_what_the_store_held(tiny, monkeypatch) -> None:
    """After every compression, the trace's kept set per (layer, head) equals the store's `pos` (4 requests
    through 2 slots, so slots are refilled and moved; chunked prefill compresses between chunks)."""
    held: dict[int, list] = {}
    original = ModelRunner._record_trace

    def snapshot(self, rows):
        original(self, rows)
        for s, r in rows:
            n = self.store.lengths[:, s].tolist()
            held.setdefault(r.index, []).append(
                ([[sorted(self.store.pos[l][s, h, :n[l]].tolist()) for h in range(self.store.num_kv_heads)]
                  for l in range(self.store.num_layers)], len(r.output_ids)))

    monkeypatch.setattr(ModelRunner, "_record_trace", snapshot)
    prompts = PROMPTS[1:] + ["A much longer prompt, long enough to be cut at prefill by the budget of sixteen."]
    results = generate(tiny, prompts, SamplingParams(max_new_tokens=20, ignore_eos=True),
                       make_policy("h2o", budget=16, window=4, interval=5),
                       EngineConfig(batch_size=2, prefill_chunk=40), trace=True)
    for res in results:
        t = res.trace
        snaps = held[res.index]
        assert len(t["compressions"]) == len(snaps) == res.compressions > 1
        ev = decode_evicted(t)
        assert ev.shape == (2, 2, res.prompt_tokens + res.generated_tokens)
        for c, (per_layer, generated) in enumerate(snaps):
            assert t["compressions"][c]["generated"] == generated
            for l in range(2):
                for h in range(2):
                    assert kept_positions(t, c, l, h) == per_layer[l][h], (res.index, c, l, h)
        # What the last compression kept stays to the end (never evicted), and so does everything newer.
        last = t["compressions"][-1]["seen"]
        assert ((ev[..., last:] == -1).all())
        assert len(t["prompt_tokens"]) == res.prompt_tokens and len(t["output_tokens"]) == res.generated_tokens
    # The long prompts were compressed between prefill chunks (several compressions before any output).
    assert max(sum(c["generated"] == 0 for c in r.trace["compressions"]) for r in results) >= 2


def test_full_policy_trace_has_no_compressions(tiny) -> None:
    [res] = generate(tiny, PROMPTS[:1], SamplingParams(max_new_tokens=5, ignore_eos=True), make_policy("full"),
                     trace=True)
    assert res.trace["compressions"] == [] and (decode_evicted(res.trace) == -1).all()


def test_token_texts_keep_characters_whole(tiny) -> None:
    ids = tiny.tokenizer("héllo — ok\n", add_special_tokens=False)["input_ids"]
    texts = token_texts(tiny.tokenizer, ids)
    assert len(texts) == len(ids) and "".join(texts) == "héllo — ok\n"
    assert "é" in texts and "—" in texts  # a character split over bytes sits whole on its last byte


# ------------------------------------------------------------------------------------ eval runs
def _cfg(out: Path, policy: str = "rkv", **kw) -> EvalConfig:
    args = dict(model="random:qwen2", dataset="gsm8k", policy=policy, out=str(out), budget=32,
                policy_knobs={"interval": 8}, limit=1, max_new_tokens=24, dtype="fp32", quiet=True)
    return EvalConfig(**{**args, **kw})


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("viewer")
    mp = pytest.MonkeyPatch()
    mp.setitem(POLICIES._items, "flagging_double", FlaggingDouble)
    try:
        out = {"plain": run_eval(_cfg(base / "plain")), "rkv": run_eval(_cfg(base / "rkv", trace=True)),
               "double": run_eval(_cfg(base / "double", "flagging_double", trace=True))}
    finally:
        mp.undo()
    return out


def test_eval_trace_leaves_records_unchanged(runs) -> None:
    plain, traced = _records(runs["plain"]), _records(runs["rkv"])
    assert not (runs["plain"] / "traces.jsonl").exists()
    assert all("trace" not in r for r in plain) and all(r["trace"] == "traces.jsonl" for r in traced)
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING | {"trace"}}  # noqa: E731
    assert [strip(r) for r in plain] == [strip(r) for r in traced]
    config = lambda p: {k: v for k, v in json.loads((p / "config.json").read_text()).items()  # noqa: E731
                        if k not in ("environment", "execution")}
    assert config(runs["plain"]) == config(runs["rkv"])
    traces = read_traces(runs["rkv"] / "traces.jsonl")
    assert set(traces) == {(r["id"], r["sample"]) for r in traced}
    for r in traced:
        t = traces[(r["id"], r["sample"])]
        assert len(t["compressions"]) == r["compressions"] and len(t["output_tokens"]) == r["generated_tokens"]


def _tiny_trace(n: int) -> dict:
    """A valid trace of n prompt tokens, no output, no compression."""
    data = base64.b64encode(zlib.compress(bytes([0xFF] * n))).decode("ascii")
    return {"version": 1, "num_layers": 1, "num_kv_heads": 1, "prompt_len": n, "prompt_tokens": ["x"] * n,
            "output_tokens": [], "compressions": [], "final_state": None,
            "evicted": {"dtype": "uint8", "shape": [1, 1, n], "codec": "zlib+base64", "data": data}}


def test_trace_file_prune_keeps_one_line_per_finished_record(tmp_path) -> None:
    path = tmp_path / "traces.jsonl"
    tf = TraceFile(path)
    tf.append("a", 0, _tiny_trace(1))
    tf.append("orphan", 0, _tiny_trace(2))  # its record was lost in a crash
    tf.append("a", 0, _tiny_trace(3))  # re-run after the crash
    with open(path, "a") as f:
        f.write('{"id": "b", "sam')  # torn
    tf.prune({("a", 0)})
    assert read_traces(path) == {("a", 0): _tiny_trace(3)}
    assert len(path.read_text().splitlines()) == 1
    before = path.read_bytes()
    tf.prune({("a", 0)})
    assert path.read_bytes() == before


# ------------------------------------------------------------------------------------ show
def test_show_errors_are_one_line(runs, tmp_path, capsys) -> None:
    with pytest.raises(SkipKVError, match="has no traces"):
        write_pages([runs["plain"]], tmp_path / "p")
    with pytest.raises(SkipKVError, match="no traced example 'nope'"):
        write_pages([runs["rkv"]], tmp_path / "p", "nope")
    with pytest.raises(SkipKVError, match="not a run dir"):
        write_pages([tmp_path], tmp_path / "p")
    # A run of other examples: copy the run and rename its ids.
    other = tmp_path / "other"
    shutil.copytree(runs["rkv"], other)
    for name in ("records.jsonl", "traces.jsonl"):
        (other / name).write_text((other / name).read_text().replace("gsm8k-test-", "gsm8k-other-"))
    with pytest.raises(SkipKVError, match="share no traced example"):
        write_pages([runs["rkv"], other], tmp_path / "p")
    # The same id with another prompt.
    lines = [json.loads(x) for x in (runs["double"] / "traces.jsonl").read_text().splitlines()]
    lines[0]["trace"]["prompt_tokens"][0] = "X"
    (other / "traces.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    shutil.copy(runs["double"] / "records.jsonl", other / "records.jsonl")
    with pytest.raises(SkipKVError, match="different prompts"):
        write_pages([runs["rkv"], other], tmp_path / "p")
    assert main(["show", str(runs["plain"]), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no traces" in err


def _dom(page: Path, fragment: str = "") -> str:
    url = page.resolve().as_uri() + (f"#{fragment}" if fragment else "")
    out = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _columns(dom: str) -> list[str]:
    return re.split(r'<section class="run"', dom)[1:]


def _classes(column: str) -> list[str]:
    """The class list of every token span in a column, in position order."""
    return re.findall(r'<span class="(tok[^"]*)"[^>]*data-p="\d+"', column)


@needs_chromium
def test_page_renders_both_runs_tokens_and_flags(runs, tmp_path) -> None:
    assert main(["show", str(runs["rkv"]), str(runs["double"]), "--out", str(tmp_path / "pages"),
                 "--id", "gsm8k-test-0000"]) == 0
    page = tmp_path / "pages" / "gsm8k-test-0000.html"
    html = page.read_text()
    assert "http://" not in html and "https://" not in html  # self-contained
    key = ("gsm8k-test-0000", 0)
    trace = {name: read_traces(runs[name] / "traces.jsonl")[key] for name in ("rkv", "double")}

    dom = _dom(page)
    cols = _columns(dom)
    assert len(cols) == 2
    assert 'data-policy="rkv"' in cols[0] and 'data-policy="flagging_double"' in cols[1]
    for col, name in zip(cols, ("rkv", "double")):
        t = trace[name]
        classes = _classes(col)
        assert len(classes) == t["prompt_len"] + len(t["output_tokens"])
        # End of generation: grey exactly where every layer and head evicted the token.
        ev = decode_evicted(t)
        gone = [i for i, c in enumerate(classes) if " gone" in c]
        assert gone == [p for p in range(ev.shape[2]) if (ev[:, :, p] >= 0).all()]
        assert gone  # the budget of 32 evicts part of the ~400-token prompt
    prompt_box = cols[0].split('<div class="text prompt">', 1)[1].split("</div>", 1)[0]
    assert "Answer the following questions." in re.sub(r"<[^>]+>", "", prompt_box)  # the prompt, token by token
    assert re.search(r'data-p="0"[^>]*>&lt;\|im_start\|&gt;</span>', cols[0])
    p = trace["double"]["prompt_len"]
    flagged = [i for i, c in enumerate(_classes(cols[1])) if " flag" in c]
    checks = [i for i, c in enumerate(_classes(cols[1])) if " chk" in c]
    assert flagged == list(range(p + 4, p + 8)) and checks == list(range(p, p + 4))
    assert not any(" flag" in c or " chk" in c for c in _classes(cols[0]))
    assert "end of generation" in dom and "2 flagged" not in dom and "1 flagged, 1 check sentences" in dom

    # Replay: after compression 1, positions not yet fed are faint and grey means evicted by then.
    dom = _dom(page, "step=1&tip=5")
    col = _columns(dom)[0]
    classes, t = _classes(col), trace["rkv"]
    seen, ev = t["compressions"][0]["seen"], decode_evicted(t)
    assert [i for i, c in enumerate(classes) if " fut" in c] == list(range(seen, len(classes)))
    assert [i for i, c in enumerate(classes) if " gone" in c] == [
        q for q in range(seen) if ((ev[:, :, q] >= 0) & (ev[:, :, q] <= 0)).all()]
    assert "after compression 1 of" in dom
    # The hover box pinned on position 5 (a prompt token) of the first run, at compression 1.
    box = dom.split('<div id="tip"', 1)[1].split("</div>", 1)[0]
    held = int(((ev[:, :, 5] < 0) | (ev[:, :, 5] > 0)).sum())
    assert "position 5</b> (prompt token 5)" in box and f"held by {held} of 4 layer·heads" in box
    evicted = sorted({int(e) for e in ev[:, :, 5].ravel() if e >= 0})
    assert ("evicted: never" in box) == (not evicted)
    for e in evicted:
        assert f"at compression {e + 1}" in box
