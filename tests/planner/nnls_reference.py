#!/usr/bin/env python3
"""The reference cases of least_squares_test.cc: each an A, b and SciPy's
NNLS solution (scipy.optimize.nnls) with its residual norm, printed as the
C++ that the test holds. Run: python3 tests/planner/nnls_reference.py
"""
import textwrap

import numpy as np
from scipy.optimize import nnls


def cases():
    rng = np.random.default_rng(16)
    # Dropping the first column that comes out negative and refitting (the
    # fit's method until 2026-11-28) ends at x = 0, residual 4.69.
    trap_a = np.array([
        [-0.49, -0.59, -0.08, 0.29], [-0.97, 0.99, -0.41, -0.38],
        [0.36, -0.56, -0.4, 0.65], [0.4, 0.07, -0.63, 0.05],
        [0.81, -0.53, -0.51, 1.5], [1.27, -0.82, 0.57, -0.16],
        [-0.36, 0.24, -0.24, 0.0], [0.51, -0.78, -0.57, 1.1]])
    trap_b = np.array([-1.18, 0.68, -1.21, 0.24, -3.51, 1.6, -0.46, -1.87])
    yield "EliminationTrap", trap_a, trap_b, True
    yield "Gaussian30x6", rng.normal(size=(30, 6)), rng.normal(size=30), True
    a = rng.uniform(0.1, 1.0, size=(10, 3))
    yield "ExactPositive", a, a @ np.array([0.5, 2.0, 1.0]), True
    a = rng.uniform(0.1, 1.0, size=(6, 3))
    yield "AllZero", a, -(a @ np.ones(3)), True
    # Column 2 = column 0 + column 1 and a zero column: x is not unique,
    # the residual is.
    a = rng.normal(size=(12, 4))
    a[:, 2] = a[:, 0] + a[:, 1]
    a[:, 3] = 0
    yield "CollinearAndZeroColumns", a, rng.normal(size=12), False
    # The step model's shape: steps up of a table (1 up to a row's segment,
    # its fraction on the segment) and an attention term, each row over the
    # measured time, against 1 (relative error), the times noisy.
    knots = [1, 2, 4, 8, 16, 32]
    rows = []
    for tokens in [1, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 32, 3, 7]:
        i = max(k for k in range(len(knots)) if knots[k] <= tokens)
        f = 0.0 if i == len(knots) - 1 else (tokens - knots[i]) / (knots[i + 1] - knots[i])
        steps = [1.0 if k <= i else (f if k == i + 1 else 0.0) for k in range(len(knots))]
        attention = tokens * rng.uniform(50, 500)
        seconds = (1e-3 + 2e-4 * tokens + 3e-7 * attention) * rng.uniform(0.8, 1.25)
        rows.append([v / seconds for v in steps + [attention]])
    a = np.array(rows)
    yield "StepTableRelative", a, np.ones(len(rows)), True


def cpp(values, indent):
    """A C++ initializer list of the shortest round-trip doubles, wrapped
    within 100 columns."""
    text = "{" + ", ".join(repr(float(v)) for v in values) + "}"
    return textwrap.fill(text, 97, initial_indent=" " * indent,
                         subsequent_indent=" " * (indent + 1))


for name, a, b, unique in cases():
    x, residual = nnls(a, b, maxiter=1000)
    print(f"    {{\"{name}\",")
    print("     {")
    print(",\n".join(cpp(r, 6) for r in a) + "},")
    print(cpp(b, 5) + ",")
    print(cpp(x, 5) + ",")
    print(f"     {residual!r}, {'true' if unique else 'false'}}},")
