"""One prefill, many policies (engine/shared.py): every branch must be the run that policy would have made
alone, tokens, KV figures and layer lengths included; what cannot share is refused."""

from __future__ import annotations

import random

import pytest
import torch

from skipkv import SamplingParams, generate, load_model, make_policy
from skipkv.attention import QueryBuffer
from skipkv.config import EngineConfig
from skipkv.engine.shared import branch, generate_shared, prefill_full, shares_prefill
from skipkv.errors import SkipKVError
from skipkv.models.patches import routed
from skipkv.policies import parse_policy_spec

# Prefill-only and decode-time compressors, per-layer and model-wide, pooled and not.
SPECS = ["full", "streaming_llm:phase=prefill", "snapkv:phase=prefill", "pyramidkv:phase=prefill", "rkv",
         "snapkv", "laprox", "laprox:kernel=7,normalize=sum", "laprox:norm=frobenius,prefill_window=16",
         "h2o:phase=prefill", "h2o", "h2o:variant=last_query", "laprox:granularity=head", "adakv",
         # the frontier's prefill methods (the long-prompt grid's); the second kvzip reuses the first's scores
         "criticalkv_ada", "layer_defensivekv", "expected_attention:phase=prefill", "kvzip", "kvzip:allocation=head"]
FIELDS = ("token_ids", "text", "finish_reason", "prompt_tokens", "generated_tokens", "peak_kv_tokens",
          "peak_kv_bytes", "decode_peak_kv_tokens", "decode_peak_kv_bytes", "compressions", "layer_kv_tokens",
          "head_kv_tokens", "allocated_kv_bytes", "peak_total_bytes", "extra")


def policies(budget: int):
    return [parse_policy_spec(s, budget=budget, interval=8)[1] if s != "full" else make_policy("full") for s in SPECS]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_each_branch_equals_that_policys_own_run(dtype):
    """bf16 too: the shared prefill is the same batch-1 forward, so nothing may round differently."""
    bundle = load_model("random:qwen2:sharp", dtype=dtype)
    ids = random.Random(1).choices(range(5, 250), k=240)
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)  # 30 > interval: the decode-phase policies compress again
    pols = policies(48)
    got = generate_shared(bundle, ids, sp, pols)
    for spec, policy, g in zip(SPECS, pols, got):
        [want] = generate(bundle, [ids], sp, policy, EngineConfig(batch_size=1))
        for f in FIELDS:
            assert getattr(g, f) == getattr(want, f), (spec, f)
    by = dict(zip(SPECS, got))
    assert by["full"].layer_kv_tokens == [269] * 2 and by["rkv"].compressions > 1  # both kinds really ran
    assert by["h2o"].compressions > 1 and by["h2o"].text != by["h2o:phase=prefill"].text
    assert len(set(by["laprox"].layer_kv_tokens)) > 1  # model-wide: layers of different lengths
    for spec in ("laprox:granularity=head", "adakv"):  # head-split: the heads of a layer differ
        assert any(len(set(layer)) > 1 for layer in by[spec].head_kv_tokens), spec
    assert len({r.text for r in got}) > 1  # the policies did not all keep the same thing


def test_branch_store_equals_the_policys_own_prefill():
    """Entry for entry (positions and keys), the compressed copy is the store the policy's own prefill leaves."""
    from skipkv.engine import make_requests
    from skipkv.engine.runner import ModelRunner

    bundle = load_model("random:qwen2:sharp", dtype="fp64")
    ids = random.Random(3).choices(range(5, 250), k=300)
    sp = SamplingParams(max_new_tokens=1)
    with routed(bundle.model), torch.inference_mode():
        full = prefill_full(bundle, ids, 32, attn=True)[0]
        for policy in policies(60)[1:]:
            if not shares_prefill(policy, 32):  # expected_attention's 128 queries: not in this 32-query prefill
                continue
            got = branch(bundle, full, policy, ids, sp)[0].store
            own = ModelRunner(bundle, policy, num_slots=1)
            own.prefill(make_requests(bundle, [ids], sp, policy))
            want = own.store
            assert torch.equal(got.lengths[:, 0], want.lengths[:, 0]) and int(want.lengths[:, 0].min()) < 300
            for l in range(got.num_layers):
                n = int(want.lengths[l, 0])
                assert torch.equal(got.pos[l][0, :, :n], want.pos[l][0, :, :n])
                assert torch.equal(got.k[l][0, :, :n], want.k[l][0, :, :n])


def test_narrowed_query_buffer_equals_a_buffer_of_that_size():
    L, S, Hq, D = 2, 2, 3, 4
    big, small = (QueryBuffer(L, S, Hq, w, D, torch.float32, torch.device("cpu")) for w in (8, 3))
    g = torch.Generator().manual_seed(0)
    real = torch.tensor([11, 0])  # row 1 gets only the 2 decode queries: fewer than even the small window holds
    q = torch.randn(S, Hq, 11, D, generator=g)
    pos = torch.arange(11).expand(S, -1)
    for buf in (big, small):
        for l in range(L):
            buf.write(l, 0, q, pos, real)
    for step in range(2):
        qd = torch.randn(S, Hq, 1, D, generator=g)
        pd = (real + step)[:, None]
        for buf in (big, small):
            for l in range(L):
                buf.write(l, 0, qd, pd, torch.ones(S, dtype=torch.long))
    got = big.narrowed(3)
    assert torch.equal(got.qpos, small.qpos) and torch.equal(got.q, small.q)
    with pytest.raises(ValueError):
        small.narrowed(4)


def test_what_cannot_share_is_refused():
    bundle = load_model("random:qwen2:sharp")
    ids = list(range(5, 60))
    assert not shares_prefill(make_policy("skipkv"))  # hidden states
    assert not shares_prefill(make_policy("laprox", prefill_window=64), 32)  # a wider window than captured
    for pols, sp, msg in (([make_policy("skipkv", budget=16)], SamplingParams(max_new_tokens=2), "hidden states"),
                          ([make_policy("snapkv", budget=40)], SamplingParams(max_new_tokens=2, temperature=0.7),
                           "greedy")):
        with pytest.raises(SkipKVError, match=msg):
            generate_shared(bundle, ids, sp, pols)


# ------------------------------------------------------------------------------------------ eval runs
TIMING = ("seconds", "compress_seconds", "session", "finished_at")


def _records(out) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return sorted(({k: v for k, v in r.items() if k not in TIMING} for r in rows), key=lambda r: r["id"])


def _cell(out, policy: str, ratio: float | None, **knobs):
    from skipkv.eval.runner import EvalConfig

    return EvalConfig(model="random:qwen2:sharp", dataset="niah", policy=policy, out=str(out), budget_ratio=ratio,
                      policy_knobs={"interval": 8, **knobs} if policy != "full" else {},
                      dataset_options={"lengths": [400, 600], "depths": [0.3, 0.8]}, max_new_tokens=12,
                      batch_size=1, quiet=True)


def test_run_shared_writes_what_each_run_alone_writes(tmp_path):
    """Records (timing aside), summaries and config identity of a shared run equal separate run_eval runs; a
    second call resumes (nothing to do), and a half-done group only fills in what is missing."""
    import json
    import shutil
    from pathlib import Path

    from skipkv.eval.runner import run_eval
    from skipkv.eval.shared import run_shared

    def summary(out: str) -> dict:
        return {k: v for k,
                v in json.loads((Path(out) / "summary.json").read_text()).items() if k != "tokens_per_second"}

    specs = [("full", None, {}), ("snapkv", 0.2, {"phase": "prefill"}), ("laprox", 0.2, {}),
             ("laprox", 0.1, {"kernel": 3}), ("rkv", 0.3, {}), ("h2o", 0.2, {"phase": "prefill"})]
    shared = [_cell(tmp_path / "shared" / f"c{i}", p, r, **k) for i, (p, r, k) in enumerate(specs)]
    alone = [_cell(tmp_path / "alone" / f"c{i}", p, r, **k) for i, (p, r, k) in enumerate(specs)]
    run_eval(alone[2])  # one run of the group is already done: the shared pass must leave it as it is
    before = (Path(alone[2].out) / "records.jsonl").read_bytes()
    shutil.copytree(alone[2].out, shared[2].out)
    run_shared(shared)
    assert (Path(shared[2].out) / "records.jsonl").read_bytes() == before
    # One sessions.jsonl line per run dir the shared pass generated into, with the session its records carry.
    for cfg in shared:
        sessions = [json.loads(line)["session"] for line in (Path(cfg.out) / "sessions.jsonl").read_text().splitlines()]
        rows = [json.loads(line) for line in (Path(cfg.out) / "records.jsonl").read_text().splitlines()]
        assert sessions == sorted({r["session"] for r in rows}), cfg.out
    for cfg in alone[:2] + alone[3:]:
        run_eval(cfg)
    outputs = set()
    for a, b in zip(alone, shared):
        ra, rb = _records(Path(a.out)), _records(Path(b.out))
        assert len(ra) == 4 and ra == rb, a.policy
        outputs.add(tuple(r["output"] for r in ra))
        assert summary(a.out) == summary(b.out)
        config = json.loads((Path(b.out) / "config.json").read_text())
        assert config["execution"].get("shared_prefill") is (None if b is shared[2] else True)
    assert len(outputs) > 1
    mtime = (Path(shared[1].out) / "records.jsonl").stat().st_mtime_ns
    run_shared(shared)  # resumes: every example done, nothing appended
    assert (Path(shared[1].out) / "records.jsonl").stat().st_mtime_ns == mtime
    run_eval(shared[1])  # and run_eval accepts a shared run's dir as its own (same identity)


def test_run_shared_loads_and_renders_the_data_once(tmp_path, monkeypatch):
    """The runs of a group share their examples: one load and one rendering per example, not one per run (a
    long-context set fits each haystack by tokenizing it repeatedly, so per-run loads cost minutes per block)."""
    from skipkv.eval import prompts
    from skipkv.eval.longctx import NIAH
    from skipkv.eval.shared import run_shared

    calls = {"load": 0, "render": 0}
    load, render = NIAH.load, prompts.render

    def counted_load(self, request):
        calls["load"] += 1
        return load(self, request)

    def counted_render(*args, **kwargs):
        calls["render"] += 1
        return render(*args, **kwargs)

    monkeypatch.setattr(NIAH, "load", counted_load)
    monkeypatch.setattr(prompts, "render", counted_render)
    run_shared([_cell(tmp_path / "alone", "full", None)])
    one = dict(calls)
    calls.update(load=0, render=0)
    specs = [("full", None), ("rkv", 0.3), ("laprox", 0.2)]
    run_shared([_cell(tmp_path / f"c{i}", p, r) for i, (p, r) in enumerate(specs)])
    assert calls == one and one["load"] == 1  # three runs cost what one does
    assert all(len(_records(tmp_path / f"c{i}")) == 4 for i in range(3))


def test_run_shared_refuses_runs_that_cannot_share(tmp_path):
    from dataclasses import replace

    from skipkv.eval.shared import run_shared

    ok = _cell(tmp_path / "a", "snapkv", 0.2)
    b = str(tmp_path / "b")
    for bad, msg in ((_cell(b, "skipkv", 0.2), "hidden states"),
                     (replace(ok, out=b, max_new_tokens=5), "max_new_tokens"),
                     (_cell(tmp_path / "a", "laprox", 0.1), "two runs write"),
                     (replace(ok, out=b, prefill_chunk=128), "chunks")):
        with pytest.raises(SkipKVError, match=msg):
            run_shared([ok, bad])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before any dir was made
