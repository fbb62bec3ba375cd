"""How the numeric scorer reads a number a model writes in LaTeX, with a scale, in dotted groups, or as a
term of an expression: MATH's thousands (``10,\\!000``), degrees (``30^\\circ``), ``$5k``, ``1.234.567``,
``2x``, ``x - 5``, ``5!``."""

from __future__ import annotations

import pytest

from batchrun.protocol import RowCheck
from batchrun.scoring import Judgement, ScoringSettings, score_sample


def judged(text: str, answer) -> dict:
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": text}]}
    settings = ScoringSettings(scorers=("numeric",))
    return score_sample(record, Judgement(check=RowCheck(answer=answer), settings=settings))


@pytest.mark.parametrize(
    ("text", "answer", "passed"),
    [
        # MATH writes thousands as a comma and a thin space, 10,\!000: read as 10, then 000, it was 0 ("0 is
        # not 10000"), $1,\!234.56 was 234.56, and a key of 10,\!000 passed \boxed{0} and failed \boxed{10000}.
        (r"The final answer is $\boxed{10,\!000}$.", 10000, True),
        (r"\boxed{10,\!000}", 0, False),
        (r"\boxed{\$1,\!234.56}", 1234.56, True),
        (r"\boxed{1,\!234,\!567}", 1234567, True),
        (r"\boxed{1,\,000}", 1000, True),
        (r"\boxed{1{,}\!000}", 1000, True),
        (r"\boxed{10000}", r"10,\!000", True),
        (r"\boxed{0}", r"10,\!000", False),
        # Degrees in LaTeX are the unit, as the Unicode 30° is: 30^\circ was a power, no number.
        (r"\boxed{30^\circ}", 30, True),
        (r"\boxed{30^{\circ}}", 30, True),
        (r"The angle is $30^\circ$.", 30, True),
        (r"\boxed{-40^\circ}", -40, True),
        (r"\boxed{30^\circ \text{C}}", 30, True),
        (r"\boxed{30\degree}", 30, True),
        (r"\boxed{45^\circ}", r"45^\circ", True),  # a key of it was a scorer error
        (r"\boxed{45}", r"45^\circ", True),
    ],
)
def test_maths_thousands_and_degrees_are_read_as_their_numbers(text, answer, passed):
    """MATH's ``10,\\!000`` was read as 0 (a key of it passed ``\\boxed{0}``) and ``30^\\circ`` as no number
    ("no number in the answer"); now they are 10000 and 30 degrees, the unit ``°``."""
    score = judged(text, answer)
    assert score["passed"] is passed, score


@pytest.mark.parametrize(
    ("text", "answer", "passed"),
    [
        # A number that is a term of an expression is not its value: each passed for its last number.
        (r"\boxed{2x}", 2, False),
        (r"\boxed{2a}", 2, False),
        (r"\boxed{y = 2x}", 2, False),
        ("ANSWER: y = 2x", 2, False),
        (r"\boxed{3i}", 3, False),
        (r"\boxed{2 + 3i}", 3, False),
        (r"\boxed{2\theta}", 2, False),
        ("ANSWER: x - 5", 5, False),
        ("ANSWER: x-5", -5, False),
        ("ANSWER: 5 - x", 5, False),
        (r"\boxed{n+1}", 1, False),
        (r"\boxed{x+1}", 1, False),
        (r"\boxed{2n+1}", 1, False),
        (r"\boxed{x^2 + 1}", 1, False),
        (r"\boxed{\pi + 1}", 1, False),
        (r"\boxed{5!}", 5, False),
        (r"The answer is $5!$.", 5, False),
        (r"\boxed{\log_2 8}", 8, False),
        (r"\boxed{\ln 2}", 2, False),
        (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", 2, False),
        (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", 2, False),
        # Units, words, ordinals and the working before the answer still read their number.
        ("ANSWER: 5 m", 5, True),
        ("ANSWER: 5m", 5, True),
        ("ANSWER: 5s", 5, True),
        ("ANSWER: 5kg", 5, True),
        ("ANSWER: 12 cm^2", 12, True),
        ("ANSWER: 5 km/h", 5, True),
        ("ANSWER: $15/h", 15, True),
        ("ANSWER: 72 dollars", 72, True),
        ("ANSWER: 10 %", 10, True),
        ("ANSWER: 300 K", 300, True),  # a unit apart from its number is the unit
        ("ANSWER: 0.5 M", 0.5, True),
        ("The answer is 7th", 7, True),
        ("The meeting is at 10am", 10, True),
        (r"\boxed{5\text{ m}}", 5, True),
        (r"\boxed{5 \mu m}", 5, True),
        ("x = 5", 5, True),
        ("n = 12", 12, True),
        (r"\boxed{x_1 = 3}", 3, True),
        ("x = -5", -5, True),
        ("The answer is 5!", 5, True),  # an exclamation in prose, no factorial
        ("The answer is 5 - that is all", 5, True),
        ("Η απάντηση είναι 5 λεπτά", 5, True),  # a Greek word, no Greek variable
        ("3x + 2 = 11, so x = 3", 3, True),
    ],
)
def test_a_number_that_is_a_term_of_an_expression_is_no_number(text, answer, passed):
    """``\\boxed{2x}`` passed for 2, ``x - 5`` for 5, ``n+1`` for 1, ``\\boxed{5!}`` for 5, ``\\log_2 8`` for 8:
    now each is an expression, no number, while a unit (``5m``, ``5 km/h``), a word and ``x = 5`` still read."""
    score = judged(text, answer)
    assert score["passed"] is passed, score
    if not passed:
        assert "no number" in score["explanation"], score


@pytest.mark.parametrize(
    ("text", "answer", "passed"),
    [
        # A scale's letter glued to a number is its scale: read as its number, $5k passed for 5.
        ("ANSWER: $5k", 5, False),
        ("ANSWER: $5k", 5000, True),
        ("ANSWER: $1.5M", 1.5, False),
        ("ANSWER: $1.5M", 1_500_000, True),
        # Without a currency sign a glued K, M or B may be a unit (300K kelvins, 0.5M molar, 64K bytes): the
        # number as before (a review found each failing once read as a scale).
        ("The temperature is 300K.", 300, True),
        ("ANSWER: 0.5M", 0.5, True),
        ("ANSWER: 1.5M", 1.5, True),
        ("The file is 64K.", 64, True),
        ("ANSWER: $1.1M", 1_100_000, True),
        ("ANSWER: \u00a32m", 2_000_000, True),  # after a currency sign, m is millions
        ("ANSWER: 5bn", 5e9, True),
        ("ANSWER: -$5k", -5000, True),
        ("ANSWER: $50K", 50_000, True),
        # European thousands in dotted groups of three: 1.234.567 was 0.567; a date or a version, no number.
        ("ANSWER: 1.234.567", 1_234_567, True),
        ("ANSWER: 1.234.567", 0.567, False),
        ("ANSWER: 12.05.2024", 0.2024, False),
        ("ANSWER: 1.2.3", 0.3, False),
    ],
)
def test_a_scale_letter_and_dotted_thousands_are_read_at_their_value(text, answer, passed):
    """``$5k`` and ``1.5M`` passed for 5 and 1.5, ``1.234.567`` for 0.567, the date ``12.05.2024`` for 0.2024:
    now ``$5k`` is 5000, ``1.5M`` 1500000, ``1.234.567`` 1234567, and a date or a version no number."""
    score = judged(text, answer)
    assert score["passed"] is passed, score
