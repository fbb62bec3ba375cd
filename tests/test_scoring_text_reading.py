"""How ``exact`` and ``includes`` read a reply and the row's answer: LaTeX around a key, typeset numbers
and matrices, Unicode punctuation and invisible characters, logic's operators, possessives, and an
``ANSWER:`` line over a fenced block."""

from __future__ import annotations

import time

import pytest
from test_scoring import judged

from batchrun.scoring import extract_answer, normalize


def boxed(answer: str) -> str:
    return f"The final answer is $\\boxed{{{answer}}}$."


@pytest.mark.parametrize(
    ("reply", "answer", "scorer", "passed"),
    [
        (boxed(r"\text{(C)}"), r"\text{(C)}", "exact", True),
        (boxed("C"), r"\text{(C)}", "exact", True),
        ("ANSWER: (C)", r"\text{(C)}", "exact", True),
        (boxed(r"\text{odd}"), r"\text{odd}", "exact", True),
        ("ANSWER: Sunday", r"\text{Sunday}", "exact", True),
        (boxed(r"\textbf{Sunday}"), r"\textbf{Sunday}", "exact", True),
        ("ANSWER: Sunday", r"\textnormal{Sunday}", "exact", True),
        ("ANSWER: Sunday", r"\mbox{Sunday}", "exact", True),
        ("ANSWER: Sunday", r"$\text{Sunday}$", "exact", True),
        ("ANSWER: $\\text{Sunday}$", "Sunday", "exact", True),
        ("The number is odd.", r"\text{odd}", "includes", True),
        ("The number is odd.", r"$\text{odd}$", "includes", True),
        # Unwrapped, the key still says what it says.
        (boxed(r"\text{(D)}"), r"\text{(C)}", "exact", False),
        ("The number is even.", r"\text{odd}", "includes", False),
        (boxed("5"), r"\text{5} + \text{6}", "exact", False),
    ],
)
def test_a_keys_latex_text_wrapper_is_read_as_the_replys(reply, answer, scorer, passed):
    """Before: a reply's ``\\boxed{\\text{...}}`` was unwrapped and the row's key never was, so a key
    written MATH-style, ``\\text{(C)}``, failed every reply ("'(C)' is not '\\\\text{(C)}'"), and includes
    found no ``\\text{odd}`` in "The number is odd.". Now both are read without the text command (and the
    math delimiters) that wrap all of them."""
    assert judged(reply, answer, scorer)["passed"] is passed


GROUPED = [r"10,\!000", r"10{,}000", r"10\,000", "10,000", "10000", "10\u202f000"]


@pytest.mark.parametrize(
    ("reply", "answer", "passed"),
    [
        *((reply, answer, True) for reply in GROUPED for answer in GROUPED[:5]),
        # Groups of three digits only: other numbers are not joined.
        (r"10,\!001", r"10,\!000", False),
        ("1,0000", r"10,\!000", False),
        (r"1\,00", "100", False),
        ("(1, 000)", "1000", False),
    ],
)
def test_a_latex_thousands_separator_is_no_mark_between_digits(reply, answer, passed):
    """Before: ``10,\\!000`` (MATH's way) normalised to "10 000", its marks between digits a space, and
    failed exact against ``\\boxed{10000}`` and ``\\boxed{10,000}``. Now each way of grouping thousands is
    the number."""
    assert judged(boxed(reply), answer, "exact")["passed"] is passed


@pytest.mark.parametrize(
    ("reply", "answer", "passed"),
    [
        ("\u201cParis\u201d", "Paris", True),
        ("\u2018Paris\u2019", "Paris", True),
        ("\u00abParis\u00bb", "Paris", True),
        ("\u201eParis\u201c", "Paris", True),
        ("O\u2019Brien", "O'Brien", True),
        ("Don\u2019t Stop Believin\u2019", "Don't Stop Believin'", True),
        ("Paris\u3002", "Paris", True),
        ("Paris\u2026", "Paris", True),
        ("\u00bfQu\u00e9?", "Qu\u00e9", True),
        ("1\u20132", "1-2", True),
        ("x \u2212 1", "x - 1", True),
        ("\u6771\u4eac\u3002", "\u6771\u4eac", True),
        ("x \u2260 5", "x != 5", True),
        ("x \u2264 3", "x <= 3", True),
        ("2 \u00d7 3", "2 * 3", True),
        ("（B）", "B", True),
        # What they say still differs.
        ("1\u20132", "12", False),
        ("x \u2212 1", "x + 1", False),
        ("x \u2264 3", "x >= 3", False),
        ("x \u2260 5", "x = 5", False),
        ("\u6771\u4eac\u3002", "\u4eac\u90fd", False),
    ],
)
def test_unicode_punctuation_is_punctuation(reply, answer, passed):
    """Before: only ASCII's marks were punctuation, so "“Paris”", "Paris。", "¿Qué?", "O’Brien" failed
    exact for "Paris", "Qué", "O'Brien", and an en dash or a typeset "≠" was another character than the
    "-" or "!=" of the key. Now every Unicode punctuation mark goes, and dashes, quotes and operators
    written typographically are their ASCII forms."""
    assert judged(f"ANSWER: {reply}", answer, "exact")["passed"] is passed


@pytest.mark.parametrize(
    "reply", ["Answer: B\u200b", "Answer: \u200bB", "Answer: B\u2060", "Answer: \ufeffB", "Answer: B\u200d"]
)
def test_an_invisible_format_character_is_no_part_of_the_answer(reply):
    """Before: a zero-width space (and the other format characters: joiners, U+2060, the byte order mark)
    stayed in the answer, and "B\\u200b" failed exact for "B". Now they are removed."""
    assert judged(reply, "B", "exact")["passed"] is True
    assert judged(reply, "C", "exact")["passed"] is False


@pytest.mark.parametrize(
    ("reply", "answer", "passed"),
    [
        ("Hamlet is William Shakespeare's play.", "William Shakespeare", True),
        ("It's France's.", "France", True),
        ("Hamlet is William Shakespeare\u2019s play.", "William Shakespeare", True),
        ("It is France's capital.", "France", True),
        ("McDonald's sells burgers.", "McDonald's", True),
        ("McDonald\u2019s sells burgers.", "McDonald's", True),
        ("It's raining.", "it", True),  # "it's" is "it is": the word is said
        # No word is cut short: a plural is not its singular, a longer word not its start.
        ("I like cats.", "cat", False),
        ("Hamlet is Shakespearean.", "Shakespeare", False),
        ("The Parisian's view.", "Paris", False),
    ],
)
def test_includes_finds_a_word_before_its_possessive(reply, answer, passed):
    """Before: the apostrophe, removed as punctuation, joined "'s" to its word ("shakespeares"), so
    "Hamlet is William Shakespeare's play." did not include "William Shakespeare" (with "’" it did). Now a
    word before "'s" is found whole too (exact still reads the whole answer: "Shakespeare's" is not
    "Shakespeare")."""
    assert judged(reply, answer, "includes")["passed"] is passed
    assert judged(f"ANSWER: {reply}", answer, "exact")["passed"] is False


MATRIX = r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"


@pytest.mark.parametrize(
    ("reply", "answer", "passed"),
    [
        (MATRIX, MATRIX, True),
        (r"\begin{bmatrix}1&2\\3&4\end{bmatrix}", MATRIX, True),
        (r"\left[\begin{array}{cc} 1 & 2 \\ 3 & 4 \end{array}\right]", MATRIX, True),
        ("[[1, 2], [3, 4]]", MATRIX, True),
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
        (r"\begin{pmatrix} 1 & 2 & 3 & 4 \end{pmatrix}", MATRIX, False),
        (r"\begin{pmatrix} 1 \\ 2 \\ 3 \\ 4 \end{pmatrix}", MATRIX, False),
        (r"\begin{pmatrix} 1 & 3 \\ 2 & 4 \end{pmatrix}", MATRIX, False),
        (r"\begin{pmatrix} 1 & 2 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", False),
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 1 & 2 \end{pmatrix}", False),
        ("[1, 2]", "[[1, 2]]", False),
        ("[[1, 2]]", "[1, 2]", False),
        ("[[1, 2]]", "[[1, 2]]", True),
    ],
)
def test_a_matrix_keeps_its_rows_and_columns(reply, answer, passed):
    """Before: "&" and "\\\\" were punctuation and the outer brackets decoration, so a 1x4 or a 4x1
    matrix passed exact for the 2x2 of the same numbers, a row vector for a column one, and "[1, 2]" for
    "[[1, 2]]". Now a LaTeX matrix is read as the list of its rows, and a list's list keeps its brackets."""
    assert judged(boxed(reply), answer, "exact")["passed"] is passed


@pytest.mark.parametrize(
    ("reply", "answer", "passed"),
    [
        ("x != 5", "x = 5", False),
        ("x!=y", "x=y", False),
        ("!x", "x", False),
        ("~x", "x", False),
        ("x && y", "x || y", False),
        ("p | q", "p & q", False),
        ("|x|", "x", False),
        ("a && !b", "a && b", False),
        ("5!/3!", "5/3", False),
        # Each still reads as itself, the spaces around an operator not counting.
        ("x != 5", "x!=5", True),
        ("x && y", "x&&y", True),
        ("a && !b", "a&&!b", True),
        ("p | q", "p|q", True),
        ("|x|", "|x|", True),
        ("AT&T", "AT&T", True),
        # An exclamation, a table's edges, LaTeX's alignment and "about" are no operators.
        ("Paris!", "Paris", True),
        ("Yes! Paris", "Yes Paris", True),
        ("| Paris |", "Paris", True),
        (r"x &= 5", "x = 5", True),
        ("~5", "5", True),
    ],
)
def test_logic_operators_are_kept(reply, answer, passed):
    """Before: "!", "|", "&" and "~" were punctuation, so "x != 5" passed exact for "x = 5", "!x" and "~x"
    for "x", "x && y" for "x || y", "|x|" for "x". Now they stay where they are operators."""
    assert judged(f"ANSWER: {reply}", answer, "exact")["passed"] is passed


@pytest.mark.parametrize(
    ("reply", "read"),
    [
        ("ANSWER:\n```python\nprint(1)\n```", "print(1)"),
        ("ANSWER:\n```python\nprint(1)\n```\nThis prints 1.", "print(1)"),
        ("ANSWER: ```python\nprint(1)\n```", "print(1)"),
        ("ANSWER:\n```\nprint(1)\n```", "print(1)"),
        ("ANSWER: ```42```", "42"),
        ('ANSWER:\n```json\n{"a": 1}\n```', '{"a": 1}'),
        ("ANSWER:\n```python\nx = 1\nprint(x)", "x = 1\nprint(x)"),  # never closed: to the end
    ],
)
def test_an_answer_line_over_a_tagged_block_is_the_blocks_content(reply, read):
    """Before: ``ANSWER:`` over a fenced block with a language tag read the block with its fences and tag
    ("```python\\nprint(1)\\n```", "python print1" normalised) and any prose after it, and failed exact for
    ``print(1)``. Now the answer is what the block holds."""
    assert extract_answer(reply) == read
    assert judged(reply, read, "exact")["passed"] is True
    # The json scorer reads the block's content as it read the fenced block.
    assert judged('ANSWER:\n```json\n{"a": 1}\n```', '{"a": 1}', "json")["passed"] is True
    assert judged('ANSWER:\n```\n{"a": 1}\n```\nDone.', '{"a": 1}', "json")["passed"] is True


@pytest.mark.parametrize(
    "text",
    [
        r"\begin{pmatrix}" * 60_000,
        r"\begin{pmatrix} 1 & 2 \\ 3" * 35_000 + r"\end{pmatrix}",
        (r"\begin{array}{" + "c" * 1000) * 900 + r"\end{array}",
        "\\text{" * 150_000 + "x" + "}" * 150_000,
        "1" + r"\,000" * 150_000 + "1",
        r"1{,}000" * 130_000,
        "| " * 450_000,
        "~ " * 450_000,
        "a!b!" * 220_000,
        "a's " * 220_000,
        "\u201ca\u201d\u2014" * 220_000,
        "[[1,2]]" * 130_000,
        "ANSWER:\n```python\n" + "x\n" * 450_000,
    ],
)
def test_the_new_readings_are_linear_on_a_megabyte(text):
    """About 1 MB of each new syntax, repeated adversarially, is read in about a second."""
    start = time.monotonic()
    judged(text, "a + b", "exact")
    judged(text, "a + b", "includes")
    normalize(text)
    assert time.monotonic() - start < 20  # a hang guard, not a speed claim (under 2 s each)
