"""bench/shim_overhead.py's statistics: the confidence interval it prints for the median of
the per-round ratios is the distribution-free one (order statistics), and holds its level."""

from __future__ import annotations

import math
import random

from bench.shim_overhead import median_ci


def test_the_median_interval_is_the_order_statistics_that_cover_95_percent():
    for n in (5, 6, 41, 101, 201):
        values = list(range(1, n + 1))
        random.Random(n).shuffle(values)
        med, lo, hi = median_ci([float(v) for v in values])
        assert med == (n + 1) / 2
        k = int(lo)  # the values are their own ranks: the interval is x(k) .. x(n+1-k)
        assert hi == n + 1 - k
        # P(median outside [x(k), x(n+1-k)]) = 2 P(Binomial(n, 1/2) <= k-1): at most 5 %, and
        # the next narrower interval would exceed it
        below = sum(math.comb(n, i) for i in range(k)) / 2**n
        assert 2 * below <= 0.05 or k == 1
        assert 2 * (below + math.comb(n, k) / 2**n) > 0.05
    assert median_ci([1.0, 2.0, 3.0])[1:] == (1.0, 3.0)  # too few rounds: the whole range
