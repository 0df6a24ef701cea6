"""Shared fixtures: tiny random-weight models built from config (no download), in float64 so that
token-for-token equalities are not at the mercy of float rounding ties."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch

from skipkv.models import load_model

torch.set_num_threads(2)
# `--dtype auto` follows the processor (skipkv.hardware); the suite pins the capability answer so that what it runs
# (bf16, as before auto existed) does not depend on the processor CI gets. Subprocesses inherit it.
# tests/test_hardware.py fakes the capability both ways.
os.environ.setdefault("SKIPKV_CPU_BF16", "1")
# Likewise the 16-bit decode attention kernel (fused SDPA where it is faster, kernels.decode_sdpa): the suite runs
# the fused call on every processor; tests/test_hardware.py runs both.
os.environ.setdefault("SKIPKV_DECODE_SDPA", "1")
# And the fp32 linears' layout (transposed where MKL is faster that way, kernels.transposed_linears): the suite's
# fp32 models run the transposed layout on every processor; tests/test_packed.py runs both.
os.environ.setdefault("SKIPKV_TRANSPOSED_LINEARS", "1")

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "2 + 2 =",
    "In the beginning the Universe was created. This has made a lot of people very angry and been widely regarded",
]


@pytest.fixture(scope="session")
def tiny():
    return load_model("random:qwen2", dtype="fp64")


@pytest.fixture(scope="session", params=["random:llama", "random:qwen3"])
def tiny_other(request):
    return load_model(request.param, dtype="fp64")


def assert_same_entries(a, b, rows: int, atol: float = 1e-12) -> None:
    """Two KVStores hold the same entries in slots [0, rows): equal lengths and positions, and K, V and every
    accumulator within `atol` (fp64: only the order of sums may differ). Past a slot's length lies junk."""
    assert torch.equal(a.lengths, b.lengths)
    for l in range(a.num_layers):
        for s in range(rows):
            m = int(a.lengths[l, s])
            for got, want in [(b.k[l], a.k[l]), (b.v[l], a.v[l])] + [(b.aux[n][l], a.aux[n][l]) for n in a.aux_names]:
                torch.testing.assert_close(got[s, :, :m], want[s, :, :m], rtol=0, atol=atol)
            assert torch.equal(a.pos[l][s, :, :m], b.pos[l][s, :, :m])



@functools.cache
def calibrated_stats(model: str = "random:qwen2", dtype: str = "fp64") -> str:
    """A TriAttention statistics file for `model` (skipkv calibrate on 512 tokens of its packaged text), written
    once per session. A policy's `contract_knobs` value "@calibrated" stands for it (resolve_contract_knobs)."""
    from skipkv.eval.calibrate import calibrate

    out = Path(tempfile.mkdtemp(prefix="skipkv-stats-")) / "stats.safetensors"
    calibrate(model, str(out), tokens=512, segment=256, dtype=dtype)
    return str(out)


def resolve_contract_knobs(knobs: dict, model: str = "random:qwen2") -> dict:
    """Contract knobs with "@calibrated" replaced by a statistics file calibrated on `model`."""
    return {k: calibrated_stats(model) if v == "@calibrated" else v for k, v in knobs.items()}
