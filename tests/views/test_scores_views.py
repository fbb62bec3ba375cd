"""The views over scores: re-scoring a finished run, comparing two runs (against known figures), and
the report's scores section in a real Chromium."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import json
import math
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from html import escape as html_escape
from pathlib import Path

import pytest
from helpers import read_jsonl, run, stats_of, write_rows

from batchrun.scoring import mcnemar_exact, paired_bootstrap, sign_flip_p, t975
from batchrun.storage import WriteError
from batchrun.views import compare, report, score

ROOT = Path(__file__).resolve().parents[2]

ROWS = [
    # The fake model answers 42 to each; the rows expect different things.
    {"id": "exact-42", "prompt": "Say 42 [calls:0] [answer:42]", "answer": "42"},
    {"id": "four", "prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"},  # includes passes, exact fails
    {"id": "two", "prompt": "Say 2 [calls:0] [answer:42, 2]", "answer": "2"},  # the same
    {"id": "seven", "prompt": "Say 7 [calls:0] [answer:42]", "answer": "7"},  # fails either way
    {
        "id": "file",
        "prompt": "Make out.txt [run:echo nope > out.txt]",
        "verify": "echo checking out.txt; grep -q yes out.txt",
    },
]


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(1, 5) == pytest.approx(2 * (1 + 6) / 64)  # 0.21875
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0


def test_paired_bootstrap_interval():
    # No spread in the pairs is no certainty: as if each outcome not seen had been seen half a time.
    lo, hi = paired_bootstrap([0.5] * 20)
    assert 0.35 < lo < 0.5 < hi < 0.65 and hi - 0.5 == pytest.approx(0.5 - lo)
    diffs = [1.0] * 30 + [0.0] * 60 + [-1.0] * 10  # mean 0.2
    lo, hi = paired_bootstrap(diffs, 4000, seed=1)
    assert lo < 0.2 < hi
    assert paired_bootstrap(diffs, 4000, seed=1) == (lo, hi)  # seeded: the same inputs, the same interval
    # The normal approximation's half-width is 1.96 * sd / sqrt(n) = 1.96 * 0.6 / 10 ~ 0.118.
    assert 0.09 < (hi - lo) / 2 < 0.15
    assert paired_bootstrap([]) is None


def test_the_row_bootstrap_resamples_whole_rows_as_drawn():
    """The row bootstrap draws rows by index and adds their totals in C (10,000 resamples of 50,000 rows
    of 2 pairs: 251-384 s before, 113 s after); its interval is the one of resampling the rows themselves."""
    import random as random_module

    def by_rows(diffs, reps, seed, rows):  # the rows' (sum, pairs) drawn as they are, then widened
        rng = random_module.Random(seed)
        grouped = {}
        for row, d in zip(rows, diffs, strict=True):
            grouped.setdefault(row, [0.0, 0])
            grouped[row][0] += d
            grouped[row][1] += 1
        sums, g = list(grouped.values()), len(grouped)
        means = sorted(
            sum(t for t, _ in p) / sum(k for _, k in p) for p in (rng.choices(sums, k=g) for _ in range(reps))
        )
        lo, hi = means[int(0.025 * (reps - 1))], means[int(math.ceil(0.975 * (reps - 1)))]
        mean, widen = sum(diffs) / len(diffs), t975(g - 1) / 1.959964 * math.sqrt(g / (g - 1))
        floor = 1.959964 * statistics.stdev(diffs) / math.sqrt(len(diffs))  # the pairs' normal interval
        return (
            max(min(diffs), mean - max((mean - lo) * widen, floor)),
            min(max(diffs), mean + max((hi - mean) * widen, floor)),
        )

    rng = random.Random(5)
    for seed in range(60):
        n = rng.randint(3, 40)
        diffs = [rng.choice((-1.0, 0.0, 0.0, 1.0, 0.5)) for _ in range(n)]
        rows = [i // 3 for i in range(n)] if seed % 2 else [rng.randint(0, 6) for _ in range(n)]
        if len(set(rows)) in (1, n):
            continue
        assert paired_bootstrap(diffs, 500, seed, rows) == pytest.approx(
            by_rows(diffs, 500, seed, rows), rel=1e-12
        )


def test_the_row_interval_is_never_narrower_than_the_pairs_own():
    """Two runs of 10 rows of 4 samples that differ in one row only, one flip each way: every resampled
    row's difference is 0, and the row bootstrap read "B - A +0.0% (95% CI +0.0% to +0.0%)" (data/eval's
    two README runs). The pairs' own normal interval is the floor: +-1.96 * sd / sqrt(n)."""
    diffs = [0.0] * 38 + [1.0, -1.0]
    rows = [i // 4 for i in range(40)]
    lo, hi = paired_bootstrap(diffs, 2000, 0, rows)
    half = 1.959964 * statistics.stdev(diffs) / math.sqrt(40)
    assert (lo, hi) == pytest.approx((-half, half)) and half > 0.06
    # No pair differs: a narrow interval about 0, not a certain 0 (test_differences_all_alike_...).
    lo, hi = paired_bootstrap([0.0] * 40, 2000, 0, rows)
    assert -0.06 < lo < 0.0 < hi < 0.06


def test_compare_interval_leaves_out_0_only_where_mcnemar_finds_a_difference():
    """8 rows, 3 pairs passed only in B and none only in A: "+37.5% (95% CI +5.3% to +85.9%)" beside
    "McNemar exact p = 0.25", an interval that read as a sure gain the test did not find. With one pair a
    row the interval is never narrower than the exact one the test agrees with (the discordant pairs'
    share B passed, Clopper-Pearson), so it holds 0 exactly when p >= 0.05, whatever the pairs."""
    pairs = [(False, True)] * 3 + [(True, True)] * 3 + [(False, False)] * 2
    r = compare.compare_pairs(pairs, bootstrap=2000)
    assert r["p_value"] == 0.25 and r["difference"] == 0.375
    lo, hi = r["difference_95ci"]
    assert lo < 0 < hi and lo == pytest.approx(3 / 8 * (2 * 0.025 ** (1 / 3) - 1))
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 40)
        pairs = [(rng.random() < 0.5, rng.random() < rng.choice((0.2, 0.5, 0.8))) for _ in range(n)]
        r = compare.compare_pairs(pairs, bootstrap=200)
        lo, hi = r["difference_95ci"]
        assert (lo > 0 or hi < 0) <= (r["p_value"] < 0.05), (pairs, r)
        assert lo <= r["difference"] <= hi


def test_compare_interval_by_row_reaches_0_where_the_sign_flip_test_finds_nothing(capsys):
    """5 rows of 4 pairs, B ahead in every row: the sign-flip test's p is 2/32 (5 rows can never give
    less), yet the resampled interval left 0 out, a sure gain beside a test that did not find one."""
    gains = [2, 1, 1, 2, 1]
    pairs, rows = [], []
    for row, gain in enumerate(gains):
        pairs += [(False, True)] * gain + [(True, True)] * (4 - gain)
        rows += [row] * 4
    r = compare.compare_pairs(pairs, bootstrap=2000, rows=rows)
    assert (r["p_value_test"], r["p_value"]) == ("sign_flip_by_row", 0.0625)
    assert r["difference_95ci"][0] == 0.0 < r["difference"] < r["difference_95ci"][1]
    assert r["difference_95ci_reaches_0_by_the_test"] is True
    text = compare.text_report(
        {
            **r,
            "run_a": "a",
            "run_b": "b",
            "only_in_a": 0,
            "only_in_b": 0,
            "by_toolsets": {},
            "flipped_to_fail": [],
            "flipped_to_pass": [],
            **{k: 0 for k in ("unjudged_in_a", "unjudged_in_b", "judged_differently")},
        }
    )
    assert "the interval is widened to 0: it left 0 out, but the sign-flip test by row does not find" in text
    rng = random.Random(9)
    for _ in range(200):
        pairs, rows = _simulated_comparison(rng, rng.randint(3, 12), rng.randint(2, 4))
        r = compare.compare_pairs(pairs, bootstrap=200, rows=rows)
        lo, hi = r["difference_95ci"]
        assert (lo > 0 or hi < 0) <= (r["p_value"] < 0.05), (pairs, rows, r)


def test_compare_pairs_figures():
    # 10 pairs: both pass 2, only A passes 5, only B passes 1, both fail 2.
    pairs = [(True, True)] * 2 + [(True, False)] * 5 + [(False, True)] * 1 + [(False, False)] * 2
    r = compare.compare_pairs(pairs, bootstrap=2000)
    assert (r["pairs"], r["pass_rate_a"], r["pass_rate_b"]) == (10, 0.7, 0.3)
    assert r["difference"] == pytest.approx(-0.4)
    # Widened for 10 pairs as 10 rows are (t with 9 degrees of freedom): it reaches past 0, as McNemar's
    # p = 0.22 says it should (the percentile interval alone stopped at 0.0 exactly); and never narrower
    # than the exact interval the test agrees with: 1 of the 6 discordant pairs B's, Clopper-Pearson
    # [0.0042, 0.6412], times 6/10 as a difference: [-0.595, +0.169] (the bootstrap's reaches lower, to
    # -0.89, and higher only to below +0.1).
    assert r["difference_95ci"][0] < 0.6 * (2 * 0.0042107 - 1) < -0.4
    assert r["difference_95ci"][1] == pytest.approx(0.6 * (2 * 0.6412 - 1), abs=1e-3)
    assert (r["passed_only_in_a"], r["passed_only_in_b"]) == (5, 1)
    assert r["mcnemar_p"] == pytest.approx(0.21875)


def test_sign_flip_by_row_is_mcnemar_with_one_pair_a_row_and_exact_otherwise():
    for b, c in ((1, 5), (0, 10), (3, 3), (7, 2), (20, 35)):
        assert sign_flip_p([-1] * b + [1] * c + [0] * 4) == pytest.approx(mcnemar_exact(b, c), rel=1e-12)
    rng = random.Random(3)
    for _ in range(100):  # against every sign assignment
        totals = [rng.randint(-4, 4) for _ in range(rng.randint(1, 9))]
        signs = list(itertools.product((1, -1), repeat=len(totals)))
        extreme = sum(
            abs(sum(s * t for s, t in zip(sign, totals, strict=True))) >= abs(sum(totals)) for sign in signs
        )
        assert sign_flip_p(totals) == pytest.approx(extreme / len(signs), abs=1e-12)
    # At the exact computation's limit (rows x their totals' sum near 2e7), still exact: rows of one pair
    # are McNemar's test, and a p-value below the smallest float is 0.
    rows, minus = 4400, 2150
    tail = sum(math.comb(rows, j) for j in range(minus + 1))
    assert sign_flip_p([1] * (rows - minus) + [-1] * minus) == pytest.approx(
        2 * tail / 2**rows, rel=1e-12, abs=0
    )
    # no row or one row of +500 (sums 98,500 or more away from 0): 201 of 2^200 sign choices, each side
    assert sign_flip_p([500] * 199 + [-500]) == pytest.approx(2 * 201 / 2**200, rel=1e-12, abs=0)
    assert sign_flip_p([1] * 4000) == 0.0  # 2^-3999, below the smallest float: no NaN, no error
    # Beyond the exact computation's size (3000 rows of 10 pairs), the normal approximation: rows of
    # +-10 alike are McNemar's test on rows.
    assert sign_flip_p([10] * 1550 + [-10] * 1450) == pytest.approx(mcnemar_exact(1450, 1550), rel=0.002)


def _simulated_comparison(
    rng: random.Random, rows: int, samples: int
) -> tuple[list[tuple[bool, bool]], list[int]]:
    """Two models equally good over the rows, not row by row: each row has two pass probabilities
    (Beta(0.5, 0.5)), given to A and B in random order; ``samples`` pairs a row."""
    pairs, keys = [], []
    for row in range(rows):
        q1, q2 = rng.betavariate(0.5, 0.5), rng.betavariate(0.5, 0.5)
        qa, qb = (q1, q2) if rng.random() < 0.5 else (q2, q1)
        for _ in range(samples):
            pairs.append((rng.random() < qa, rng.random() < qb))
            keys.append(row)
    return pairs, keys


def test_compare_tests_rows_not_pairs_when_rows_have_several_samples():
    """10 rows of 10 pairs, no difference between the models: McNemar over the 100 pairs said p < 0.05
    in 37% of the comparisons (73 of 200), and the bootstrap over pairs left out the true difference (0)
    in 36%; by row, the sign-flip test said p < 0.05 in 2.5% and the bootstrap left it out in 4%."""
    rng = random.Random(7)
    runs, mcnemar, by_row, pair_cover, row_cover = 200, 0, 0, 0, 0
    for _ in range(runs):
        pairs, rows = _simulated_comparison(rng, 10, 10)
        naive = compare.compare_pairs(pairs, bootstrap=200)
        r = compare.compare_pairs(pairs, bootstrap=200, rows=rows)
        assert naive["mcnemar_p"] == r["mcnemar_p"] and r["p_value_test"] == "sign_flip_by_row"
        mcnemar += r["mcnemar_p"] < 0.05
        by_row += r["p_value"] < 0.05
        pair_cover += naive["difference_95ci"][0] <= 0 <= naive["difference_95ci"][1]
        row_cover += r["difference_95ci"][0] <= 0 <= r["difference_95ci"][1]
    assert mcnemar / runs > 0.25
    assert by_row / runs <= 0.08
    assert pair_cover / runs < 0.75
    assert row_cover / runs >= 0.92
    assert (r["pairs"], r["rows"]) == (100, 10)
    # Printed and written with the test that gave the p-value, and McNemar's beside it as not valid.
    r.update(by_toolsets={}, only_in_a=0, only_in_b=0, judged_differently=0, run_a="a", run_b="b")
    r.update(flipped_to_fail=[], flipped_to_pass=[])
    text, page = compare.text_report(r), compare.html_report(r)
    assert f"sign-flip test by row p = {r['p_value']:.4g}" in text and "100 paired samples in 10 rows" in text
    assert "takes the pairs for independent" in text
    assert "sign-flip test by row" in page and "McNemar exact p" not in page


def test_compare_interval_by_row_holds_with_few_rows():
    """5 rows of 20 pairs: resampled as they are, 5 rows spread less than rows do, and the percentile
    interval missed the true difference (0) in 18% of simulated nulls; widened for 4 degrees of freedom,
    6.5%. A single row has nothing to resample but its pairs: McNemar's test and the pairs' interval."""
    rng = random.Random(11)
    runs, cover = 200, 0
    for _ in range(runs):
        pairs, rows = _simulated_comparison(rng, 5, 20)
        lo, hi = compare.compare_pairs(pairs, bootstrap=400, rows=rows)["difference_95ci"]
        cover += lo <= 0 <= hi
    assert cover / runs >= 0.9
    pairs = [(False, True)] * 6 + [(True, True)] * 4
    one_row = compare.compare_pairs(pairs, bootstrap=2000, rows=["r"] * 10)
    assert one_row == {**compare.compare_pairs(pairs, bootstrap=2000), "rows": 1}
    assert one_row["p_value_test"] == "mcnemar_exact" and one_row["difference_95ci"][0] > 0


def test_compare_interval_with_one_sample_a_row_holds_with_few_rows():
    """Rows of one sample each (--samples_per_prompt=1, the default): the pairs' percentile interval was
    not widened for few rows as the rows' interval is, and left out the true difference (0) of simulated
    nulls too often: 6 rows of partial-credit scores 12% of 200 (now 5%), 5 rows passed or failed 7.5%
    (now 2%; 5 rows of 20 samples, widened: 6.5%)."""
    rng = random.Random(11)
    runs, cover = 200, 0
    for _ in range(runs):
        pairs = [(rng.random(), rng.random()) for _ in range(6)]
        lo, hi = compare.compare_pairs(pairs, bootstrap=400, rows=list(range(6)))["difference_95ci"]
        cover += lo <= 0 <= hi
    assert cover / runs >= 0.92
    rng, cover = random.Random(11), 0
    for _ in range(runs):
        pairs, rows = _simulated_comparison(rng, 5, 1)
        lo, hi = compare.compare_pairs(pairs, bootstrap=400, rows=rows)["difference_95ci"]
        cover += lo <= 0 <= hi
    assert cover / runs >= 0.95


@pytest.mark.parametrize(
    ("pairs", "rows", "p_value", "interval"),
    [
        ([(False, True)] * 6, [0, 0, 0, 1, 1, 1], 0.5, (-1.0, 1.0)),  # 2 rows: nothing shown
        ([(False, True)], None, 1.0, (-1.0, 1.0)),  # one pair alone bounds nothing
        # 10 of 10: B better, not certainly by 100%; as wide as the exact interval McNemar's test agrees
        # with (Clopper-Pearson for 10 of 10, 0.025^(1/10) = 0.6915, as 2 pi - 1)
        ([(False, True)] * 10, None, 0.001953125, (2 * 0.025**0.1 - 1, 1.0)),
        ([(True, True)] * 40, [i // 4 for i in range(40)], 1.0, (-0.0568, 0.0568)),  # ties: not a certain 0
        ([(True, True)] * 1000, None, 1.0, (-0.00196, 0.00196)),
    ],
)
def test_differences_all_alike_do_not_read_as_a_certain_difference(pairs, rows, p_value, interval):
    """B passes every pair A fails, in 2 rows of 3 samples: the sign-flip p is 0.5, yet the interval read
    "+100.0% (95% CI +100.0% to +100.0%)" (every resample alike, the pairs' spread 0, so no floor either);
    one pair alone, p = 1, likewise; all ties read as a certain 0. The interval now takes the pairs' spread
    as if each outcome not seen had been seen half a time, widened for few rows as the bootstrap's is."""
    r = compare.compare_pairs(pairs, bootstrap=2000, rows=rows)
    assert r["p_value"] == pytest.approx(p_value)
    assert r["difference_95ci"] == pytest.approx(interval, abs=1e-4)


def test_compare_with_one_pair_a_row_is_unchanged():
    pairs = [(True, True)] * 2 + [(True, False)] * 5 + [(False, True)] * 1 + [(False, False)] * 2
    by_pair = compare.compare_pairs(pairs, bootstrap=2000)
    by_row = compare.compare_pairs(pairs, bootstrap=2000, rows=[f"r{i}" for i in range(10)])
    assert by_pair == by_row
    assert by_row["p_value"] == by_row["mcnemar_p"] == pytest.approx(0.21875)
    assert by_row["p_value_test"] == "mcnemar_exact" and by_row["rows"] == 10


class CountingRandom(random.Random):
    """A ``random.Random`` that counts the uniforms drawn (``choices`` draws one a pick)."""

    uniforms = 0

    def random(self) -> float:
        CountingRandom.uniforms += 1
        return super().random()


@pytest.mark.parametrize("per_row", [1, 10])
def test_the_bootstrap_of_many_pairs_draws_class_counts_not_each_pair(monkeypatch, per_row):
    """100,000 pairs (one a row, or 10 a row): each resample drew every pair or row one by one, 10,000
    resamples 140 s (one a row) and 113 s; their differences fall in few classes (-1, 0, 1; a row of 10
    pairs: its sum, -10 to 10), so a resample is a draw of each class's count, a few binomials."""
    rng = random.Random(per_row)
    diffs = [float(rng.random() < 0.5) - float(rng.random() < 0.5) for _ in range(100_000)]
    rows = None if per_row == 1 else [i // per_row for i in range(100_000)]
    monkeypatch.setattr(random, "Random", CountingRandom)
    CountingRandom.uniforms = 0
    lo, hi = paired_bootstrap(diffs, 200, 0, rows)
    assert CountingRandom.uniforms <= 200 * 200  # one by one: 200 * 100,000, or 200 * 10,000 rows
    mean = sum(diffs) / len(diffs)
    assert lo < mean < hi and hi - lo < 0.03


def test_the_class_count_bootstrap_resamples_as_drawing_one_by_one(monkeypatch):
    """The resample means drawn by class counts and drawn unit by unit have one distribution: their
    quantiles agree within Monte Carlo error (20,000 resamples each), for pairs and for rows of 1 to 4."""
    from batchrun import scoring

    rng = random.Random(2)
    cases = [
        ([rng.choice((-1.0, 0.0, 0.0, 1.0)) for _ in range(400)], [1] * 400),
        *(
            list(zip(*[(float(sum(rng.choice((-1, 0, 1)) for _ in range(k))), k) for k in ks], strict=True))
            for ks in ([rng.randint(1, 4) for _ in range(600)], [3] * 600)
        ),
    ]
    for totals, counts in cases:
        totals, counts = list(totals), list(counts)
        by_class = sorted(scoring._resampled_means(random.Random(0), totals, counts, 20_000))
        monkeypatch.setattr(scoring, "BOOTSTRAP_DRAWN_ONE_BY_ONE_UP_TO", 10**9)
        one_by_one = sorted(scoring._resampled_means(random.Random(0), totals, counts, 20_000))
        monkeypatch.undo()
        spread = statistics.stdev(one_by_one)
        assert statistics.stdev(by_class) == pytest.approx(spread, rel=0.03)
        assert statistics.fmean(by_class) == pytest.approx(statistics.fmean(one_by_one), abs=0.03 * spread)
        for q in (0.025, 0.16, 0.5, 0.84, 0.975):
            i = int(q * 19_999)
            assert abs(by_class[i] - one_by_one[i]) <= 0.08 * spread, (q, by_class[i], one_by_one[i])


def test_binomial_draw_has_the_binomial_distribution():
    """Pearson's chi-square of 20,000 draws against the binomial probabilities, by inversion (n p < 10)
    and by transformed rejection (n p >= 10), p above 1/2 by symmetry: below the 99.9% point each time."""
    from batchrun.scoring import binomial_draw

    rng = random.Random(4)
    for n, p in (
        (1, 0.3),
        (7, 0.5),
        (30, 0.3),
        (99, 0.1),
        (101, 0.1),
        (40, 0.5),
        (1000, 0.93),
        (10**5, 0.37),
    ):
        draws = collections.Counter(binomial_draw(rng, n, p) for _ in range(20_000))
        assert all(0 <= k <= n for k in draws)
        log_pmf = [
            math.lgamma(n + 1)
            - math.lgamma(k + 1)
            - math.lgamma(n - k + 1)
            + k * math.log(p)
            + (n - k) * math.log1p(-p)
            for k in range(n + 1)
        ]
        expected = [20_000 * math.exp(x) for x in log_pmf]
        # Bins of at least 20 expected draws, the tails pooled into their neighbours.
        bins, seen, want = [], 0, 0.0
        for k in range(n + 1):
            seen, want = seen + draws[k], want + expected[k]
            if want >= 20:
                bins.append((seen, want))
                seen, want = 0, 0.0
        if bins:
            last_seen, last_want = bins.pop()
            bins.append((last_seen + seen, last_want + want))
        chi2 = sum((o - e) ** 2 / e for o, e in bins)
        df = len(bins) - 1
        assert chi2 < df + 3.1 * math.sqrt(2 * df) + 6, (n, p, chi2, df)
    assert (
        binomial_draw(rng, 0, 0.4) == 0
        and binomial_draw(rng, 9, 0.0) == 0
        and binomial_draw(rng, 9, 1.0) == 9
    )


def test_mcnemar_exact_is_exact_for_few_pairs_and_bounded_for_many(monkeypatch):
    """McNemar's tail summed math.comb by math.comb: 30,000 discordant pairs took 86 s, 47,600 240 s,
    the whole comparison's slowest part. Up to 20,000 it is the same sum of integers (the same figure,
    bit for bit); beyond, in floating point from the largest term down, within 1e-9 of the exact sum."""
    from batchrun import scoring

    for b in range(40):
        for c in range(40):
            n, k = b + c, min(b, c)
            old = 1.0 if n == 0 else min(1.0, 2 * (sum(math.comb(n, i) for i in range(k + 1)) / 2**n))
            assert mcnemar_exact(b, c) == old

    def exact(b: int, c: int) -> float:
        n, term, tail = b + c, 1, 1
        for i in range(min(b, c)):
            term = term * (n - i) // (i + 1)
            tail += term
        return min(1.0, 2 * tail / 2**n)

    calls = []
    monkeypatch.setattr(math, "comb", lambda *a: calls.append(a) or pytest.fail("math.comb a term"))
    for b, c in ((29_950, 30_050), (29_500, 30_500), (28_000, 32_000), (10_000, 10_001), (20, 19_990)):
        assert mcnemar_exact(b, c) == pytest.approx(exact(b, c), rel=1e-9, abs=1e-300)
    assert mcnemar_exact(10**6, 10**6 + 2000) == pytest.approx(0.1576, abs=1e-3)  # ~ 2 * Phi(-1.414)
    assert mcnemar_exact(10**6, 10**6) == 1.0 and mcnemar_exact(0, 10**6) == 0.0
    monkeypatch.setattr(scoring, "MCNEMAR_EXACT_UP_TO", 0)  # the floating-point sum for few pairs too
    rng = random.Random(6)
    for _ in range(300):
        b, c = rng.randint(0, 3000), rng.randint(0, 3000)
        assert mcnemar_exact(b, c) == pytest.approx(exact(b, c), rel=1e-9, abs=1e-300)
    assert not calls


def test_the_sign_flip_p_value_keeps_only_the_lower_tail_and_is_the_same():
    """The sign-flip test's distribution kept only up to the lower tail's top, and only as far as the rows
    so far reach: the same p-values bit for bit as the whole distribution (2.4x fewer steps at 4,472 rows)."""

    def whole(totals: list[int]) -> float:  # the distribution over every sum, as before
        sizes = [abs(t) for t in totals if t]
        observed, span = abs(sum(totals)), sum(abs(t) for t in totals)
        if not sizes or observed == 0:
            return 1.0
        dist = [1.0] + [0.0] * span
        for size in sizes:
            dist = [(a + b) * 0.5 for a, b in zip(dist, [0.0] * size + dist[:-size], strict=True)]
        return min(1.0, 2 * sum(dist[: (span - observed) // 2 + 1]))

    rng = random.Random(8)
    for _ in range(2000):
        width = rng.randint(1, 12)
        totals = [rng.randint(-width, width) + rng.choice((0, 0, 1)) for _ in range(rng.randint(1, 50))]
        assert sign_flip_p(totals) == whole(totals), totals
    totals = [1] * 2237 + [-1] * 2235
    assert sign_flip_p(totals) == whole(totals)


def _covers(rows: int, per_row: int, runs: int, seed: int) -> tuple[float, float]:
    """Simulated nulls (:func:`_simulated_comparison`): the share of intervals holding 0 and of p-values
    below 0.05."""
    rng = random.Random(seed)
    cover = rejected = 0
    for _ in range(runs):
        pairs, keys = _simulated_comparison(rng, rows, per_row)
        r = compare.compare_pairs(pairs, bootstrap=400, rows=keys)
        cover += r["difference_95ci"][0] <= 0 <= r["difference_95ci"][1]
        rejected += r["p_value"] < 0.05
    return cover / runs, rejected / runs


@pytest.mark.parametrize(
    ("rows", "per_row"),
    [
        (150, 1),
        (150, 4),
        pytest.param(20_000, 1, marks=pytest.mark.slow),
        pytest.param(5000, 10, marks=pytest.mark.slow),
    ],
    ids=lambda v: str(v),
)
def test_the_interval_covers_and_the_test_holds_where_resamples_draw_class_counts(rows, per_row):
    """Two models alike over the rows, resampled by class counts (above 100 units): the interval holds
    the true difference (0), and the p-value falls below 0.05, as often as they should, a few rows above
    that line and many (100 simulated comparisons each here; 400 with 1,000 resamples: 94-98% and
    2-6%, also at 1,000 rows of 10, where the sign-flip test is exact)."""
    cover, rejected = _covers(rows, per_row, 100, seed=rows + per_row)
    assert cover >= 0.9
    assert rejected <= 0.1


def test_rescore_a_finished_run_without_model_calls_then_compare(server, tmp_path, capsys):
    dataset = write_rows(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "data"
    run(server, dataset, out, run_name="a")
    run(server, dataset, out, run_name="b", scorer="includes,verify")
    a, b = out / "a", out / "b"
    calls = server.stats()["requests"]
    assert stats_of(a)["scores"]["passed"] == 1  # exact-42 only

    assert score.main([str(a), "--scorer=includes"]) == 0
    assert server.stats()["requests"] == calls  # no model call
    lines = {line["row_id"]: line["score"]["passed"] for line in read_jsonl(a / "scores.includes.jsonl")}
    assert lines == {"exact-42": True, "four": True, "two": True, "seven": False, "file": None}
    stats = stats_of(a)
    assert stats["scores"]["rescored"]["includes"]["passed"] == 3
    assert stats["scores"]["passed"] == 1  # the run's own scores stay as they were
    assert read_jsonl(a / "trajectories.jsonl")[0]["score"]["scorer"] in ("exact", "verify")
    assert score.main([str(a), "--scorer=verify"]) == 2  # the sandbox is gone
    assert "sandbox" in capsys.readouterr().err

    page = tmp_path / "ab.html"
    capsys.readouterr()
    assert compare.main([str(a), str(b), f"--out={page}", "--json", "--bootstrap=500"]) == 0
    r = json.loads(capsys.readouterr().out)
    # One model, two scorers: exact in A and includes in B judge the same replies differently (rows
    # four and two "flipped to pass", B - A +40%): that says nothing of the model. Those pairs are left
    # out; the file row (verify in both: includes does not apply to it) is the one pair.
    assert (r["pairs"], r["judged_differently"]) == (1, 4)
    assert r["judged_differently_rows"] == ["exact-42", "four", "seven", "two"]
    assert r["flipped_to_pass"] == [] and r["flipped_to_fail"] == [] and r["difference"] == 0
    assert "another scorer or its settings" in page.read_text("utf-8")
    # A re-scored with B's scorer pairs with B: the same replies, the same verdicts.
    assert (
        compare.main([str(a), str(b), "--scores_a=includes", "--json", f"--out={page}", "--bootstrap=500"])
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert (r["pairs"], r["judged_differently"], r["difference"]) == (4, 0, 0)
    assert (r["pass_rate_a"], r["pass_rate_b"]) == (0.75, 0.75)
    # A's own scores against its re-scoring with includes: the same flips, without another run.
    assert (
        compare.main([str(a), str(a), "--scores_b=includes", "--json", f"--out={tmp_path / 'x.html'}"]) == 0
    )
    again = json.loads(capsys.readouterr().out)
    assert again["pairs"] == 4  # the file row has no includes verdict
    assert again["flipped_to_pass"] == ["four", "two"]  # Rows four and two: fail (exact), pass (includes)
    assert (again["passed_only_in_a"], again["passed_only_in_b"]) == (0, 2)
    assert again["difference"] == pytest.approx(0.5)
    text = (tmp_path / "x.html").read_text("utf-8")
    assert "Failed in A, passed in B (2)" in text and "<li>four</li>" in text
    assert compare.main([str(a), str(b), "--scores=nope", f"--out={tmp_path / 'y.html'}"]) == 2


def _flip_run(tmp_path: Path, rows: list[dict]) -> Path:
    """A run judged with exact (its own scores) and re-scored with includes: rows whose answer is
    "42, N" fail the first and pass the second, so they flip to pass in B."""
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    assert score.main([str(out / "run"), "--scorer=includes"]) == 0
    return out / "run"


def test_compare_lists_each_flipped_row_even_when_rows_share_a_label(tmp_path, capsys):
    # The flipped rows were a set of labels (the row's id, else its prompt's start): two different
    # rows with one id were one entry, "flipped to pass (1)" for two rows that flipped.
    rows = [
        {"id": "same", "prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"},
        {"id": "same", "prompt": "Say 2 [calls:0] [answer:42, 2]", "answer": "2"},
        {"id": "other", "prompt": "Say 7 [calls:0] [answer:42, 7]", "answer": "7"},
    ]
    a = _flip_run(tmp_path, rows)
    capsys.readouterr()
    page = tmp_path / "c.html"
    assert compare.main([str(a), str(a), "--scores_b=includes", "--json", f"--out={page}"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed_only_in_b"] == 3
    assert len(r["flipped_to_pass"]) == 3, r["flipped_to_pass"]
    assert len(set(r["flipped_to_pass"])) == 3  # each entry says which row it is
    assert "other" in r["flipped_to_pass"] and all("same" in n for n in r["flipped_to_pass"] if n != "other")
    assert "Failed in A, passed in B (3)" in page.read_text("utf-8")


def test_compare_prints_no_terminal_escape_from_a_row(tmp_path):
    # A dataset row's id (or prompt) is printed in the flipped-rows lines: its escape sequences
    # reached the terminal as they were (clear the screen, set the window title, hide text).
    hostile = "\x1b]0;PWNED\x07evil\x1b[2J\x1b[8m\x9b31m"
    rows = [
        {"id": hostile, "prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"},
        {"prompt": "Say 2 \x1b[31mred [calls:0] [answer:42, 2]", "answer": "2"},
    ]
    a = _flip_run(tmp_path, rows)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchrun.views.compare",
            str(a),
            str(a),
            "--scores_b=includes",
            f"--out={tmp_path / 'c.html'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    flipped = next(line for line in done.stdout.splitlines() if "flipped to pass" in line)
    assert "(2)" in flipped and "evil" in flipped and "red" in flipped
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", done.stdout), repr(done.stdout)
    assert "\\x1b" in flipped  # shown, not obeyed


def test_score_and_compare_when_their_output_cannot_be_written(tmp_path, capsys):
    # scores.NAME.jsonl or compare's --out that cannot be written (a read-only run directory, a
    # missing folder, a directory in its place) ended in a WriteError traceback: one line naming it.
    a = _flip_run(tmp_path, [{"prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"}])
    (a / "scores.numeric.jsonl").mkdir()
    capsys.readouterr()
    assert score.main([str(a), "--scorer=numeric"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write ") and str(a / "scores.numeric.jsonl") in err
    for out in (tmp_path / "missing" / "c.html", tmp_path):
        assert compare.main([str(a), str(a), "--scores_b=includes", f"--out={out}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out {out}") and "Traceback" not in err


def test_compare_checks_its_out_before_any_work_and_prints_no_result_beside_a_failure(
    tmp_path, capsys, monkeypatch
):
    # --out in a missing folder, or a directory, was found only after the whole comparison: the report
    # (or its JSON) was printed, then "error: cannot write", exit 2.
    a = _flip_run(tmp_path, [{"prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"}])
    capsys.readouterr()
    monkeypatch.setattr(compare, "compare_runs", lambda *args: pytest.fail("compared before --out's check"))
    for out, why in ((tmp_path / "missing" / "c.html", "is not a directory"), (tmp_path, "is a directory")):
        assert compare.main([str(a), str(a), "--scores_b=includes", "--json", f"--out={out}"]) == 2
        done = capsys.readouterr()
        assert done.out == "" and why in done.err and f"--out {out}" in done.err
    monkeypatch.undo()

    # Written before anything is printed: a write that fails after the check (a full disk) leaves no
    # valid-looking JSON on stdout beside exit 2.
    def full(path, text):
        raise WriteError(path, OSError(28, "No space left on device"))

    monkeypatch.setattr(compare, "write_text_atomic", full)
    assert (
        compare.main([str(a), str(a), "--scores_b=includes", "--json", f"--out={tmp_path / 'c.html'}"]) == 2
    )
    done = capsys.readouterr()
    assert done.out == "" and done.err.startswith("error: cannot write ")


def test_compare_never_writes_its_page_over_a_run_s_files_or_another_file(tmp_path, capsys):
    # --out=A/trajectories.jsonl replaced the run's samples with the page, exit 0; any file of a run
    # directory was exposed, and so was any file at all.
    a = _flip_run(tmp_path, [{"prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"}])
    killed = tmp_path / "killed"  # a run killed before its merge: batch files alone
    killed.mkdir()
    shutil.copy(a / "batch_0.jsonl", killed / "batch_0.jsonl")
    notes = tmp_path / "notes.html"
    notes.write_text("my notes\n")
    (tmp_path / "link.html").symlink_to(a / "statistics.json")
    before = {p: p.read_bytes() for p in [*a.iterdir(), *killed.iterdir(), notes] if p.is_file()}
    capsys.readouterr()
    outs = {
        a / "trajectories.jsonl": "is in the run directory",
        a / "statistics.json": "is in the run directory",
        a / "new.html": "is in the run directory",
        killed / "c.html": "is in the run directory",
        tmp_path / "link.html": "is in the run directory",
        notes: "exists and is no comparison page",
    }
    for out, why in outs.items():
        assert compare.main([str(a), str(a), "--scores_b=includes", f"--out={out}"]) == 2
        done = capsys.readouterr()
        assert done.out == "" and f"error: --out {out} {why}" in done.err
    assert {p: p.read_bytes() for p in before} == before
    assert not (a / "new.html").exists() and not (killed / "c.html").exists()
    # An earlier comparison page is replaced, as the default compare.html is on every comparison.
    page = tmp_path / "c.html"
    for _ in range(2):
        assert compare.main([str(a), str(a), "--scores_b=includes", f"--out={page}"]) == 0
        assert page.read_text().startswith(compare.PAGE_START)
    assert capsys.readouterr().out.endswith(f"Wrote {page}\n")


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--scores=../../x"], "--scores"),
        (["--scores="], "--scores"),
        (["--scores_a="], "--scores_a"),
        (["--scores_b=a/b"], "--scores_b"),
        (["--scores=/abs/scores.c4.jsonl"], "--scores"),
    ],
)
def test_compare_takes_a_re_scoring_s_name_as_views_score_writes_it(tmp_path, capsys, flags, flag):
    # --scores=../../x went into the path; --scores= meant the runs' own scores, silently.
    with pytest.raises(SystemExit) as exc:
        compare.main([str(tmp_path), str(tmp_path), *flags, f"--out={tmp_path / 'c.html'}"])
    assert exc.value.code == 2
    assert f"error: {flag}: letters, digits, '.', '+', '-' and '_' only" in capsys.readouterr().err


@contextlib.contextmanager
def _held_as_a_runner_holds_it(run_dir: Path):
    """The run directory's lock, held as a runner holds it (batchrun.run.recorder.Recorder.lock)."""
    with (run_dir / ".lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.truncate(0)
        held.write("pid 4242 on elsewhere\n")
        held.flush()
        yield held


def test_score_and_a_runner_never_write_the_run_directory_together(tmp_path, capsys, monkeypatch):
    # views.score read statistics.json, scored, then wrote it back with its section added. A --resume
    # that finished meanwhile (a judge's re-scoring takes minutes) had its statistics.json replaced by
    # that older copy: measured, a resume adding 120 trajectories left statistics.json saying 120 of 240,
    # 2 invocations of 3 and 635 requests of 1,295. It now refuses a directory a runner works in, and
    # holds the directory's lock while it works, so no runner starts there meanwhile.
    a = _flip_run(tmp_path, [{"prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"}])
    before = (a / "statistics.json").read_text("utf-8")
    with _held_as_a_runner_holds_it(a):
        capsys.readouterr()
        assert score.main([str(a), "--scorer=numeric", "--name=busy"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {a} is in use by a running batch_runner (pid 4242 on elsewhere)")
        assert "re-score when it has ended" in err
    assert (a / "statistics.json").read_text("utf-8") == before
    assert not (a / "scores.busy.jsonl").exists()

    # A runner started while the re-scoring works is refused, naming it; the re-scoring completes.
    resume = [
        sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={tmp_path / 'd.jsonl'}",
        "--batch_size=4", "--run_name=run", "--model=mock", f"--output_dir={a.parent}", "--num_workers=2",
        "--distribution=terminal_only", "--max_failure_rate=1.0", "--resume", "--samples_per_prompt=2",
    ]  # fmt: skip
    (tmp_path / "start_a_runner.py").write_text(
        "import json, subprocess, sys\n"
        "def score(record, row, sandbox):\n"
        f"    done = subprocess.run({resume!r}, capture_output=True, text=True, timeout=120)\n"
        f"    open({str(tmp_path / 'runner.json')!r}, 'w').write(json.dumps([done.returncode, done.stderr]))\n"
        "    return True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert score.main([str(a), "--scorer=start_a_runner:score", "--name=mine"]) == 0
    code, err = json.loads((tmp_path / "runner.json").read_text())
    assert code == 2 and "in use by a running batch_runner" in err and "batchrun.views.score" in err, err
    stats = stats_of(a)
    assert stats["scores"]["rescored"]["mine"]["passed"] == 1
    assert len(stats["runs"]) == 1 and stats["trajectories"] == 1  # no second invocation ran
    assert not (a / ".lock").exists() or (a / ".lock").stat().st_size < 200


def test_a_judge_rescoring_of_a_busy_run_directory_asks_the_judge_nothing(tmp_path, capsys):
    """The judge's start check came before the run directory's lock: re-scoring a run a runner was
    resuming made one call to the judge (billed by a paid one), then exited 2. The lock comes first."""
    from batchrun.fakes.fake_model import FakeModelServer

    a = _flip_run(tmp_path, [{"prompt": "Say 4 [calls:0] [answer:42, 4]", "rubric": "r"}])
    with FakeModelServer() as judge, _held_as_a_runner_holds_it(a):
        capsys.readouterr()
        argv = [str(a), "--scorer=judge", "--judge_model=j", f"--judge_base_url={judge.base_url}"]
        assert score.main(argv) == 2
        assert "is in use by a running batch_runner" in capsys.readouterr().err
        assert (judge.stats()["requests"], judge.stats()["check_calls"]) == (0, 0)
    assert not (a / "scores.judge.jsonl").exists()


def test_export_and_compare_refuse_a_run_a_runner_is_resuming(tmp_path, capsys):
    # During a --resume, trajectories.jsonl is the earlier invocation's while discarded.jsonl and
    # failed.jsonl grow: an export mid-resume wrote 15 samples (exit 0) of a run that ended with 90,
    # its "not exported" counts from the growing files; compare paired the same half-old samples.
    from batchrun.views import export

    a = _flip_run(tmp_path, [{"prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"}])
    out = tmp_path / "out"
    with _held_as_a_runner_holds_it(a) as held:
        capsys.readouterr()
        assert export.main([str(a), "--format=messages", f"--out={out}"]) == 2
        err = capsys.readouterr().err
        assert "in use by a running batch_runner (pid 4242 on elsewhere)" in err and "export it when" in err
        assert not out.exists()
        assert compare.main([str(a), str(a), "--scores_b=includes", f"--out={tmp_path / 'c.html'}"]) == 2
        assert "compare it when it has ended" in capsys.readouterr().err
        # A re-scoring holding the lock adds its own file only: no reason to wait for it.
        held.truncate(0)
        held.write("pid 4242 on elsewhere (python -m batchrun.views.score)\n")
        held.flush()
        assert export.main([str(a), "--format=messages", f"--out={out}"]) == 0
    assert compare.main([str(a), str(a), "--scores_b=includes", f"--out={tmp_path / 'c.html'}"]) == 0


@pytest.mark.parametrize(
    "damaged", ['{"runs": [{"duration_s": 1.0}], "scores": {"pass', '{"scores": [1]}', "[]"]
)
def test_score_never_overwrites_a_statistics_json_it_cannot_read(tmp_path, capsys, damaged):
    # A statistics.json that does not parse (torn, hand-edited) was replaced by one holding only the
    # new scores: the run's totals and runs history were gone. Or it raised (a scores section of
    # another shape). The file is left as it is, and the error names it.
    a = _flip_run(tmp_path, [{"prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"}])
    (a / "statistics.json").write_text(damaged)
    capsys.readouterr()
    assert score.main([str(a), "--scorer=numeric"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(a / "statistics.json") in err
    assert (a / "statistics.json").read_text() == damaged


@pytest.mark.browser
def test_rescore_and_compare_count_duplicate_rows_as_the_run_does(tmp_path, capsys):
    # Two identical rows want two samples of one (row, sample); a --rerun_discarded leaves the old
    # discard in discarded.jsonl beside the new one. A re-scoring has no dataset: it must count what the
    # run's own scores count, as statistics.json's scores.duplicate_samples says.
    twice = {"prompt": "Say 42 twice [calls:0] [answer:42]", "answer": "42"}
    wrong = {"prompt": "Say 43 [calls:0] [answer:42]", "answer": "43"}
    dataset = write_rows(tmp_path / "d.jsonl", [twice, twice, wrong])
    out = tmp_path / "data"
    run(None, dataset, out, keep="passed")
    run(None, dataset, out, keep="passed", resume=True, rerun_discarded=True)
    a = out / "run"
    assert len(read_jsonl(a / "trajectories.jsonl")) == 2 and len(read_jsonl(a / "discarded.jsonl")) == 2
    stats = stats_of(a)
    assert (stats["scores"]["scored"], stats["scores"]["passed"]) == (3, 2)
    (dup,) = stats["scores"]["duplicate_samples"]
    assert (dup["sample_index"], dup["wanted"]) == (0, 2)
    assert dup["row_key"] == read_jsonl(a / "trajectories.jsonl")[0]["metadata"]["row_key"]

    assert len(score.run_samples(a)) == 3
    assert score.main([str(a), "--scorer=includes"]) == 0
    rescored = stats_of(a)["scores"]["rescored"]["includes"]
    assert (rescored["scored"], rescored["passed"]) == (3, 2)  # as the run's own: not 2 and 2
    assert len(read_jsonl(a / "scores.includes.jsonl")) == 3

    capsys.readouterr()
    assert (
        compare.main([str(a), str(a), "--scores_b=includes", "--json", f"--out={tmp_path / 'c.html'}"]) == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert (r["pairs"], r["pass_rate_a"], r["pass_rate_b"]) == (3, 2 / 3, 2 / 3)


def _report_scores(run_dir: Path) -> tuple[int, int, int]:
    """The report's scores section as read: samples and passes summed over its per-row table, and the
    failing samples it lists."""
    page = (run_dir / "report.html").read_text("utf-8")
    section = page[page.index('<section id="scores">') :]
    table = section[section.index('<table class="scores"') : section.index("</table>")]
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", table, re.DOTALL)]
    rows = [cells[i : i + 5] for i in range(0, len(cells), 5)]
    failing = int(re.search(r"Failing samples \((\d+)\)", section).group(1))
    return sum(int(r[1]) for r in rows), sum(int(r[2]) for r in rows), failing


@pytest.mark.parametrize("flags", [{"exclude_partial": True}, {"keep": "passed", "exclude_partial": True}])
def test_the_report_judges_the_samples_statistics_json_counts(tmp_path, flags):
    """The report's per-row table and failing list are the samples of the pass rate above them: each
    (row, sample) once (an old discard that --rerun_discarded ran again was listed beside its new run),
    and the partial samples --exclude_partial leaves out of trajectories.jsonl (a row that always ran
    out of turns was missing from the table, its failures from the list)."""
    rows = [
        {"id": "right", "prompt": "Say 42 [calls:0] [answer:42]", "answer": "42"},
        {"id": "wrong", "prompt": "Say 43 [calls:0] [answer:42]", "answer": "43"},
        {"id": "loop", "prompt": "Loop [loop]", "answer": "1"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run(None, dataset, out, max_turns=3, **flags)
    run(None, dataset, out, max_turns=3, resume=True, rerun_discarded=True, **flags)
    a = out / "run"
    scores = stats_of(a)["scores"]
    assert (scores["scored"], scores["passed"], scores["scorer_errors"]) == (3, 1, 0)
    assert _report_scores(a) == (3, 1, 2)  # as the runner wrote it
    assert report.main([str(a)]) == 0
    assert _report_scores(a) == (3, 1, 2)  # and as the view writes it again


def test_the_reports_per_row_table_never_merges_two_rows(tmp_path):
    """Rows were grouped by their label (the row's id, else its prompt's first 60 characters): two
    rows that share a long preamble (or an id) made one line, a row that always fails hidden in one
    that always passes as "2 samples, 1 pass"."""
    preamble = "Answer the question below and end with a line ANSWER: <the answer>. "
    rows = [
        {"prompt": preamble + "Say 42 [calls:0] [answer:42]", "answer": "42"},
        {"prompt": preamble + "Say 43 [calls:0] [answer:42]", "answer": "43"},
        {"id": "same", "prompt": "Say 4 [calls:0] [answer:4]", "answer": "4"},
        {"id": "same", "prompt": "Say 5 [calls:0] [answer:4]", "answer": "5"},
    ]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    page = (out / "run" / "report.html").read_text("utf-8")
    table = page[page.index('<table class="scores"') :]
    table = table[: table.index("</table>")]
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", table, re.DOTALL)]
    lines = [cells[i : i + 5] for i in range(0, len(cells), 5)]
    assert sorted((n, passes) for _, n, passes, _, _ in lines) == [
        ("1", "0"),
        ("1", "0"),
        ("1", "1"),
        ("1", "1"),
    ]
    assert len({label for label, *_ in lines}) == 4, lines  # each line says which row it is


def test_report_scores_section_in_chromium(browser, tmp_path: Path):
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", ROWS), out, samples_per_prompt=2)
    report = out / "run" / "report.html"
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(report.as_uri())
    section = page.locator("#scores")
    assert section.is_visible()
    assert page.inner_text('[data-stat="pass_rate"]') == "20.0%"  # 2 of 10 samples
    assert page.inner_text('[data-stat="pass@1"]') == "0.200"
    assert page.inner_text('[data-stat="pass@2"]') == "0.200"
    assert "exact-42" in page.inner_text("table.scores")
    assert section.locator("svg.hist").count() == 1
    # A failing sample's verify output is one click away.
    failing = section.locator("details.failing", has_text="file").first
    output = failing.locator("pre")
    assert not output.is_visible()
    failing.locator("summary").click()
    assert output.is_visible() and "checking out.txt" in output.inner_text()
    shot = tmp_path / "scores.png"
    section.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    assert errors == []
    page.close()


def test_compare_skips_a_re_scoring_line_of_another_shape(tmp_path, capsys):
    # A scores.NAME.jsonl line without row_key or sample_index (edited, torn mid-way) ended in a KeyError
    # traceback; it is skipped, as torn lines are everywhere.
    rows = [{"id": "r", "prompt": "Say 4 [calls:0] [answer:42, 4]", "answer": "4"}]
    a = _flip_run(tmp_path, rows)
    path = a / "scores.includes.jsonl"
    path.write_text(
        '{"score": {"passed": true}}\n{"row_key": "x", "sample_index": "0", "score": {}}\n' + path.read_text()
    )
    capsys.readouterr()
    assert (
        compare.main([str(a), str(a), "--scores_b=includes", "--json", f"--out={tmp_path / 'c.html'}"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["passed_only_in_b"] == 1


def test_compare_tells_samples_without_a_verdict_in_b_from_samples_only_in_a(tmp_path, capsys):
    """A sample judged in A that B holds without a verdict (B's scorers had nothing to judge it by, or a
    scorer error) was counted "only in A", which reads as if B had no such sample: here "only in A: 2" for
    a run compared with its own re-scoring, which holds every sample. They are counted apart, by reason,
    in the text, the page and the JSON; "only in A" keeps the samples B has none of."""
    rows = [
        {"id": "right", "prompt": "Say 42 [calls:0] [answer:42]", "answer": "42"},
        {"id": "broken", "prompt": "Say a(b [calls:0] [answer:a(b]", "answer": "a(b"},  # no regex compiles
        {"id": "made", "prompt": "Make it [calls:0]", "verify": "true"},  # nothing regex can judge
        {"id": "free", "prompt": "Chat [calls:0]"},  # judged in neither: in no count
    ]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    a, page = out / "run", tmp_path / "c.html"
    assert score.main([str(a), "--scorer=regex"]) == 0
    capsys.readouterr()
    assert compare.main([str(a), str(a), "--scores_b=regex", f"--out={page}"]) == 0
    printed = capsys.readouterr().out
    assert "1 paired samples in 1 rows (only in A: 0, only in B: 0)" in printed, printed
    line = (
        "not paired: 2 samples judged in A have no verdict in B (1 unscored: B's scorers have nothing to "
        "judge them by; 1 scorer errors), in 2 rows: broken, made"
    )
    assert line in printed
    html = page.read_text("utf-8")
    assert "only in A: 0, only in B: 0" in html and html_escape(line) in html
    assert compare.main([str(a), str(a), "--scores_b=regex", f"--out={page}", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["only_in_a"], figures["only_in_b"], figures["unjudged_in_b"]) == (0, 0, 2)
    assert figures["unjudged_in_b_by_reason"] == {"unscored": 1, "scorer_error": 1}
    assert figures["unjudged_in_b_rows"] == ["broken", "made"]
    assert (figures["unjudged_in_a"], figures["unjudged_in_a_rows"]) == (0, [])
    # The other way round: judged in B, without a verdict in A.
    assert compare.main([str(a), str(a), "--scores_a=regex", f"--out={page}", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["only_in_b"], figures["unjudged_in_a"], figures["unjudged_in_b"]) == (0, 2, 0)
    assert figures["unjudged_in_a_by_reason"] == {"unscored": 1, "scorer_error": 1}


def test_compare_leaves_out_pairs_two_runs_judged_with_other_settings(tmp_path, capsys):
    """Two runs of one model, one dataset: numeric with --numeric_tolerance=0.1 in B passed 40.05 for
    40 where A's default failed it; compared, B "improved" on every row. Left out, as another scorer."""
    rows = [
        {"id": f"r{i}", "prompt": f"Say {40 + i}.05 [calls:0] [answer:{40 + i}.05]", "answer": 40 + i}
        for i in range(4)
    ]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out, run_name="a", scorer="numeric")
    run(
        None,
        write_rows(tmp_path / "d.jsonl", rows),
        out,
        run_name="b",
        scorer="numeric",
        numeric_tolerance=0.1,
    )
    assert stats_of(out / "a")["scores"]["passed"] == 0 and stats_of(out / "b")["scores"]["passed"] == 4
    page = tmp_path / "c.html"
    capsys.readouterr()
    assert compare.main([str(out / "a"), str(out / "b"), "--json", f"--out={page}"]) == 1
    assert "no sample is judged alike in both runs (left out: 4 pairs" in capsys.readouterr().err
    assert compare.main([str(out / "a"), str(out / "a"), "--json", f"--out={page}", "--bootstrap=500"]) == 0
    assert json.loads(capsys.readouterr().out)["pairs"] == 4  # one run, one way of judging: all pairs


def test_compare_leaves_out_pairs_judged_against_another_check(tmp_path, capsys):
    """A row's check is not part of its identity: two runs of the same model, the same replies, where B's
    dataset fixed the answer of four rows, were compared as a regression (pass rate 100% -> 33%,
    McNemar p = 0.125, four rows "flipped to fail"). Such pairs say nothing of the model: left out,
    counted and listed."""
    rows_a = [
        {"id": f"r{i}", "prompt": f"Say {40 + i} [calls:0] [answer:{40 + i}]", "answer": 40 + i}
        for i in range(6)
    ]
    rows_b = [dict(row, answer=row["answer"] + 1) if i < 4 else row for i, row in enumerate(rows_a)]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "a.jsonl", rows_a), out, run_name="a")
    run(None, write_rows(tmp_path / "b.jsonl", rows_b), out, run_name="b")
    assert stats_of(out / "a")["scores"]["passed"] == 6 and stats_of(out / "b")["scores"]["passed"] == 2
    page = tmp_path / "c.html"
    capsys.readouterr()
    assert compare.main([str(out / "a"), str(out / "b"), "--json", f"--out={page}", "--bootstrap=500"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["pairs"], r["pass_rate_a"], r["pass_rate_b"]) == (2, 1.0, 1.0)
    assert r["flipped_to_fail"] == [] and r["mcnemar_p"] == 1.0
    assert r["judged_differently"] == 4 and r["judged_differently_rows"] == ["r0", "r1", "r2", "r3"]
    assert "left out: 4 pairs judged against another check in B" in page.read_text("utf-8")
    assert compare.main([str(out / "a"), str(out / "b"), f"--out={page}", "--bootstrap=500"]) == 0
    assert "left out: 4 pairs judged against another check in B" in capsys.readouterr().out


def test_lines_of_one_prompt_with_other_checks_are_paired_and_grouped_by_their_check(tmp_path, capsys):
    """Lines with one prompt and settings but another answer have one identity: their samples were paired
    (compare) and grouped into rows (pass@k) by the order they ended in. Two runs of one dataset whose
    samples ended in another order were compared as "judged against another check" pair by pair, and a
    row holding a pass and a fail of the two lines made pass@2 1.0 where each line's is 1 or 0."""
    rows = [{"prompt": "Say a number [calls:0] [answer:7]", "answer": answer} for answer in ("7", "8")]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    for name, last_first in (("a", False), ("b", True)):
        run(None, dataset, out, run_name=name, samples_per_prompt=2)
        # The samples in the order they might have ended: each line's in turn, the other way in B.
        path = out / name / "trajectories.jsonl"
        lines = path.read_text("utf-8").splitlines(keepends=True)
        lines.sort(key=lambda line: json.loads(line)["metadata"]["row_fields"], reverse=last_first)
        path.write_text("".join(lines), "utf-8")
    capsys.readouterr()
    assert compare.main([str(out / "a"), str(out / "b"), "--json", f"--out={tmp_path / 'c.html'}"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["pairs"], r["judged_differently"], r["pass_rate_a"], r["pass_rate_b"]) == (4, 0, 0.5, 0.5)
    # The report's per-row table has a line of each (it had one row of 4 samples and 2 passes), named by
    # its dataset line, whatever order the samples are in.
    for name in ("a", "b"):
        page = report.write_report(out / name).read_text("utf-8")
        table = page[page.index("<table", page.index('id="scores"')) :]
        cells = re.findall(
            r"<tr><td>([^<]*)</td><td>(\d+)</td><td>(\d+)</td>", table[: table.index("</table>")]
        )
        assert cells == [
            ("Say a number [calls:0] [answer:7] · line 1", "2", "2"),
            ("Say a number [calls:0] [answer:7] · line 2", "2", "0"),
        ], (name, cells)
    assert score.main([str(out / "b"), "--scorer=exact", "--name=again"]) == 0
    rescored = stats_of(out / "b")["scores"]["rescored"]["again"]
    assert (rescored["passed"], rescored["rows_scored"], rescored["pass_at_k"]["pass@2"]) == (2, 2, 0.5)
    # One line's samples missing in B (they failed): the other line's still meet their own in A, not the
    # missing line's (numbered by their rank, they moved onto it).
    path = out / "b" / "trajectories.jsonl"
    kept = [line for line in path.read_text("utf-8").splitlines(keepends=True) if '\\"7\\"' not in line]
    assert len(kept) == 2
    path.write_text("".join(kept), "utf-8")
    capsys.readouterr()
    assert compare.main([str(out / "a"), str(out / "b"), "--json", f"--out={tmp_path / 'c.html'}"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["pairs"], r["judged_differently"], r["only_in_a"], r["pass_rate_b"]) == (2, 0, 2, 0.0)


def test_identical_lines_are_paired_and_grouped_by_their_occurrence(tmp_path, capsys):
    """Identical lines' samples were paired (compare) and grouped into rows (pass@k) by the order they
    ended in: a run compared with itself, its samples in another order, showed a row flipped each way,
    and pass@k differed with the order. Each record says its line's occurrence; they go by it now."""
    row = {"id": "d", "prompt": "Dup [answers:1|2] [calls:0]", "answer": 1}
    out = tmp_path / "data"
    run(
        None,
        write_rows(tmp_path / "d.jsonl", [row, row]),
        out,
        run_name="a",
        samples_per_prompt=6,
        seed_per_request=True,
    )
    a, b = out / "a", out / "b"
    shutil.copytree(a, b)
    path = b / "trajectories.jsonl"
    recs = read_jsonl(path)
    verdicts = {
        (r["metadata"]["occurrence"], r["metadata"]["sample_index"]): r["score"]["passed"] for r in recs
    }
    assert any(verdicts[0, i] != verdicts[1, i] for i in range(6)), verdicts  # else order could not matter
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in sorted(recs, key=lambda r: -r["metadata"]["occurrence"])),
        "utf-8",
    )
    capsys.readouterr()
    assert compare.main([str(a), str(b), "--json", f"--out={tmp_path / 'c.html'}"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["pairs"], r["flipped_to_fail"], r["flipped_to_pass"]) == (12, [], [])
    assert r["pass_rate_a"] == r["pass_rate_b"]
    expected = stats_of(a)["scores"]["pass_at_k"]
    for run_dir in (a, b):
        assert score.main([str(run_dir), "--scorer=numeric", "--name=again"]) == 0
        assert stats_of(run_dir)["scores"]["rescored"]["again"]["pass_at_k"] == expected
    # The report's per-row table: a line of each, with its own passes, in either order.
    passes = [str(sum(verdicts[o, i] for i in range(6))) for o in (0, 1)]
    for run_dir in (a, b):
        page = report.write_report(run_dir).read_text("utf-8")
        table = page[page.index("<table", page.index('id="scores"')) :]
        cells = re.findall(
            r"<tr><td>([^<]*)</td><td>(\d+)</td><td>(\d+)</td>", table[: table.index("</table>")]
        )
        assert cells == [("d · line 1", "6", passes[0]), ("d · line 2", "6", passes[1])], cells


def test_views_judge_a_sample_discarded_again_by_its_latest_discard(tmp_path, capsys):
    """A sample discarded, run again (--rerun_discarded) and discarded again has two rows in
    discarded.jsonl; statistics.json counts the latest. The views took the first: a re-scoring judged a
    reply the run no longer holds, and compare met a stale verdict (2 of 6 "passed" where 1 of 6 did)."""
    row = {"prompt": "Coin [answers:1 2|2|1] [calls:0]", "answer": 1}
    dataset, out = write_rows(tmp_path / "d.jsonl", [row]), tmp_path / "data"
    flags = dict(samples_per_prompt=6, keep="passed", seed_per_request=True, scorer="numeric")
    run(None, dataset, out, **flags)
    run(None, dataset, out, resume=True, rerun_discarded=True, force_resume=True, seed=1, **flags)
    a = out / "run"
    latest = {}
    for line in read_jsonl(a / "discarded.jsonl"):
        latest.setdefault(line["sample_index"], []).append(line["record"])
    assert any(len(recs) == 2 for recs in latest.values()), latest  # a sample discarded twice
    samples = score.run_samples(a)
    assert sorted(index for _, (_, index), _ in samples) == list(range(6))
    for rec, (_, index), _ in samples:
        if index in latest:
            assert rec == latest[index][-1]
    # Judged again by another scorer, as the run's latest outcomes are: no stale reply among them.
    assert score.main([str(a), "--scorer=includes", "--answer_pattern=ANSWER: (.*)", "--name=inc"]) == 0
    finals = [rec["conversations"][-1]["value"] for rec, _, _ in samples]
    rescored = stats_of(a)["scores"]["rescored"]["inc"]
    assert rescored["passed"] == sum(bool(re.search(r"ANSWER: .*\b1\b", text)) for text in finals)


def test_a_view_parses_each_record_once_and_takes_its_saved_row_key(tmp_path, monkeypatch):
    """The views read a run's samples from trajectories.jsonl, and the partial ones --exclude_partial left
    out from the batch files, which hold every kept record too: each of those was parsed again to be
    left out (a third of a 100,000-sample compare), and each record's whole identity was made again only
    to give way to the row key it saves (another third). Now a batch line is parsed only when it can hold
    a partial record, and a saved key is taken as it is."""
    import batchrun.identity
    import batchrun.storage

    rows = [{"prompt": f"Say 42 ({n}) [calls:0] [answer:42]", "answer": "42"} for n in range(3)]
    rows.append({"prompt": "Loop [calls:3]", "max_turns": 1, "answer": "42"})
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out, exclude_partial=True)
    a = out / "run"
    assert len(read_jsonl(a / "trajectories.jsonl")) == 3
    parsed = []
    real_parse = batchrun.storage._parse_line
    monkeypatch.setattr(batchrun.storage, "_parse_line", lambda raw: parsed.append(raw) or real_parse(raw))

    def unmade(record):
        raise AssertionError("the identity of a record that saves its key was made again")

    monkeypatch.setattr(batchrun.identity.RowIdentity, "of_record", unmade)
    samples = score.run_samples(a)
    assert sorted(rec["partial"] for rec, _, _ in samples) == [False, False, False, True]
    assert len(parsed) == 4  # not 3 + 4: the batch file's kept lines are not read again
    assert [key for _, key, _ in samples] == [score.record_sample(rec) for rec, _, _ in samples]


@pytest.mark.parametrize("value", ["99", "1000001", "10000000000", "-5"])
def test_compare_refuses_a_bootstrap_it_could_not_finish_or_would_not_trust(value, capsys):
    """--bootstrap had no upper limit: a typo's extra zeros (10,000,000,000 resamples) ran for hours before
    a figure. It is refused at once, exit 2, naming the flag, before any run is read."""
    with pytest.raises(SystemExit) as stopped:
        compare.main(["/nonexistent/a", "/nonexistent/b", f"--bootstrap={value}"])
    assert stopped.value.code == 2
    assert "--bootstrap must be from 100 to 1,000,000" in capsys.readouterr().err


def test_a_rescoring_reads_numeric_tolerance_as_the_run_does(tmp_path, capsys):
    """views.score took any float as --numeric_tolerance: NaN or a negative one failed every numeric answer,
    the right ones too (the run's 1 of 1 passing re-scored as 0 of 1, exit 0), and one above 1 passed
    answers off by more than the answer. It is read as the run's flag is: 0 to 1, else exit 2 naming it."""
    out = tmp_path / "data"
    run(
        None,
        write_rows(tmp_path / "d.jsonl", [{"prompt": "Say 42 [calls:0] [answer:42]", "answer": "42"}]),
        out,
    )
    a = out / "run"
    for value in ("nan", "-1", "2", "inf", "1e-6x"):
        assert score.main([str(a), "--scorer=numeric", f"--numeric_tolerance={value}"]) == 2, value
        assert "--numeric_tolerance must be a number from 0 to 1" in capsys.readouterr().err
    assert not (a / "scores.numeric.jsonl").exists()
    assert score.main([str(a), "--scorer=numeric", "--numeric_tolerance=0.01"]) == 0
    rescored = stats_of(a)["scores"]["rescored"]["numeric"]
    assert (rescored["scored"], rescored["passed"]) == (1, 1)


@pytest.mark.timeout(300)
def test_a_rescorings_pattern_is_bounded_by_the_runs_verify_timeout(tmp_path, capsys):
    """views.score bounded each --answer_pattern search by 60 s whatever the run's --verify_timeout, one
    sample after another: a pattern that backtracks on every answer held a run judged with
    --verify_timeout=1 for 60 s a sample (2 samples: 120 s). It takes the run's bound, or its own
    --verify_timeout, read as the run's flag."""
    out = tmp_path / "data"
    answer = "a" * 40 + "b"
    rows = [{"id": "r", "prompt": f"Say it [calls:0] [answer:{answer}]", "answer": "x"}]
    run(None, write_rows(tmp_path / "d.jsonl", rows), out, samples_per_prompt=2, verify_timeout=1)
    argv = [str(out / "run"), "--scorer=exact", "--answer_pattern=((a+)+$)"]
    for flags, bound in (([], "1 s"), (["--verify_timeout=0.5", "--name=short"], "0.5 s")):
        started = time.monotonic()
        assert score.main([*argv, *flags]) == 0, capsys.readouterr().err
        assert time.monotonic() - started < 30
        name = "short" if flags else "exact"
        errors = [line["score"]["error"] for line in read_jsonl(out / "run" / f"scores.{name}.jsonl")]
        assert errors == [f"exact: --answer_pattern took longer than {bound} on the final answer"] * 2, errors
    for value in ("0", "nan", "-1"):
        assert score.main([*argv, f"--verify_timeout={value}"]) == 2
        assert "--verify_timeout must be a number" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_rescorings_runaway_pattern_is_given_up_after_three_rows_not_tried_on_each(tmp_path, capsys):
    """A pattern that backtracks on every answer cost each sample its whole --verify_timeout, one after
    another (1,000 samples at the default 60 s: 17 hours, for a table of timeouts). After it has run away
    on three rows' answers in a row, the other samples are left unscored at once, the pattern named, and
    the re-scoring says so; the first three keep their timeouts."""
    out = tmp_path / "data"
    rows = [
        {"id": f"r{i}", "prompt": f"Say it {i} [calls:0] [answer:{'a' * (40 + i)}b]", "answer": "x"}
        for i in range(8)
    ]
    run(None, write_rows(tmp_path / "d.jsonl", rows), out, verify_timeout=0.5)
    assert score.main([str(out / "run"), "--scorer=exact", "--answer_pattern=((a+)+$)"]) == 0
    assert "8 scorer errors" in capsys.readouterr().out
    scores = [line["score"] for line in read_jsonl(out / "run" / "scores.exact.jsonl")]
    assert [s["passed"] for s in scores] == [None] * 8
    errors = collections.Counter(s["error"].split(" (over")[0] for s in scores)
    assert errors == {
        "exact: --answer_pattern took longer than 0.5 s on the final answer": 3,
        "exact: --answer_pattern /((a+)+$)/ ran away": 5,
    }, errors
    assert "on the answers of 3 rows in a row" in scores[-1]["error"]


def test_samples_nothing_can_judge_are_not_counted_as_planned_and_not_passed(tmp_path, capsys):
    """The conservative figure (passes over every sample planned) counted the unscored samples, those whose
    row the scorers have nothing to judge by, as not passed: a re-scoring by includes of a run whose rows
    are half verify ones (the README's eval run) read "1 passed of 4 samples planned (25.0%)", as did the
    run's own figure with rows that have no check at all. They are outside the evaluation: not planned."""
    rows = [
        {"id": "right", "prompt": "Say 42 [calls:0] [answer:42]", "answer": 42},
        {"id": "wrong", "prompt": "Say 41 [calls:0] [answer:41]", "answer": 42},
        {"id": "made", "prompt": "Make it [calls:0]", "verify": "true"},
        {"id": "free", "prompt": "Chat [calls:0]"},  # nothing to judge it by
    ]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    own = stats_of(out / "run")["scores"]
    assert (own["scored"], own["unscored"], own["passed"]) == (3, 1, 2)
    assert (own["samples_planned"], own["pass_rate_of_planned"]) == (3, round(2 / 3, 6))
    capsys.readouterr()
    assert score.main([str(out / "run"), "--scorer=includes"]) == 0
    printed = capsys.readouterr().out
    assert "Scores: pass rate 50.0% of 2 scored" in printed and "samples planned" not in printed, printed
    again = stats_of(out / "run")["scores"]["rescored"]["includes"]
    assert (again["scored"], again["unscored"], again["samples_planned"], again["pass_rate_of_planned"]) == (
        2,
        2,
        2,
        0.5,
    )


def test_failed_samples_nothing_can_judge_are_not_pending_nor_planned(server, tmp_path, capsys):
    """A failed sample of a row with nothing to judge it by (no answer, verify or rubric) was counted in
    samples_pending, so in samples_planned as not passed, as the unscored ones were before: here "1 passed
    of 5 samples planned (20.0%)" for 1 of 2 judged and 2 judgeable samples failed. A re-scoring counts the
    pending samples its own scorers can judge: includes cannot judge a verify row's."""
    rows = [
        {"id": "right", "prompt": "Say 42 [calls:0] [answer:42]", "answer": 42},
        {"id": "wrong", "prompt": "Say 41 [calls:0] [answer:41]", "answer": 42},
        {"id": "refused", "prompt": "Say 42 [error:400]", "answer": 42},
        {"id": "made", "prompt": "Make it [error:400]", "verify": "true"},
        {"id": "free", "prompt": "Chat [error:400]"},  # nothing to judge it by
    ]
    out = tmp_path / "data"
    run(server, write_rows(tmp_path / "d.jsonl", rows), out)
    stats = stats_of(out / "run")
    own = stats["scores"]
    assert stats["remaining_for_resume"] == 3  # --resume runs every one
    assert (own["scored"], own["passed"], own["samples_pending"]) == (2, 1, 2)
    assert (own["samples_planned"], own["pass_rate_of_planned"]) == (4, 0.25)
    assert own["samples_pending_by_check"] == {"answer": 1, "none": 1, "verify": 1}
    assert "1 passed of 4 samples planned (25.0%" in capsys.readouterr().out
    page = (out / "run" / "report.html").read_text("utf-8")
    assert 'data-stat="pass_rate_of_planned">25.0%<' in page
    # The card of those not judged says what it counts, and that these are none of them.
    assert (
        "0 unscored (nothing to judge them by) · 0 scorer errors; not counted here: 2 samples without an outcome (failed or not run)"
        in page
    )
    assert score.main([str(out / "run"), "--scorer=includes"]) == 0
    assert "1 passed of 3 samples planned (33.3%" in capsys.readouterr().out
    again = stats_of(out / "run")["scores"]["rescored"]["includes"]
    assert (again["samples_pending"], again["samples_planned"], again["pass_rate_of_planned"]) == (
        1,
        3,
        round(1 / 3, 6),
    )


def test_a_judge_rescoring_asks_the_judge(tmp_path, capsys, monkeypatch):
    """views.score --scorer=judge: every sample was a scorer error and nothing was asked ("'JudgeSettings'
    object has no attribute 'chat'": a refactor gave the judge's settings where its client belongs), exit
    0. Now the judge answers: its verdicts, its usage, and its key in no file."""
    from batchrun.fakes.fake_model import FakeModelServer

    rows = [
        {"id": "yes", "prompt": 'Grade me [calls:0] [verdict:{"score": 1, "passed": true}]', "rubric": "r"},
        {
            "id": "no",
            "prompt": 'Grade me too [calls:0] [verdict:{"score": 0, "passed": false}]',
            "rubric": "r",
        },
    ]
    out = tmp_path / "data"
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-secret-4242")
    with FakeModelServer() as server:
        run(server, write_rows(tmp_path / "d.jsonl", rows), out)
        before = server.stats()
        argv = [
            str(out / "run"),
            "--scorer=judge",
            "--judge_model=judge-model",
            f"--judge_base_url={server.base_url}",
        ]
        assert score.main(argv) == 0
        after = server.stats()
        assert after["requests"] - before["requests"] == 2
        assert after["check_calls"] - before["check_calls"] == 1  # the run's start check, on the judge
    lines = {line["row_id"]: line["score"] for line in read_jsonl(out / "run" / "scores.judge.jsonl")}
    assert {k: (v["passed"], v["error"]) for k, v in lines.items()} == {
        "yes": (True, None),
        "no": (False, None),
    }
    assert all(v["judge_usage"]["calls"] == 1 for v in lines.values())
    rescored = stats_of(out / "run")["scores"]["rescored"]["judge"]
    assert (rescored["scored"], rescored["passed"]) == (2, 1)
    for path in (out / "run").iterdir():
        assert "sk-judge-secret-4242" not in path.read_text("utf-8", "replace"), path


# Rows the fake model's judge grades as written: one passed, one failed.
GRADED = [
    {"id": "yes", "prompt": 'Grade me [calls:0] [verdict:{"score": 1, "passed": true}]', "rubric": "r"},
    {"id": "no", "prompt": 'Grade me [calls:0] [verdict:{"score": 0, "passed": false}]', "rubric": "r"},
]


def _judged_run(server, rows: list[dict], tmp_path, monkeypatch):
    """A run of ``rows`` judged by ``server``'s judge (--scorer=judge, judge-model); its data directory."""
    out = tmp_path / "data"
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-secret-4242")
    judged = dict(scorer="judge", judge_model="judge-model", judge_base_url=server.base_url)
    run(server, write_rows(tmp_path / "d.jsonl", rows), out, keep_no_reasoning=True, **judged)
    return out


def test_a_rescoring_of_the_errors_only_judges_them_alone_and_only_as_the_run_did(
    tmp_path, capsys, monkeypatch
):
    """views.score --only_errors: the samples whose verdict in the run is a scorer error are judged again,
    the others keep the run's verdict and cost no judge call. Asked with other scorers or another judge
    than the run's, it exits 2 before the judge is asked anything: the two kinds of verdicts would be
    mixed in one pass rate."""
    from batchrun.fakes.fake_model import FakeModelServer

    rows = [
        *GRADED,
        {"id": "broken", "prompt": "Grade me [calls:0] [verdict:no verdict here]", "rubric": "r"},
    ]
    with FakeModelServer() as server:
        out = _judged_run(server, rows, tmp_path, monkeypatch)
        capsys.readouterr()
        argv = [str(out / "run"), f"--judge_base_url={server.base_url}", "--only_errors"]
        before = server.stats()
        for other, said in [  # each flag once: a view refuses one given twice
            (
                ["--scorer=judge", "--judge_model=judge-2"],
                "--judge_model=judge-model, not --judge_model=judge-2",
            ),
            (
                ["--scorer=judge,includes", "--judge_model=judge-model"],
                "--scorer=judge, not --scorer=judge,includes",
            ),
        ]:
            assert score.main([*argv, *other]) == 2
            assert said in capsys.readouterr().err
        assert server.stats()["requests"] == before["requests"]  # nothing asked of the judge
        assert not (out / "run" / "scores.judge.jsonl").exists()

        assert score.main([*argv, "--scorer=judge", "--judge_model=judge-model"]) == 0
        after = server.stats()
    assert after["requests"] - before["requests"] == 1  # the broken verdict's sample alone
    assert "Judged again: 1 sample(s)" in capsys.readouterr().out
    lines = {line["row_id"]: line["score"] for line in read_jsonl(out / "run" / "scores.judge.jsonl")}
    assert {k: (v["passed"], bool(v["error"])) for k, v in lines.items()} == {
        "yes": (True, False),
        "no": (False, False),
        "broken": (None, True),  # the fake's judge answers no verdict again
    }
    rescored = stats_of(out / "run")["scores"]["rescored"]["judge"]
    assert (rescored["scored"], rescored["scorer_errors"], rescored["judged_again"]) == (2, 1, 1)


def test_a_rescoring_of_the_errors_of_a_run_with_none_asks_the_judge_nothing(tmp_path, capsys, monkeypatch):
    """--only_errors on a run whose every verdict stands: before, the judge's start check came first, so
    a judge gone since the run (a local server stopped) failed it, exit 2, where nothing was to be judged.
    Now the judge is not asked: exit 0, each sample keeping the run's verdict."""
    from batchrun.fakes.fake_model import FakeModelServer

    with FakeModelServer() as server:
        out = _judged_run(server, GRADED, tmp_path, monkeypatch)
        gone = server.base_url
    capsys.readouterr()
    argv = [str(out / "run"), "--scorer=judge", "--judge_model=judge-model", f"--judge_base_url={gone}"]
    assert score.main([*argv, "--only_errors"]) == 0
    assert "Judged again: 0 sample(s)" in capsys.readouterr().out
    lines = {
        line["row_id"]: line["score"]["passed"] for line in read_jsonl(out / "run" / "scores.judge.jsonl")
    }
    assert lines == {"yes": True, "no": False}
    rescored = stats_of(out / "run")["scores"]["rescored"]["judge"]
    assert (rescored["scored"], rescored["passed"], rescored["judged_again"]) == (2, 1, 0)
    assert score.main(argv) == 2  # judging every sample again needs the judge


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://127.0.0.1:1/v1", "cannot reach the judge's endpoint http://127.0.0.1:1/v1"),
        ("localhost:8080", "--judge_base_url must be an http:// or https:// URL"),
        ("ftp://judge.example/v1", "--judge_base_url must be an http:// or https:// URL"),
        ("http://user:pw-9137@[::1/v1", "--judge_base_url must be an http:// or https:// URL"),
    ],
)
def test_a_judge_rescoring_that_cannot_reach_its_judge_stops_before_any_sample(tmp_path, capsys, url, said):
    """A judge URL without a scheme, of another scheme, or a closed port: every sample was a scorer error
    after its retries (3.4 s a sample against a closed port), the scores file written, exit 0. Now the
    judge takes the run's start check first: exit 2 saying why, nothing written, no credential shown."""
    out = tmp_path / "data"
    run(
        None,
        write_rows(tmp_path / "d.jsonl", [{"prompt": "Say 42 [calls:0] [answer:42]", "rubric": "r"}]),
        out,
    )
    assert score.main([str(out / "run"), "--scorer=judge", "--judge_model=j", f"--judge_base_url={url}"]) == 2
    err = capsys.readouterr().err
    assert said in err and "pw-9137" not in err
    assert not (out / "run" / "scores.judge.jsonl").exists()
    assert "rescored" not in stats_of(out / "run")["scores"]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--scorer=includes", "--answer_pattern="], "--answer_pattern must not be empty"),
        (
            ["--scorer=includes", "--answer_normalize=,,"],
            "--answer_normalize must be a comma-separated list of names (one is empty)",
        ),
        (["--scorer=includes", "--judge_model=j"], "--judge_model applies only with the judge scorer"),
        (
            ["--scorer=exact", "--judge_base_url=http://127.0.0.1:9/v1"],
            "--judge_base_url applies only with the judge scorer",
        ),
        (
            ["--scorer=exact", "--judge_api_key_env=MY_JUDGE_KEY"],
            "--judge_api_key_env applies only with the judge scorer",
        ),
        (["--scorer=includes", "--concurrency=4"], "--concurrency applies only with the judge scorer"),
        (
            [
                "--scorer=judge",
                "--judge_model=j",
                "--judge_base_url=http://127.0.0.1:9/v1",
                "--judge_api_key_env=NO_SUCH_VAR_XYZ",
            ],
            "the environment variable NO_SUCH_VAR_XYZ is not set or is empty",
        ),
        (
            [
                "--scorer=judge",
                "--judge_model=j",
                "--judge_base_url=http://127.0.0.1:9/v1",
                "--judge_api_key_env=a-b",
            ],
            "--judge_api_key_env must name an environment variable",
        ),
        (
            ["--scorer=judge", "--judge_model=j", "--judge_base_url=https://openrouter.ai/api/v1"],
            "no API key for the judge at --judge_base_url=https://openrouter.ai/api/v1",
        ),
        (["--scorer=includes", f"--name={'n' * 201}"], "--name: at most 200 characters"),
    ],
)
def test_a_rescoring_refuses_what_the_run_refuses_before_anything(tmp_path, capsys, monkeypatch, flags, said):
    """Each of these the runner refuses, and the re-scoring took: an empty pattern or ",," for none, a
    judge's flag without the judge (ignored), a key variable not set (keyless), a hosted judge without a
    key (its start check sent over the network first), --concurrency without the judge (it does
    nothing), a name too long for a file (every judge call paid, then "File name too long")."""
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    out = tmp_path / "data"
    run(
        None,
        write_rows(tmp_path / "d.jsonl", [{"prompt": "Say 42 [calls:0] [answer:42]", "answer": 42}]),
        out,
    )
    before = sorted(p.name for p in (out / "run").iterdir())
    assert score.main([str(out / "run"), *flags]) == 2
    assert said in capsys.readouterr().err
    assert sorted(p.name for p in (out / "run").iterdir()) == before


def test_a_rescoring_names_a_damaged_manifest_not_a_flag_never_given(tmp_path, capsys):
    out = tmp_path / "data"
    run(
        None,
        write_rows(tmp_path / "d.jsonl", [{"prompt": "Say 42 [calls:0] [answer:42]", "answer": 42}]),
        out,
    )
    manifest = out / "run" / "run_manifest.json"
    manifest.write_text(
        json.dumps({**json.loads(manifest.read_text("utf-8")), "verify_timeout": "abc"}), "utf-8"
    )
    assert score.main([str(out / "run"), "--scorer=exact"]) == 2
    err = capsys.readouterr().err
    assert (
        "run_manifest.json: its verify_timeout is not one a run writes" in err
        and "give --verify_timeout" in err
    )
    assert score.main([str(out / "run"), "--scorer=exact", "--verify_timeout=5"]) == 0


def test_a_judge_rescoring_that_could_not_write_its_verdicts_asks_the_judge_nothing(server, tmp_path, capsys):
    """A read-only run directory: the judge's start check and a call for every sample were paid for,
    then "cannot write scores.judge.jsonl: Read-only file system". Now the write is tried first. (Here the
    temp file's place is a directory: the same refusal from the filesystem, as root can write anywhere.)"""
    from batchrun.storage import temp_path

    out = tmp_path / "data"
    rows = [{"prompt": f"Say 42 ({n}) [calls:0] [answer:42]", "rubric": "says 42"} for n in range(3)]
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    run_dir = out / "run"
    temp_path(run_dir / "scores.judge.jsonl").mkdir()
    argv = [
        str(run_dir),
        "--scorer=judge",
        "--judge_model=judge-model",
        f"--judge_base_url={server.base_url}",
    ]
    assert score.main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "scores.judge.jsonl" in err and "nothing re-scored" in err, err
    assert server.stats()["requests"] == 0
    assert "rescored" not in stats_of(run_dir)["scores"]


def test_a_judge_rescoring_judges_several_samples_at_once_in_their_order(tmp_path, capsys):
    """views.score judged one sample after another: 10,000 samples at 2 s a verdict took 5.5 hours. Now
    --concurrency of them at once (default 8), the lines in the samples' order as before."""
    from batchrun.fakes.fake_model import FakeModelServer

    verdict = {
        True: '[verdict:{"score": 1, "passed": true}]',
        False: '[verdict:{"score": 0, "passed": false}]',
    }
    rows = [
        {"id": f"r{n}", "prompt": f"Grade {n} [calls:0] {verdict[n % 3 == 0]}", "rubric": "r"}
        for n in range(8)
    ]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    run_dir = out / "run"
    order = [
        (r["metadata"]["row_key"], r["metadata"]["row_id"])
        for r in read_jsonl(run_dir / "trajectories.jsonl")
    ]
    for flag in ("--concurrency=0", "--concurrency=257"):
        with pytest.raises(SystemExit) as stopped:
            score.main([str(run_dir), "--scorer=judge", "--judge_model=j", "--judge_base_url=http://x", flag])
        assert stopped.value.code == 2 and "--concurrency must be from 1 to 256" in capsys.readouterr().err
    with FakeModelServer(latency_s=0.3) as judge:
        argv = [str(run_dir), "--scorer=judge", "--judge_model=j", f"--judge_base_url={judge.base_url}"]
        assert score.main([*argv, "--concurrency=4"]) == 0
        assert judge.stats()["max_in_flight"] == 4
    lines = read_jsonl(run_dir / "scores.judge.jsonl")
    assert [(line["row_key"], line["row_id"]) for line in lines] == order
    assert {line["row_id"]: line["score"]["passed"] for line in lines} == {
        f"r{n}": n % 3 == 0 for n in range(8)
    }


class _HangingJudge:
    """A judge that passes the start check and then never answers a verdict (it holds each call open)."""

    def __init__(self, loading_s: float = 0.0, hang: bool = True) -> None:
        import http.server
        import threading

        self.asked = threading.Semaphore(0)
        self.loading_until = time.monotonic() + loading_s
        self.loading_answers = 0
        hanging = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _loading(self) -> bool:
                if time.monotonic() >= hanging.loading_until:
                    return False
                hanging.loading_answers += 1  # as llama-server answers while it loads its model
                said = f"Loading model (request from {self.headers.get('Authorization')})"  # quotes the key
                data = json.dumps({"error": {"code": 503, "message": said}}).encode()
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return True

            def do_GET(self) -> None:
                if not self._loading():
                    self._answer({"data": [{"id": "j"}]})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"])).decode()
                if self._loading():
                    return
                content = "OK"
                if "Reply with OK." not in body:  # a verdict
                    if hang:  # held open until the test ends
                        hanging.asked.release()
                        time.sleep(120)
                        return
                    content = '{"score": 1, "passed": true}'
                message = {"role": "assistant", "content": content}
                self._answer(
                    {
                        "id": "c",
                        "object": "chat.completion",
                        "model": "j",
                        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                    }
                )

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("concurrency", [1, 4])
def test_ctrl_c_stops_a_judge_rescoring_whose_judge_hangs(tmp_path, concurrency):
    """views.score judged in a ThreadPoolExecutor, whose threads the interpreter joins at exit: against a
    judge that does not answer, Ctrl-C and a second one left it running (still there 65 s later; each call
    may take 4 x 600 s). Now Ctrl-C ends it at once, exit 130, nothing written."""
    import signal

    rows = [{"id": f"r{n}", "prompt": f"Grade {n} [calls:0]", "rubric": "r"} for n in range(6)]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    judge = _HangingJudge()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchrun.views.score",
                str(out / "run"),
                "--scorer=judge",
                "--judge_model=j",
                f"--judge_base_url={judge.base_url}",
                f"--concurrency={concurrency}",
            ],  # fmt: skip
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell's Ctrl-C reaches it
        )
        try:
            assert judge.asked.acquire(timeout=60), "no verdict was asked"
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=15)
        finally:
            proc.kill()
            proc.wait()
    finally:
        judge.close()
    assert proc.returncode == 130, err
    assert "Interrupted: nothing re-scored" in err
    assert not (out / "run" / "scores.judge.jsonl").exists()


def test_a_judge_that_wants_a_key_it_was_not_given_names_the_judges_variable(tmp_path, capsys, monkeypatch):
    """The judge's start check said 'pass --api_key or set OPENROUTER_API_KEY or OPENAI_API_KEY' when its
    endpoint wanted a key: views.score has no --api_key, and neither variable is read for a judge at its
    own URL, so following the advice gave the same exit 2. It names --judge_api_key_env's variable."""
    from batchrun.fakes.fake_model import FakeModelServer

    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    rows = [{"prompt": "Say 42 [calls:0] [answer:42]", "rubric": "r"}]
    out = tmp_path / "data"
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    run(None, dataset, out)
    with FakeModelServer(api_key="sk-judge-77") as judge:
        argv = [str(out / "run"), "--scorer=judge", "--judge_model=j", f"--judge_base_url={judge.base_url}"]
        assert score.main(argv) == 2
        err = capsys.readouterr().err
        assert "wants an API key (HTTP 401) and none was given: set JUDGE_API_KEY" in err
        assert "--api_key" not in err.replace("--judge_api_key_env", "")
        with pytest.raises(SystemExit) as stopped:  # the run's own check of its judge says the same
            run(
                None,
                dataset,
                out,
                run_name="run2",
                scorer="judge",
                judge_model="j",
                judge_base_url=judge.base_url,
            )
        assert stopped.value.code == 2
        assert "the judge's endpoint" in (err := capsys.readouterr().err) and "set JUDGE_API_KEY" in err


def test_a_judge_that_dies_mid_rescoring_stops_it_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    """A judge that stopped answering mid-way made every remaining sample a scorer error after its retries
    (36 of 64 samples, 27 s at --concurrency=4; hours for 10,000), written as the re-scoring, exit 0. Now
    the run's dead-endpoint stop: DEAD_AFTER failed attempts in a row, the calls held and the judge probed
    for the grace (the run's --endpoint_grace, 120 s; 2 s here), then no call is sent, nothing is written,
    exit 5."""
    import threading

    monkeypatch.setattr(score, "JUDGE_GRACE_S", 2.0)

    rows = [{"id": f"r{n}", "prompt": f"Grade {n} [calls:0]", "rubric": "r"} for n in range(64)]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    run_dir = out / "run"
    before = stats_of(run_dir)
    judge = subprocess.Popen(
        [sys.executable, "-m", "batchrun.fakes.fake_model", "--latency=0.3"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        base_url = judge.stdout.readline().strip()
        argv = [str(run_dir), "--scorer=judge", "--judge_model=mock", f"--judge_base_url={base_url}"]
        code: list[int] = []
        started = time.monotonic()
        judging = threading.Thread(target=lambda: code.append(score.main([*argv, "--concurrency=4"])))
        judging.start()
        time.sleep(1.5)  # the start check and a few verdicts
    finally:
        judge.kill()  # the judge dies: its port refuses every further call
        judge.wait()
    judging.join(120)
    err = capsys.readouterr().err
    assert code == [5], err
    assert time.monotonic() - started < 20
    assert "the judge's endpoint" in err and "stopped answering" in err
    assert not (run_dir / "scores.judge.jsonl").exists()
    assert stats_of(run_dir) == before


def test_a_judge_whose_key_is_refused_mid_rescoring_stops_it_and_nothing_is_written(
    tmp_path, capsys, monkeypatch
):
    """A judge key revoked (or its credits spent) mid-way made every remaining sample a scorer error, each
    refused at once, written as the re-scoring, exit 0. Now the run's refused-key stop: REFUSED_AFTER
    refusals in a row and probes refused for the grace (the run's --endpoint_grace, 120 s; 2 s here),
    then no call is sent, nothing is written, exit 8, the judge's words shown without the key they quote."""
    from helpers import OK_REPLY, ScriptedEndpoint

    from batchrun.run.endpoint_watch import EXIT_ENDPOINT_REFUSED

    monkeypatch.setattr(score, "JUDGE_GRACE_S", 2.0)
    key = "sk-judge-revoked-0123456789"
    verdict = {"role": "assistant", "content": '{"score": 1, "passed": true}'}

    def revoked_after_five(call: dict, calls: list[dict]):
        if call["check"] and sum(1 for c in calls if c["check"]) == 1:
            return 200, OK_REPLY
        if not call["check"] and sum(1 for c in calls if not c["check"]) <= 5:
            return 200, {"choices": [{"index": 0, "finish_reason": "stop", "message": verdict}]}
        return 401, {"error": {"message": f"Invalid API key: {key}"}}

    rows = [{"id": f"r{n}", "prompt": f"Grade {n} [calls:0]", "rubric": "r"} for n in range(48)]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    run_dir = out / "run"
    before = stats_of(run_dir)
    monkeypatch.setenv("JUDGE_API_KEY", key)
    judge = ScriptedEndpoint(revoked_after_five)
    try:
        argv = [str(run_dir), "--scorer=judge", "--judge_model=m", f"--judge_base_url={judge.base_url}"]
        code = score.main([*argv, "--concurrency=2"])
    finally:
        judge.close()
    err = capsys.readouterr().err
    assert code == EXIT_ENDPOINT_REFUSED, err  # before: 0, 43 of 48 samples scorer errors, written
    assert "refused 8 calls in a row, then its probes for 2 s (HTTP 401: Invalid API key: [REDACTED])" in err
    assert (
        "its key or the account is refused (revoked, out of credits, suspended), its model is gone, or" in err
    )
    # Said as it happens, while the user can still act (before, nothing until the grace's end).
    assert "warning: 8 judge calls in a row were refused (last: http_401); the re-scoring is paused" in err
    assert (
        "warning: the judge's endpoint refused the re-scoring's probe too (HTTP 401: Invalid API key: "
        "[REDACTED])" in err
    )
    assert key not in err
    assert judge.checks() == 2 and judge.prompt_calls() <= 5 + 8 + 2
    assert not (run_dir / "scores.judge.jsonl").exists()
    assert stats_of(run_dir) == before


def test_a_judge_that_refuses_many_samples_of_their_own_is_probed_each_time(tmp_path, capsys, monkeypatch):
    """A judge whose moderation refuses the samples it flags (403) while its probe is answered: each 8
    refusals in a row pause the re-scoring for a probe, and each probe answered lets it go on. Before,
    only the first pause was followed: the second probe's answer was never taken (nothing ticked the
    watch), its pause ran out on its own, and no later refusals were probed."""
    from helpers import OK_REPLY, ScriptedEndpoint

    monkeypatch.setattr(score, "JUDGE_GRACE_S", 5.0)
    verdict = {"role": "assistant", "content": '{"score": 1, "passed": true}'}

    def moderated(call: dict, calls: list[dict]):
        if call["check"]:
            return 200, OK_REPLY
        if "flagged" in json.dumps(call["body"]):
            return 403, {"error": {"message": "Your input was flagged by moderation", "code": 403}}
        return 200, {"choices": [{"index": 0, "finish_reason": "stop", "message": verdict}]}

    rows = [{"id": f"r{n}", "prompt": f"Grade flagged {n} [calls:0]", "rubric": "r"} for n in range(32)]
    rows += [{"id": f"s{n}", "prompt": f"Grade {n} [calls:0]", "rubric": "r"} for n in range(4)]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    run_dir = out / "run"
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-9876543210")
    with ScriptedEndpoint(moderated) as judge:
        argv = [str(run_dir), "--scorer=judge", "--judge_model=m", f"--judge_base_url={judge.base_url}"]
        code = score.main([*argv, "--concurrency=1"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert judge.checks() == 1 + 32 // 8  # the start check, and a probe after each 8 refusals
    assert err.count("judge calls in a row were refused") == err.count("answered the probe") == 1  # said once
    rescored = [json.loads(line) for line in (run_dir / "scores.judge.jsonl").read_text().splitlines()]
    assert len(rescored) == 36


def test_a_judge_that_restarts_mid_rescoring_is_waited_for(tmp_path, capsys, monkeypatch):
    """The dead-judge stop waits for the judge as a run waits for its endpoint: one restarted within the
    grace is probed back and the re-scoring goes on to its end (exit 0), the later samples judged."""
    import socket
    import threading

    monkeypatch.setattr(score, "JUDGE_GRACE_S", 30.0)
    verdict = '[verdict:{"score": 1, "passed": true}]'
    rows = [{"id": f"r{n}", "prompt": f"Grade {n} [calls:0] {verdict}", "rubric": "r"} for n in range(48)]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    run_dir = out / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def judge() -> subprocess.Popen:
        cmd = [sys.executable, "-m", "batchrun.fakes.fake_model", f"--port={port}", "--latency=0.3"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        return proc

    first = judge()
    argv = [
        str(run_dir),
        "--scorer=judge",
        "--judge_model=mock",
        f"--judge_base_url=http://127.0.0.1:{port}/v1",
    ]
    code: list[int] = []
    judging = threading.Thread(target=lambda: code.append(score.main([*argv, "--concurrency=4"])))
    judging.start()
    time.sleep(1.5)
    first.kill()
    first.wait()
    time.sleep(4)  # dead long enough for DEAD_AFTER failed attempts
    second = judge()
    try:
        judging.join(120)
    finally:
        second.kill()
        second.wait()
    assert code == [0], capsys.readouterr().err
    lines = read_jsonl(run_dir / "scores.judge.jsonl")
    assert len(lines) == 48
    assert all(line["score"]["passed"] is True for line in lines[-8:])


def test_a_judge_rescoring_waits_for_a_judge_loading_its_model(tmp_path, capsys, monkeypatch):
    """The judge's start check gave a judge still loading its model (503 'Loading model') no grace:
    started beside a llama-server, views.score exited 2 at once, where a run waits --endpoint_grace. It
    waits as a run does (120 s at most), then judges. The warning that it waits quotes the server's words,
    its key redacted (a server echoing the request's Authorization showed the key on the console)."""
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-loading-5150")
    rows = [{"id": f"r{n}", "prompt": f"Grade {n} [calls:0]", "rubric": "r"} for n in range(3)]
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", rows), out)
    judge = _HangingJudge(loading_s=2.0, hang=False)
    try:
        argv = [str(out / "run"), "--scorer=judge", "--judge_model=j", f"--judge_base_url={judge.base_url}"]
        assert score.main(argv) == 0, capsys.readouterr().err
    finally:
        judge.close()
    assert judge.loading_answers >= 1
    err = capsys.readouterr().err
    assert "is not ready" in err and "Loading model (request from Bearer [REDACTED])" in err
    assert "sk-judge-loading-5150" not in err
    lines = read_jsonl(out / "run" / "scores.judge.jsonl")
    assert [line["score"]["passed"] for line in lines] == [True, True, True]
