"""Task-independent metrics of a sampled evaluation (n samples per problem).

* pass@k: the unbiased estimator of Chen et al., 2021 (*Evaluating Large Language Models Trained on
  Code*, arXiv:2107.03374): the probability that at least one of k samples drawn without replacement
  from the n is correct, 1 - C(n-c, k) / C(n, k), computed as a product to avoid huge binomials.
* maj@k: the expected correctness of majority voting over a uniformly random k of the n samples.
  Samples without an answer do not vote; a tie among the most frequent answers is broken uniformly at
  random, so a subset scores the fraction of its tied answers that are correct; a subset without votes
  scores 0. The expectation is exact (all subsets, grouped by their per-answer counts) when there are at
  most 20,000 subsets, otherwise a mean over 2,000 random subsets.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence

__all__ = ["answer_spread", "maj_at_k", "pass_at_k", "sampled_metrics"]

MAX_EXACT_SUBSETS = 20_000  # above this many k-subsets maj@k switches to Monte Carlo
MONTE_CARLO_SUBSETS = 2_000  # standard error at most 0.5 / sqrt(2000) ~ 0.011 per problem


def _check_k(n: int, k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be at least 1, got k={k}")
    if k > n:
        raise ValueError(f"k={k} exceeds the number of samples n={n}; draw at least k samples per problem")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``c`` correct out of ``n`` samples."""
    _check_k(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"the number of correct samples must be in [0, n={n}], got c={c}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): no factorials, no overflow.
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _answer_correctness(answers: Sequence[str | None], correct: Sequence[bool]) -> dict[str, float]:
    """Correctness of each distinct answer: the mean flag of its samples (they normally all agree)."""
    flags: dict[str, list[float]] = defaultdict(list)
    for answer, ok in zip(answers, correct, strict=True):
        if answer is not None:
            flags[answer].append(float(ok))
    return {answer: sum(values) / len(values) for answer, values in flags.items()}


def _vote_score(votes: dict[str, int], correctness: dict[str, float]) -> float:
    """Expected correctness of the majority answer given vote counts, ties broken uniformly at random."""
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [answer for answer, count in votes.items() if count == top]
    return sum(correctness[answer] for answer in tied) / len(tied)


def _count_splits(sizes: Sequence[int], k: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """Every way to take k items from groups of the given sizes, as (group, count) pairs with count > 0.

    Iterative, and zero counts are left out, so a thousand distinct answers neither hit the recursion
    limit nor cost a thousand-long tuple per split.
    """
    room_after, remaining = [], sum(sizes)  # room_after[i]: items in the groups after group i
    for size in sizes:
        remaining -= size
        room_after.append(remaining)
    stack: list[tuple[int, int, tuple[tuple[int, int], ...]]] = [(0, k, ())]
    while stack:
        group, left, split = stack.pop()
        if left == 0:
            yield split
            continue
        # Take at least what the later groups cannot hold, so every branch ends with exactly k taken.
        for count in range(max(0, left - room_after[group]), min(sizes[group], left) + 1):
            stack.append((group + 1, left - count, (*split, (group, count)) if count else split))


def _exact_majority(answers: Sequence[str | None], correctness: dict[str, float], k: int) -> float:
    """Mean vote score over all C(n, k) subsets.

    A subset's score depends only on how many samples of each answer it holds, so the subsets are
    enumerated as per-answer counts, each weighted by the number of subsets with those counts; this
    gives the same mean as listing every subset at a fraction of the cost.
    """
    sizes = Counter(answers)  # None (no answer) is a group too: it fills places in a subset but casts no vote
    groups = list(sizes)
    total = 0.0
    for split in _count_splits([sizes[group] for group in groups], k):
        weight = math.prod(math.comb(sizes[groups[g]], count) for g, count in split)
        votes = {groups[g]: count for g, count in split if groups[g] is not None}
        total += weight * _vote_score(votes, correctness)
    return total / math.comb(len(answers), k)


def _sampled_majority(answers: Sequence[str | None], correctness: dict[str, float], k: int, seed: int) -> float:
    """Mean vote score over MONTE_CARLO_SUBSETS uniformly random k-subsets."""
    rng = random.Random(seed)
    total = 0.0
    for _ in range(MONTE_CARLO_SUBSETS):
        subset = rng.sample(range(len(answers)), k)
        total += _vote_score(Counter(answers[i] for i in subset if answers[i] is not None), correctness)
    return total / MONTE_CARLO_SUBSETS


def maj_at_k(answers: list[str | None], correct: list[bool], k: int, seed: int = 0) -> float:
    """Expected majority-vote correctness over a uniformly random ``k`` of one problem's samples."""
    if len(answers) != len(correct):
        raise ValueError(f"answers and correct differ in length ({len(answers)} vs {len(correct)})")
    n = len(answers)
    _check_k(n, k)
    correctness = _answer_correctness(answers, correct)
    if math.comb(n, k) <= MAX_EXACT_SUBSETS:
        return _exact_majority(answers, correctness, k)
    return _sampled_majority(answers, correctness, k, seed)


def _check_problems(problems: Sequence[tuple[Sequence[str | None], Sequence[float]]]) -> int:
    """The common number of samples per problem; raises if problems differ or are malformed."""
    if not problems:
        raise ValueError("sampled_metrics needs at least one problem")
    sizes: set[int] = set()
    for index, (answers, scores) in enumerate(problems):
        if len(answers) != len(scores):
            raise ValueError(f"problem {index} has {len(answers)} answers but {len(scores)} scores")
        sizes.add(len(scores))
    if len(sizes) != 1:
        raise ValueError(f"every problem needs the same number of samples, got sizes {sorted(sizes)}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("every problem needs at least one sample (eval.samples >= 1)")
    return n


def sampled_metrics(problems: list[tuple[list[str | None], list[float]]], ks: list[int]) -> dict[str, float]:
    """pass@k and maj@k (means over problems) for each k, the mean score of all samples, and how
    the right answers spread (:func:`answer_spread`): ``distinct_right``, the distinct right answers
    a problem, and ``right_entropy``, their entropy in nats (0 for a problem with at most one), both
    means over every problem.

    Each problem is (answer keys, scores) over the same number n of samples; a score above 0.5 counts
    as correct.
    """
    n = _check_problems(problems)
    for k in ks:
        if k > n:
            raise ValueError(f"eval.pass_k has k={k} > eval.samples={n}; lower k or raise eval.samples")
        if k < 1:
            raise ValueError(f"eval.pass_k has k={k}; every k must be at least 1")
    answer_lists = [list(answers) for answers, _ in problems]
    flags = [[score > 0.5 for score in scores] for _, scores in problems]
    metrics: dict[str, float] = {}
    for k in ks:
        metrics[f"pass@{k}"] = sum(pass_at_k(n, sum(ok), k) for ok in flags) / len(problems)
        # A different seed per problem keeps Monte Carlo errors independent across problems.
        majority = [maj_at_k(answer_lists[i], flags[i], k, seed=i) for i in range(len(problems))]
        metrics[f"maj@{k}"] = sum(majority) / len(problems)
    all_scores = [float(score) for _, scores in problems for score in scores]
    metrics["mean_score"] = sum(all_scores) / len(all_scores)
    spreads = [answer_spread(answers, ok) for answers, ok in zip(answer_lists, flags, strict=True)]
    metrics["distinct_right"] = sum(s["distinct"] for s in spreads) / len(problems)
    metrics["right_entropy"] = sum(s["entropy"] for s in spreads) / len(problems)
    return metrics


def win_rate(policy_scores: Sequence[float], reference_scores: Sequence[float]) -> float:
    """Fraction of prompts whose policy completion scores strictly higher than the reference's
    under the judge (a tie is a loss, as in the TL;DR evaluation of the TBA paper)."""
    if len(policy_scores) != len(reference_scores) or not policy_scores:
        raise ValueError(
            f"win_rate needs equal, non-empty score lists, got {len(policy_scores)} and {len(reference_scores)}"
        )
    return sum(p > r for p, r in zip(policy_scores, reference_scores, strict=True)) / len(policy_scores)


def diversity(embeddings: Sequence[Sequence[float]]) -> float:
    """1 - mean cosine similarity over ordered pairs i != j of the rows of ``embeddings`` [n, d]
    (red-teaming: embeddings of n attacks, a list of rows or a numpy array; 0 when all point the same way,
    1 when all are orthogonal, up to 2 when they point in opposite directions)."""
    import numpy as np  # numpy only here: the rest of this module is pure Python

    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"diversity needs an [n, d] array with n >= 2 rows, got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if not np.all(norms > 0):
        raise ValueError(f"diversity: rows {np.flatnonzero(norms[:, 0] == 0).tolist()} are zero vectors")
    unit = x / norms
    total = unit.sum(axis=0)
    n = x.shape[0]
    # sum over all pairs of u_i . u_j = |sum_i u_i|^2; the n diagonal terms are 1 each
    off_diagonal = float(total @ total) - float((unit * unit).sum())
    return 1.0 - off_diagonal / (n * (n - 1))


def answer_spread(
    answers: Sequence[str | None], correct: Sequence[bool], target: dict[str, float] | None = None
) -> dict[str, float]:
    """How one problem's samples spread over its right answers, against a target distribution.

    ``answers``: each sample's canonical answer (None: none given); ``correct``: whether each is
    right; ``target``: the distribution over right answers that the samples' right answers should
    follow (summing to 1; trajectory balance's with a 0/1 reward and no reference: uniform over the
    right answers). Returns ``success`` (the share of samples that are right), ``distinct`` (how many
    different right answers were sampled), ``entropy`` (in nats, of the right answers' empirical
    distribution; 0 with fewer than one) and ``tv`` (total variation distance, ½ Σ |p − q|, between
    the right answers' empirical distribution p and ``target`` q; 1 where no sample was right; left
    out without a target)."""
    if len(answers) != len(correct) or not answers:
        raise ValueError(
            f"answer_spread needs as many answers as verdicts, at least one: {len(answers)}, {len(correct)}"
        )
    if target is not None:
        total = sum(target.values())
        if not target or any(v < 0 for v in target.values()) or not math.isclose(total, 1.0, rel_tol=1e-6):
            raise ValueError(
                f"answer_spread: target must be a distribution over right answers, summing to 1 (got {total})"
            )
    right = Counter(a for a, c in zip(answers, correct, strict=True) if c and a is not None)
    n_right = sum(right.values())
    if n_right == 0:
        return {"success": 0.0, "distinct": 0.0, "entropy": 0.0, **({"tv": 1.0} if target is not None else {})}
    p = {a: k / n_right for a, k in right.items()}
    out = {
        "success": n_right / len(answers),
        "distinct": float(len(right)),
        "entropy": -sum(v * math.log(v) for v in p.values()),
    }
    if target is not None:
        out["tv"] = 0.5 * sum(abs(p.get(a, 0.0) - target.get(a, 0.0)) for a in set(p) | set(target))
    return out
