"""A dataset row's own toolsets, tools, system prompt and max_turns: what the endpoint was offered, what
the record says, bad rows by line number, rows asking for what this run does not have."""

from __future__ import annotations

import hashlib
import json

import pytest
from helpers import by_prompt, read_jsonl, run, stats_of, write_rows

from batchrun.fakes.fake_model import find_prompt
from batchrun.identity import row_key
from batchrun.protocol import RowOptions
from batchrun.record import identity_options
from batchrun.run.dataset import load_dataset
from batchrun.sharegpt import split_system_value
from batchrun.views.export import to_openai_messages

SEARCH_VARS = ("WEB_SEARCH_PROVIDER", "TAVILY_API_KEY", "BRAVE_API_KEY", "EXA_API_KEY", "FIRECRAWL_API_KEY")


def _requests_by_prompt(server) -> dict[str, list[dict]]:
    """Every chat request the fake endpoint received, by the prompt it was for, in order."""
    out: dict[str, list[dict]] = {}
    for body in server.stats()["last_requests"]:
        out.setdefault(find_prompt(body["messages"])[1], []).append(body)
    return out


def _offered(body: dict) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools") or []]


def _system(body: dict) -> str | None:
    first = body["messages"][0]
    return first["content"] if first["role"] == "system" else None


def test_each_row_is_offered_what_it_asked_for_and_the_record_says_so(server, tmp_path):
    rows = [
        {"prompt": "own toolsets", "toolsets": ["file"], "id": 1},
        {"prompt": "tools only", "tools": ["terminal"], "answer": "x"},
        {"prompt": "both", "toolsets": ["terminal", "file"], "tools": ["read_file", "terminal"]},
        {"prompt": "own system", "system": "You are terse.\nAnswer in one line."},
        {"prompt": "one turn", "max_turns": 1},
        {"prompt": "no tools at all", "toolsets": []},
        {"prompt": "from the distribution"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run(server, dataset, out, ephemeral_system_prompt="EPHEMERAL-INSTRUCTIONS-123", max_turns=5)

    sent = _requests_by_prompt(server)
    terminal_only = ["terminal", "process", "read_file", "write_file", "patch", "search_files"]
    file_tools = ["read_file", "write_file", "patch", "search_files"]
    # What the endpoint was offered, request by request.
    assert {tuple(_offered(b)) for b in sent["own toolsets"]} == {tuple(file_tools)}
    assert {tuple(_offered(b)) for b in sent["tools only"]} == {("terminal",)}
    assert {tuple(_offered(b)) for b in sent["both"]} == {("terminal", "read_file")}
    assert {tuple(_offered(b)) for b in sent["no tools at all"]} == {()}
    assert {tuple(_offered(b)) for b in sent["from the distribution"]} == {tuple(terminal_only)}
    # One system message: the row's own, then the ephemeral one; other rows get the ephemeral one alone.
    assert {_system(b) for b in sent["own system"]} == {
        "You are terse.\nAnswer in one line.\n\nEPHEMERAL-INSTRUCTIONS-123"
    }
    assert {_system(b) for b in sent["both"]} == {"EPHEMERAL-INSTRUCTIONS-123"}
    assert len(sent["one turn"]) == 1  # the fake's plan with tools takes three calls
    assert len(sent["own toolsets"]) == 3

    run_dir = out / "run"
    recs = {p: r for p, (r,) in by_prompt(read_jsonl(run_dir / "trajectories.jsonl")).items()}
    assert set(recs) == {r["prompt"] for r in rows}

    meta = {p: r["metadata"] for p, r in recs.items()}
    # Written with their types (JSON text of the sorted names, "" and 0 for none); read back as lists and None.
    own = {p: identity_options(m) for p, m in meta.items()}
    assert meta["own toolsets"]["row_toolsets"] == '["file"]' and meta["own toolsets"]["row_tools"] == ""
    assert own["own toolsets"]["row_toolsets"] == ["file"] and own["own toolsets"]["row_tools"] is None
    assert recs["own toolsets"]["toolsets_used"] == ["file"]
    assert meta["own toolsets"]["tools_offered"] == file_tools
    assert own["tools only"]["row_tools"] == ["terminal"] and own["tools only"]["row_toolsets"] is None
    assert recs["tools only"]["toolsets_used"] == ["terminal"]
    assert own["both"]["row_toolsets"] == ["file", "terminal"]
    assert own["both"]["row_tools"] == ["read_file", "terminal"]
    assert meta["both"]["tools_offered"] == ["terminal", "read_file"]
    assert own["no tools at all"]["row_toolsets"] == [] and meta["no tools at all"]["tools_offered"] == []
    # Nothing was drawn for rows with their own toolsets or tools (they hold what they were given);
    # the distribution row drew.
    assert all(
        meta[p]["toolsets_sampled"] == recs[p]["toolsets_used"]
        for p in ("own toolsets", "tools only", "both")
    )
    assert meta["from the distribution"]["toolsets_sampled"] == ["terminal", "file"]
    assert all(
        own["from the distribution"][k] is None for k in ("row_toolsets", "row_tools", "row_max_turns")
    )

    # The row's system prompt is saved at the start of the system entry; the ephemeral one nowhere.
    system_entry = recs["own system"]["conversations"][0]["value"]
    assert system_entry.startswith("You are terse.\nAnswer in one line.\n\n")
    assert split_system_value(system_entry) == "You are terse.\nAnswer in one line."
    assert split_system_value(recs["both"]["conversations"][0]["value"]) is None
    digest = hashlib.sha256(b"You are terse.\nAnswer in one line.").hexdigest()
    assert meta["own system"]["row_system_sha256"] == digest
    assert all(meta[p]["row_system_sha256"] == "" for p in recs if p != "own system")
    exported = to_openai_messages(recs["own system"]["conversations"])
    assert exported[0] == {"role": "system", "content": "You are terse.\nAnswer in one line."}
    assert to_openai_messages(recs["both"]["conversations"])[0]["role"] == "user"
    for path in run_dir.iterdir():
        if path.is_file():
            assert b"EPHEMERAL-INSTRUCTIONS-123" not in path.read_bytes(), path.name

    # max_turns: the row's own limit, recorded beside the run's.
    assert recs["one turn"]["api_calls"] == 1 and meta["one turn"]["stop_reason"] == "max_turns"
    assert meta["one turn"]["row_max_turns"] == 1 and meta["one turn"]["max_turns"] == 1
    assert meta["own toolsets"]["row_max_turns"] == 0 and meta["own toolsets"]["max_turns"] == 5

    # The settings have fields of their own, not copies in row_fields.
    assert json.loads(meta["own toolsets"]["row_fields"]) == {"id": 1}
    assert json.loads(meta["tools only"]["row_fields"]) == {"answer": "x"}
    assert meta["both"]["row_fields"] == "{}" and meta["own system"]["row_fields"] == "{}"
    assert all(m["sample_index"] == 0 for m in meta.values())


BAD_ROWS = [
    ({"prompt": "a", "toolsets": ["webz"]}, "field 'toolsets' names unknown toolset 'webz'"),
    ({"prompt": "b", "toolsets": "terminal"}, "field 'toolsets' must be a list of names"),
    ({"prompt": "c", "tools": ["teleport"]}, "field 'tools' names unknown tool 'teleport'"),
    ({"prompt": "d", "tools": ["terminal", 3]}, "field 'tools' must be a list of names"),
    (
        {"prompt": "e", "toolsets": ["file"], "tools": ["terminal"]},
        "field 'tools' names 'terminal', which none of the row's toolsets (file) offers",
    ),
    ({"prompt": "f", "system": ""}, "field 'system' must be a non-empty string"),
    ({"prompt": "g", "system": ["x"]}, "field 'system' must be a non-empty string"),
    ({"prompt": "h", "max_turns": 0}, "field 'max_turns' must be a positive integer"),
    ({"prompt": "i", "max_turns": True}, "field 'max_turns' must be a positive integer"),
    ({"prompt": "j", "max_turns": 2.5}, "field 'max_turns' must be a positive integer"),
    ({"prompt": "k", "samples": -1}, "field 'samples' must be a positive integer"),
]


def test_bad_row_settings_are_bad_lines_with_their_line_number_and_the_run_goes_on(server, tmp_path, capsys):
    rows = [
        {"prompt": "good one", "toolsets": ["terminal"]},
        *[r for r, _ in BAD_ROWS],
        {"prompt": "good two"},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run(server, dataset, out)
    err = capsys.readouterr().err
    for line_no, (_, message) in enumerate(BAD_ROWS, start=2):
        assert f"{dataset}:{line_no}: {message}" in err
    recs = read_jsonl(out / "run" / "trajectories.jsonl")
    assert sorted(r["conversations"][1]["value"] for r in recs) == ["good one", "good two"]
    assert stats_of(out / "run")["this_run"]["bad_dataset_lines"] == len(BAD_ROWS)


def test_rows_are_checked_against_the_registry_names_given(tmp_path):
    """The known names come from the catalog the caller passes (the registry's, plugins included)."""
    dataset = write_rows(
        tmp_path / "d.jsonl",
        [
            {"prompt": "x", "toolsets": ["mytools"], "tools": ["my_tool"]},
            {"prompt": "y", "tools": ["terminal"]},
        ],
    )
    rows, problems = load_dataset(str(dataset), catalog={"my_tool": ("mytools",)})
    assert [r.options for r in rows] == [RowOptions(toolsets=("mytools",), tools=("my_tool",))]
    assert problems == [f"{dataset}:2: field 'tools' names unknown tool 'terminal' (known: my_tool)"]


def test_a_row_asking_for_a_toolset_this_run_lacks_fails_at_start_without_a_model_call(
    server, tmp_path, monkeypatch
):
    for var in SEARCH_VARS:
        monkeypatch.delenv(var, raising=False)
    rows = [
        {"prompt": "needs search", "toolsets": ["web", "terminal"]},
        {"prompt": "needs web_search", "tools": ["web_search"]},
        {"prompt": "fine", "toolsets": ["terminal"]},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run(server, dataset, out)
    assert set(server.stats()["requests_by_prompt"]) == {"fine"}
    failed = {f["prompt"]: f for f in read_jsonl(out / "run" / "failed.jsonl")}
    assert set(failed) == {"needs search", "needs web_search"}
    assert all(f["error_class"] == "preflight" for f in failed.values())
    assert "toolset 'web'" in failed["needs search"]["error"]
    assert "not available in this run" in failed["needs web_search"]["error"]
    assert failed["needs search"]["row_toolsets"] == ["terminal", "web"]
    assert failed["needs web_search"]["row_tools"] == ["web_search"]
    assert stats_of(out / "run")["remaining_for_resume"] == 2  # they run again once configured


def test_rows_differing_only_in_their_settings_are_different_work(server, tmp_path, capsys):
    rows = [
        {"prompt": "same words"},
        {"prompt": "same words", "system": "Persona A."},
        {"prompt": "same words", "system": "Persona B."},
        {"prompt": "same words", "max_turns": 2},
        {"prompt": "same words", "toolsets": ["file"]},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run(server, dataset, out)
    recs = read_jsonl(out / "run" / "trajectories.jsonl")
    assert len(recs) == 5 and len({r["metadata"]["row_key"] for r in recs}) == 5
    # The row without settings of its own keeps the identity it had before they existed.
    (plain,) = [r for r in recs if all(v is None for v in identity_options(r["metadata"]).values())]
    assert plain["metadata"]["row_key"] == row_key("same words")

    before = server.stats()["requests"]
    capsys.readouterr()
    run(server, dataset, out, resume=True)
    assert server.stats()["requests"] == before
    assert "5 prompt(s) already finished, 0 to run" in capsys.readouterr().out
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 5

    # A row whose record is lost runs again, and only that one: its twin with another system prompt does not.
    batch = out / "run" / "batch_0.jsonl"
    lines = batch.read_text("utf-8").splitlines(keepends=True)
    lost = [ln for ln in lines if json.loads(ln)["metadata"]["row_system_sha256"]][0]
    batch.write_text("".join(ln for ln in lines if ln != lost), "utf-8")
    run(server, dataset, out, resume=True)
    expected = (
        "Persona A."
        if json.loads(lost)["metadata"]["row_system_sha256"] == _sha("Persona A.")
        else "Persona B."
    )
    assert server.stats()["requests"] == before + 3  # one row, the fake's three calls
    assert {_system(b) for b in server.stats()["last_requests"][-3:]} == {expected}
    assert len(read_jsonl(out / "run" / "trajectories.jsonl")) == 5


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("field", ["toolsets", "tools"])
def test_a_row_that_names_toolsets_or_tools_runs_under_a_distribution_that_offers_none_of_them(
    server, tmp_path, field, monkeypatch
):
    """--distribution=minimal (web only) without a search provider: rows with their own tools still run."""
    for var in SEARCH_VARS:
        monkeypatch.delenv(var, raising=False)
    value = ["terminal"]
    dataset = write_rows(tmp_path / "d.jsonl", [{"prompt": "own tools", field: value}])
    out = tmp_path / "data"
    run(server, dataset, out, distribution="minimal")
    (rec,) = read_jsonl(out / "run" / "trajectories.jsonl")
    assert rec["toolsets_used"] == ["terminal"]


def test_row_settings_and_samples_with_the_built_in_mock_model(tmp_path):
    rows = [
        {
            "prompt": "mock with a persona",
            "system": "You are a pirate.",
            "tools": ["read_file"],
            "samples": 2,
        },
        {"prompt": "mock capped", "max_turns": 1},
    ]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "data"
    run(None, dataset, out, samples_per_prompt=1)
    recs = by_prompt(read_jsonl(out / "run" / "trajectories.jsonl"))
    persona = recs["mock with a persona"]
    assert sorted(r["metadata"]["sample_index"] for r in persona) == [0, 1]
    for rec in persona:
        assert split_system_value(rec["conversations"][0]["value"]) == "You are a pirate."
        assert rec["metadata"]["tools_offered"] == ["read_file"] and rec["toolsets_used"] == ["file"]
    (capped,) = recs["mock capped"]
    assert capped["api_calls"] == 1 and capped["metadata"]["max_turns"] == 1
    assert stats_of(out / "run")["dataset_samples"] == 3
