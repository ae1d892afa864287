"""The shared tolerance for reordered sums: it accepts what a real reordering does to a long fp32
sum and rejects an error a hundred times larger."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.helpers.numerics import assert_reordered_close, reorder_tolerance, reordered_error, unit_roundoff

N = 100_000  # terms per sum
SUMS = 64  # independent sums, so that the test sees the tail of the error, not one draw


def sequential_sums(x: np.ndarray) -> np.ndarray:
    """Each row summed left to right in float32: numpy's cumulative sum adds one term at a time,
    so the roundings are IEEE's and the same on every CPU."""
    return np.cumsum(x, axis=1, dtype=np.float32)[:, -1]


@pytest.fixture(scope="module")
def terms() -> np.ndarray:
    return np.random.default_rng(0).random((SUMS, N), dtype=np.float32)  # positive: no cancellation


def test_the_tolerance_follows_from_dtype_and_length():
    assert unit_roundoff(torch.float32) == 2.0**-24 and unit_roundoff(torch.bfloat16) == 2.0**-8
    assert reorder_tolerance(torch.float32, 4 * N) == pytest.approx(2 * reorder_tolerance(torch.float32, N))
    assert reorder_tolerance(torch.float64, N) == pytest.approx(reorder_tolerance(torch.float32, N) * 2.0**-29)
    assert reorder_tolerance(torch.float32, N) == pytest.approx(6 * math.sqrt(2 * N) * 2.0**-24)
    with pytest.raises(ValueError, match="at least 1"):
        reorder_tolerance(torch.float32, 0)


def test_a_reordered_fp32_sum_of_1e5_terms_passes_and_an_error_100_times_larger_fails(terms):
    forward = torch.from_numpy(sequential_sums(terms))
    backward = torch.from_numpy(sequential_sums(terms[:, ::-1]))
    shuffled = torch.from_numpy(sequential_sums(terms[:, np.random.default_rng(1).permutation(N)]))
    exact = torch.tensor([math.fsum(row) for row in terms.astype(np.float64)], dtype=torch.float64)
    scale = torch.from_numpy(np.abs(terms).astype(np.float64).sum(axis=1))  # Σ|x_i| of each sum
    # the orders really differ: these are rounding errors, not equal numbers
    assert not torch.equal(forward, backward) and not torch.equal(forward, shuffled)
    for a, b in [(forward, backward), (forward, shuffled), (backward, shuffled), (forward, exact)]:
        assert_reordered_close(a, b, terms=N, scale=scale)
    # the largest of the 64 reordering errors, made 100 times larger on top of the exact sums
    worst = (forward.double() - backward.double()).abs().max()
    assert worst > 0
    with pytest.raises(AssertionError, match="beyond what reordering"):
        assert_reordered_close(exact + 100 * worst, exact, terms=N, scale=scale)
    # the bound is not loose by orders of magnitude: a real reordering uses a fair part of it
    assert reordered_error(forward, backward, dtype=torch.float32, terms=N, scale=scale) > 0.02


def test_default_scale_is_the_largest_expected_magnitude_and_bf16_is_looser():
    expected = torch.tensor([1000.0, -2.0, 0.5])
    tol = reorder_tolerance(torch.float32, 100) * 1000.0
    assert_reordered_close(expected + 0.9 * tol, expected, terms=100)
    with pytest.raises(AssertionError, match="1.2x beyond"):
        assert_reordered_close(expected + 1.2 * tol, expected, terms=100)
    assert_reordered_close(expected + 1.2 * tol, expected, terms=100, dtype=torch.bfloat16)


def test_mappings_compare_per_key_with_their_own_scale_and_name_the_culprit():
    expected = {"big.weight": torch.full((3,), 100.0), "small.bias": torch.full((2,), 1e-3)}
    tol = reorder_tolerance(torch.float32, 10)
    ok = {"big.weight": expected["big.weight"] + 50 * tol, "small.bias": expected["small.bias"] * (1 + 0.5 * tol)}
    assert_reordered_close(ok, expected, terms=10)
    # an error that the big tensor's scale would hide is caught in the small one's
    bad = {"big.weight": expected["big.weight"], "small.bias": expected["small.bias"] + 1e-5}
    with pytest.raises(AssertionError, match="small.bias"):
        assert_reordered_close(bad, expected, terms=10)
    with pytest.raises(AssertionError, match="keys differ"):
        assert_reordered_close({"big.weight": expected["big.weight"]}, expected, terms=10)


def test_shapes_and_non_finite_values_are_errors_not_tolerated():
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_reordered_close(torch.zeros(3), torch.zeros(4), terms=1)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_reordered_close(torch.tensor([float("nan")]), torch.tensor([1.0]), terms=1)
