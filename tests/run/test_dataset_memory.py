"""What a dataset row and its jobs hold in memory: a run's end with 100,000 rows must stay under 200 MB
(issue 5), and the rows and the plan's jobs are held from the start to the end."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import sys
import tracemalloc

from batchrun.config import RunConfig
from batchrun.protocol import PromptJob, RowCheck, RowOptions
from batchrun.run.dataset import Row, load_dataset
from batchrun.run.plan import make_plan
from batchrun.run.resume import all_samples
from batchrun.secrets import Redactor


def test_rows_without_settings_of_their_own_share_one_options_object(tmp_path):
    """A RowOptions each took 104 bytes a row (10 MB of 100,000 rows); frozen and compared by value,
    one serves every row without settings, and a row's own settings are still its own."""
    path = tmp_path / "d.jsonl"
    lines = [
        {"prompt": "a"},
        {"prompt": "b", "max_turns": 3},
        {"prompt": "c", "system": "be brief"},
        {"prompt": "d"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    rows, _ = load_dataset(str(path), catalog={})
    shared = rows[0].options
    assert rows[3].options is shared and Row(0, "e", None, None, 0).options is shared
    assert shared == RowOptions() and hash(shared) == hash(RowOptions())
    assert rows[1].options == RowOptions(max_turns=3) and rows[2].options == RowOptions(system="be brief")


def test_a_row_has_no_dict_and_a_replaced_row_no_saved_key():
    """A row's __dict__ (and the saved key grown into it) took 28 MB of 100,000 rows, slots 17.6 MB. A
    row made from another by dataclasses.replace works out its own key, not the other's."""
    row = Row(3, "first words", None, "/w", 0)
    redact = Redactor(None)
    assert not hasattr(row, "__dict__")
    key = row.saved_key(redact)
    assert row.saved_key(redact) is key  # held: worked out once per redactor
    other = dataclasses.replace(row, prompt="other words")
    assert other.saved_key(redact) != key and other.saved_key(redact) == Row(
        3, "other words", None, "/w", 0
    ).saved_key(redact)
    assert dataclasses.replace(row) == row and dataclasses.replace(row).saved_key(redact) == key


def test_rows_hold_their_prompts_and_less_than_400_bytes_each(tmp_path):
    """The rows of 5,000 lines and their saved keys, measured: besides the prompt texts they held 500
    bytes a row (a __dict__, a RowOptions each), now 300 (the row's slots, the key's text and the tuple
    it is held in, the line number's int)."""
    n = 5_000
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Task {i}: " + "word " * 60}) + "\n" for i in range(n)))
    redact = Redactor("sk-x")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        rows, _ = load_dataset(str(path), catalog={})
        for row in rows:
            row.saved_key(redact)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    prompts = sum(sys.getsizeof(row.prompt) for row in rows)
    assert len(rows) == n
    assert (held - prompts) / n < 400, f"{(held - prompts) / n:.0f} bytes a row besides its prompt"


def test_a_rows_own_settings_and_check_have_no_dict_and_travel_whole():
    """A row's own RowOptions and its RowCheck are held as long as the row: without a __dict__, 72 bytes
    each, not 112. Pickled to a worker inside its job, and copied, they are the same values."""
    check = RowCheck(answer=("4", "four"), verify=("pytest -q",), verify_files=(("t.py", "x"),), rubric="r")
    options = RowOptions(toolsets=("file", "web"), tools=("a",), system="be brief", max_turns=3)
    job = PromptJob(0, 1, "p", ("web",), options=options, check=check)
    assert not hasattr(check, "__dict__") and not hasattr(options, "__dict__")
    for again in (pickle.loads(pickle.dumps(job)), copy.deepcopy(job)):
        assert again.options == options and hash(again.options) == hash(options)
        assert again.check == check and hash(again.check) == hash(check)
    assert dataclasses.replace(options, max_turns=4) == RowOptions(("file", "web"), ("a",), "be brief", 4)
    assert dataclasses.asdict(options)["system"] == "be brief" and RowCheck().is_empty()


def test_the_plans_jobs_share_their_toolsets_and_have_no_dict(tmp_path):
    """The plan holds a job for each sample for the whole run (41 MB of 100,000 jobs, now 19.5): its
    toolsets are a few combinations, one tuple each, and a job has no __dict__."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"task {i}"}) + "\n" for i in range(200)), encoding="utf-8")
    rows, _ = load_dataset(str(path))
    config = RunConfig.from_flags(
        dataset_file=str(path),
        batch_size=10,
        run_name="p",
        output_dir=str(tmp_path / "data"),
        distribution="balanced",
        seed=7,
    )
    jobs = [
        job for batch in make_plan(all_samples(rows, 2), config, tmp_path / "none").batches for job in batch
    ]
    assert len(jobs) == 400 and not hasattr(jobs[0], "__dict__")
    for name in ("toolsets", "toolsets_sampled"):
        values = [getattr(job, name) for job in jobs]
        assert 1 < len(set(values)) == len({id(v) for v in values}), name
