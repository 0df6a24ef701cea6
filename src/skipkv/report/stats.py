"""Interval estimates and paired tests for accuracies (what every reported accuracy carries).

    wilson(7, 100)             # (0.034, 0.137): the 95% Wilson score interval of 7 right out of 100
    mcnemar_exact(1, 6)        # two-sided exact McNemar p on discordant pairs (only A right, only B right)
    interval([1, 0, 0.5, 1])   # Wilson for 0/1 scores, a seeded percentile bootstrap for fractional ones
    holm([0.01, 0.04, 0.03])   # [0.03, 0.06, 0.06]: Holm-adjusted p-values of one family of tests
"""

from __future__ import annotations

import math
import random
from typing import Sequence


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials (95% for z = 1.96); (0, 0) when n = 0."""
    if n == 0:
        return 0.0, 0.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of b successes in b + c trials at 1/2."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap(values: Sequence[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of `values` (seeded, so a report is reproducible)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def interval(per_example: Sequence[float]) -> tuple[float, float]:
    """95% interval of a mean accuracy over examples: Wilson when every score is 0 or 1 (one sample each),
    else a bootstrap over examples (pass@1 over several samples, partial-credit graders)."""
    if all(v in (0.0, 1.0) for v in per_example):
        return wilson(int(sum(per_example)), len(per_example))
    return bootstrap(list(per_example))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: sorted ascending, the i-th (from 0) of m is
    multiplied by m - i, made non-decreasing, capped at 1. A test is rejected at level a iff its adjusted p <= a;
    this controls the family-wise error rate over the whole family, whatever the dependence between tests."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out
