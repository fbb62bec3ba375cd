"""batchrun/identity.py: one RowIdentity for a dataset row, its job, its outcome and what a run saved."""

from __future__ import annotations

import hashlib
import json
import pickle

from helpers import read_jsonl, requests, run, write_rows

from batchrun.identity import RowIdentity, outcome_sample, record_sample, row_key
from batchrun.protocol import Outcome, PromptJob, RowOptions
from batchrun.run.dataset import Row
from batchrun.secrets import Redactor

SECRET = "id.secret.value.4242"


def _row(prompt: str, **kw) -> Row:
    return Row(
        index=0, prompt=prompt, image=kw.pop("image", None), cwd=kw.pop("cwd", None), occurrence=0, **kw
    )


def test_the_key_is_the_row_key_of_the_saved_fields():
    """Run directories written so far hold these keys: the type computes exactly the same hex."""
    plain = _row("same words")
    assert RowIdentity.of_row(plain, str).key == row_key("same words")
    opts = RowOptions(toolsets=("web", "file"), tools=("b", "a"), system="be brief", max_turns=3)
    row = _row("same words", image="img:1", cwd="/repo", options=opts)
    options = {
        "row_toolsets": ["file", "web"],
        "row_tools": ["a", "b"],
        "row_system_sha256": hashlib.sha256(b"be brief").hexdigest(),
        "row_max_turns": 3,
    }
    assert RowIdentity.of_row(row, str).key == row_key("same words", "img:1", "/repo", options)
    assert len({RowIdentity.of_row(r, str).key for r in (plain, row, _row("same words", cwd="/repo"))}) == 3


def test_a_row_and_its_saved_record_and_outcome_row_have_one_identity():
    opts = RowOptions(toolsets=("terminal",), max_turns=2)
    row = _row(f"note {SECRET}", cwd=f"/w/{SECRET}", options=opts)
    redact = Redactor(None, environ={"MY_TOKEN": SECRET}).sample
    saved = RowIdentity.of_row(row, redact)
    assert SECRET not in saved.text and SECRET not in (saved.cwd or "")
    record = {
        "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": saved.text}],
        # as records write them: "" for none, JSON text for the name lists
        "metadata": {
            "image": "",
            "cwd": saved.cwd,
            "row_toolsets": '["terminal"]',
            "row_tools": "",
            "row_system_sha256": "",
            "row_max_turns": 2,
            "sample_index": 1,
        },
    }
    assert RowIdentity.of_record(record) == saved
    assert record_sample(record) == (saved.key, 1)
    outcome_row = {"prompt": saved.text, **saved.fields(), "sample_index": 1}
    assert RowIdentity.of_outcome_row(outcome_row) == saved
    assert outcome_sample(outcome_row) == (saved.key, 1)


def test_a_saved_key_is_read_back_when_it_has_a_keys_form():
    record = {"conversations": [{"from": "human", "value": "hello"}], "metadata": {}}
    computed = row_key("hello")
    assert RowIdentity.of_record(record).key == computed
    stored = "0123456789abcdef" * 2
    for value, expected in [
        (stored, stored),
        ("", computed),
        ("ABC", computed),
        (stored.upper(), computed),
        (None, computed),
        (12, computed),
        (stored + "0", computed),
    ]:
        record["metadata"]["row_key"] = value
        assert RowIdentity.of_record(record).key == expected, value
    # the saved key names the same identity: equality is by the fields
    record["metadata"]["row_key"] = stored
    assert RowIdentity.of_record(record) == RowIdentity("hello")


def test_an_outcome_carries_its_jobs_identity_and_row_id_across_a_pickle():
    job = PromptJob(
        0,
        3,
        "task",
        ("terminal",),
        cwd="/r",
        row_id="row-7",
        options=RowOptions(system="sys"),
        sample_index=2,
    )
    outcome = pickle.loads(pickle.dumps(Outcome.failed(job, "tools", "broken")))
    assert outcome.identity == RowIdentity.of_job(job)
    assert (outcome.prompt, outcome.cwd, outcome.image, outcome.row_id, outcome.sample_index) == (
        "task",
        "/r",
        None,
        "row-7",
        2,
    )
    assert outcome.identity.system_sha256 == hashlib.sha256(b"sys").hexdigest()


def test_every_saved_key_is_the_one_readers_compute(server, tmp_path, monkeypatch):
    """metadata.row_key (and row_key of failed/discarded rows) is computed from the identity as saved,
    after redaction: reading it back gives what computing it from the saved fields gives."""
    monkeypatch.setenv("DATASET_SECRET", SECRET)
    repo = tmp_path / "repo"
    repo.mkdir()
    rows = [
        {"prompt": "plain [calls:0]"},
        {"prompt": "own settings [calls:0]", "toolsets": ["terminal"], "max_turns": 4, "cwd": str(repo)},
        {"prompt": f"keep {SECRET} safe"},  # a secret in the prompt: discarded, redacted
        {"prompt": "terse [no_reasoning]"},
        {"prompt": "down [error:500]"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run(server, dataset, out)
    run_dir = out / "run"
    records = read_jsonl(run_dir / "trajectories.jsonl")
    discards = read_jsonl(run_dir / "discarded.jsonl")
    failed = read_jsonl(run_dir / "failed.jsonl")
    assert len(records) == 2 and len(discards) == 2 and len(failed) == 1
    for rec in records + [d["record"] for d in discards]:
        stored = rec["metadata"]["row_key"]
        bare = {**rec, "metadata": {**rec["metadata"], "row_key": ""}}
        assert stored == RowIdentity.of_record(bare).key
    for row in discards + failed:
        assert row["row_key"] == RowIdentity.of_outcome_row({**row, "row_key": None}).key
    assert SECRET not in json.dumps(discards)


def test_resume_finds_a_record_by_its_saved_key(server, tmp_path):
    """A record whose saved key names its row is finished, whatever its saved text says."""
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": "alpha [calls:0]"}, {"prompt": "beta [calls:0]"}])
    out = tmp_path / "data"
    run(server, dataset, out)
    batch = out / "run" / "batch_0.jsonl"
    recs = read_jsonl(batch)
    for rec in recs:  # the saved text no longer names the row; the saved key still does
        for turn in rec["conversations"]:
            if turn["from"] == "human":
                turn["value"] = "edited by hand"
    batch.write_text("".join(json.dumps(r) + "\n" for r in recs), "utf-8")
    before = requests(server)
    run(server, dataset, out, resume=True)
    assert requests(server) == before  # nothing ran again


def test_stop_after_passes_finds_earlier_passes_of_a_row_holding_scaffolding_text(server, tmp_path):
    """The run's passes and the earlier runs' are keyed by one identity (secrets redacted, scaffolding
    kept, as the saved text is): a row whose prompt quotes the ephemeral system prompt keeps its pass."""
    scaffold = "Always answer in one short sentence, please."
    rows = [{"prompt": f"Easy one [answer:1] [calls:0] ({scaffold})", "answer": 1}]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    flags = dict(ephemeral_system_prompt=scaffold, stop_after_passes=1, scorer="includes")
    run(server, dataset, out, samples_per_prompt=1, **flags)
    assert requests(server) == {rows[0]["prompt"]: 1}
    run(server, dataset, out, resume=True, samples_per_prompt=4, **flags)
    assert requests(server) == {rows[0]["prompt"]: 1}  # the earlier pass counts: samples 1-3 skipped
    skipped = [
        r for r in read_jsonl(out / "run" / "discarded.jsonl") if r["reason"] == "skipped_after_passes"
    ]
    assert sorted(r["sample_index"] for r in skipped) == [1, 2, 3]


def test_a_rows_saved_key_is_its_identitys_held_per_redactor_and_never_pickled():
    """Resume, merge and statistics ask each row's saved key several times: worked out once per
    redactor and held on the row, it is what RowIdentity.of_row gives, and a pickled or copied row
    carries no redactor (its secrets) along."""
    import copy

    secret = "sk-held-secret-0123456789"
    row = Row(3, f"use {secret} here", "img:1", "/w", 0, options=RowOptions(toolsets=("web", "file")))
    first, other = Redactor(secret), Redactor(None)
    assert row.saved_key(first.sample) == RowIdentity.of_row(row, first.sample).key
    assert row.saved_key(other.sample) == RowIdentity.of_row(row, other.sample).key
    assert row.saved_key(first.sample) != row.saved_key(other.sample)  # the secret is redacted in one only
    assert row.saved_key(first.sample) == RowIdentity.of_row(row, first.sample).key
    for again in (pickle.loads(pickle.dumps(row)), copy.deepcopy(row), copy.copy(row)):
        assert again == row and hash(again) == hash(row)
        assert getattr(again, "_saved_key", None) is None  # no key held: nor the redactor it came from
        assert again.saved_key(other.sample) == row.saved_key(other.sample)
    assert secret.encode() not in pickle.dumps(row).replace(secret.encode(), b"", 1)
