"""What the field's libraries do for skipkv, and the hand-written code checked against them (docs/libraries.md).

    python -m pytest tests/test_libraries.py -q
"""

from __future__ import annotations

import pytest

from skipkv.errors import SkipKVError


def test_run_dir_lock_is_exclusive_and_released(tmp_path):
    from skipkv.eval.rundir import locked

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a started run: a refusal keeps its lock file
    with locked(out):
        with pytest.raises(SkipKVError, match="another skipkv eval is writing"), locked(out):
            pass
    with locked(out):  # released when the block ended
        pass


def test_mcnemar_exact_is_scipys_binomial_test():
    stats = pytest.importorskip("scipy.stats")
    from skipkv.report.stats import mcnemar_exact

    for n in range(1, 60):
        for b in range(n + 1):
            want = stats.binomtest(b, n, 0.5).pvalue
            assert mcnemar_exact(b, n - b) == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_wilson_is_scipys_wilson_interval_at_z_196():
    stats = pytest.importorskip("scipy.stats")
    from skipkv.report.stats import wilson

    for n in (1, 7, 50, 200):
        for k in range(0, n + 1, max(1, n // 7)):
            ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
            # scipy takes z = 1.95996..., the reports z = 1.96 (their committed numbers stay as they are)
            assert wilson(k, n) == pytest.approx((ci.low, ci.high), abs=2e-5)
