"""Pure helpers of the benchmarks: the DAP budget fit and search (no model runs)."""

from __future__ import annotations

import random

import pytest

from lowmem.suite.bench.dap import fit_longest, search_longest


def _quadratic(a: float, b: float):
    return lambda n: a * n * n + b * n


@pytest.mark.parametrize("seed", range(5))
def test_fit_longest_recovers_the_crossing_of_a_quadratic(seed):
    rng = random.Random(seed)
    a, b = rng.uniform(1e-4, 1e-2), rng.uniform(0.01, 2.0)
    peak = _quadratic(a, b)
    budget = peak(rng.randint(50, 2000)) + rng.uniform(0, 1)
    n = fit_longest((64, peak(64)), (128, peak(128)), budget)
    assert peak(n) <= budget < peak(n + 1)


def test_fit_longest_linear_peak():
    assert fit_longest((10, 20.0), (20, 40.0), 100.0) == 50


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("tol", [1, 4])
def test_search_longest_brackets_and_bisects(seed, tol):
    rng = random.Random(seed)
    a, b = rng.uniform(1e-4, 1e-2), rng.uniform(0.01, 2.0)
    peak = _quadratic(a, b)
    true_n = rng.randint(40, 1500)
    budget = peak(true_n) + 1e-9
    calls = []

    def measure(n):
        calls.append(n)
        return peak(n)

    known: dict[int, float] = {}
    guess = max(8, int(true_n * rng.uniform(0.3, 2.5)))
    n = search_longest(measure, budget, guess, tol, known)
    assert peak(n) <= budget
    assert true_n - n < tol + 1 and n <= true_n
    assert set(calls) == set(known) and len(calls) == len(set(calls))  # each size measured once
    assert len(calls) < 40


def test_search_longest_nothing_fits():
    assert search_longest(lambda n: 1e6, 10.0, 100, 1, {}) == 0
