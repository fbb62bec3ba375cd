"""Replies that hedge and still passed: the hedge written so the detector did not see it (a format
character inside "or", markdown emphasis around it, a Cyrillic letter in it, a bar or a slash between two
boxes, an ellipsis, "vs.", "could be"), or the answer read from code (a box in inline code or a fenced block
after the ``ANSWER:`` line, an ``ANSWER:`` line in a ``~~~`` block). A wrong answer that passes is the worst
verdict: users train on the passed samples.

Every case in the ``*_fails`` and ``*_is_read`` tests passed (or was read wrongly) before this file's fix;
the ``*_still_*`` tests are guards, which behaved so before and must still (the fix must not fail an
answer that commits, nor let a hedge it saw before pass)."""

from __future__ import annotations

import time

import pytest
from test_scoring import judged

from batchrun.scoring import extract_answer, read_number

B4, B5 = r"\boxed{4}", r"\boxed{5}"


def verdicts(reply: str, answer, scorers=("numeric", "exact")) -> list[bool | None]:
    out = []
    for scorer in scorers:
        want = answer if scorer == "numeric" else str(answer)
        out.append(judged(reply, want, scorer)["passed"])
    return out


@pytest.mark.parametrize(
    "gap",
    [
        " _or_ ",  # markdown italic
        " __or__ ",  # markdown bold
        " \u043er ",  # Cyrillic o
        " \u043e\u0433 ",  # Cyrillic o and ghe: no Latin letter at all
        " \u03bfr ",  # Greek omicron
        " \uff4f\uff52 ",  # fullwidth
        " o\u200br ",  # a zero-width space inside "or"
        " | ",
        " \\| ",
        " \u2228 ",  # logic's or
        " / ",
        "/",
        # LaTeX's spaces, \\text{} and emphasis around the sign (a review found each read as the last box)
        " \\; | \\; ",
        " \\quad | \\quad ",
        " \\ / \\ ",
        " \\text{ | } ",
        " **|** ",
        "\\;\\lor\\;",
        "~|~",
    ],
)
def test_two_boxes_offered_through_a_hidden_or_fail(gap):
    """Before: ``\\boxed{4} _or_ \\boxed{5}`` (Cyrillic "оr", "|", "∨", "/" between the boxes) was read as
    its last box and passed numeric and exact for 5. Now the two boxes are read as one answer offering both
    ("4 _or_ 5", "4 or 5") and pass for neither."""
    reply = f"{B4}{gap}{B5}"
    assert verdicts(reply, 5) == [False, False]
    assert verdicts(reply, 4) == [False, False]


@pytest.mark.parametrize(
    ("reply", "other"),
    [
        ("4 o\u200br 5", 4),  # zero-width space
        ("4 o\u00adr 5", 4),  # soft hyphen
        ("4 o\u2060r 5", 4),  # word joiner
        ("4 \u043er 5", 4),  # Cyrillic o
        ("4 _or_ 5", 4),
        ("4 \u2026 5", 4),  # an ellipsis
        ("4 ... 5", 4),
        ("4...5", 4),
        ("1...5", 0.5),  # read as .5 before
        ("4 vs. 5", 4),
        ("4 versus. 5", 4),
        ("4, but it could be 5", 4),
        ("4, though it may well be 5", 4),
        ("4, but it could also be about 5", 4),
        ("4, alternatively 5", 4),
        ("4 apples. Alternatively, 5 apples.", 4),
        ("4 apples. Or maybe 5.", 4),
        ("4 apples. It could also be 5.", 4),
    ],
)
def test_numbers_offered_through_a_hidden_hedge_fail(reply, other):
    """Before: each passed numeric for its last number (5; "1...5" for 0.5): the detector read "o\\u200br"
    as two words, "…", "..." and the period of "vs." as a sentence's end, and knew no "could be",
    "alternatively" or a sentence opening with "Or". Now each offers two numbers and passes for neither."""
    last = read_number(reply)[0]
    assert judged(reply, last, "numeric")["passed"] is False
    assert judged(reply, other, "numeric")["passed"] is False


@pytest.mark.parametrize("reply", ["4 (could be 5)", "4 (may well be 5)", "4 (alternatively 5)"])
def test_a_remark_that_offers_another_number_fails(reply):
    """Before: "4 (could be 5)" passed numeric for 4 (the remark's "could be" was no hedge word). Now the
    remark offers 5 and the answer passes for neither."""
    assert judged(reply, 4, "numeric")["passed"] is False
    assert judged(reply, 5, "numeric")["passed"] is False


@pytest.mark.parametrize(
    "reply",
    [
        f"ANSWER: 4\n`{B5}`",
        f"ANSWER: 4\nThe form is `{B5}`.",
        f"ANSWER: 4\n```\n{B5}\n```",
        f"ANSWER: 4\n```latex\n{B5}\n```",
        f"ANSWER: 4\n~~~\n{B5}\n~~~",
        f"{B4}\n`{B5}`",
        f"{B4} and then ``{B5}``",
        "ANSWER: 4\n~~~\nANSWER: 5\n~~~",
        "ANSWER: 4\n~~~python\nANSWER: 5\n~~~",
        "ANSWER: 4\n~~~~\n~~~\nANSWER: 5\n~~~~",
    ],
)
def test_a_box_or_answer_line_in_code_is_no_answer(reply):
    """Before: a box anywhere, code included, beat the ANSWER line (``ANSWER: 4`` over `` `\\boxed{5}` ``
    passed numeric and exact for 5), and an ``ANSWER: 5`` in a ``~~~`` block (only ``` was a fence) was the
    last label. Now code is an example, the answer is outside it: 4."""
    assert extract_answer(reply) == "4"
    assert verdicts(reply, 5) == [False, False]
    assert verdicts(reply, 4) == [True, True]


@pytest.mark.parametrize(
    "reply",
    [f"ANSWER: `{B5}`", f"ANSWER:\n```\n{B5}\n```", f"ANSWER:\n~~~\n{B5}\n~~~", f"The answer is `{B5}`."],
)
def test_an_answer_boxed_in_code_still_passes(reply):
    """Guards (they passed before too): an answer whose only box is in code, alone on its ANSWER line or
    in the block under it, is still that box's content, 5, for exact as for numeric."""
    assert verdicts(reply, 5) == [True, True]


@pytest.mark.parametrize(
    "reply",
    [
        f"{B4} or `{B5}`",
        f"`{B4}` or {B5}",
        f"{B4} **or** {B5}",
        f"{B4} *or* {B5}",
        rf"{B4} \lor {B5}",
    ],
)
def test_a_hedge_still_fails(reply):
    """Guards (they failed before too): a box in code that the answer's box offers as another still makes
    a hedge (read without the code's box, "\\boxed{4} or `\\boxed{5}`" would pass for 4), and the hedges
    the detector saw before still fail."""
    assert verdicts(reply, 5) == [False, False]
    assert verdicts(reply, 4) == [False, False]


@pytest.mark.parametrize(
    ("reply", "read", "scorer"),
    [
        ("ANSWER:\n~~~python\nprint(1)\n~~~", "print(1)", "exact"),
        ("ANSWER: ~~~python\nprint(1)\n~~~\nThis prints 1.", "print(1)", "exact"),
        ('ANSWER:\n~~~json\n{"a": 1}\n~~~', '{"a": 1}', "json"),
    ],
)
def test_a_tilde_fenced_block_is_read_as_a_backtick_one(reply, read, scorer):
    """Before: ``ANSWER:`` over a ``~~~`` block read "~~~python" as the answer and failed. Now a ``~~~``
    fence is a fence wherever a ``` one is: the answer is what the block holds."""
    assert extract_answer(reply) == read
    assert judged(reply, read, scorer)["passed"] is True


def test_the_json_scorer_reads_a_tilde_fenced_value():
    """Before: a reply that was only a ``~~~json`` block failed json (only ``` blocks were looked into)."""
    assert judged('Here it is:\n~~~json\n{"a": 1}\n~~~', '{"a": 1}', "json")["passed"] is True


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("it could not be anything but 5", 5),
        ("5, which could be checked by substitution.", 5),
        ("The 4 of them could be seated in 5 ways.", 5),
        ("With $20 she could buy 5 apples.", 5),
        ("I first got 4... no, it is 5.", 5),
        ("Is it 4 or 5? It is 5.", 5),
        ("He needs 3/4 of a cup of sugar.", 0.75),
        (r"The probability is $\frac{3}{4}$.", 0.75),
        (r"\boxed{\frac{3}{4}}", 0.75),
        (r"\boxed{3/4}", 0.75),
        ("The files are in a/b and c/d; there are 5.", 5),
        ("x = 4, so x + 1 = 5.", 5),
        ("The answer is `\\boxed{5}`", 5),  # every box in code: the answer still
        ("```\n\\boxed{5}\n```", 5),
        ("Write it as `\\boxed{n}`.\n\\boxed{5}", 5),
        ("ANSWER: 4\n```\nx = 4\n```\nANSWER: 5", 5),
        ("\u0435\u0441\u043b\u0438 x = 4, \u0442\u043e y = 5", 5),  # Russian "if ..., then": "то" is no "to"
    ],
)
def test_a_committed_answer_still_passes(reply, answer):
    """Guards (they passed before too): a modal that is no hedge ("could not be", "could be checked",
    "could be seated", "could buy"), an ellipsis before a correction, a fraction and a path's slash, a box
    that is only in code, and Russian text around the numbers all still pass for the one number."""
    assert judged(reply, answer, "numeric")["passed"] is True


@pytest.mark.parametrize(
    "text",
    [
        (B4 + " _or_ ") * 60_000,
        (B4 + " | ") * 80_000,
        "`" + B4 + "`" * 2 + "\n" * 1 + "``" * 100_000 + B5,
        "".join("`" * n + "x" for n in range(1, 1400)),
        "~~~\n" * 250_000,
        "```\n~~~~\n" * 100_000,
        "~~~" + " " * 1_000_000,
        "4 o\u200b" * 200_000 + "r 5",
        "4 ... " * 170_000 + "5",
        "4 \u2026 " * 250_000 + "5",
        "4 could be " * 90_000 + "5",
        "4. Or " * 170_000 + "5",
        "_a" * 500_000,
        "*" * 1_000_000 + "a",
        "\u043e" * 1_000_000 + " 5",
    ],
    ids=lambda text: f"{text[:12]!r}x{len(text)}",
)
def test_the_new_readings_are_linear_on_a_megabyte(text):
    """About 1 MB of each new syntax, repeated adversarially, is read in about a second."""
    start = time.monotonic()
    extract_answer(text)
    for scorer in ("numeric", "exact", "json"):
        judged(text, "5" if scorer != "numeric" else 5, scorer)
    assert time.monotonic() - start < 20  # a hang guard, not a speed claim (under 2 s each)
