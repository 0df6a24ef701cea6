"""The retention viewer: one self-contained HTML page per example of a traced run (`skipkv eval --trace`).

    skipkv eval --model random:qwen2 --dataset gsm8k --limit 2 --policy rkv --budget 32 --interval 8 \\
        --max-tokens 64 --out runs/v-rkv --trace --quiet
    skipkv show runs/v-rkv                       # runs/v-rkv/show/<id>.html + index.html
    skipkv show runs/v-rkv runs/v-h2o --id gsm8k-test-0000 --out /tmp/pages   # two runs side by side

Each page shows the prompt (collapsed) and the generated text token by token, each token shaded by the share
of (layer, kv head) pairs that hold it in the cache; a slider replays the compressions (after compression k:
tokens every layer and head had evicted are grey, tokens not generated yet are faint); sentences the policy
flagged redundant are outlined and `check` sentences marked (from `Policy.trace_state`); hovering a token
gives its position, when each layer/head evicted it and which layers keep it. Two run dirs put the same
example side by side. Everything (data, CSS, JS) is inline: the page opens offline in any browser.
Reads run dirs only; never loads a model or a tokenizer (token texts are in the trace).
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skipkv.engine.trace import decode_evicted
from skipkv.errors import SkipKVError
from skipkv.eval.records import read_traces
from skipkv.eval.rundir import TRACES_FILE
from skipkv.outputs import check_dir, write_atomic
from skipkv.report.runs import Run, is_run_dir, load_run


@dataclass(frozen=True)
class TracedRun:
    run: Run
    records: dict[tuple[str, int], dict[str, Any]]
    traces: dict[tuple[str, int], dict[str, Any]]

    @property
    def label(self) -> str:
        budget = self.run.policy_config.get("budget")
        return f"{self.run.policy}" + (f" · budget {budget}" if budget is not None else "")


def load_traced(path: Path) -> TracedRun:
    """A run dir with its traces; a one-line SkipKVError if it is not a run dir or holds no trace."""
    path = Path(path)
    if not is_run_dir(path):
        raise SkipKVError(f"show: {path} is not a run dir (config.json + records.jsonl)")
    run = load_run(path)
    records = {(str(r["id"]), int(r.get("sample", 0))): r for r in run.records}
    traces = read_traces(path / TRACES_FILE) if (path / TRACES_FILE).exists() else {}
    traces = {k: v for k, v in traces.items() if k in records}
    if not traces:
        raise SkipKVError(f"show: {path} has no traces; run `skipkv eval ... --trace` to record them")
    for key, trace in traces.items():
        check_trace(trace, records[key], f"show: {path / TRACES_FILE} ({key[0]!r} sample {key[1]})")
    return TracedRun(run, records, traces)


def check_trace(trace: dict[str, Any], record: dict[str, Any], where: str) -> None:
    """A trace belongs to the record it is drawn under: the same prompt length, generated tokens and
    compressions (a traces.jsonl copied from another run, model or tokenizer differs in them), and its eviction
    array decodes to the shape it states. A one-line SkipKVError naming `where` otherwise."""
    mine = {"prompt_tokens": trace["prompt_len"], "generated_tokens": len(trace["output_tokens"]),
            "compressions": len(trace["compressions"])}
    for field, value in mine.items():
        if record.get(field) is not None and record[field] != value:
            raise SkipKVError(f"{where}: the trace has {value} {field.replace('_', ' ')}, its record "
                              f"{record[field]}; the trace is not from this run")
    try:
        decode_evicted(trace)
    except ValueError as exc:
        raise SkipKVError(f"{where}: {exc}") from None


def _payload(tr: TracedRun, key: tuple[str, int]) -> dict[str, Any]:
    """What the page's script needs of one run for one example."""
    trace, record = tr.traces[key], tr.records[key]
    ev = decode_evicted(trace)  # [L, H, T]; -1 = never evicted
    wide = len(trace["compressions"]) >= 0xFF  # uint8 while compression indices leave room for NEVER
    raw = ev.copy()
    raw[raw < 0] = 0xFFFF if wide else 0xFF
    states = [c.get("state") for c in trace["compressions"]] + [trace.get("final_state")]
    return {
        "label": tr.label, "dir": tr.run.path.name, "policy": tr.run.policy, "model": tr.run.model,
        "L": int(ev.shape[0]), "H": int(ev.shape[1]), "prompt_len": int(trace["prompt_len"]),
        "tokens": list(trace["prompt_tokens"]) + list(trace["output_tokens"]),
        # uint8 (uint16 little-endian past 254 compressions), base64: the script reads it with atob and a
        # typed array, no inflate needed; the max value means never evicted.
        "ev": base64.b64encode(raw.astype("<u2" if wide else "u1").tobytes()).decode("ascii"), "wide": wide,
        "steps": [{"generated": c["generated"], "seen": c["seen"]} for c in trace["compressions"]],
        "states": states,
        "stats": {k: record.get(k) for k in ("generated_tokens", "compressions", "correct", "extracted",
                                              "peak_kv_tokens", "finish_reason", "budget")},
    }


def _page_name(key: tuple[str, int], samples: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key[0])
    return f"{safe}.html" if samples == 1 and key[1] == 0 else f"{safe}-s{key[1]}.html"


def render_page(runs: list[TracedRun], key: tuple[str, int]) -> str:
    """The HTML of one example's page (one column per run)."""
    data = {"id": key[0], "sample": key[1], "dataset": runs[0].run.dataset,
            "runs": [_payload(tr, key) for tr in runs]}
    blob = json.dumps(data, ensure_ascii=True).replace("</", "<\\/")
    title = html.escape(f"{key[0]} — " + " vs ".join(tr.label for tr in runs))
    return _TEMPLATE.replace("__TITLE__", title).replace("__DATA__", blob)


def _common_keys(runs: list[TracedRun], example_id: str | None) -> list[tuple[str, int]]:
    names = [str(tr.run.path) for tr in runs]
    if len(runs) == 2 and runs[0].run.dataset != runs[1].run.dataset:
        raise SkipKVError(f"show: {names[0]} ran {runs[0].run.dataset}, {names[1]} ran {runs[1].run.dataset}; "
                          "give two runs of the same dataset")
    if example_id is not None:
        for tr, name in zip(runs, names):
            if not any(k[0] == example_id for k in tr.traces):
                some = ", ".join(sorted({k[0] for k in tr.traces})[:3])
                raise SkipKVError(f"show: {name} has no traced example {example_id!r} (it has e.g. {some})")
    keys = set(runs[0].traces)
    for tr in runs[1:]:
        keys &= set(tr.traces)
    keys = {k for k in keys if example_id is None or k[0] == example_id}
    if not keys:
        raise SkipKVError(f"show: {' and '.join(names)} share no traced example" +
                          (f" {example_id!r}" if example_id else ""))
    for k in sorted(keys):
        prompts = {tuple(tr.traces[k]["prompt_tokens"]) for tr in runs}
        if len(prompts) > 1:
            raise SkipKVError(f"show: example {k[0]!r} has different prompts in {' and '.join(names)}")
    return sorted(keys)


def write_pages(dirs: list[Path], out: Path | None = None, example_id: str | None = None) -> list[Path]:
    """One page per traced example common to `dirs` (one or two run dirs) into `out` (default DIR/show),
    plus an index.html linking them. Returns the example pages' paths."""
    if not 1 <= len(dirs) <= 2:
        raise SkipKVError(f"show: give one or two run dirs, got {len(dirs)}")
    out = _check_out(out, Path(dirs[0]) / "show")  # before any run is read: a bad --out fails at once
    runs = [load_traced(Path(d)) for d in dirs]
    keys = _common_keys(runs, example_id)
    out.mkdir(parents=True, exist_ok=True)
    (out / SHOW_MARKER).touch()
    samples = max(k[1] for k in keys) + 1
    pages = []
    for key in keys:
        path = out / _page_name(key, samples)
        write_atomic(path, render_page(runs, key))
        pages.append(path)
    items = "\n".join(f'<li><a href="{html.escape(p.name)}">{html.escape(k[0])}'
                      f'{f" sample {k[1]}" if samples > 1 else ""}</a></li>' for k, p in zip(keys, pages))
    heading = html.escape(" vs ".join(f"{tr.label} ({tr.run.path.name})" for tr in runs))
    write_atomic(out / "index.html", f"<!doctype html><meta charset='utf-8'><title>{heading}</title>"
                                     f"<body style='font-family:sans-serif'><h1>{heading}</h1><ul>{items}</ul>")
    return pages


SHOW_MARKER = ".skipkv-show"  # in every folder `show` writes: it may overwrite its own pages there, nothing else


def _check_out(out: str | Path | None, default: Path) -> Path:
    """The pages' folder: not empty text, not a file, writable, and either new, empty, the default RUN_DIR/show,
    or a folder `show` wrote before (its marker): show never overwrites an index.html it did not write."""
    if out is None:
        return check_dir(default, "show --out")
    path = check_dir(out, "show --out")
    if path.is_dir() and any(path.iterdir()) and not (path / SHOW_MARKER).exists():
        raise SkipKVError(f"show --out {path} is a folder that holds other files; give a new or empty folder")
    return path


_TEMPLATE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
:root { --held: 215; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2430;
       background: #f6f7f9; }
header { position: sticky; top: 0; z-index: 5; background: #fff; border-bottom: 1px solid #d8dce3;
         padding: 10px 18px 8px; }
h1 { font-size: 17px; margin: 0 0 6px; }
h1 small { font-weight: normal; color: #667; }
.controls { display: flex; align-items: center; gap: 12px; flex-wrap: wrap; }
.controls input[type=range] { width: 360px; }
#steplabel { font-variant-numeric: tabular-nums; min-width: 260px; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 18px; margin-top: 6px; font-size: 12.5px; color: #445; }
.legend span.sw { display: inline-block; vertical-align: middle; margin-right: 5px; }
.scale { width: 110px; height: 12px;
         background: linear-gradient(90deg, hsl(var(--held),85%,95%), hsl(var(--held),85%,68%));
         border: 1px solid #bbc; }
main { display: grid; gap: 14px; padding: 14px 18px 40px; }
.run { background: #fff; border: 1px solid #d8dce3; border-radius: 6px; padding: 10px 14px; min-width: 0; }
.run h2 { font-size: 15px; margin: 0 0 2px; }
.run .meta { font-size: 12.5px; color: #556; margin-bottom: 4px; }
.run .now { font-size: 12.5px; color: #334; margin-bottom: 8px; background: #eef2f7; padding: 3px 8px;
            border-radius: 4px; }
details { margin: 4px 0 10px; }
summary { cursor: pointer; color: #445; font-size: 13px; }
.text { font: 13px/1.95 ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; white-space: pre-wrap;
        word-break: break-word; }
.tok { border-radius: 2px; padding: 1px 0; cursor: default; }
.tok.gone { color: #a3a8b2; background: none !important; text-decoration: line-through;
            text-decoration-color: #c9ccd3; }
.tok.fut { color: #c5c9d1; background: none !important; border-bottom: 1px dotted #d0d3da; }
.tok .nl { color: #9aa3b5; }
.tok .ph { color: #b0b6c2; }
.tok.flag { box-shadow: inset 0 2px 0 #d0342c, inset 0 -2px 0 #d0342c; }
.tok.flag.fs { box-shadow: inset 2px 2px 0 #d0342c, inset 0 -2px 0 #d0342c; }
.tok.flag.fe { box-shadow: inset -2px 2px 0 #d0342c, inset 0 -2px 0 #d0342c; }
.tok.flag.fs.fe { box-shadow: inset 0 0 0 2px #d0342c; }
.tok.chk { text-decoration: underline wavy #e08a00; text-underline-offset: 3px; }
.tok.cs::before { content: "\21BB check "; font: bold 10px system-ui, sans-serif; color: #fff;
                  background: #e08a00; border-radius: 3px; padding: 0 3px; margin-right: 2px; }
.sw.flagbox { width: 26px; height: 12px; box-shadow: inset 0 0 0 2px #d0342c; }
.sw.chkbox { color: #fff; background: #e08a00; border-radius: 3px; padding: 0 3px; font: bold 10px system-ui; }
.sw.gonebox { color: #a3a8b2; text-decoration: line-through; font-family: ui-monospace, monospace; }
.sw.futbox { color: #c5c9d1; border-bottom: 1px dotted #c5c9d1; font-family: ui-monospace, monospace; }
#tip { position: fixed; z-index: 10; pointer-events: none; display: none; max-width: 420px;
       background: #1d2430; color: #eef;
       font: 12px/1.45 system-ui, sans-serif; padding: 7px 9px; border-radius: 5px;
       box-shadow: 0 3px 10px rgba(0,0,0,.25); }
#tip b { color: #fff; }
</style></head>
<body>
<header>
  <h1 id="title"></h1>
  <div class="controls">
    <label for="step">replay compressions</label>
    <input type="range" id="step" min="1" value="1">
    <span id="steplabel"></span>
  </div>
  <div class="legend">
    <span><span class="sw scale"></span>token colour: share of (layer, kv head) pairs whose cache holds it at
      this step (pale = few, deep = all)</span>
    <span><span class="sw gonebox">abc</span>evicted by every layer and head at or before this step</span>
    <span><span class="sw futbox">abc</span>not generated yet at this step</span>
    <span><span class="sw flagbox"></span>sentence the policy flagged redundant (a later sentence is
      near-identical)</span>
    <span><span class="sw chkbox">&#x21BB; check</span> <span style="text-decoration: underline wavy
      #e08a00">sentence</span> with a check keyword (Wait, Alternatively, again)</span>
    <span>hover a token: position, when each layer/head evicted it, layers keeping it</span>
  </div>
</header>
<main id="runs"></main>
<div id="tip"></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const NEVER = -1;
function decodeEv(b64, wide) {  // -> [L * H * T] compression index at which each copy left; NEVER = stayed
  const bin = atob(b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const arr = wide ? new Uint16Array(bytes.buffer) : bytes, never = wide ? 0xFFFF : 0xFF;
  const out = new Int32Array(arr.length);
  for (let i = 0; i < arr.length; i++) out[i] = arr[i] === never ? NEVER : arr[i];
  return out;
}
function ranges(xs) {  // [0,1,2,5,7,8] -> "0-2, 5, 7-8"
  const out = [];
  for (let i = 0; i < xs.length; ) {
    let j = i; while (j + 1 < xs.length && xs[j + 1] === xs[j] + 1) j++;
    out.push(i === j ? String(xs[i]) : xs[i] + "-" + xs[j]); i = j + 1;
  }
  return out.join(", ") || "none";
}
function esc(s) { return s.replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c])); }

const maxSteps = Math.max(...DATA.runs.map(r => r.steps.length));
const runs = DATA.runs.map((r, ri) => {
  const T = r.tokens.length, LH = r.L * r.H, ev = decodeEv(r.ev, r.wide);
  const col = document.createElement("section");
  col.className = "run"; col.dataset.policy = r.policy; col.dataset.run = String(ri);
  const st = r.stats;
  const verdict = st.correct === true ? "correct" : st.correct === false ? "wrong" : "";
  col.innerHTML = `<h2>${esc(r.label)}</h2><div class="meta">${esc(r.dir)} · ${esc(r.model)} · ` +
    `${st.generated_tokens} generated · ${st.compressions} compressions · peak KV ${st.peak_kv_tokens} tokens` +
    (verdict ? ` · ${verdict}` + (st.extracted != null ? ` (answer ${esc(String(st.extracted))})` : "") : "") +
    `</div><div class="now"></div><details><summary></summary>` +
    `<div class="text prompt"></div></details><div class="text output"></div>`;
  const spans = [];
  const boxes = [col.querySelector(".prompt"), col.querySelector(".output")];
  for (let p = 0; p < T; p++) {
    const s = document.createElement("span"), t = r.tokens[p];
    s.className = "tok"; s.dataset.p = String(p);
    if (t === "") s.innerHTML = '<span class="ph">\u00b7</span>';  // one byte of a multi-byte character
    else if (t.includes("\n")) s.innerHTML = esc(t).replace(/\n/g, '<span class="nl">\u21b5</span>\n');
    else s.textContent = t;
    boxes[p < r.prompt_len ? 0 : 1].appendChild(s);
    spans.push(s);
  }
  document.getElementById("runs").appendChild(col);
  return {r, T, LH, ev, col, spans, now: col.querySelector(".now"), summary: col.querySelector("summary"),
          step: -1, state: null};
});
document.getElementById("runs").style.gridTemplateColumns = `repeat(${runs.length}, minmax(0, 1fr))`;
document.getElementById("title").innerHTML = `${esc(DATA.id)}${DATA.sample ? " (sample " + DATA.sample + ")" : ""} ` +
  `<small>${esc(DATA.dataset)} · ${runs.map(x => esc(x.r.label)).join(" vs ")}</small>`;

// Which (layer, head) copies of position p are held after compression c (c = -1: the end of generation).
function heldAfter(x, p, c) {
  let n = 0;
  for (let i = 0; i < x.LH; i++) { const e = x.ev[i * x.T + p]; if (e === NEVER || (c >= 0 && e > c)) n++; }
  return n;
}
function spanSets(state) {
  const flag = new Map(), chk = new Set(), chkStart = new Set(), fs = new Set(), fe = new Set();
  if (state && state.flagged) for (const [a, b, sim] of state.flagged) {
    fs.add(a); fe.add(b); for (let p = a; p <= b; p++) flag.set(p, sim);
  }
  if (state && state.sentences) for (const [a, b, label] of state.sentences) if (label === "check") {
    chkStart.add(a); for (let p = a; p <= b; p++) chk.add(p);
  }
  return {flag, chk, chkStart, fs, fe};
}
function render(k) {  // k in 1..maxSteps: after compression k; maxSteps + 1: end of generation
  const end = k > maxSteps;
  document.getElementById("steplabel").textContent = end ? "end of generation (final cache)" :
    `after compression ${k} of ${maxSteps}`;
  for (const x of runs) {
    const C = x.r.steps.length, c = end || k > C ? -1 : k - 1;
    const seen = c < 0 ? x.T : x.r.steps[c].seen;
    const state = x.r.states[c < 0 ? C : c];
    const sets = spanSets(state);
    let total = 0, promptHeld = 0;
    for (let p = 0; p < x.T; p++) {
      const s = x.spans[p], h = p < seen ? heldAfter(x, p, c) : 0;
      total += h;
      if (p < x.r.prompt_len && h > 0) promptHeld++;
      s.className = "tok" + (p >= seen ? " fut" : h === 0 ? " gone" : "") +
        (sets.flag.has(p) ? " flag" : "") + (sets.fs.has(p) ? " fs" : "") + (sets.fe.has(p) ? " fe" : "") +
        (sets.chk.has(p) ? " chk" : "") + (sets.chkStart.has(p) ? " cs" : "");
      s.style.background = p < seen && h > 0 ? `hsl(var(--held), 85%, ${95 - 27 * h / x.LH}%)` : "";
    }
    const nflag = state && state.flagged ? state.flagged.length : 0;
    const nchk = state && state.sentences ? state.sentences.filter(s => s[2] === "check").length : 0;
    x.now.textContent = (c < 0 ? `end: ${x.T} positions` + (C ? ` after ${C} compressions` : ", never compressed") :
        `compression ${c + 1} of ${C}, at generated token ${x.r.steps[c].generated}: ${seen} positions seen`) +
      `; the cache holds ${(total / x.LH).toFixed(1)} per layer and head on average` +
      (state ? `; ${nflag} flagged, ${nchk} check sentences` : "");
    x.summary.textContent = `prompt (${x.r.prompt_len} tokens; ${promptHeld} still held by some layer and head)`;
    x.step = c; x.sets = sets;
  }
}
const slider = document.getElementById("step");
slider.max = String(maxSteps + 1);
const asked = /step=(\d+)/.exec(location.hash);  // page.html#step=3 opens at compression 3
slider.value = String(asked ? Math.min(Math.max(1, Number(asked[1])), maxSteps + 1) : maxSteps + 1);
slider.addEventListener("input", () => render(Number(slider.value)));
render(Number(slider.value));

const tip = document.getElementById("tip");
function tipFor(x, p) {  // the hover box of position p in run x, at the step shown
  const c = x.step, C = x.r.steps.length, seen = c < 0 ? x.T : x.r.steps[c].seen;
  const byStep = new Map(), layers = [];
  for (let l = 0; l < x.r.L; l++) {
    let keeps = false;
    for (let h = 0; h < x.r.H; h++) {
      const e = x.ev[(l * x.r.H + h) * x.T + p];
      if (e !== NEVER) byStep.set(e, (byStep.get(e) || 0) + 1);
      if (e === NEVER || (c >= 0 && e > c)) keeps = true;
    }
    if (keeps && p < seen) layers.push(l);
  }
  const evs = [...byStep.entries()].sort((a, b) => a[0] - b[0]).map(([e, n]) => `${n} at compression ${e + 1}`);
  const where = p < x.r.prompt_len ? `prompt token ${p}` : `output token ${p - x.r.prompt_len}`;
  let out = `<b>position ${p}</b> (${where}) <b>${esc(JSON.stringify(x.r.tokens[p]))}</b><br>`;
  out += p >= seen ? "not generated yet at this step<br>" :
    `held by ${heldAfter(x, p, c)} of ${x.LH} layer·heads; layers keeping it: ${ranges(layers)}<br>`;
  out += `evicted: ${evs.length ? evs.join(", ") : "never"}` + (C ? ` (of ${C} compressions)` : "");
  if (x.sets.flag.has(p)) {
    const sim = Number(x.sets.flag.get(p)).toFixed(3);
    out += `<br>in a sentence flagged redundant (similarity ${sim})`;
  }
  if (x.sets.chk.has(p)) out += "<br>in a check sentence";
  return out;
}
function showTip(span, cx, cy) {
  tip.innerHTML = tipFor(runs[Number(span.closest(".run").dataset.run)], Number(span.dataset.p));
  tip.style.display = "block";
  const w = tip.offsetWidth, hgt = tip.offsetHeight;
  tip.style.left = Math.min(cx + 14, innerWidth - w - 8) + "px";
  tip.style.top = (cy + 18 + hgt > innerHeight ? cy - hgt - 10 : cy + 18) + "px";
}
document.addEventListener("mousemove", ev => {
  const s = ev.target.closest && ev.target.closest(".tok");
  if (s) showTip(s, ev.clientX, ev.clientY); else tip.style.display = "none";
});
const pinned = /tip=(\d+)/.exec(location.hash);  // page.html#tip=120 opens with position 120's box (first run)
if (pinned && runs[0].spans[Number(pinned[1])]) {
  const span = runs[0].spans[Number(pinned[1])], box = span.getBoundingClientRect();
  showTip(span, box.left, box.bottom - 12);
}
</script>
</body></html>
"""
