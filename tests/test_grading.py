"""Tests of the math graders: the GSM8K last-number rule on hand-graded solutions, and math-verify."""

from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tba.grading import (
    GRADERS,
    answer_key,
    extract_last_number,
    get_grader,
    grade_last_number,
    grade_math_verify,
    gsm8k_reference,
)

try:
    import math_verify.grader
    import math_verify.parser
except ImportError:  # the last-number tests still run; the math-verify ones are skipped
    math_verify = None

requires_math_verify = pytest.mark.skipif(math_verify is None, reason="needs the math-verify package")


# --- extract_last_number ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$1,234.50", 1234.5),
        ("-7", -7.0),
        ("50%", 50.0),
        ("The answer is 18.", 18.0),
        ("5 - 3 = 2", 2.0),  # a spaced minus is not a sign
        ("20-15=5", 5.0),  # an unspaced one is, but only the last number counts
        ("The difference is 11 - 4", 4.0),
        ("The range is 70-85", -85.0),  # the rule's known quirk: a hyphen touching digits is a sign
        ("+15", 15.0),
        ("3.", 3.0),
        (".5", 0.5),
        ("It is .25 full", 0.25),
        ("1e5", 100000.0),
        ("-2.5e-3", -0.0025),
        ("1E5", 5.0),  # only a lowercase e is an exponent
        ("3 eggs", 3.0),  # an e followed by letters is no exponent
        ("3.5.2", 0.2),  # read as 3.5 then .2; must not crash
        ("1,000,000", 1000000.0),
        ("", None),
        ("no digits here", None),
        ("- + . ,", None),
    ],
)
def test_extract_last_number(text: str, expected: float | None) -> None:
    assert extract_last_number(text) == expected


# --- GSM8K grading on hand-graded solutions ----------------------------------------------------------

# (model completion, reference answer, grade worked out by hand under the last-number rule)
GSM8K_CASES: list[tuple[str, str, float]] = [
    (  # plain correct answer ending in a sentence period
        "Natalia sold 48/2 = 24 clips in May. Altogether she sold 48 + 24 = 72 clips in April and May. "
        "The answer is 72.",
        "72",
        1.0,
    ),
    (  # dollars and a decimal rate
        "Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10.",
        "10",
        1.0,
    ),
    (  # several numbers and spaced subtraction; the last is the answer
        "Betty has 100/2 = $50. Her grandparents give her 15 * 2 = $30. In total she has 50 + 15 + 30 = $95, "
        "so she needs 100 - 95 = $5 more.",
        "5",
        1.0,
    ),
    (  # thousands separators throughout
        "The house cost $80,000 and the repairs $50,000, so he spent $130,000. The repairs raised the value by "
        "150%, so it is worth 80,000 * 2.5 = $200,000. His profit is 200,000 - 130,000 = $70,000.",
        "70000",
        1.0,
    ),
    (  # the reference has a comma, the completion none
        "Each of the 4 rooms needs 300 tiles, so he buys 4 * 300 = 1200 tiles in total.",
        "1,200",
        1.0,
    ),
    (  # the completion has a comma, the reference none
        "The school ordered 24 boxes of 50 pencils, which is 24 * 50 = 1,200 pencils.",
        "1200",
        1.0,
    ),
    (  # decimal money with a trailing zero
        "Each notebook costs $1.25, so 6 notebooks cost 6 * 1.25 = $7.50.",
        "7.5",
        1.0,
    ),
    (  # a negative answer
        "The temperature was 5 degrees at noon and fell 12 degrees by midnight, so it was 5 - 12 = -7 degrees.",
        "-7",
        1.0,
    ),
    (  # the sign of the answer is missing
        "The temperature was 5 degrees at noon and fell 12 degrees by midnight, a change of 7 degrees.",
        "-7",
        0.0,
    ),
    (  # a percent sign after the answer
        "She answered 45 of the 50 questions correctly, so her score is 45 / 50 * 100 = 90%.",
        "90",
        1.0,
    ),
    (  # the right number appears, but the model goes on and a later number counts
        "John has 3 boxes of 12 pencils, so 3 * 12 = 36 pencils. He gives away 10, leaving 26 pencils. "
        "Then he buys 4 more packs.",
        "26",
        0.0,
    ),
    (  # no number at all
        "I am not sure how to solve this problem without more information.",
        "18",
        0.0,
    ),
    (  # trailing text without a number does not matter
        "Janet's ducks lay 16 eggs a day. She eats 3 and bakes with 4, so 16 - 3 - 4 = 9 eggs are left. "
        "She sells them at $2 each, making 9 * 2 = $18. So she makes 18 dollars every day. Hope this helps!",
        "18",
        1.0,
    ),
    (  # trailing text with a number changes the answer
        "She started with 25 apples and gave away 7, so she has 25 - 7 = 18 apples left. Hope this helps! "
        "Feel free to ask about problem 3.",
        "18",
        0.0,
    ),
    (  # a GSM8K-style final line inside the completion
        "Natalia sold 48 clips in April and half as many, 24, in May: 48 + 24 = 72.\n#### 72",
        "72",
        1.0,
    ),
    (  # the model writes the final line and then starts inventing the next problem
        "Natalia sold 48 clips in April and 24 in May: 48 + 24 = 72.\n#### 72\n\n"
        "Question: A baker makes 30 loaves a day",
        "72",
        0.0,
    ),
    (  # an exponent-form answer
        "The culture starts with 125 cells and doubles 3 times, so it ends with 125 * 2^3 = 1e3 cells.",
        "1000",
        1.0,
    ),
    (  # a negative exponent equals the same decimal
        "Each bead weighs 0.05 grams and a chip weighs 1/20 of a bead, so a chip weighs 0.05 / 20 = 2.5e-3",
        "0.0025",
        1.0,
    ),
    (  # 18.0 equals 18
        "Tom reads 6 pages an hour for 3 hours, so 6 * 3 = 18.0 pages.",
        "18",
        1.0,
    ),
    (  # an arithmetic slip
        "He runs 3 sprints 3 times a week, so 3 * 3 = 9 sprints of 60 meters: 9 * 60 = 560 meters.",
        "540",
        0.0,
    ),
    (  # an unfinished spaced subtraction ends on its second operand
        "Mia is 11 and her brother is 4, so the difference between their ages is 11 - 4",
        "7",
        0.0,
    ),
    (  # compact equations: the signs go to 15, but the last number is 5
        "Money left: 20-15=5",
        "5",
        1.0,
    ),
    (  # price with cents and commas
        "She earns $1,234.50 each week, so in 4 weeks she earns 1,234.50 * 4 = $4,938.",
        "4938",
        1.0,
    ),
    (  # a fraction is read as its denominator
        "3 pizzas are shared equally by 4 friends, so each friend gets 3/4",
        "0.75",
        0.0,
    ),
    (  # a decimal without a leading zero
        "The tank held 100 liters and 75 were used, so it is now .25 full",
        "0.25",
        1.0,
    ),
    (  # an ordinal after the answer
        "She finished the 12 km race in 3rd place out of 12 runners",
        "3",
        0.0,
    ),
    (  # cents converted to dollars with trailing zeros
        "4 quarters is 4 x 25 = 100 cents, which is $1.00",
        "1",
        1.0,
    ),
    (  # millions with separators
        "The city has 250,000 households using 4 liters each, so it needs 250,000 * 4 = 1,000,000 liters.",
        "1000000",
        1.0,
    ),
    (  # an explicit plus sign
        "The stock went from $85 to $100, a net change of +15",
        "15",
        1.0,
    ),
    (  # empty completion
        "",
        "72",
        0.0,
    ),
    (  # an off-by-one answer
        "There are 7 days in a week, so in 5 weeks there are 7 * 5 = 36 days.",
        "35",
        0.0,
    ),
]


@pytest.mark.parametrize(("completion", "reference", "expected"), GSM8K_CASES)
def test_grade_last_number_hand_graded(completion: str, reference: str, expected: float) -> None:
    assert grade_last_number(completion, reference) == expected


def test_hand_graded_cases_cover_both_grades() -> None:
    grades = [expected for _, _, expected in GSM8K_CASES]
    assert len(GSM8K_CASES) >= 25
    assert grades.count(1.0) >= 10 and grades.count(0.0) >= 10


def test_grade_last_number_reference_without_number() -> None:
    assert grade_last_number("The answer is 5.", "five") == 0.0
    assert grade_last_number("no number", "no number") == 0.0


# --- gsm8k_reference -------------------------------------------------------------------------------


def test_gsm8k_reference_real_format() -> None:
    natalia = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
    )
    weng = (
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"
    )
    tiles = "Each room needs 300 tiles.\nHe needs 4*300 = <<4*300=1200>>1,200 tiles.\n#### 1,200"
    assert gsm8k_reference(natalia) == "72"
    assert gsm8k_reference(weng) == "10"
    assert gsm8k_reference(tiles) == "1,200"  # commas are kept; the grader drops them
    assert gsm8k_reference("It fell by 10-13 = <<10-13=-3>>-3 degrees.\n####  -3 \n") == "-3"
    assert grade_last_number("so the total is 1200 tiles", gsm8k_reference(tiles)) == 1.0


def test_gsm8k_reference_takes_the_last_marker() -> None:
    assert gsm8k_reference("#### 5\nA correction follows.\n#### 6") == "6"


def test_gsm8k_reference_without_marker() -> None:
    with pytest.raises(ValueError, match="no '#### <final answer>' line"):
        gsm8k_reference("Natalia sold 72 clips.")


# --- math-verify -----------------------------------------------------------------------------------


MATH_VERIFY_CASES: list[tuple[str, str, float]] = [
    ("The answer is 18.", "18", 1.0),
    ("So the final answer is $\\boxed{18}$.", "18", 1.0),
    ("So the final answer is $\\boxed{17}$.", "18", 0.0),
    ("The total is $1234$ dollars.", "1,234", 1.0),
    ("Each gets $\\frac{1}{2}$ of the cake.", "0.5", 1.0),
    ("Each gets 0.5 of the cake.", "\\frac{1}{2}", 1.0),
    ("The side is $\\boxed{3\\sqrt{2}}$.", "3\\sqrt{2}", 1.0),
    ("The side is $\\boxed{3}$.", "3\\sqrt{2}", 0.0),  # the bare reference must not be read as just 3
    ("I could not find the answer.", "18", 0.0),
    ("The answer is 18.", "", 0.0),
]


@requires_math_verify
@pytest.mark.parametrize(("completion", "reference", "expected"), MATH_VERIFY_CASES)
def test_grade_math_verify_main_thread(completion: str, reference: str, expected: float) -> None:
    assert threading.current_thread() is threading.main_thread()
    assert grade_math_verify(completion, reference) == expected


@pytest.fixture
def fresh_timeout_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-arm math-verify's once-per-process warning, so a test can see whether it gets through."""
    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False)


@requires_math_verify
def test_math_verify_itself_fails_in_a_thread() -> None:
    # The premise of grade_math_verify's thread handling: math-verify's default timeouts raise here.
    errors: list[BaseException] = []

    def run() -> None:
        try:
            math_verify.parse("18")
        except ValueError as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "threaded environment" in str(errors[0])


@requires_math_verify
def test_grade_math_verify_in_a_thread(
    fresh_timeout_warning: None, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    results: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(grade_math_verify("So the answer is $\\boxed{18}$.", "18"))
            results.append(grade_math_verify("Each gets $\\frac{1}{2}$.", "0.5"))
            results.append(grade_math_verify("So the answer is 17.", "18"))
        except BaseException as err:  # surfaced to the test below rather than lost in the thread
            errors.append(err)

    with caplog.at_level(logging.DEBUG):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert errors == []
    assert results == [1.0, 1.0, 0.0]
    assert not [record for record in caplog.records if "Timeout is disabled" in record.getMessage()]
    captured = capsys.readouterr()
    assert "Timeout is disabled" not in captured.out + captured.err


@requires_math_verify
def test_grade_math_verify_in_a_thread_pool(
    fresh_timeout_warning: None, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    with caplog.at_level(logging.WARNING), ThreadPoolExecutor(max_workers=4) as pool:
        grades = list(pool.map(lambda case: grade_math_verify(case[0], case[1]), MATH_VERIFY_CASES))
        keys = list(pool.map(lambda text: answer_key(text, "math_verify"), ["$\\boxed{18}$", "no answer"]))
    assert grades == [expected for _, _, expected in MATH_VERIFY_CASES]
    assert keys == ["18", None]
    assert not [record for record in caplog.records if "Timeout is disabled" in record.getMessage()]
    captured = capsys.readouterr()
    assert "Timeout is disabled" not in captured.out + captured.err


@requires_math_verify
def test_other_math_verify_warnings_still_pass(caplog: pytest.LogCaptureFixture) -> None:
    grade_math_verify("18", "18")  # installs the filter
    with caplog.at_level(logging.WARNING):
        logging.getLogger("math_verify.parser").warning("Timeout during parsing: x")
    assert [record.getMessage() for record in caplog.records] == ["Timeout during parsing: x"]


def test_grade_math_verify_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match=r"pip install 'tba\[math\]'"):
        grade_math_verify("18", "18")


# --- answer keys and the registry ------------------------------------------------------------------


def test_answer_key_last_number_agrees_on_equal_values() -> None:
    keys = {answer_key(text, "last_number") for text in ["18", "18.0", "The answer is 18.", "#### 18", "+18"]}
    assert keys == {"18.0"}
    assert answer_key("1,234", "last_number") == answer_key("1234.00", "last_number") == "1234.0"
    assert answer_key("-0", "last_number") == answer_key("0", "last_number") == "0.0"
    assert answer_key("17", "last_number") != answer_key("18", "last_number")
    assert answer_key("no answer", "last_number") is None


@requires_math_verify
def test_answer_key_math_verify() -> None:
    assert answer_key("So the answer is $\\boxed{18}$.", "math_verify") == "18"
    assert answer_key("The answer is 18.", "math_verify") == "18"
    assert answer_key("$\\frac{1}{2}$", "math_verify") == "1/2"
    assert answer_key("no answer here", "math_verify") is None


def test_answer_key_unknown_grader() -> None:
    with pytest.raises(ValueError, match="choose one of: last_number, math_verify"):
        answer_key("18", "exact_match")


def test_get_grader() -> None:
    assert get_grader("last_number") is grade_last_number
    assert get_grader("math_verify") is grade_math_verify
    assert set(GRADERS) == {"last_number", "math_verify"}
    with pytest.raises(ValueError, match="unknown grader 'exact'; choose one of: last_number, math_verify"):
        get_grader("exact")
