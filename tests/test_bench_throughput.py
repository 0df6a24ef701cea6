"""`skipkv bench throughput` on the tiny model: the JSON it writes, errors before any work, and (CUDA only)
the host syncs of a decode step."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from conftest import PROMPTS
from skipkv import SamplingParams, make_policy
from skipkv.bench.throughput import SweepPoint, parse_workload, saturation
from skipkv.cli import main
from skipkv.config import EngineConfig, parse_bytes
from skipkv.errors import SkipKVError


def test_bench_throughput_json(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", "random:qwen2", "--workload", "synthetic:12x10", "--requests", "6",
                 "--kv-memory", "40KiB", "--policies", "full,rkv", "--budget", "12", "--interval", "4", "--window",
                 "4", "--dtype", "fp32", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    runs = {r["policy"]: r for r in rep["policies"]}
    assert set(runs) == {"full", "rkv"}
    for r in runs.values():
        assert r["generated_tokens"] == 60 and r["requests"] == 6 and r["tokens_per_s"] > 0
        assert 0 < r["peak_kv_bytes"] <= 40 << 10
        for key in ("requests_per_s", "max_batch", "ttft_p50", "tpot_p50", "tpot_p99", "compress_share"):
            assert key in r
    # 40 KiB hold 80 slot entries of the tiny model in fp32 (512 B an entry over its 2 layers): full reserves
    # 12 + 10 = 22 entries a request (3 at once), rkv budget + interval = 16 (5 at once).
    assert (runs["full"]["max_batch"], runs["rkv"]["max_batch"]) == (3, 5)
    assert (tmp_path / "t.png").stat().st_size > 0


def test_bad_input_fails_before_work(tmp_path, capsys):
    (tmp_path / "afile").write_text("")  # (permission bits do not stop root, so no read-only directory here)
    for args, msg in ((["--workload", "synthetic:12"], "PROMPTxOUTPUT"), (["--kv-memory", "lots"], "size like"),
                      (["--out", str(tmp_path / "afile" / "x.json")], "is a file, not a folder"),
                      (["--out", str(tmp_path)], "is a folder"), (["--policies", "nope"], "nope"),
                      (["--batch-sweep", "1,x"], "batch-sweep")):
        try:
            code = main(["bench", "throughput", "--model", "random:qwen2", *args])
        except SystemExit as exc:  # argparse's own one-line usage errors
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SkipKVError):
        parse_workload("synthetic:0x5")
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1.5KiB") == 1536 and parse_bytes("100") == 100


def test_saturation():
    pts = [SweepPoint("full", b, t) for b, t in ((1, 10.0), (2, 19.0), (4, 30.0), (8, 31.0), (16, 31.5))]
    assert saturation(pts) == 4
    assert saturation(pts[:3]) == 4  # still growing at the largest batch measured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are only measurable on CUDA")
def test_decode_step_syncs_once_on_cuda():
    from skipkv.engine import Engine
    from skipkv.models import load_model

    bundle = load_model("random:qwen2", dtype="fp32", device="cuda")
    with Engine(bundle, make_policy("rkv", budget=48, window=4, interval=32), EngineConfig()) as eng:
        for p in PROMPTS:
            eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
        for _ in range(3):
            eng.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(4):  # no compression in these steps (budget 48 + interval 32 not reached)
                    assert eng.step().stats.compressions == 0
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message).lower()]) == 4  # the sampler, once a step


def test_compress_share_counts_requests_cut_by_the_time_limit():
    """With --max-seconds nothing may finish; the compression time of the aborted requests still counts. A limit
    of 0 cuts the run after its first step (the prefill, which compresses the 20-token prompts to budget 12)
    whatever the machine's speed (0.5 s let a fast CPU finish all 3 x 400 tokens in 0.38 s)."""
    from skipkv import load_model
    from skipkv.bench.throughput import Workload, run_engine

    bundle = load_model("random:qwen2", dtype="fp32")
    work = Workload("t", [list(range(5, 25))] * 3, [SamplingParams(max_new_tokens=400, ignore_eos=True)] * 3)
    run = run_engine(bundle, make_policy("rkv", budget=12, window=4, interval=2), work, EngineConfig(), "rkv",
                     max_seconds=0.0)
    assert run.steps == 1
    assert run.requests_per_s == 0  # cut before any request finished
    assert run.compress_share > 0


def test_batch_sweep_repeats_alternate_engine_and_transformers(tmp_path, monkeypatch):
    import skipkv.bench.throughput as tp

    order = []
    real_engine, real_hf = tp.run_engine, tp.run_hf
    monkeypatch.setattr(tp, "run_engine", lambda *a, **k: (order.append("E"), real_engine(*a, **k))[1])
    monkeypatch.setattr(tp, "run_hf", lambda *a, **k: (order.append("T"), real_hf(*a, **k))[1])
    out = tmp_path / "s.json"
    assert main(["bench", "throughput", "--model", "random:qwen2", "--workload", "synthetic:8x6", "--requests", "2",
                 "--policies", "full", "--batch-sweep", "2", "--hf-reference", "--repeats", "3", "--dtype", "fp32",
                 "--out", str(out)]) == 0
    assert "".join(order) == "E" + "ET" * 3  # the warm-up, then three back-to-back pairs
    (point,) = json.loads(out.read_text())["sweep"]
    assert len(point["engine_runs"]) == len(point["hf_runs"]) == 3
    ratios = sorted(e / h for e, h in zip(point["engine_runs"], point["hf_runs"]))
    assert point["ratio"] == pytest.approx(ratios[1])
    assert point["tokens_per_s"] == pytest.approx(sorted(point["engine_runs"])[1])
    assert main(["bench", "throughput", "--model", "random:qwen2", "--repeats", "0"]) == 2


def test_timeline_notes_tokens_and_batch_at_each_interval():
    """The timeline's rows are [seconds, tokens so far, requests that got a token]: one per interval, ending at
    the run's total, with the batch the engine ran."""
    from skipkv import load_model
    from skipkv.bench.throughput import Workload, run_engine

    bundle = load_model("random:qwen2", dtype="fp32")
    work = Workload("t", [list(range(5, 25))] * 3, [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 3)
    run = run_engine(bundle, make_policy("full"), work, EngineConfig(), "full", timeline_s=0.0)
    assert len(run.timeline) == run.steps  # interval 0: every step that produced a token
    assert run.timeline[-1][1] == run.generated_tokens == 90
    assert [row[2] for row in run.timeline] == [3] * 30
    assert all(a[0] <= b[0] and a[1] < b[1] for a, b in zip(run.timeline, run.timeline[1:]))
    sparse = run_engine(bundle, make_policy("full"), work, EngineConfig(), "full", timeline_s=3600.0)
    assert len(sparse.timeline) == 1  # the first token's step only
