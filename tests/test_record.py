"""One record schema, whatever the run: records from different backends, endpoints, toolsets and
outcomes load together with Hugging Face ``datasets`` (the installed version), with the same features."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_jsonl, write_jsonl

import batch_runner
from batchrun.identity import row_key
from batchrun.prompt.llm import Usage
from batchrun.prompt.tools.catalog import known_tool_names
from batchrun.prompt.trajectory import build_record, to_sharegpt
from batchrun.record import (
    METADATA,
    RECORD_FIELDS,
    USAGE,
    conform,
    is_tool_failure,
    load_runs,
    metadata_typed,
    normalize_metadata,
    record_features,
    record_schema,
    row_option_fields,
)

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("offline_hf")


def load(files: list[Path], cache: Path, features=None):
    return datasets.load_dataset(
        "json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache), features=features
    )


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "terminal", "arguments": '{"command": "ls"}'},
}


def _messages(with_calls: bool) -> list[dict]:
    msgs = [{"role": "user", "content": "List files"}]
    if with_calls:
        msgs += [
            {"role": "assistant", "content": "", "reasoning": "look first", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "name": "terminal", "content": '{"output": "a"}'},
        ]
    msgs.append({"role": "assistant", "content": "Done.", "reasoning": "answer now"})
    return msgs


def situation(
    *,
    backend: str,
    providers: bool,
    reasoning_tokens: bool,
    cost: bool,
    with_calls: bool,
    completed: bool,
    row: dict | None = None,
    served: str | None = "served/model",
    own: dict | None = None,
    score: dict | None = None,
) -> dict:
    """A record as run_prompt and the recorder build it, for one kind of backend, endpoint and outcome."""
    usage = Usage()
    usage.note_request()
    reported: dict = {"prompt_tokens": 10, "completion_tokens": 5}
    if reasoning_tokens:
        reported["completion_tokens_details"] = {"reasoning_tokens": 3}
    if cost:  # OpenRouter: its cost, and its prompt cache's reads and writes
        reported["cost"] = 0.001
        reported["prompt_tokens_details"] = {"cached_tokens": 6, "cache_write_tokens": 4}
    usage.add(reported, "ProviderA" if providers else None)
    meta = {
        "batch_num": 0,
        "timestamp": "2026-01-01T00:00:00",
        "model": "requested/model",
        "served_model": served,
        "stop_reason": "final_answer" if completed else "max_turns",
        "duration_s": 1,  # an int here must still be written as a float
        "sandbox": backend,
        "isolation": "docker" if backend == "docker" else "bubblewrap",
        "sandbox_start_wait_s": 0.0,
        "sandbox_start_s": 0.5,
        "sandbox_start_blocked_s": 0.0,
        "sandbox_stop_s": 0.1,
        "usage": usage.as_dict(),
        "toolsets_sampled": ["terminal", "file"],
        "image": "busybox:latest" if backend == "docker" else None,
        "cwd": "/work" if backend == "docker" else None,
        "row_id": None if row is None else str(row.get("id")),
        "row_fields": None if row is None else json.dumps(row, sort_keys=True),
        "sample_index": 0,
        "max_turns": 10,
        "tools_offered": ["terminal", "read_file"],
        # The row's own settings (the recorder writes them; null when the row has none).
        **row_option_fields(**(own or {"toolsets": None, "tools": None, "system": None, "max_turns": None})),
    }
    meta["prompt_tokens"] = meta["usage"]["prompt_tokens"]  # as run_prompt copies them
    meta["completion_tokens"] = meta["usage"]["completion_tokens"]
    if backend == "docker":
        meta["sandbox_stop_background"] = True  # local runs never set it: the schema fills it
    rec = build_record(
        prompt_index=0,
        messages=_messages(with_calls),
        tool_schemas=[],
        known_tools=known_tool_names(),
        metadata=meta,
        completed=completed,
        partial=not completed,
        api_calls=2 if with_calls else 1,
        toolsets_used=["terminal", "file"],
        score=score,
    )
    rec["metadata"]["row_key"] = row_key("List files", meta["image"], meta["cwd"])  # as the recorder does
    return rec


SITUATIONS = {
    "local_plain_endpoint_no_calls": dict(
        backend="local", providers=False, reasoning_tokens=False, cost=False, with_calls=False, completed=True
    ),
    "docker_openrouter_calls": dict(
        backend="docker",
        providers=True,
        reasoning_tokens=True,
        cost=True,
        with_calls=True,
        completed=True,
        row={"id": 7, "answer": "42"},
        own={"toolsets": ("terminal", "file"), "tools": ("terminal",), "system": "Be brief.", "max_turns": 4},
        # A verify score with partial credit (as batchrun.scoring.combine gives it).
        score={
            "value": 1,  # an int must still be written as a float
            "passed": True,
            "scorer": "verify",
            "explanation": "verify: exit 0",
            "verify_exit_code": 0,
            "verify_output": "ok\n",
            "parts": [{"scorer": "verify", "value": 1.0, "passed": True, "explanation": "exit 0"}],
        },
    ),
    "local_partial_calls_unknown_served": dict(
        backend="local",
        providers=False,
        reasoning_tokens=False,
        cost=False,
        with_calls=True,
        completed=False,
        served=None,
    ),
    "docker_discarded_sample_no_calls": dict(
        backend="docker",
        providers=True,
        reasoning_tokens=False,
        cost=True,
        with_calls=False,
        completed=True,
        # A judge that answered nonsense: no verdict, its error and its usage.
        score={
            "scorer": "judge",
            "explanation": "",
            "error": "judge: the judge's reply holds no JSON verdict",
            "judge_usage": {
                "requests": 1,
                "calls": 1,
                "prompt_tokens": 9,
                "completion_tokens": 2,
                "cost_usd": 0,
            },
            "parts": [{"scorer": "judge", "explanation": "", "error": "no JSON verdict"}],
        },
    ),
}


def test_every_record_has_exactly_the_schema_keys_whatever_the_situation():
    tools = known_tool_names()
    for name, kw in SITUATIONS.items():
        rec = situation(**kw)
        assert tuple(rec) == RECORD_FIELDS, name
        assert list(rec["metadata"]) == list(METADATA), name
        assert list(rec["metadata"]["usage"]) == list(USAGE), name
        # Nothing outside the schema, types as declared.
        assert conform(rec, record_schema(tools)) == rec, name
        for turn in rec["conversations"]:
            assert list(turn) == ["from", "value", "tool_calls"], name
            assert isinstance(turn["tool_calls"], list), name


def test_metadata_is_said_typed_only_when_normalizing_would_give_it_back_unchanged():
    """The merge copies a line as written when its metadata is typed, and only checks that (no typed copy
    built to compare, half of a 20,000-record merge's CPU): a claim of typed must never be wrong."""
    import copy
    import random

    rng = random.Random(7)
    typed = [situation(**kw)["metadata"] for kw in SITUATIONS.values()]
    for meta in typed:  # what the recorder writes is recognised as typed
        assert metadata_typed(meta) and normalize_metadata(meta) == meta

    odd_values = [
        None,
        0,
        1,
        -1,
        -2,
        2**63,
        2.5,
        3.0,
        True,
        "",
        "x",
        [],
        ["a"],
        [None],
        {},
        {"a": 1},
        float("nan"),
        float("inf"),
    ]
    spots = [(k,) for k in METADATA] + [("usage", k) for k in USAGE]
    tried = differs = 0
    for meta in typed:
        for spot in spots:
            for value in [*odd_values, "missing"]:
                m = copy.deepcopy(meta)
                holder = m if len(spot) == 1 else m["usage"]
                if value == "missing":
                    del holder[spot[-1]]
                else:
                    holder[spot[-1]] = value
                tried += 1
                if normalize_metadata(m) != m:
                    differs += 1
                    assert not metadata_typed(m), (spot, value)
        for text in ('["cost_usd", "prompt_tokens"]', '["prompt_tokens"] ', "[1]", "null", "x"):
            m = copy.deepcopy(meta)
            m["usage"]["unreported"] = text
            assert not metadata_typed(m), text
        m = copy.deepcopy(meta)
        m["extra"] = rng.random()
        assert not metadata_typed(m)
    assert differs > tried // 3  # the perturbations do change many records


def test_unreported_counts_are_zero_and_named_never_null():
    """A count no response reported is 0 and named in usage.unreported: no column is null throughout a run."""
    rec = situation(**SITUATIONS["local_plain_endpoint_no_calls"])
    usage = rec["metadata"]["usage"]
    assert usage["reasoning_tokens"] == 0 and usage["cost_usd"] == 0.0 and usage["providers"] == "[]"
    assert set(json.loads(usage["unreported"])) == {
        "reasoning_tokens", "cached_tokens", "cache_write_tokens", "cost_usd"
    }  # fmt: skip
    assert usage["cached_tokens"] == usage["cache_write_tokens"] == 0
    assert usage["prompt_tokens"] == 10 and usage["calls"] == 1
    assert rec["metadata"]["sandbox_stop_background"] is False  # a key of every record, false here
    assert isinstance(rec["metadata"]["duration_s"], float)
    full = situation(**SITUATIONS["docker_openrouter_calls"])["metadata"]["usage"]
    assert full["reasoning_tokens"] == 3 and json.loads(full["providers"]) == ["ProviderA"]
    assert full["cost_usd"] == 0.001 and full["unreported"] == "[]"
    assert (full["cached_tokens"], full["cache_write_tokens"]) == (6, 4)


def test_records_of_every_situation_load_together_with_the_same_features(tmp_path):
    files = []
    for name, kw in SITUATIONS.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(situation(**kw), ensure_ascii=False) + "\n", "utf-8")
        files.append(path)
    schema = record_features(known_tool_names())
    # Their concatenation, as one file, infers exactly the declared schema: one type per key.
    together = tmp_path / "together.jsonl"
    together.write_text("".join(p.read_text("utf-8") for p in files), "utf-8")
    plain = load([together], tmp_path / "c0")
    assert plain.features == schema
    assert plain.num_rows == len(SITUATIONS)
    assert type(plain.features["conversations"]).__name__ == "List"  # not untyped JSON
    # The separate files in either order, with the declared features (the loader otherwise types
    # each column from the first file alone, and a column null throughout that file has no type).
    for i, order in enumerate((files, files[::-1])):
        ds = load(order, tmp_path / f"c{i + 1}", features=schema)
        assert ds.features == schema
        tokens = [m["usage"]["reasoning_tokens"] for m in ds["metadata"]]
        assert sorted(tokens) == [0, 0, 0, 3]  # unreported: 0, and named in usage.unreported
    # Without features= too, in either order: no column is null or an empty list throughout a file
    # (except conversations.tool_calls in a file where no call was made at all: see batchrun.record).
    with_calls = [f for f, kw in zip(files, SITUATIONS.values(), strict=True) if kw["with_calls"]]
    for i, order in enumerate((with_calls, with_calls[::-1])):
        assert load(order, tmp_path / f"p{i}").num_rows == len(with_calls)
    # Each file alone: every column the loader types is typed as the schema says, or is all null.
    for i, path in enumerate(files):
        inferred = load([path], tmp_path / f"s{i}").features
        _assert_compatible(inferred.to_dict(), schema.to_dict(), path.name)


def _assert_compatible(got, want, where):
    if isinstance(got, dict) and "_type" in got:
        if got["_type"] == "Value" and got.get("dtype") == "null":
            return
        assert got["_type"] == want["_type"], where
        if got["_type"] == "List":
            _assert_compatible(got["feature"], want["feature"], where)
        else:
            assert got == want, where
        return
    assert set(got) == set(want), where
    for key in got:
        _assert_compatible(got[key], want[key], f"{where}.{key}")


def test_to_sharegpt_puts_tool_calls_on_every_entry():
    conv = to_sharegpt(_messages(with_calls=True), [])
    assert [len(c["tool_calls"]) for c in conv] == [0, 0, 1, 0, 0]


# ----------------------------------------------------------------------------- end to end


def _run(dataset: Path, out: Path, run_name: str, distribution: str, **kw) -> Path:
    assert (
        batch_runner.main(
            dataset_file=str(dataset),
            batch_size=2,
            run_name=run_name,
            model="mock",
            output_dir=str(out),
            num_workers=1,
            distribution=distribution,
            max_failure_rate=1.0,
            **kw,
        )
        == 0
    )
    return out / run_name


def test_two_mock_runs_load_together_and_carry_their_rows(tmp_path):
    with_calls = tmp_path / "calls.jsonl"
    with_calls.write_text(
        json.dumps({"prompt": "Count files [calls:1]", "id": 11, "answer": "3", "source": "s"}) + "\n"
        + json.dumps({"prompt": "Read a note [calls:2]", "id": "q-2"}) + "\n",
        "utf-8",
    )  # fmt: skip
    no_calls = write_jsonl(tmp_path / "plain.jsonl", ["Say hi [calls:0]", "Say bye [calls:0]"])
    out = tmp_path / "data"
    a = _run(with_calls, out, "a", "terminal_only")
    b = _run(no_calls, out, "b", "reasoning")
    ra, rb = read_jsonl(a / "trajectories.jsonl"), read_jsonl(b / "trajectories.jsonl")
    assert len(ra) == 2 and len(rb) == 2
    # The row's own fields reach its record.
    by_id = {r["metadata"]["row_id"]: r for r in ra}
    assert set(by_id) == {"11", "q-2"}
    assert json.loads(by_id["11"]["metadata"]["row_fields"]) == {"id": 11, "answer": "3", "source": "s"}
    assert json.loads(by_id["q-2"]["metadata"]["row_fields"]) == {"id": "q-2"}
    # No id: ""; no other fields: an empty object's text (never null, so the column keeps its type).
    assert all(r["metadata"]["row_id"] == "" and r["metadata"]["row_fields"] == "{}" for r in rb)
    for r in ra + rb:
        meta = r["metadata"]
        assert meta["model"] == "mock" and meta["served_model"] == "mock"
        assert set(r["toolsets_used"]) <= set(meta["toolsets_sampled"]) | set(r["toolsets_used"])
        assert meta["row_key"] and "image" in meta and "cwd" in meta
        assert list(meta) == list(METADATA)
    assert any(t["tool_calls"] for r in ra for t in r["conversations"])
    assert not any(t["tool_calls"] for r in rb for t in r["conversations"])
    assert {tuple(r["toolsets_used"]) for r in ra} != {tuple(r["toolsets_used"]) for r in rb}
    files = [a / "trajectories.jsonl", b / "trajectories.jsonl"]
    schema = record_features(known_tool_names())
    plain = load(files, tmp_path / "c1")  # the run with calls first: its columns type the others'
    ds = load(files[::-1], tmp_path / "c2", features=schema)
    assert ds.num_rows == plain.num_rows == 4
    assert ds.features == schema
    _assert_compatible(plain.features.to_dict(), schema.to_dict(), "plain")
    # Each run directory carries a dataset card: load_dataset(run_dir) types every column, including
    # those null throughout the run (b: no row id, no tool call, no reasoning tokens reported).
    for i, run in enumerate((a, b)):
        own = datasets.load_dataset(str(run), split="train", cache_dir=str(tmp_path / f"card{i}"))
        assert own.features == schema and own.num_rows == 2
    assert own["metadata"][0]["row_id"] == "" and own["metadata"][0]["usage"]["reasoning_tokens"] == 0
    # Several runs in either order, without naming the schema: batchrun.record.load_runs.
    for i, order in enumerate(((b, a), (a, b))):
        both = load_runs(*order, cache_dir=str(tmp_path / f"runs{i}"))
        assert both.num_rows == 4 and sorted(both["run_name"]) == ["a", "a", "b", "b"]
        assert datasets.Features({k: v for k, v in both.features.items() if k != "run_name"}) == schema
    # A run that counted one more tool (a plugin's, say): its column is null in the other run's rows.
    extra = tmp_path / "data" / "extra"
    extra.mkdir()
    lines = []
    for rec in read_jsonl(a / "trajectories.jsonl"):
        rec["tool_stats"]["my_tool"] = {"count": 1, "success": 1, "failure": 0}
        rec["tool_error_counts"]["my_tool"] = 0
        lines.append(json.dumps(rec) + "\n")
    (extra / "trajectories.jsonl").write_text("".join(lines), "utf-8")
    mixed = load_runs(b, extra, cache_dir=str(tmp_path / "mixed"))
    assert [r["my_tool"] for r in mixed["tool_stats"]] == [
        None,
        None,
        {"count": 1, "success": 1, "failure": 0},
    ] * 1 + [{"count": 1, "success": 1, "failure": 0}]


def test_runs_export_together_into_one_dataset(tmp_path):
    """Several run directories export into one Parquet file (one schema), each row naming its run."""
    from batchrun.views import export

    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps({"prompt": "Count [calls:1]", "id": 3, "answer": "7"}) + "\n", "utf-8")
    out = tmp_path / "data"
    a = _run(first, out, "a", "terminal_only")
    b = _run(write_jsonl(tmp_path / "plain.jsonl", ["Say hi [calls:0]"]), out, "b", "reasoning")
    assert export.main([str(b), str(a), "--format=parquet", f"--out={tmp_path / 'exp'}"]) == 0
    ds = datasets.load_dataset(str(tmp_path / "exp"), split="train", cache_dir=str(tmp_path / "c"))
    rows = {r["run_name"]: r for r in ds}
    assert set(rows) == {"a", "b"}
    assert (rows["a"]["row_id"], json.loads(rows["a"]["row_fields"])) == ("3", {"id": 3, "answer": "7"})
    assert rows["b"]["row_id"] == "" and rows["b"]["served_model"] == "mock"
    assert any(m["tool_calls"] for m in rows["a"]["messages"])
    card = (tmp_path / "exp" / "README.md").read_text("utf-8")
    assert "`a`" in card and "`b`" in card
    # The same run named twice would export its samples twice: refused.
    assert export.main([str(a), str(a), "--format=openai", f"--out={tmp_path / 'twice'}"]) == 2


@pytest.mark.docker
@pytest.mark.slow
def test_a_local_and_a_docker_run_load_together(tmp_path, docker_test_image):
    """The container backend's own keys (sandbox_stop_background, image, cwd) exist in local records too."""
    out = tmp_path / "data"
    local = _run(write_jsonl(tmp_path / "l.jsonl", ["Local one [calls:1]"]), out, "local", "terminal_only")
    rows = [{"prompt": "In a container [calls:1]", "image": docker_test_image, "cwd": "/work", "id": 1}]
    dataset = tmp_path / "c.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    docker = _run(dataset, out, "docker", "terminal_only", sandbox="docker", default_image=docker_test_image)
    (lrec,) = read_jsonl(local / "trajectories.jsonl")
    (drec,) = read_jsonl(docker / "trajectories.jsonl")
    assert list(lrec["metadata"]) == list(drec["metadata"]) == list(METADATA)
    assert lrec["metadata"]["sandbox_stop_background"] is False and lrec["metadata"]["image"] == ""
    assert lrec["metadata"]["sandbox_image"] == "" and drec["metadata"]["sandbox_image"] == docker_test_image
    assert drec["metadata"]["sandbox_stop_background"] is True
    assert (drec["metadata"]["image"], drec["metadata"]["cwd"]) == (docker_test_image, "/work")
    assert drec["metadata"]["row_id"] == "1"
    files = [local / "trajectories.jsonl", docker / "trajectories.jsonl"]
    schema = record_features(known_tool_names())
    for i, order in enumerate((files, files[::-1])):
        ds = load(order, tmp_path / f"c{i}", features=schema)
        assert ds.num_rows == 2 and ds.features == schema
    # Without features=, in both orders: every column is typed in both runs (image "" on local).
    for i, order in enumerate((files, files[::-1])):
        plain = load(order, tmp_path / f"plain{i}")
        assert plain.num_rows == 2
        _assert_compatible(plain.features.to_dict(), schema.to_dict(), "plain")


def test_the_exporter_carries_served_model_and_row_fields(tmp_path):
    from batchrun.views import export

    dataset = tmp_path / "d.jsonl"
    rows = [{"prompt": "Join me [calls:0]", "id": 5, "answer": "x"}, {"prompt": "No id [calls:0]"}]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    run_dir = _run(dataset, tmp_path / "data", "e", "terminal_only")
    export.export_run(run_dir, "parquet", tmp_path / "out")
    loaded = load_parquet(tmp_path / "out" / "train.parquet", tmp_path / "c")
    got = {r["row_id"]: (r["served_model"], r["row_fields"]) for r in loaded}
    assert got == {"5": ("mock", '{"answer": "x", "id": 5}'), "": ("mock", "{}")}


def load_parquet(path: Path, cache: Path):
    return datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(cache))


def test_the_record_schema_imports_nothing_above_it():
    """record.py is a leaf beside sharegpt.py: the tool names come from its callers, not the catalog."""
    code = "import sys, batchrun.record; print(sorted(m for m in sys.modules if m.startswith('batchrun.')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.replace("'", '"')) == ["batchrun.record", "batchrun.sharegpt"]


# ----------------------------------------------------------------------------- is_tool_failure


@pytest.mark.parametrize(
    "content",
    [
        '{"error": "No such file"}',
        '{"error": ""}',  # non-null, even if empty
        '{"error": {"code": 2}}',
        '{"success": false}',
        '{"success": false, "error": null}',
        '{"content": {"error": "nested failure"}}',
        '{"content": {"success": false}}',
        '{"output": "", "exit_code": -1, "error": "Command timed out after 5 s"}',
        "error: something broke",
        "error:no space",
        "  error: leading whitespace",
        "",
        "   \n",
    ],
)
def test_is_tool_failure_true(content):
    assert is_tool_failure(content) is True


@pytest.mark.parametrize(
    "content",
    [
        '{"output": "boom", "exit_code": 1, "error": null}',  # a non-zero exit code is not a failure
        '{"error": null}',
        '{"success": true}',
        '{"content": {"error": null, "text": "fine"}}',
        '{"content": "some text mentioning error: inside"}',
        '{"bytes_written": 12, "path": "a.txt"}',
        "[]",
        "42",
        "plain text output",
        "the word error: appears later",
        "errors: 0",
    ],
)
def test_is_tool_failure_false(content):
    assert is_tool_failure(content) is False
