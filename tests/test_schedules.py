"""β annealing and learning-rate multipliers as functions of the (0-based) trainer step."""

from __future__ import annotations

import math

import pytest

from tba.schedules import beta_at, lr_multiplier

# --- beta_at ------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 250, 10_000])
def test_beta_is_constant_without_annealing(step: int) -> None:
    assert beta_at(step, 0.05) == 0.05
    assert beta_at(step, 0.05, None, 100) == 0.05  # no final value: nothing to anneal to
    assert beta_at(step, 0.05, 0.01, 0) == 0.05  # no annealing steps: stays at the start value


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.014),  # start
        (100, 0.012),  # 0.014 − 0.010·(100/500)
        (250, 0.009),  # midpoint
        (499, 0.014 - 0.010 * 499 / 500),
        (500, 0.004),  # end
        (501, 0.004),  # after the end: constant
        (100_000, 0.004),
        (-3, 0.014),  # negative steps are clamped to the start
    ],
)
def test_beta_linear_annealing_paper_setting(step: int, expected: float) -> None:
    assert beta_at(step, 0.014, 0.004, 500) == pytest.approx(expected, rel=1e-12)


def test_beta_annealing_is_monotone_and_can_increase() -> None:
    down = [beta_at(s, 1.0, 0.5, 10) for s in range(15)]
    assert all(a > b for a, b in zip(down[:10], down[1:11], strict=True))
    assert down[10:] == [0.5] * 5
    assert beta_at(5, 0.1, 0.3, 10) == pytest.approx(0.2, rel=1e-12)
    assert beta_at(10, 0.1, 0.3, 10) == pytest.approx(0.3, rel=1e-12)


# --- lr_multiplier ------------------------------------------------------------------------------


def test_warmup_is_linear_and_reaches_the_peak_after_warmup_steps() -> None:
    # Step 0 is not spent at lr 0: warmup goes (s+1)/(w+1) for s < w, so 1/5 .. 4/5 for w = 4.
    values = [lr_multiplier(s, total_steps=100, warmup_steps=4) for s in range(6)]
    assert values == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0], rel=1e-12)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_warmup_is_the_same_for_every_schedule(schedule: str) -> None:
    for s in range(3):
        assert lr_multiplier(s, 20, 3, schedule, 0.5) == pytest.approx((s + 1) / 4, rel=1e-12)
    assert lr_multiplier(3, 20, 3, schedule, 0.5) == pytest.approx(1.0, rel=1e-12)


def test_no_warmup_starts_at_the_peak() -> None:
    assert lr_multiplier(0, 10) == 1.0
    assert lr_multiplier(0, 10, 0, "cosine") == 1.0
    assert lr_multiplier(0, 10, 0, "linear") == 1.0


@pytest.mark.parametrize("step", [0, 5, 9, 10, 500])
def test_constant_schedule_without_warmup(step: int) -> None:
    assert lr_multiplier(step, 10, 0, "constant", 0.3) == 1.0


# total 11 steps (0..10), warmup 2: decay over steps 2..10, span 8; min_ratio 0.1.
COSINE = [
    (2, 1.0),
    (4, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # frac 0.25 → 0.868198...
    (6, 0.55),  # frac 0.5: halfway between 1 and 0.1
    (8, 0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4))),  # frac 0.75 → 0.231801...
    (10, 0.1),  # the last step reaches min_ratio
    (11, 0.1),  # beyond the last step: stays at the floor
    (50, 0.1),
]
LINEAR = [(2, 1.0), (4, 0.775), (6, 0.55), (8, 0.325), (10, 0.1), (11, 0.1), (50, 0.1)]


@pytest.mark.parametrize(("step", "expected"), COSINE)
def test_cosine_decay_values(step: int, expected: float) -> None:
    assert lr_multiplier(step, 11, 2, "cosine", 0.1) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("step", "expected"), LINEAR)
def test_linear_decay_values(step: int, expected: float) -> None:
    assert lr_multiplier(step, 11, 2, "linear", 0.1) == pytest.approx(expected, rel=1e-12)


def test_cosine_explicit_numbers_and_zero_floor() -> None:
    assert lr_multiplier(4, 11, 2, "cosine", 0.1) == pytest.approx(0.8681980515, rel=1e-9)
    assert lr_multiplier(8, 11, 2, "cosine", 0.1) == pytest.approx(0.2318019485, rel=1e-9)
    # default min_ratio 0: ends at exactly 0 on the last step
    assert lr_multiplier(10, 11, 2, "cosine") == pytest.approx(0.0, abs=1e-15)
    assert lr_multiplier(10, 11, 2, "linear") == 0.0


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_is_monotone_after_warmup(schedule: str) -> None:
    values = [lr_multiplier(s, 30, 5, schedule, 0.2) for s in range(5, 30)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))
    assert values[0] == pytest.approx(1.0) and values[-1] == pytest.approx(0.2)


def test_unknown_schedule_is_rejected_after_warmup() -> None:
    with pytest.raises(ValueError, match=r"unknown lr schedule 'step'"):
        lr_multiplier(5, 10, 2, "step")


def test_warmup_stable_then_cosine_cut_short_as_in_the_gsm8k_recipe():
    from tba.schedules import lr_multiplier

    m = [lr_multiplier(s, 700, 50, "cosine", 0.0, stable_steps=350, decay_steps=600) for s in range(700)]
    assert m[0] == 1 / 51 and m[49] == 50 / 51
    assert m[50] == m[399] == 1.0  # 350 stable steps at the peak
    assert m[400] == 1.0 and abs(m[700 - 1] - 0.5 * (1 + math.cos(math.pi * 299 / 600))) < 1e-12
    assert 0.5 < m[-1] < 0.51  # cut at 700, halfway down the 600-step cosine
    assert all(a >= b for a, b in zip(m[50:], m[51:], strict=False))


def test_beta_jumps_to_its_final_value_as_in_the_tldr_recipe():
    from tba.schedules import beta_at

    assert beta_at(0, 1.0, 0.05, 256, 32) == 1.0
    assert beta_at(16, 1.0, 0.05, 256, 32) == pytest.approx(1.0 - 0.95 * 16 / 256)
    assert beta_at(31, 1.0, 0.05, 256, 32) > 0.8
    assert beta_at(32, 1.0, 0.05, 256, 32) == beta_at(200, 1.0, 0.05, 256, 32) == 0.05
