"""batchrun/run/plan.py: each row's toolsets, sampled reproducibly."""

from __future__ import annotations

import collections
import json

from helpers import offered_in_system, read_jsonl, run, write_jsonl

from batchrun.prompt.tools.catalog import tools_for_toolsets
from toolset_distributions import prompt_rng, sample_toolsets_from_distribution


def test_same_seed_gives_each_prompt_the_same_toolsets(server, tmp_path):
    prompts = [f"sampled prompt {i} [calls:0]" for i in range(10)] + ["sampled prompt 0 [calls:0]"]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "data"
    run(server, dataset, out, run_name="first", distribution="balanced", seed=7)
    run(server, dataset, out, run_name="second", distribution="balanced", seed=7)
    first = read_jsonl(out / "first" / "trajectories.jsonl")
    second = read_jsonl(out / "second" / "trajectories.jsonl")
    key = lambda r: r["prompt_index"]  # noqa: E731
    assert [r["toolsets_used"] for r in sorted(first, key=key)] == [
        r["toolsets_used"] for r in sorted(second, key=key)
    ]
    occurrences: collections.Counter[str] = collections.Counter()
    kept: set[str] = set()
    not_offered: set[str] = set()
    for rec in sorted(first, key=key):
        prompt = prompts[rec["prompt_index"]]
        sampled = sample_toolsets_from_distribution("balanced", prompt_rng(7, prompt, occurrences[prompt]))
        occurrences[prompt] += 1
        used = rec["toolsets_used"]
        # toolsets_used: the sampled toolsets this installation can offer, in sampled order
        assert used == [t for t in sampled if t in used]
        kept.update(used)
        not_offered.update(set(sampled) - set(used))
        offered = [t["name"] for t in offered_in_system(rec["conversations"][0]["value"])]
        assert offered == [t.name for t in tools_for_toolsets(used)]
    assert not kept & not_offered  # a toolset is either available to every prompt or to none
    assert {"terminal", "file"} & kept and not {"terminal", "file"} & not_offered
    assert len({tuple(r["toolsets_used"]) for r in first}) > 1  # the coins really vary by prompt
    stats = json.loads((out / "first" / "statistics.json").read_text("utf-8"))
    offered_counts = collections.Counter(t for r in first for t in r["toolsets_used"])
    assert stats["this_run"]["toolsets_offered"] == dict(offered_counts)


def test_a_different_seed_changes_the_draws():
    prompts = [f"sampled prompt {i} [calls:0]" for i in range(10)]
    draws = {
        seed: [sample_toolsets_from_distribution("balanced", prompt_rng(seed, p)) for p in prompts]
        for seed in (7, 8)
    }
    assert draws[7] != draws[8]


def test_a_distribution_that_may_draw_a_toolset_without_its_extra_is_refused_with_the_pip_line(
    server, tmp_path, monkeypatch, capsys
):
    import pytest

    from batchrun.prompt.tools import config as tool_config

    # The light core: the browser extra's module is missing (a name no installation has).
    monkeypatch.setitem(tool_config.TOOLSET_EXTRAS, "browser", ("browser", ("no_such_module_of_the_test",)))
    dataset = write_jsonl(tmp_path / "d.jsonl", ["a prompt [calls:0]"])
    with pytest.raises(SystemExit) as exc:
        run(server, dataset, tmp_path / "data", distribution="browser_only")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "browser" in err and "pip install 'batch-runner[browser]'" in err
    assert sum(server.stats()["requests_by_prompt"].values()) == 0


def test_a_row_asking_for_a_toolset_without_its_extra_fails_naming_the_pip_line(
    server, tmp_path, monkeypatch
):
    from batchrun.prompt.tools import config as tool_config

    monkeypatch.setitem(tool_config.TOOLSET_EXTRAS, "browser", ("browser", ("no_such_module_of_the_test",)))
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({"prompt": "browse [calls:0]", "toolsets": ["browser"]}) + "\n", "utf-8")
    run(server, dataset, tmp_path / "data")
    failed = read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")
    assert len(failed) == 1 and "pip install 'batch-runner[browser]'" in failed[0]["error"]
    assert sum(server.stats()["requests_by_prompt"].values()) == 0
