"""How far apart two computations may be that are equal in exact arithmetic but add their terms in
another order (chunks, micro-batches, ranks, padding, another kernel, another CPU) or round their
operands to another dtype (bf16 against fp32).

The tolerance follows from the dtype and the number of terms, not from a run that passed once.
Floating-point addition rounds each partial sum s_k to within a relative u (the unit roundoff,
half the dtype's machine epsilon): fl(s_k) = s_k (1 + δ_k), |δ_k| ≤ u. The error of a sum of n
terms is Σ_k δ_k s_k with |s_k| ≤ Σ|x_i|. Modelling the δ_k as independent with mean zero (the
probabilistic rounding error analysis of Higham and Mary, SIAM J. Sci. Comput. 2019), the
Azuma-Hoeffding inequality bounds it by λ·√n·u·Σ|x_i| except with probability 2·exp(−λ²/2). Two orders of the
same sum differ by the errors of both, 2n roundings: the bound is λ·√(2n)·u·Σ|x_i|. λ = 6 leaves
a chance of 3·10⁻⁸ per compared number. The worst case, n·u·Σ|x_i|, would accept almost anything
for long sums; the √n bound is what reorderings actually reach, and an error 100 times larger
than a real reordering's is rejected (tests/test_numerics.py shows both on 10⁵ fp32 terms).

Rounding a product's operands to a lower precision (bf16 autocast, fp32 accumulation) is one
more relative error of at most u per term, relative to the term itself rather than to a partial
sum: there the count is of rounded operands along the path, not of the sums' lengths
(:func:`bf16_operand_terms`), with that dtype's u.

The scale Σ|x_i| is the size of the summands. For one output of a network it is not at hand;
``scale`` defaults to the largest magnitude of the expected values, which stands in for it where
the summands do not cancel much more than the result does. Through several layers the roundings
of each add up: ``terms`` is then the sum of the reduction lengths along the path (the vocabulary
for a head's backward pass, the hidden size per layer, the tokens a weight gradient sums over).

Tests that must be bit-exact (a resumed run against an uninterrupted one, a seed's determinism,
weights that must not move) compare with ``torch.equal`` on the same machine, by design, and do
not use this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

LAMBDA = 6.0  # standard deviations of the rounding model: P(false alarm) ≤ 2·exp(−18) ≈ 3e-8


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the largest relative error of one rounding to nearest."""
    return torch.finfo(dtype).eps / 2


def reorder_tolerance(dtype: torch.dtype, terms: int) -> float:
    """Relative tolerance, in units of Σ|x_i|, between two summation orders of ``terms`` terms
    computed in ``dtype`` (or with operands rounded to it): λ·√(2·terms)·u."""
    if terms < 1:
        raise ValueError(f"terms must be at least 1, got {terms}")
    return LAMBDA * math.sqrt(2 * terms) * unit_roundoff(dtype)


def _as_tensor(x) -> torch.Tensor:
    return x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def reordered_error(actual, expected, *, dtype: torch.dtype, terms: int, scale=None) -> float:
    """The largest difference between ``actual`` and ``expected`` in units of the tolerance:
    at most 1 is what a reordering (or the dtype's rounding) can explain."""
    a = _as_tensor(actual).to(torch.float64)
    e = _as_tensor(expected).to(torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} against {tuple(e.shape)}")
    if scale is None:
        scale = e.abs().max() if e.numel() else torch.tensor(0.0, dtype=torch.float64)
    scale = _as_tensor(scale).to(torch.float64)
    tiny = torch.finfo(dtype).tiny  # an all-zero expected value tolerates only underflow
    bound = reorder_tolerance(dtype, terms) * scale.clamp(min=tiny)
    if not torch.isfinite(a).all() or not torch.isfinite(e).all():
        raise AssertionError("non-finite values: a reordering does not make or explain them")
    return float(((a - e).abs() / bound).max()) if a.numel() else 0.0


def assert_reordered_close(actual, expected, *, dtype: torch.dtype = torch.float32, terms: int, scale=None) -> None:
    """Assert that ``actual`` equals ``expected`` up to a reordering of sums of ``terms`` terms in
    ``dtype``. Both may be tensors, numbers, lists, or mappings of them (gradients by parameter
    name: each gets its own scale). ``scale``: the size of the summands, a number or a tensor that
    broadcasts against the values; by default the largest magnitude among the expected values."""
    if isinstance(expected, Mapping):
        if set(actual) != set(expected):
            raise AssertionError(f"keys differ: {sorted(set(actual) ^ set(expected))}")
        worst = {k: reordered_error(actual[k], expected[k], dtype=dtype, terms=terms, scale=scale) for k in expected}
        bad = {k: v for k, v in worst.items() if v > 1}
        assert not bad, (
            f"beyond what reordering {terms} terms in {dtype} explains "
            f"(tolerance {reorder_tolerance(dtype, terms):.2e} of the scale): "
            + ", ".join(f"{k}: {v:.1f}x" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
        )
        return
    ratio = reordered_error(actual, expected, dtype=dtype, terms=terms, scale=scale)
    assert ratio <= 1, (
        f"{ratio:.1f}x beyond what reordering {terms} terms in {dtype} explains "
        f"(tolerance {reorder_tolerance(dtype, terms):.2e} of the scale)"
    )


def adam_first_step_tolerance(
    grad: torch.Tensor, weight: torch.Tensor, lr: float, terms: int, eps: float = 1e-8
) -> torch.Tensor:
    """Per-weight bound on how far one AdamW step from the same weights may move them apart when
    the gradients differ by a reordering of ``terms`` fp32 terms (by ``δ``, at most the tolerance
    times the gradient's largest entry).

    Adam's first step is lr·g/(|g| + ε): it divides each gradient by its own size, so a relative
    error becomes an absolute one. Where |g| > 2δ the step's derivative ε/(|g|+ε)² bounds the change
    by lr·δ·ε/(|g| − δ + ε)² (next to nothing); a gradient within 2δ of zero may flip its sign and
    move its weight by up to 2·lr either way. The new weight w − step rounds to within u·|w| in
    each run, and the step's eight roundings (the moments, the square root, ε, the bias
    corrections, the quotient, lr) to within 8u·lr in each."""
    g = grad.detach().to(torch.float64).abs()
    delta = reorder_tolerance(torch.float32, terms) * float(g.max())
    smooth = lr * delta * eps / (g - delta + eps).clamp(min=eps) ** 2
    flip = torch.full_like(g, 2 * lr)
    u = unit_roundoff(torch.float32)
    rounding = 2 * u * weight.detach().to(torch.float64).abs() + 2 * 8 * u * lr
    return torch.where(g > 2 * delta, smooth, flip) + rounding


def model_terms(config, tokens: int) -> int:
    """``terms`` for a decoder's outputs and gradients: the reduction lengths along one number's
    path, added. Per layer the query, key and value projections sum over the hidden size, the
    scores over a head's size, attention over the positions, the output and MLP projections over
    the hidden and intermediate sizes; then the head over the hidden size and the softmax over the
    vocabulary. ``tokens``: the positions attention sees and a weight's gradient sums over (all
    the batch's token positions)."""
    h, i = config.hidden_size, config.intermediate_size
    head = h // config.num_attention_heads
    per_layer = h + head + tokens + h + h + i
    return config.num_hidden_layers * per_layer + h + config.vocab_size + tokens


def batch_tokens(batch) -> int:
    """Token positions of a trainer :class:`~tba.types.Batch` (each rollout's prompt and
    completion, no padding): what a step's gradients and loss sum over."""
    prompts = sum(len(batch.prompt_ids[i // batch.group_size]) for i in range(len(batch.rollouts)))
    return prompts + sum(len(r.completion) for r in batch.rollouts)


def padded_positions(prompts, completions) -> int:
    """Token positions of a padded batch of prompt + completion rows: ``tokens`` for model_terms."""
    return len(prompts) * max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))


def bf16_operand_terms(config) -> int:
    """``terms`` for a decoder run under bf16 autocast against fp32: each matmul rounds its two
    operands to bf16 once and accumulates in fp32. Those errors are relative to each product, so a
    dot product's is at most λ·√(Σ(2u·x_i·y_i)²) ≤ 2λu·Σ|x_i·y_i|, with no √n of its length; what
    adds up is the rounded operands along a number's path: two per matmul, six matmuls a layer
    (queries/keys/values, scores, attention × values, output, gate/up, down) and the head."""
    return 2 * (6 * config.num_hidden_layers + 1)
