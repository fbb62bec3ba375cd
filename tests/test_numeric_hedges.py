"""The numeric scorer's hedge rule over a corpus of final replies written the ways models write them:
committed answers (which must pass) and hedges (which must fail, whichever number is wanted).

Before it the rule failed 26 of the 92 committed replies ("The temperature dropped from 10 to -5", "I had 5
apples, ate 3, 2 left", "The costs add up to $45", "Since 9 is not prime, the answer is 11"), each read as a
range, a list, a bound or an alternative, and passed 13 of the 72 hedges ("4 hours, maybe 5", "between 4% and
5%", "5 or more")."""

from __future__ import annotations

import pytest

from batchrun.protocol import RowCheck
from batchrun.scoring import Judgement, ScoringSettings, read_number, score_sample, wanted_number


def judged(text: str, answer) -> dict:
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": text}]}
    settings = ScoringSettings(scorers=("numeric",))
    return score_sample(record, Judgement(check=RowCheck(answer=answer), settings=settings))


# (final reply, the row's answer): each commits to one number, the answer, and passes.
COMMITTED = [
    # the ways an answer is marked
    ("The answer is 18.", 18),
    ("ANSWER: 18", 18),
    (r"The total is $\boxed{18}$.", 18),
    ("16 - 3 - 4 = 9 eggs are left, and 9 * 2 = 18.\n#### 18", 18),
    ("Final answer: 42", 42),
    ("**Answer:** 42", 42),
    ("So, she earns $18 every day.", 18),
    ("Therefore, the answer is 7.", 7),
    ("x = 4", 4),
    # units, currency, percentages, big numbers, decimals, fractions
    ("She pays $1,250.50 in total.", 1250.5),
    ("The discount is 25%.", 25),
    ("It takes 3.5 hours.", 3.5),
    ("The train travels 120 km.", 120),
    ("He needs 3/4 of a cup of sugar.", 0.75),
    ("The population is 1,000,000.", 1000000),
    ("Each person gets 2 1/2 pizzas.", 2.5),
    (r"The probability is $\frac{1}{6}$.", 1 / 6),
    ("The area is 36 square feet.", 36),
    # step-by-step working ending in the result
    (
        "Step 1: 5 + 3 = 8\nStep 2: 8 * 2 = 16\nStep 3: 16 - 4 = 12\nSo the result is 12.",
        12,
    ),
    ("Weng earns 12 / 60 = $0.2 per minute. For 50 minutes she earned 0.2 * 50 = $10.", 10),
    ("Natalia sold 48 / 2 = 24 clips in May, so 48 + 24 = 72 clips altogether.", 72),
    ("She sold <<48+24=72>>72 clips.", 72),
    ("First 4, then 1 more.\nANSWER: 5", 5),
    ("After 2 steps we get 4", 4),
    ("I computed 3+1 and got 4", 4),
    ("2 + 2 -> 4", 4),
    (
        "Betty has 100 / 2 = $50. Her parents give $15 and her grandparents 15 * 2 = $30, "
        "so she needs 100 - 50 - 15 - 30 = $5 more.",
        5,
    ),
    # lists of intermediate numbers, then the result
    ("The primes below 10 are 2, 3, 5 and 7, so there are 4.", 4),
    ("6 apples, 7 pears, total 13", 13),
    ("The divisors of 12 are 1, 2, 3, 4, 6, 12; their sum is 28.", 28),
    ("I had 5 apples, ate 3, 2 left", 2),
    ("She had 10 cookies, gave away 4, 6 remain.", 6),
    ("Scores: 80, 90, 100. The average is 90.", 90),
    ("The primes below 10 are 2, 3, 5, 7, 4 in all.", 4),
    ("Adding the coordinates of the point (2, 3) gives 5.", 5),
    ("The midpoint is (2, 3), so its y-coordinate is 3.", 3),
    # ranges or alternatives in the working, then a committed result
    ("Is it 4 or 5? It is 5.", 5),
    ("The answer must be between 1 and 10. Checking each, it is 7.", 7),
    ("Between 1 and 10, only 7 works.", 7),
    ("A score of 90 or more earns an A, so she needs 5 more points.", 5),
    ("Any group of 4 or fewer rides free, so the 3 of them pay $0... no: the fare is $12.", 12),
    ("Since 9 is not prime, the answer is 11.", 11),
    ("3 boxes are not enough, so she needs 4.", 4),
    ("Whether she starts with 2 or 3, either way the answer is 5.", 5),
    ("It could be 4 or 5 at first glance, but checking again, the answer is 5.", 5),
    ("Either 8 or 9 fits the first clue; the second clue rules out 8, therefore 9.", 9),
    ("x = 2 or x = -3, and since x > 0, x = 2.", 2),
    ("Since 15 is not divisible by 4, we round up to 16.", 16),
    ("We need 7.5 buses, so we round up to 8 buses.", 8),
    # "from X to Y" as a change: Y is the result
    ("The temperature dropped from 10 to -5", -5),
    ("The temperature dropped from 10 to -5 degrees.", -5),
    ("The price rose from $40 to $50.", 50),
    ("His savings went from 120 to 95 dollars.", 95),
    ("The population increased from 1,200 to 1,500.", 1500),
    ("The number of students decreased from 30 to 24.", 24),
    ("The water level fell from 8 m to 5 m.", 5),
    ("The score changed from 3 to 7.", 7),
    ("The price dropped by 20% to $80.", 80),
    # negative numbers, dates, times, years
    ("The temperature is -5 degrees.", -5),
    ("4 - 9 = -5", -5),
    ("The balance is \u22125 dollars.", -5),
    ("The meeting is on March 3, 2024.", 2024),
    ("The meeting is on Sept 3, 2024.", 2024),
    ("The meeting is on dec 3, 2024.", 2024),
    ("She was born on July 4, 1990, so in 2024 she turns 34.", 34),
    ("The trip takes 2 hours 30 minutes, which is 150 minutes.", 150),
    ("The costs add up to $45.", 45),
    ("The costs, which I checked twice, add up to $45.", 45),
    ("Rounding, we round up to 16.", 16),
    ("Together they sum up to 100.", 100),
    ("The bills tallied up to $45.", 45),
    ("About 4 hours.", 4),  # an approximation names its number: the tolerance decides
    ("It is approximately 3.14.", 3.14),
    ("Janet has 16 - 3 - 4 = 9 eggs left and earns 9 * $2 = $18.\n\nThe answer is $18.", 18),
    ("He runs 3 sprints 3 times a week, 60 meters each: 3 * 3 * 60 = 540 meters.", 540),
    (r"The answer is $\boxed{-5}$.", -5),
    ("Total: $45.00", 45),
    ("It is 10:30 now, so 90 minutes remain until noon.", 90),
    ("From 9 AM to 5 PM is 8 hours.", 8),
    ("Counting from 1 to 10, there are 10 numbers.", 10),
    ("The temperature went from -3 to 4, a rise of 7 degrees.", 7),
    ("She scored 85%, 90% and 95%, an average of 90%.", 90),
    ("x = 2, y = 3, so x + y = 5.", 5),
    ("Groups of 4 or more pay $10.", 10),
    ("Rounding 7.5 up gives 8.", 8),
    ("Mark has 3 times as many as Sam, who has 4, so Mark has 12.", 12),
    ("In 2020 she was 25, so in 2023 she is 28.", 28),
    ("The bill was $80; with a 15% tip, the total is $92.", 92),
    ("After the sale, prices went down from $25 to $20.", 20),
    ("The tank had 50 liters, used 20, 30 remaining.", 30),
    ("We have x^2 = 9 and x > 0, so x = 3.", 3),
    ("It's not 6; it's 7.", 7),
    ("He walks 2 miles or bikes 5 miles each day; in a week he bikes 35 miles.", 35),
    ("Neither 4 nor 6 works, but 5 does, so the answer is 5.", 5),
    ("Tickets cost $5 for 12 or younger and $8 otherwise, so the family pays $26.", 26),
    ("The value was adjusted from 3.5 to 4.2.", 4.2),
    ("The price of the shirt rose sharply from $40 to $50.", 50),
    ("Note that 12 is not the total; the total is 15.", 15),
    ("After 3 days the tank is not full, leaving 40 liters to fill.", 40),
]

# (final reply, the row's answer): each offers several numbers or bounds one; fails whichever is wanted.
HEDGES = [
    ("ANSWER: 4 or 5", 5),
    ("The answer is either 4 or 5.", 5),
    ("It is approximately 4 or 5 hours.", 5),
    ("Somewhere between 20 and 25 minutes.", 25),
    ("It takes 4-5 hours.", 5),
    ("It takes 4 to 5 hours.", 5),
    ("It takes from 4 to 5 hours.", 5),
    ("The price ranges from $40 to $50.", 50),
    ("The answer is 5 \u00b1 1.", 1),
    ("The answer is 5 +/- 1.", 1),
    (r"$\boxed{5 \pm 1}$", 1),
    ("Roughly 30-35%.", 35),
    ("Between 4% and 5%.", 5),
    ("Between $40 and $50.", 50),
    ("It could be 7, or maybe 8.", 8),
    ("I think it's 12, possibly 13.", 13),
    ("It takes 4 hours, maybe 5.", 5),
    ("The total is 10 or 11, I'm not sure.", 11),
    ("Answer: 3 or 4 apples", 4),
    ("The answer is 6 to 8 weeks.", 8),
    ("3, 4, or 5", 5),
    ("x = 2 or x = -3", -3),
    ("x = 2, x = 3", 3),
    ("The answer is 3 (or 4 if you count the partial box).", 4),
    ("The answer is 4, or the answer is 5.", 5),
    ("It is 4, or if we round up, the answer is 5.", 5),
    ("It is 4 or so, maybe 5.", 5),
    ("At least 4.", 4),
    ("No more than 10 people.", 10),
    ("Fewer than 5.", 5),
    ("x < 4", 4),
    ("The answer is not 4.", 4),
    ("It will be up to 40 people.", 40),
    ("Either 12 or 15 cookies.", 15),
    ("The answer is 15 or 16 cookies, depending on rounding.", 16),
    ("10 to 12 dollars", 12),
    ("The range is 3\u20137.", 7),
    ("About 4 or 5 days.", 5),
    ("The price rose from $40 to $50 or $60.", 60),
    ("The price will rise to 4 or 5 dollars.", 5),
    ("It is between 4 and 6, probably 5.", 5),
    ("The answer is 4, perhaps 5.", 5),
    (r"\boxed{4} or \boxed{5}", 5),
    ("So the answer is 4 or 5.", 5),
    ("Therefore the answer is 4 to 5.", 5),
    ("It rose by 4 to 5 percent.", 5),
    ("She needs 5 or more.", 5),
    ("4 or fewer", 4),
    ("The answer is 4 (maybe 5).", 5),
    ("Approximately 4\u20135 kg.", 5),
    ("It's in the range 10-12.", 12),
    ("Anywhere from 3 to 5 days.", 5),
    ("Likely 7 or 8.", 8),
    ("$4.50 to $5.00", 5),
    ("4 or 5, so either could be correct.", 5),
    ("x = 3 or 4", 4),
    ("The answer is 2 or -2.", -2),
    ("5 plus or minus 1", 1),
    ("It is 4 so maybe 5.", 5),
    ("It takes 4 hours or so, 5 at most.", 5),
    ("The price can go up to $40.", 40),
    ("The costs can add up to $45.", 45),
    ("From 10 to -5.", -5),
    ("I had 5 or 6 apples, ate 3, maybe 2 left", 2),
    ("The answer is 8, though it might be 9.", 9),
    ("About 3, maybe 4.", 4),
    ("Probably 6, possibly 7.", 7),
    ("Could be 5 or it could be 6.", 6),
    ("x = 1, x = 2, or x = 3", 3),
    ("It's 20% or 25%.", 25),
    ("It increased, taking from 4 to 5 hours.", 5),
    ("It does not add up to 45.", 45),
    ("It is 4, or the total is 5.", 5),
    ("It is 4, or maybe, giving 5.", 5),
    # a word that starts like a month is no date's month (each passed, read as "May 1999, 2000")
    ("It was maybe 1999, 2000.", 2000),
    ("The margin 1500, 2000.", 2000),
    ("Decimal 1024, 2048", 2048),
    # "up to" after a verb that reaches it, but negated or a possibility (each passed as naming its number)
    ("The parts cannot add up to 40.", 40),
    ("The costs never add up to $45.", 45),
    ("The costs could easily add up to $45.", 45),
    ("The bill won't ever tally up to $45.", 45),
    ("They probably add up to 45.", 45),
    # a hedged list is no list with a clause (each passed, failed before 301e4fb)
    ("Either 4, 5 in total.", 5),
    ("Perhaps 4, 5 altogether.", 5),
    ("She has maybe 3, 2 left.", 2),
]


@pytest.mark.parametrize(("text", "answer"), COMMITTED)
def test_a_committed_answer_passes_numeric(text, answer):
    score = judged(text, answer)
    assert score["passed"] is True, score


@pytest.mark.parametrize(("text", "answer"), HEDGES)
def test_a_hedge_fails_numeric_whichever_number_is_wanted(text, answer):
    score = judged(text, answer)
    assert score["passed"] is False, score
    assert "offers several numbers" in score["explanation"] or "bounds, negates" in score["explanation"]


@pytest.mark.parametrize(("text", "value"), [("-5", -5), ("2", 2), ("18", 18), ("1,500", 1500), ("$50", 50)])
def test_a_row_answer_of_one_number_is_wanted(text, value):
    assert wanted_number(text) == value
    assert read_number(text) == (value, None)


def test_a_long_run_of_dashes_or_equals_is_read_in_linear_time():
    """The arrow rule ("2 + 2 -> 4") tried "-+>" from every dash of a run without a ">": quadratic, 2.4 s
    for a 64 KiB reply of dashes between two numbers, about a minute for 300 KB."""
    import time

    start = time.monotonic()
    for mark in "-=":
        assert read_number("5" + mark * 300_000 + "5")[0] is not None
    assert time.monotonic() - start < 30  # a hang guard, not a speed claim: the old code took minutes
    assert read_number("2 + 2 --> 4") == (4, None)
    assert read_number("2 + 2 ==> 4") == (4, None)
