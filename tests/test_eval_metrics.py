"""Tests of pass@k and maj@k against hand-computed values and brute-force enumeration of subsets."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from tba.eval_metrics import maj_at_k, pass_at_k, sampled_metrics

# --- pass@k ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c / n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 1, 3, 0.6),  # 1 - C(4,3)/C(5,3) = 1 - 4/10
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 5, 1, 1.0),
        (5, 4, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 2), (6, 2, 3), (8, 3, 2), (9, 0, 4), (10, 5, 5), (7, 6, 1)])
def test_pass_at_k_matches_enumeration(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_large_n_is_finite() -> None:
    # C(1000, 500) overflows a float; the product form must not.
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (4, 1, 5, "k=5 exceeds the number of samples n=4"),
        (4, 1, 0, "k must be at least 1, got k=0"),
        (4, 5, 1, r"in \[0, n=4\], got c=5"),
        (4, -1, 1, r"in \[0, n=4\], got c=-1"),
    ],
)
def test_pass_at_k_errors(n: int, c: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


# --- maj@k -----------------------------------------------------------------------------------------


def test_maj_at_k_hand_computed() -> None:
    answers: list[str | None] = ["1", "1", "2"]
    correct = [True, True, False]
    assert maj_at_k(answers, correct, 3) == 1.0  # "1" wins 2 to 1
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 3)  # one vote: right 2 times in 3
    # {1,1}: 1; {1,2}: tie, half right; {1,2}: tie, half right -> (1 + 0.5 + 0.5) / 3
    assert maj_at_k(answers, correct, 2) == pytest.approx(2 / 3)


def test_maj_at_k_with_missing_answers() -> None:
    answers: list[str | None] = ["5", None, None, "7"]
    correct = [True, False, False, False]
    # k=4: votes 5 and 7 tie -> 0.5.
    assert maj_at_k(answers, correct, 4) == pytest.approx(0.5)
    # k=2, six subsets: {5,N} x2 -> 1; {7,N} x2 -> 0; {N,N} -> no votes, 0; {5,7} -> tie, 0.5.
    assert maj_at_k(answers, correct, 2) == pytest.approx(2.5 / 6)
    # k=1: only the "5" sample scores.
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.25)


def test_maj_at_k_without_any_answer() -> None:
    assert maj_at_k([None, None, None], [False, False, False], 2) == 0.0


def test_maj_at_k_beats_pass_at_1_when_the_mode_is_right() -> None:
    # The right answer holds 3 of 5 samples and the wrong ones are split: voting 5 always finds it.
    answers: list[str | None] = ["4", "4", "4", "9", "12"]
    correct = [True, True, True, False, False]
    assert maj_at_k(answers, correct, 5) == 1.0
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.6)
    # k=3, ten subsets: 1 with three 4s, 6 with two 4s -> 1 each; 3 with one 4, one 9, one 12 -> tie, 1/3.
    assert maj_at_k(answers, correct, 3) == pytest.approx((7 + 3 / 3) / 10)


def test_maj_at_k_disagreeing_flags_use_the_mean() -> None:
    # Two samples share the key "3" but only one was graded correct: the answer counts as half right.
    assert maj_at_k(["3", "3"], [True, False], 2) == pytest.approx(0.5)


def _brute_maj_at_k(answers: list[str | None], correct: list[bool], k: int) -> float:
    """maj@k by listing every k-subset of sample indices."""
    right: dict[str, list[bool]] = {}
    for answer, ok in zip(answers, correct, strict=True):
        if answer is not None:
            right.setdefault(answer, []).append(ok)
    scores = []
    for subset in itertools.combinations(range(len(answers)), k):
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            scores.append(0.0)
            continue
        top = max(votes.values())
        tied = [answer for answer, count in votes.items() if count == top]
        scores.append(sum(sum(right[a]) / len(right[a]) for a in tied) / len(tied))
    return sum(scores) / len(scores)


@pytest.mark.parametrize("seed", range(8))
def test_maj_at_k_matches_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(3, 11)
    answers = [rng.choice(["1", "2", "3", "4", None]) for _ in range(n)]
    correct = [answer == "1" for answer in answers]
    for k in range(1, n + 1):
        assert maj_at_k(answers, correct, k) == pytest.approx(_brute_maj_at_k(answers, correct, k), abs=1e-12)


def test_maj_at_k_monte_carlo_agrees_with_exact() -> None:
    # n=40, k=10: C(40,10) ~ 8.5e8 subsets, so maj_at_k samples. Counts 16 right ("A"), 12 "B", 8 "C",
    # 4 missing. The exact value is computed here from the multivariate hypergeometric distribution.
    groups = {"A": 16, "B": 12, "C": 8, None: 4}
    answers: list[str | None] = [answer for answer, size in groups.items() for _ in range(size)]
    correct = [answer == "A" for answer in answers]
    k = 10
    exact = 0.0
    for a, b, c in itertools.product(range(k + 1), repeat=3):
        missing = k - a - b - c
        if not 0 <= missing <= groups[None]:
            continue
        weight = math.comb(16, a) * math.comb(12, b) * math.comb(8, c) * math.comb(4, missing)
        votes = {"A": a, "B": b, "C": c}
        top = max(votes.values())
        tied = [answer for answer, count in votes.items() if count == top and count > 0]
        exact += weight * (("A" in tied) / len(tied) if tied else 0.0)
    exact /= math.comb(40, k)
    assert 0.6 < exact < 0.9  # a case where the estimate has room to be wrong either way
    for seed in (0, 1):
        assert maj_at_k(answers, correct, k, seed=seed) == pytest.approx(exact, abs=0.02)
    assert maj_at_k(answers, correct, k, seed=3) == maj_at_k(answers, correct, k, seed=3)  # reproducible


def test_maj_at_k_many_distinct_answers() -> None:
    # 1,000 distinct answers, one of them right: a single vote is right one time in 1,000.
    answers: list[str | None] = [str(i) for i in range(1000)]
    correct = [i == 0 for i in range(1000)]
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.001)
    assert maj_at_k(answers, correct, 1000) == pytest.approx(0.001)  # all tied


@pytest.mark.parametrize(
    ("answers", "correct", "k", "message"),
    [
        (["1", "2"], [True], 1, r"differ in length \(2 vs 1\)"),
        (["1", "2"], [True, False], 3, "k=3 exceeds the number of samples n=2"),
        (["1", "2"], [True, False], 0, "k must be at least 1"),
    ],
)
def test_maj_at_k_errors(answers: list[str | None], correct: list[bool], k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        maj_at_k(answers, correct, k)


# --- sampled_metrics -------------------------------------------------------------------------------


def test_sampled_metrics_two_problems() -> None:
    problems: list[tuple[list[str | None], list[float]]] = [
        (["18.0", "18.0", "17.0", None], [1.0, 1.0, 0.0, 0.0]),  # 2 of 4 right
        (["3.0", "4.0", "4.0", "4.0"], [1.0, 0.0, 0.0, 0.0]),  # 1 of 4 right, the mode wrong
    ]
    metrics = sampled_metrics(problems, [1, 2, 4])
    assert set(metrics) == {
        *("pass@1", "maj@1", "pass@2", "maj@2", "pass@4", "maj@4"),
        *("mean_score", "distinct_right", "right_entropy"),
    }
    assert metrics["mean_score"] == pytest.approx(3 / 8)
    assert metrics["distinct_right"] == 1.0  # one right answer each ("18.0" twice, "3.0")
    assert metrics["right_entropy"] == 0.0
    assert metrics["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert metrics["maj@1"] == pytest.approx((0.5 + 0.25) / 2)
    # pass@2: 1 - C(2,2)/C(4,2) = 5/6 and 1 - C(3,2)/C(4,2) = 1/2.
    assert metrics["pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    # maj@2, problem 1: {18,18} 1; {18,17} x2 0.5; {18,N} x2 1; {17,N} 0 -> 4/6.
    # problem 2: {3,4} x3 0.5; {4,4} x3 0 -> 1.5/6.
    assert metrics["maj@2"] == pytest.approx((4 / 6 + 1.5 / 6) / 2)
    assert metrics["pass@4"] == 1.0
    assert metrics["maj@4"] == pytest.approx((1.0 + 0.0) / 2)


def test_sampled_metrics_count_distinct_right_answers_over_every_problem() -> None:
    problems: list[tuple[list[str | None], list[float]]] = [
        (["7", "14", "21", "5"], [1.0, 1.0, 1.0, 0.0]),  # three right answers, once each
        (["7", "7", "8", "9"], [1.0, 1.0, 0.0, 0.0]),  # one, twice
        (["1", "2", "3", "4"], [0.0, 0.0, 0.0, 0.0]),  # none right: 0 and 0, still in the mean
    ]
    metrics = sampled_metrics(problems, [1])
    assert metrics["distinct_right"] == pytest.approx((3 + 1 + 0) / 3)
    assert metrics["right_entropy"] == pytest.approx(math.log(3) / 3)


def test_sampled_metrics_scores_count_as_correct_above_one_half() -> None:
    metrics = sampled_metrics([(["a", "b"], [0.5, 0.75])], [1])
    assert metrics["pass@1"] == pytest.approx(0.5)  # 0.5 is not above one half
    assert metrics["mean_score"] == pytest.approx(0.625)


def test_sampled_metrics_errors() -> None:
    with pytest.raises(ValueError, match="eval.pass_k has k=8 > eval.samples=4"):
        sampled_metrics([(["1"] * 4, [1.0] * 4)], [1, 8])
    with pytest.raises(ValueError, match=r"same number of samples, got sizes \[2, 3\]"):
        sampled_metrics([(["1"] * 2, [1.0] * 2), (["1"] * 3, [1.0] * 3)], [1])
    with pytest.raises(ValueError, match="problem 0 has 2 answers but 3 scores"):
        sampled_metrics([(["1"] * 2, [1.0] * 3)], [1])
    with pytest.raises(ValueError, match="at least one problem"):
        sampled_metrics([], [1])
    with pytest.raises(ValueError, match="eval.pass_k has k=0"):
        sampled_metrics([(["1"] * 2, [1.0] * 2)], [0])


def test_answer_spread_counts_right_answers_and_measures_them_against_the_target() -> None:
    from tba.eval_metrics import answer_spread

    uniform = {"7": 1 / 3, "14": 1 / 3, "21": 1 / 3}
    # 6 samples: 4 right (7, 7, 14, 21), one wrong, one without an answer
    got = answer_spread(["7", "7", "14", "21", "9", None], [True, True, True, True, False, False], uniform)
    assert got["success"] == pytest.approx(4 / 6)
    assert got["distinct"] == 3
    p = [0.5, 0.25, 0.25]
    assert got["entropy"] == pytest.approx(-sum(v * math.log(v) for v in p))
    assert got["tv"] == pytest.approx(0.5 * (abs(0.5 - 1 / 3) + 2 * abs(0.25 - 1 / 3)))
    # all mass on one right answer: entropy 0, TV 1 - 1/3; matching the target exactly: TV 0
    one = answer_spread(["7"] * 4, [True] * 4, uniform)
    assert one["entropy"] == 0 and one["tv"] == pytest.approx(2 / 3) and one["distinct"] == 1
    assert answer_spread(["7", "14", "21"], [True] * 3, uniform)["tv"] == pytest.approx(0.0)
    assert answer_spread(["7", "14", "21"], [True] * 3, uniform)["entropy"] == pytest.approx(math.log(3))
    # nothing right: success 0, TV 1
    assert answer_spread(["9", None], [False, False], uniform) == {
        "success": 0.0,
        "distinct": 0.0,
        "entropy": 0.0,
        "tv": 1.0,
    }
    with pytest.raises(ValueError, match="summing to 1"):
        answer_spread(["7"], [True], {"7": 0.5})
    with pytest.raises(ValueError, match="as many answers as verdicts"):
        answer_spread(["7"], [True, False], uniform)
