"""Tests of the toolset distributions: the documented table, sampling, seeding and validation."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest

import batchrun.distributions as td
from batchrun.distributions import (
    DISTRIBUTIONS,
    Distribution,
    format_distributions,
    get_distribution,
    list_distributions,
    prompt_rng,
    sample_toolsets_from_distribution,
    validate_distribution,
)

ROOT = Path(__file__).resolve().parents[1]

# Written out independently of the module: this is the users' documented interface.
EXPECTED = {
    "default": [
        ("web", 100),
        ("vision", 100),
        ("image_gen", 100),
        ("terminal", 100),
        ("file", 100),
        ("moa", 100),
        ("browser", 100),
    ],
    "image_gen": [("image_gen", 90), ("vision", 90), ("web", 55), ("terminal", 45), ("moa", 10)],
    "research": [("web", 90), ("browser", 70), ("vision", 50), ("moa", 40), ("terminal", 10)],
    "science": [
        ("web", 94),
        ("terminal", 94),
        ("file", 94),
        ("vision", 65),
        ("browser", 50),
        ("image_gen", 15),
        ("moa", 10),
    ],
    "development": [("terminal", 80), ("file", 80), ("moa", 60), ("web", 30), ("vision", 10)],
    "safe": [("web", 80), ("browser", 70), ("vision", 60), ("image_gen", 60), ("moa", 50)],
    "balanced": [
        ("web", 50),
        ("vision", 50),
        ("image_gen", 50),
        ("terminal", 50),
        ("file", 50),
        ("moa", 50),
        ("browser", 50),
    ],
    "minimal": [("web", 100)],
    "terminal_only": [("terminal", 100), ("file", 100)],
    "terminal_web": [("terminal", 100), ("file", 100), ("web", 100)],
    "creative": [("image_gen", 90), ("vision", 90), ("web", 30)],
    "reasoning": [("moa", 90), ("web", 30), ("terminal", 20)],
    "browser_use": [("browser", 100), ("web", 80), ("vision", 70)],
    "browser_only": [("browser", 100)],
    "browser_tasks": [("browser", 97), ("vision", 12), ("terminal", 15)],
    "terminal_tasks": [
        ("terminal", 97),
        ("file", 97),
        ("web", 97),
        ("browser", 75),
        ("vision", 50),
        ("image_gen", 10),
    ],
    "mixed_tasks": [
        ("browser", 92),
        ("terminal", 92),
        ("file", 92),
        ("web", 35),
        ("vision", 15),
        ("image_gen", 15),
    ],
}


class ConstantRng(random.Random):
    """A stand-in rng whose every draw is the same value, counting the draws."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value
        self.draws = 0

    def random(self) -> float:
        self.draws += 1
        return self.value


# --- the table ---------------------------------------------------------------------------


def test_all_seventeen_distributions_in_documented_order():
    assert list(DISTRIBUTIONS) == list(EXPECTED)
    assert len(DISTRIBUTIONS) == 17


@pytest.mark.parametrize("name", list(EXPECTED))
def test_probabilities_are_exactly_the_documented_ones(name):
    dist = get_distribution(name)
    assert dist.name == name
    assert list(dist.probabilities.items()) == EXPECTED[name]
    assert dist.description.strip()


def test_safe_never_offers_a_shell():
    assert "terminal" not in get_distribution("safe").probabilities


def test_distributions_are_immutable():
    dist = get_distribution("research")
    with pytest.raises(TypeError):
        dist.probabilities["terminal"] = 100  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        dist.name = "other"  # type: ignore[misc]


def test_list_distributions_is_a_copy_of_the_table():
    listed = list_distributions()
    assert listed == DISTRIBUTIONS
    listed.pop("default")
    assert "default" in DISTRIBUTIONS


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as excinfo:
        get_distribution("nope")
    message = str(excinfo.value)
    assert "'nope'" in message
    for name in EXPECTED:
        assert name in message


def test_sampling_an_unknown_name_fails_the_same_way():
    with pytest.raises(ValueError, match="valid names"):
        sample_toolsets_from_distribution("nope", random.Random(0))


# --- sampling ----------------------------------------------------------------------------


def _expected_inclusion(probabilities: dict[str, int]) -> dict[str, float]:
    """Exact inclusion rate: the coin's probability, plus the fallback for the most probable toolset."""
    rates = {toolset: percent / 100 for toolset, percent in probabilities.items()}
    all_fail = 1.0
    for rate in rates.values():
        all_fail *= 1 - rate
    fallback = max(probabilities, key=probabilities.__getitem__)
    rates[fallback] += all_fail
    return rates


@pytest.mark.parametrize("name", ["balanced", "research", "image_gen"])
def test_inclusion_frequency_matches_probability(name):
    draws = 20_000
    rng = random.Random(12345)
    counts = {toolset: 0 for toolset, _ in EXPECTED[name]}
    for _ in range(draws):
        chosen = sample_toolsets_from_distribution(name, rng)
        assert chosen, "every prompt gets at least one toolset"
        for toolset in chosen:
            counts[toolset] += 1
    expected = _expected_inclusion(dict(EXPECTED[name]))
    for toolset, count in counts.items():
        assert abs(count / draws - expected[toolset]) <= 0.02, (toolset, count / draws, expected[toolset])


def test_result_keeps_the_distribution_order():
    rng = random.Random(7)
    for _ in range(200):
        chosen = sample_toolsets_from_distribution("balanced", rng)
        order = [toolset for toolset, _ in EXPECTED["balanced"]]
        assert chosen == [toolset for toolset in order if toolset in chosen]


def test_full_probability_always_included():
    rng = random.Random(3)
    all_toolsets = [toolset for toolset, _ in EXPECTED["default"]]
    for _ in range(100):
        assert sample_toolsets_from_distribution("default", rng) == all_toolsets
        assert "browser" in sample_toolsets_from_distribution("browser_use", rng)


def test_one_draw_per_toolset():
    rng = ConstantRng(0.0)
    assert sample_toolsets_from_distribution("science", rng) == [t for t, _ in EXPECTED["science"]]
    assert rng.draws == len(EXPECTED["science"])


def test_fallback_picks_the_most_probable_toolset():
    rng = ConstantRng(0.999)  # every coin below 100% fails
    assert sample_toolsets_from_distribution("research", rng) == ["web"]
    assert sample_toolsets_from_distribution("reasoning", rng) == ["moa"]
    assert sample_toolsets_from_distribution("browser_tasks", rng) == ["browser"]


def test_fallback_breaks_ties_by_order():
    rng = ConstantRng(0.999)
    assert sample_toolsets_from_distribution("balanced", rng) == ["web"]
    assert sample_toolsets_from_distribution("mixed_tasks", rng) == ["browser"]


def test_fallback_with_made_up_low_probabilities(monkeypatch):
    made_up = Distribution("rare", "test only", MappingProxyType({"vision": 5, "moa": 20, "terminal": 20}))
    monkeypatch.setitem(td.DISTRIBUTIONS, "rare", made_up)
    assert sample_toolsets_from_distribution("rare", ConstantRng(0.999)) == ["moa"]
    rng = random.Random(99)
    draws = 5_000
    outcomes = [sample_toolsets_from_distribution("rare", rng) for _ in range(draws)]
    assert all(outcomes)
    # moa alone = all three coins fail (.95*.8*.8) or only moa's comes up (.95*.2*.8).
    moa_alone = sum(chosen == ["moa"] for chosen in outcomes) / draws
    assert abs(moa_alone - 0.76) <= 0.03
    assert ["terminal"] in outcomes  # the tied terminal never gets the fallback, but can win its coin


# --- seeding -----------------------------------------------------------------------------

PROMPTS = [f"prompt number {i}" for i in range(60)]


def _assignments(seed: int, name: str = "research") -> list[list[str]]:
    return [sample_toolsets_from_distribution(name, prompt_rng(seed, p)) for p in PROMPTS]


def test_same_seed_and_prompt_give_same_toolsets():
    assert _assignments(42) == _assignments(42)
    # Order of processing does not matter: each prompt has its own rng.
    reversed_run = [
        sample_toolsets_from_distribution("research", prompt_rng(42, p)) for p in reversed(PROMPTS)
    ]
    assert reversed_run[::-1] == _assignments(42)


def test_different_seeds_give_different_toolsets():
    assert _assignments(1) != _assignments(2)


def test_occurrence_separates_duplicate_prompts():
    first = [prompt_rng(5, "same text", 0).random() for _ in range(3)]
    again = [prompt_rng(5, "same text", 0).random() for _ in range(3)]
    second = [prompt_rng(5, "same text", 1).random() for _ in range(3)]
    assert first == again
    assert first != second


def test_prompt_rng_independent_of_pythonhashseed():
    code = "from toolset_distributions import prompt_rng; print(prompt_rng(7, 'héllo').random())"
    outputs = set()
    for hashseed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout.strip())
    assert outputs == {repr(prompt_rng(7, "héllo").random())}


# --- validation --------------------------------------------------------------------------


def _dist(probabilities: dict, name: str = "broken", description: str = "a bad one") -> Distribution:
    return Distribution(name, description, MappingProxyType(probabilities))


@pytest.mark.parametrize(
    "probabilities, fragment",
    [
        ({"web": 50, "teleport": 50}, "teleport"),
        ({"web": 0}, "'web'"),
        ({"web": -5}, "'web'"),
        ({"web": 101}, "'web'"),
        ({"web": 50.5}, "'web'"),
        ({"web": True}, "'web'"),
        ({}, "no toolset"),
    ],
)
def test_validator_rejects_bad_probabilities(probabilities, fragment):
    with pytest.raises(ValueError) as excinfo:
        validate_distribution(_dist(probabilities))
    message = str(excinfo.value)
    assert "'broken'" in message
    assert "probabilities" in message
    assert fragment in message


def test_validator_rejects_empty_description():
    with pytest.raises(ValueError, match=r"'broken'.*description"):
        validate_distribution(_dist({"web": 50}, description="  "))


def test_validator_accepts_edges_and_every_shipped_entry():
    validate_distribution(_dist({"web": 1, "browser": 100}))
    for dist in DISTRIBUTIONS.values():
        validate_distribution(dist)


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match=r"'twice'.*name"):
        td._build((_dist({"web": 50}, name="twice"), _dist({"moa": 50}, name="twice")))


# --- listing -----------------------------------------------------------------------------


def test_format_lists_every_name_description_and_probability():
    text = format_distributions()
    assert text.isascii()
    for name, entries in EXPECTED.items():
        dist = get_distribution(name)
        assert f"{name}: {dist.description}" in text
        for toolset, percent in entries:
            assert toolset in text
            assert f"{percent}%" in text


def test_format_sorts_each_distribution_by_probability():
    blocks = format_distributions().strip().split("\n\n")
    assert len(blocks) == 17
    browser_tasks = next(block for block in blocks if block.startswith("browser_tasks:"))
    rows = [line.split() for line in browser_tasks.splitlines()[1:]]
    assert rows == [["browser", "97%"], ["terminal", "15%"], ["vision", "12%"]]


# --- --distribution_file -------------------------------------------------------------------


def _file(tmp_path: Path, text: str, name: str = "dists.json") -> str:
    path = tmp_path / name
    path.write_text(text, "utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            '{"mine": {"probabilities": {"nope": 50}}}',
            "distribution 'mine': field 'probabilities' names unknown toolset 'nope'",
        ),
        (
            '{"mine": {"probabilities": {"web": 150}}}',
            "distribution 'mine': field 'probabilities' gives 'web' 150",
        ),
        ('{"mine": {"probabilities": {"web": 0}}}', "gives 'web' 0; expected an integer percent in 1..100"),
        ('{"mine": {"probabilities": {"web": 12.5}}}', "gives 'web' 12.5"),
        ('{"mine": {"probabilities": {}}}', "field 'probabilities' names no toolset"),
        (
            '{"mine": {"probabilities": {"web": 50}, "weights": 1}}',
            "distribution 'mine': unknown field 'weights'",
        ),
        ('{"default": {"probabilities": {"web": 50}}}', "distribution 'default': the name is a built-in"),
        ('{"mine": {"description": 3, "probabilities": {"web": 50}}}', "field 'description' must be text"),
        ('["web"]', "expected an object of named distributions"),
        ("{not json", "not valid JSON"),
    ],
)
def test_distribution_file_errors_name_the_file_and_field(tmp_path, text, fragment):
    path = _file(tmp_path, text)
    with pytest.raises(ValueError) as info:
        td.load_distribution_file(path, td.TOOLSETS)
    assert str(info.value).startswith(f"{path}: ")
    assert fragment in str(info.value)


def test_distribution_file_entries_are_usable_by_name_then_forgotten(tmp_path):
    yaml = pytest.importorskip("yaml")
    assert yaml
    text = "mine:\n  description: Mostly files.\n  probabilities: {file: 90, extra: 40}\n"
    table = td.load_distribution_file(_file(tmp_path, text, "d.yaml"), [*td.TOOLSETS, "extra"])
    td.use_file_distributions(table)
    try:
        assert get_distribution("mine").probabilities == {"file": 90, "extra": 40}
        assert list(td.list_distributions())[-1] == "mine"
        assert "mine: Mostly files.\n  file    90%\n  extra   40%\n" in format_distributions()
        assert sample_toolsets_from_distribution("mine", random.Random(1)) in (
            ["file"],
            ["file", "extra"],
            ["extra"],
        )
    finally:
        td.use_file_distributions({})
    with pytest.raises(ValueError, match="unknown toolset distribution 'mine'"):
        get_distribution("mine")
