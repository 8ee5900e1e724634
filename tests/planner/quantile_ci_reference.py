#!/usr/bin/env python3
"""The reference cases of summary_test.cc's QuantileIntervalTest: for n
samples 0, 1, ..., n - 1 (so each bound is its order statistic's index),
SciPy's distribution-free confidence interval of a quantile
(scipy.stats.quantile_test(...).confidence_interval, two-sided), printed as
the C++ that the test holds; -1 where SciPy has no bound (nan).
Run: python3 tests/planner/quantile_ci_reference.py
"""
import math

import numpy as np
from scipy.stats import quantile_test

CASES = [  # (n, quantile, confidence)
    (5, 0.9, 0.9), (10, 0.9, 0.9), (22, 0.9, 0.9), (29, 0.9, 0.9), (30, 0.9, 0.9),
    (50, 0.9, 0.9), (100, 0.9, 0.9), (100, 0.5, 0.95), (100, 0.99, 0.9),
    (1000, 0.9, 0.9), (5424, 0.9, 0.9), (7, 0.5, 0.9),
]


def bound(value):
    return -1 if math.isnan(value) else int(value)


for n, q, confidence in CASES:
    ci = quantile_test(np.arange(n, dtype=float), q=0.0, p=q).confidence_interval(confidence)
    print(f"    {{{n}, {q}, {confidence}, {bound(ci.low)}, {bound(ci.high)}}},")
