"""Every view's command line reads flags as strictly as the runner's: named in full, given once."""

from __future__ import annotations

import pytest

from batchrun.views import compare, export, report, score, status

# (view's main, its positional arguments, an abbreviation argparse read as a flag, a flag given twice)
CASES = [
    (compare.main, ["a", "b"], ["--boot=200"], ["--bootstrap=200", "--bootstrap=300"], "--bootstrap"),
    (
        export.main,
        ["a", "--format=messages", "--out=x"],
        ["--min=0.5"],
        ["--seed=1", "--seed", "2"],
        "--seed",
    ),
    (
        report.main,
        ["a"],
        ["--max_trajectorie=5"],
        ["--max_trajectories=5", "--max-trajectories=6"],
        "--max-trajectories",
    ),
    (score.main, ["a"], ["--scorer=exact", "--nam=x"], ["--scorer=exact", "--scorer=includes"], "--scorer"),
    (status.main, ["a"], ["--wat=5"], ["--json", "--json"], "--json"),
]


@pytest.mark.parametrize(("main", "positional", "abbreviated", "twice", "flag"), CASES)
def test_a_view_refuses_an_abbreviated_flag_and_a_flag_given_twice(
    main, positional, abbreviated, twice, flag, capsys
):
    # argparse read --boot=200 as --bootstrap=200 and --min=0.5 as --min_score=0.5, and let the last of
    # two --bootstrap win: the runner refuses both.
    with pytest.raises(SystemExit) as exc:
        main([*positional, *abbreviated])
    assert exc.value.code == 2
    assert f"unrecognized arguments: {abbreviated[-1]}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([*positional, *twice])
    assert exc.value.code == 2
    assert f"error: {flag} is given more than once" in capsys.readouterr().err


def test_both_spellings_of_one_flag_are_one_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        export.main(["a", "--format=messages", "--out=x", "--include_partial", "--no-include_partial"])
    assert exc.value.code == 2
    assert "(as --include_partial and --no-include_partial)" in capsys.readouterr().err


def test_a_flag_s_text_after_the_end_of_flags_is_no_repeat(tmp_path, capsys):
    # After "--" every word is positional: a run directory named like a flag is no second flag.
    assert report.main(["--max_trajectories=1", "--", str(tmp_path / "--max_trajectories=2")]) == 2
    assert "given more than once" not in capsys.readouterr().err


def test_compare_out_through_a_symlink_loop_is_refused_not_a_traceback(tmp_path):
    from batchrun.views import compare

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    problem = compare.out_problem(tmp_path / "a")
    assert problem is not None and problem.startswith(f"--out {tmp_path / 'a'}: cannot follow it")
