"""Training data you can hand to a trainer (issue 22): runs of every kind load together with plain
``datasets`` in any order, kept samples are exactly what the model and the tools said, secrets make a
sample a discard, and the reference's Python API works. Real runs through the in-process CLI against
the in-package fake model (``--model=mock``, or the fake server for priced answers)."""

from __future__ import annotations

import base64
import itertools
import json
import random
import urllib.parse
from pathlib import Path

import pytest
from helpers import ScriptedEndpoint, read_jsonl, run, stats_of, write_jsonl, write_rows

import batch_runner
from batchrun.config import UsageError
from batchrun.fakes.fake_model import FakeModelServer, find_prompt, respond
from batchrun.prompt.trajectory import unoffered_call
from batchrun.record import METADATA, load_runs
from batchrun.secrets import Redactor, looks_like_secret
from batchrun.sharegpt import canonical_arguments, first_human, split_reasoning

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("offline_hf")


# ----------------------------------------------------------------------------- a matrix of differing runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Runs that differ in every way a record can: endpoints and providers, row options, samples,
    reasoning, outcomes (all failed, all discarded), one prompt."""
    root = tmp_path_factory.mktemp("matrix")
    out = root / "data"

    def mock(name: str, rows: list[dict], **kw) -> Path:
        run(None, write_rows(root / f"{name}.jsonl", rows), out, run_name=name, batch_size=2, **kw)
        return out / name

    made = {
        "plain": mock("plain", [{"prompt": "List files [calls:1]"}, {"prompt": "Count lines [calls:2]"}]),
        "rows": mock(
            "rows",
            [
                {"prompt": "Own toolsets [calls:1]", "id": 7, "answer": "x", "toolsets": ["terminal"]},
                {
                    "prompt": "Own tools [calls:1]",
                    "id": "r-2",
                    "tools": ["terminal", "read_file"],
                    "system": "Be brief.",
                    "max_turns": 4,
                    "samples": 2,
                },
            ],
        ),
        "samples": mock("samples", [{"prompt": "Twice [scratchpad] [calls:1]"}], samples_per_prompt=2),
        "no_reasoning_kept": mock(
            "no_reasoning_kept", [{"prompt": "Silent [no_reasoning] [calls:1]"}], keep_no_reasoning=True
        ),
        "failed": mock(
            "failed", [{"prompt": "Broken [error:500]"}, {"prompt": "Also [error:500]"}], max_retries=0
        ),
        "discarded": mock("discarded", [{"prompt": "Quiet [no_reasoning] [calls:1]"}]),
        "one": mock("one", [{"prompt": "Just one [calls:3]", "id": 1}]),
    }
    with FakeModelServer(cost_per_token=1e-6) as server:  # OpenRouter-style cost and provider
        run(
            server,
            write_rows(root / "priced.jsonl", [{"prompt": "Priced [calls:1] [served_other]"}]),
            out,
            run_name="priced",
        )
    made["priced"] = out / "priced"
    return made


def _plain_load(files: list[Path], cache: Path):
    return datasets.load_dataset(
        "json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache)
    )


def _rows_in(run_dir: Path) -> int:
    return len(read_jsonl(run_dir / "trajectories.jsonl"))


def test_every_pair_of_differing_runs_loads_with_plain_datasets_in_both_orders(runs, tmp_path):
    """load_dataset("json", data_files=[...]) without features= reads every pair in either order."""
    assert _rows_in(runs["failed"]) == 0 and _rows_in(runs["discarded"]) == 0
    assert all(_rows_in(d) > 0 for name, d in runs.items() if name not in ("failed", "discarded"))
    problems = []
    for i, (a, b) in enumerate(itertools.permutations(runs, 2)):
        if _rows_in(runs[a]) + _rows_in(runs[b]) == 0:
            continue  # nothing at all: datasets cannot infer a JSON dataset of no rows (load_runs can)
        files = [runs[a] / "trajectories.jsonl", runs[b] / "trajectories.jsonl"]
        try:
            ds = _plain_load(files, tmp_path / f"c{i}")
        except Exception as exc:  # the loader's error names no column: say which pair
            problems.append(f"{a} then {b}: {type(exc).__name__}: {exc.__cause__ or exc}")
            continue
        assert ds.num_rows == _rows_in(runs[a]) + _rows_in(runs[b])
    assert not problems, "\n".join(problems)
    # All of them at once, too.
    everything = [d / "trajectories.jsonl" for d in runs.values()]
    assert _plain_load(everything, tmp_path / "all").num_rows == sum(_rows_in(d) for d in runs.values())


def test_no_record_holds_a_null_and_every_row_option_is_typed(runs):
    def nulls(value, where):
        if value is None:
            yield where
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from nulls(v, f"{where}.{k}")
        elif isinstance(value, list):
            for v in value:
                yield from nulls(v, f"{where}[]")

    for name, run_dir in runs.items():
        for rec in read_jsonl(run_dir / "trajectories.jsonl"):
            assert list(rec["metadata"]) == list(METADATA)
            assert not list(nulls(rec, name))
    by_prompt = {
        first_human(r["conversations"]): r["metadata"]
        for r in read_jsonl(runs["rows"] / "trajectories.jsonl")
    }
    own_tools, own_toolsets = by_prompt["Own tools [calls:1]"], by_prompt["Own toolsets [calls:1]"]
    assert json.loads(own_tools["row_tools"]) == ["read_file", "terminal"] and own_tools["row_toolsets"] == ""
    assert own_tools["row_max_turns"] == 4 and own_tools["row_id"] == "r-2" and own_tools["row_system_sha256"]
    assert json.loads(own_toolsets["row_toolsets"]) == ["terminal"] and own_toolsets["row_max_turns"] == 0
    assert own_toolsets["toolsets_sampled"] == ["terminal"]  # nothing drawn: what the row was given
    plain = read_jsonl(runs["plain"] / "trajectories.jsonl")[0]["metadata"]
    assert (plain["row_id"], plain["image"], plain["cwd"], plain["sandbox_image"]) == ("", "", "", "")
    assert plain["usage"]["providers"] == "[]" and "cost_usd" in json.loads(plain["usage"]["unreported"])
    priced = read_jsonl(runs["priced"] / "trajectories.jsonl")[0]["metadata"]
    assert json.loads(priced["usage"]["providers"]) == ["MockProvider"] and priced["usage"]["cost_usd"] > 0
    assert "cost_usd" not in json.loads(priced["usage"]["unreported"])
    assert priced["served_model"] == "mock-served-other"


def test_resume_still_knows_rows_by_their_typed_identity(runs, tmp_path):
    """The "" and 0 written for a row's missing options are the same identity as none: nothing reruns."""
    before = {name: _rows_in(d) for name, d in runs.items()}
    rows = [json.loads(x) for x in (runs["rows"].parent.parent / "rows.jsonl").read_text().splitlines()]
    run(None, write_rows(tmp_path / "rows.jsonl", rows), runs["rows"].parent, run_name="rows", resume=True)
    assert _rows_in(runs["rows"]) == before["rows"] == 3
    assert stats_of(runs["rows"])["remaining_for_resume"] == 0


def test_load_runs_names_the_run_keeps_only_record_keys_and_loads_empty_runs(runs, tmp_path):
    plain, one = runs["plain"], runs["one"]
    both = load_runs(one, plain, cache_dir=str(tmp_path / "c1"))
    assert both.num_rows == 3
    assert sorted(both["run_name"]) == ["one", "plain", "plain"]
    assert {(r, i) for r, i in zip(both["run_name"], both["prompt_index"], strict=True)} == {
        ("one", 0),
        ("plain", 0),
        ("plain", 1),
    }
    # Hermes' trajectory_compressor adds a top-level key of its own: tolerated, left out.
    compressed = tmp_path / "compressed"
    compressed.mkdir()
    lines = [{**r, "compression_metrics": {"ratio": 0.5}} for r in read_jsonl(plain / "trajectories.jsonl")]
    (compressed / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), "utf-8")
    mixed = load_runs(plain, compressed, cache_dir=str(tmp_path / "c2"))
    assert mixed.num_rows == 4 and "compression_metrics" not in mixed.column_names
    # A run with no trajectory at all loads as an empty dataset, alone or beside another.
    for i, dirs in enumerate(((runs["failed"],), (runs["failed"], runs["discarded"]))):
        empty = load_runs(*dirs, cache_dir=str(tmp_path / f"e{i}"))
        assert empty.num_rows == 0 and "run_name" in empty.column_names and "metadata" in empty.column_names
    assert load_runs(runs["failed"], plain, cache_dir=str(tmp_path / "c3")).num_rows == 2
    # Every run of the matrix in one dataset.
    assert load_runs(*runs.values(), cache_dir=str(tmp_path / "c4")).num_rows == sum(
        _rows_in(d) for d in runs.values()
    )


def test_run_directory_says_the_default_image_and_the_reference_statistics(runs):
    plain = runs["plain"]
    manifest = json.loads((plain / "run_manifest.json").read_text("utf-8"))
    stats = stats_of(plain)
    assert manifest["default_image"] == stats["default_image"] and stats["default_image"]
    # tool_statistics: the tools that were called, in percent (never a 0 % for a tool never called).
    called = {n for n, s in stats["tool_stats"].items() if s["count"]}
    assert set(stats["tool_statistics"]) == called and called
    for s in stats["tool_statistics"].values():
        assert s["success_rate"] + s["failure_rate"] == pytest.approx(100.0)
    unused = next(n for n, s in stats["tool_stats"].items() if not s["count"])
    assert stats["tool_stats"][unused]["success_rate"] is None  # fractions elsewhere, null with no call
    checkpoint = json.loads((plain / "checkpoint.json").read_text("utf-8"))
    assert checkpoint["batch_stats"] == {
        "0": {"processed": 2, "skipped": 0, "discarded_no_reasoning": 0, "trajectories": 2, "discarded": 0}
    }
    discarded = json.loads((runs["discarded"] / "checkpoint.json").read_text("utf-8"))["batch_stats"]
    assert discarded["0"]["discarded_no_reasoning"] == 1 and discarded["0"]["processed"] == 1
    failed = json.loads((runs["failed"] / "checkpoint.json").read_text("utf-8"))["batch_stats"]
    assert failed["0"]["skipped"] == 2 and failed["0"]["trajectories"] == 0


def test_turns_without_reasoning_render_as_the_reference_does(runs):
    (rec,) = read_jsonl(runs["no_reasoning_kept"] / "trajectories.jsonl")
    gpt = [t["value"] for t in rec["conversations"] if t["from"] == "gpt"]
    assert gpt and all(v.startswith("<think>\n</think>") for v in gpt)
    system = rec["conversations"][0]["value"]
    listed = json.loads(system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0])
    assert listed and all(list(t) == ["name", "description", "parameters", "required"] for t in listed)


# ----------------------------------------------------------------------------- kept text is never altered


def test_ordinary_values_of_secret_named_variables_and_echoed_prefill_leave_samples_as_they_were(
    tmp_path, monkeypatch, capsys
):
    """A variable named like a secret holding a tool's name, a number or a word is no pattern, and the
    model echoing the prefill keeps its words: every kept record is what the endpoint said."""
    monkeypatch.setenv("MY_SERVICE_TOKEN", "terminal")  # equals a tool name
    monkeypatch.setenv("BUILD_PASSWORD", "12345678")
    monkeypatch.setenv("DEPLOY_KEY", "production")
    phrase = "Answer in one short sentence, exactly."
    prefill = tmp_path / "prefill.json"
    prefill.write_text(
        json.dumps([{"role": "user", "content": phrase}, {"role": "assistant", "content": "ok"}])
    )
    prompts = [f"{phrase} Then list files [calls:2]", "Count 12345678 things [calls:1]"]
    with FakeModelServer() as server:
        run(
            server,
            write_jsonl(tmp_path / "d.jsonl", prompts),
            tmp_path / "data",
            prefill_messages_file=str(prefill),
        )
        sent = server.stats()["last_requests"]
    err = capsys.readouterr().err
    assert "not redacting BUILD_PASSWORD, DEPLOY_KEY, MY_SERVICE_TOKEN" in err
    run_dir = tmp_path / "data" / "run"
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(records) == 2 and stats_of(run_dir)["trajectories"] == 2
    assert b"[REDACTED]" not in (run_dir / "trajectories.jsonl").read_bytes()
    by_prompt = {first_human(r["conversations"]): r for r in records}
    assert set(by_prompt) == set(prompts)
    echoed = by_prompt[prompts[0]]
    calls = [c for t in echoed["conversations"] for c in t["tool_calls"]]
    assert {c["function"]["name"] for c in calls} >= {"terminal"}
    # The model wrote the phrase into a file (the fake's write_file quotes the prompt): kept as said.
    assert any(phrase in json.loads(c["function"]["arguments"]).get("content", "") for c in calls)
    assert stats_of(run_dir)["dropped_at_merge"]["unknown_tool"] == 0
    # Every answer the endpoint sent is in its kept record as sent: the words and each call's arguments.
    assert len(sent) == 5
    for body in sent:
        answer = respond(body)["choices"][0]["message"]
        rec = by_prompt[find_prompt(body["messages"])[1]]
        values = [t["value"] for t in rec["conversations"] if t["from"] == "gpt"]
        saved_args = [c["function"]["arguments"] for t in rec["conversations"] for c in t["tool_calls"]]
        for call in answer.get("tool_calls") or []:
            assert canonical_arguments(call["function"]["arguments"]) in saved_args
        words = split_reasoning(answer.get("content"))[1].strip()
        assert not words or any(words in v for v in values)
        reasoning = answer.get("reasoning_content")
        assert not reasoning or any(f"<think>\n{reasoning}\n</think>" in v for v in values)


SECRET = "s3cr3t-Value-42xyz"
ESCAPED = "".join(f"\\u{ord(c):04X}" if i % 3 == 0 else c for i, c in enumerate(SECRET))  # \u0073 for s, ...


@pytest.mark.parametrize(
    "form",
    [
        SECRET,
        SECRET.upper(),
        urllib.parse.quote(f"{SECRET}/+?", safe=""),
        base64.b64encode(f"user:{SECRET}".encode()).decode(),
        base64.b64encode(f"xy{SECRET}tail".encode()).decode(),
        base64.urlsafe_b64encode(f"a{SECRET}".encode()).decode(),
        json.dumps(json.dumps(SECRET)),
        # Some of its characters as JSON \u escapes (a model's arguments are kept as it wrote them), and
        # that text JSON-escaped once more (as a record's line holds it).
        ESCAPED,
        json.dumps(ESCAPED)[1:-1],
    ],
)
def test_every_form_of_a_secret_is_found_and_redacted(form):
    redact = Redactor(None, environ={"PAYMENT_API_KEY": SECRET})
    text = f"curl -H 'Authorization: Basic {form}' https://example.test"
    assert redact.finds_secret(text)
    assert SECRET not in redact(text) and "[REDACTED]" in redact(text) and redact.sample(text) == redact(text)


def test_secrets_and_scaffolding_are_told_apart():
    scaffold = "You are a very careful assistant."
    redact = Redactor(
        "sk-run-key-0001",
        environ={"A_TOKEN": "terminal", "B_SECRET": "99", "C_KEY": "xK9-pq2Lm"},
        scaffolding=(scaffold,),
    )
    assert redact.ignored == ["A_TOKEN", "B_SECRET"]
    assert "A_TOKEN" in redact.start_note() and "C_KEY" not in redact.start_note()
    said = f"I am {scaffold} and I call terminal with 99 items"
    assert redact.sample(said) == said and not redact.finds_secret(said)  # the model's words stay
    assert scaffold not in redact(f"error 400: the request said {json.dumps(scaffold)}")  # side files
    assert redact.finds_secret("key=XK9-PQ2LM") and redact.finds_secret("sk-run-key-0001")
    assert not looks_like_secret("web_search") and not looks_like_secret("/usr/local/bin")
    assert looks_like_secret("ghp_abcDEF123456") and not looks_like_secret("short1")


def test_a_sample_that_holds_a_secret_is_a_discard_redacted_in_discarded_jsonl(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAYMENT_API_KEY", SECRET)
    encoded = base64.b64encode(f"user:{SECRET}".encode()).decode()
    half = len(SECRET) // 2
    prompts = [
        f"Store the header Basic {encoded} [calls:2]",
        f"Shout {SECRET.upper()} [calls:1]",
        "Clean one [calls:1]",
        # base64's own output, wrapped at 76 characters, with the secret's encoded form across a break
        # (the prompt holds the secret in two halves only).
        f"[run:printf '%s%s%s' '{'x' * 50}' '{SECRET[:half]}' '{SECRET[half:]}' | base64]",
    ]
    run(None, write_jsonl(tmp_path / "d.jsonl", prompts), tmp_path / "data")
    run_dir = tmp_path / "data" / "run"
    out = capsys.readouterr().out
    assert [first_human(r["conversations"]) for r in read_jsonl(run_dir / "trajectories.jsonl")] == [
        "Clean one [calls:1]"
    ]
    discards = read_jsonl(run_dir / "discarded.jsonl")
    assert [d["reason"] for d in discards] == ["secret_in_output"] * 3
    wrapped = base64.encodebytes(f"{'x' * 50}{SECRET}".encode()).decode()
    assert "\n" in wrapped.strip() and not any(
        base64.b64encode(SECRET.encode()).decode()[2:-2] in line for line in wrapped.splitlines()
    )  # no line holds the secret's form: only the joined text does
    assert all(wrapped.strip() not in json.dumps(d) for d in discards)  # redacted there too
    stats = stats_of(run_dir)
    assert stats["discarded"]["by_reason"] == {"secret_in_output": 3}
    assert (
        stats["this_run"]["discarded"] == {"secret_in_output": 3} and stats["this_run"]["trajectories"] == 1
    )
    assert "secret_in_output" in out
    for path in run_dir.iterdir():
        if path.is_file():
            data = path.read_text("utf-8", errors="replace")
            assert SECRET not in data and SECRET.upper() not in data and encoded not in data, path.name


# ----------------------------------------------------------------------------- no bad sample is kept


def test_every_call_of_a_turn_has_its_own_id_when_the_endpoint_repeats_or_omits_them(tmp_path):
    """An endpoint that gives two calls of a turn the same id (``call_2``) and the third none: the
    runner's own id for the repeated one (``call_<position>``) was that same ``call_2``, so two tool
    results answered one id and the exported messages could not say which result is which call's."""
    from batchrun.views.export import export_run

    def answer(call: dict, calls: list[dict]):
        messages = (call["body"] or {}).get("messages", [])
        if not any(m.get("role") == "tool" for m in messages):
            ids = ["call_2", "call_2", None]
            tool_calls = [
                {
                    "id": i,
                    "type": "function",
                    "function": {"name": "terminal", "arguments": json.dumps({"command": c})},
                }
                for i, c in zip(ids, ["echo a", "echo b", "echo c"], strict=True)
            ]
            msg = {"role": "assistant", "content": "", "reasoning_content": "Run.", "tool_calls": tool_calls}
            return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls"}]}
        msg = {"role": "assistant", "content": "Done.", "reasoning_content": "Finished."}
        return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}

    with ScriptedEndpoint(answer) as endpoint:
        run(None, write_jsonl(tmp_path / "d.jsonl", ["Run three"]), tmp_path / "data", model="m",
            base_url=endpoint.base_url, api_key="sk-scripted-test", num_workers=1)  # fmt: skip
    export_run(tmp_path / "data" / "run", "openai", tmp_path / "out")
    (row,) = read_jsonl(tmp_path / "out" / "train.jsonl")
    (calling,) = [m for m in row["messages"] if m.get("tool_calls")]
    ids = [c["id"] for c in calling["tool_calls"]]
    assert len(set(ids)) == 3, ids
    # Each result answers its own call, in order: the output of echo b is the result of the second id.
    results = [m for m in row["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == ids
    assert [json.loads(m["content"])["output"].strip() for m in results] == ["a", "b", "c"]


def test_tool_results_are_exported_as_the_text_the_model_saw(tmp_path):
    """A tool error that names what the model sent (an unknown argument, here with a non-ASCII name)
    reaches the model as JSON with ``\\u00e9`` escapes. The record rendered the result's JSON again
    (``é``), so the saved and exported tool message was not the text the model was given."""
    from batchrun.views.export import export_run

    seen: list[str] = []

    def answer(call: dict, calls: list[dict]):
        messages = (call["body"] or {}).get("messages", [])
        results = [m["content"] for m in messages if m.get("role") == "tool"]
        if not results:
            args = json.dumps({"command": "ls", "répertoire": "/tmp"}, ensure_ascii=False)
            call_ = {"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": args}}
            msg = {"role": "assistant", "content": "", "reasoning_content": "Look.", "tool_calls": [call_]}
            return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls"}]}
        seen[:] = results
        msg = {"role": "assistant", "content": "Done.", "reasoning_content": "Finished."}
        return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}

    with ScriptedEndpoint(answer) as endpoint:
        run(None, write_jsonl(tmp_path / "d.jsonl", ["Look around"]), tmp_path / "data", model="m",
            base_url=endpoint.base_url, api_key="sk-scripted-test", num_workers=1)  # fmt: skip
    assert len(seen) == 1 and "\\u00e9" in seen[0]  # the escaped text the tool's answer was
    export_run(tmp_path / "data" / "run", "openai", tmp_path / "out")
    (row,) = read_jsonl(tmp_path / "out" / "train.jsonl")
    assert [m["content"] for m in row["messages"] if m["role"] == "tool"] == seen


def test_a_call_to_a_tool_not_offered_is_never_kept():
    offered, known = {"terminal"}, {"terminal", "read_file"}

    def turn(name):
        return [{"role": "assistant", "tool_calls": [{"function": {"name": name, "arguments": "{}"}}]}]

    assert unoffered_call(turn("terminal"), offered, known) is None
    assert unoffered_call(turn("read_file"), offered, known) == "tool_not_offered"
    assert unoffered_call(turn("teleport"), offered, known) == "unknown_tool"


def test_hallucinated_calls_are_discards_and_merge_drops_go_to_discarded_jsonl_once(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", ["Go far [hallucinate]", "Stay [calls:1]"])
    out = tmp_path / "data"
    run(None, dataset, out)
    run_dir = out / "run"
    assert [d["reason"] for d in read_jsonl(run_dir / "discarded.jsonl")] == ["unknown_tool"]
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 1
    # A batch file record calling a tool no longer known (a plugin since removed): dropped at every
    # merge, and set aside in discarded.jsonl once, exportable like any discard.
    (rec,) = read_jsonl(run_dir / "batch_0.jsonl")
    rec["conversations"][2]["tool_calls"][0]["function"]["name"] = "gone_plugin_tool"
    rec["metadata"]["batch_num"] = 5
    (run_dir / "batch_5.jsonl").write_text(json.dumps(rec) + "\n", "utf-8")
    for _ in range(2):
        run(None, dataset, out, resume=True)
    reasons = [d["reason"] for d in read_jsonl(run_dir / "discarded.jsonl")]
    assert sorted(reasons) == ["unknown_tool", "unknown_tool"]
    assert stats_of(run_dir)["dropped_at_merge"]["unknown_tool"] == 1


# ----------------------------------------------------------------------------- the reference's Python API


def test_batch_runner_from_python_with_the_references_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", ["First [calls:1]", "Second [calls:1]", "Third [calls:1]"])
    runner = batch_runner.BatchRunner(
        dataset_file="p.jsonl",
        batch_size=2,
        run_name="api",
        distribution="terminal_only",
        max_iterations=3,
        model="mock",
        num_workers=1,
        verbose=False,
        ephemeral_system_prompt="Be helpful and brief in every answer.",
        log_prefix_chars=50,
        providers_allowed=["anthropic", "openai"],
        providers_order=["openai"],
        provider_sort="price",
        max_tokens=512,
        reasoning_config={"enabled": True, "effort": "low"},
        prefill_messages=[
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi."},
        ],
        max_samples=2,
    )
    assert runner.run(resume=False) == 0
    run_dir = tmp_path / "data" / "api"  # under the current directory, as from the command line
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(first_human(r["conversations"]) for r in records) == ["First [calls:1]", "Second [calls:1]"]
    assert {r["metadata"]["max_turns"] for r in records} == {3}
    manifest = json.loads((run_dir / "run_manifest.json").read_text("utf-8"))
    assert manifest["reasoning_effort"] == "low" and manifest["prefill_sha256"]
    assert runner.config.providers_allowed == ("anthropic", "openai")
    assert runner.run(resume=True) == 0  # nothing left: the same records
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 2
    assert not list(tmp_path.glob("batch-runner-prefill-*"))


def test_batch_runner_arguments_are_checked_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", ["x"])
    with pytest.raises(UsageError, match="batch_size"):
        batch_runner.BatchRunner(dataset_file="p.jsonl", batch_size=0, run_name="bad", model="mock")
    with pytest.raises(ValueError, match="reasoning_config"):
        batch_runner.BatchRunner(
            dataset_file="p.jsonl", batch_size=1, run_name="bad", reasoning_config={"budget": 1}
        )
    off = batch_runner.BatchRunner(
        dataset_file="p.jsonl",
        batch_size=1,
        run_name="off",
        model="mock",
        reasoning_config={"effort": "none"},
    )
    assert off.config.reasoning_disabled
    # resume is run()'s argument: a resume's own flags given to the constructor are not flags that do nothing
    forced = batch_runner.BatchRunner(dataset_file="p.jsonl", batch_size=1, run_name="f", model="mock", force_resume=True)  # fmt: skip
    assert forced.config.force_resume
    # main(...) from Python returns the exit code instead of exiting.
    assert batch_runner.main(dataset_file="p.jsonl", batch_size=0, run_name="bad", model="mock") == 2
    assert "batch_size" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_toolset_distributions_behave_as_the_references():
    import toolset_distributions as td

    assert td.get_distribution("no_such_thing") is None
    research = td.get_distribution("research")
    assert research["toolsets"]["web"] == 90 and research["description"] == research.description
    assert td.validate_distribution("research") is True and td.validate_distribution("nope") is False
    assert set(td.list_distributions()) >= {"default", "terminal_only", "mixed_tasks"}
    random.seed(3)
    first = td.sample_toolsets_from_distribution("research")
    random.seed(3)
    assert td.sample_toolsets_from_distribution("research") == first and first
    assert set(first) <= set(research["toolsets"])
    assert td.sample_toolsets_from_distribution("terminal_only") == ["terminal", "file"]  # both at 100 %
    with pytest.raises(ValueError):
        td.sample_toolsets_from_distribution("no_such_thing")


def test_toolset_distributions_give_the_references_dicts():
    """The reference's get_distribution and list_distributions give plain dicts: a script that asks
    ``"toolsets" in dist``, iterates it, calls ``.items()`` or writes it with ``json.dumps`` got a
    KeyError 0, an AttributeError or a TypeError from the frozen dataclass they used to return."""
    import toolset_distributions as td

    research = td.get_distribution("research")
    assert (
        isinstance(research, dict)
        and "toolsets" in research
        and sorted(research) == ["description", "toolsets"]
    )
    assert dict(research.items())["toolsets"] == {
        "web": 90,
        "browser": 70,
        "vision": 50,
        "moa": 40,
        "terminal": 10,
    }
    assert json.loads(json.dumps(research)) == research
    table = json.loads(json.dumps(td.list_distributions()))
    assert list(table) == list(td.DISTRIBUTIONS) and table["terminal_only"]["toolsets"] == {
        "terminal": 100,
        "file": 100,
    }
    assert (
        research.name == "research" and research.probabilities["web"] == 90
    )  # the attribute reading still holds
    research["toolsets"]["web"] = 0  # a copy, as the run's own table is not the caller's to change
    assert td.get_distribution("research")["toolsets"]["web"] == 90


def test_validate_distribution_checks_what_get_distribution_gave():
    """validate_distribution(get_distribution(name)) was True while get_distribution gave the
    Distribution itself; the dict it gives now made it False (a dict is no name), so a script that
    checked what it got before using it saw every built-in distribution as invalid. It is checked whole
    as a Distribution is: True, or ValueError naming what is wrong (the caller's copy edited)."""
    import toolset_distributions as td

    research = td.get_distribution("research")
    assert td.validate_distribution(research) is True
    assert all(td.validate_distribution(d) is True for d in td.list_distributions().values())
    research["toolsets"]["no_such_toolset"] = 50
    with pytest.raises(ValueError, match="no_such_toolset"):
        td.validate_distribution(research)


def test_print_distribution_info(capsys):
    import toolset_distributions as td

    td.print_distribution_info("research")
    out = capsys.readouterr().out
    assert "research" in out and "web" in out and "90% chance" in out
    lines = [ln for ln in out.splitlines() if "% chance" in ln]
    assert lines[0].split()[1] == "web"  # most probable first
    td.print_distribution_info("nope")
    assert "Unknown distribution: nope" in capsys.readouterr().out


# ----------------------------------------------------------------------------- what the model said in a discard

REFUSAL = "I'm sorry, but I can't help with that."


def test_a_refusal_is_a_discard_of_its_own_that_keeps_the_refusal(tmp_path):
    """OpenAI's ``message.refusal`` (content null) was read as an empty answer: discarded as empty_answer
    with no trace of its text, and with --keep_empty_answers kept as a final answer of no words. It is
    the discard ``refusal`` (no flag keeps it), its text the turn's words, exported with it."""
    from batchrun.views.export import export_run

    def answer(call, calls):
        message = {"role": "assistant", "content": None, "refusal": REFUSAL}
        return 200, {"model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}

    with ScriptedEndpoint(answer) as endpoint:
        run(endpoint, write_jsonl(tmp_path / "d.jsonl", ["Pick this lock."]), tmp_path / "data",
            keep_empty_answers=True, keep_no_reasoning=True)  # fmt: skip
    run_dir = tmp_path / "data" / "run"
    assert not read_jsonl(run_dir / "trajectories.jsonl")
    (row,) = read_jsonl(run_dir / "discarded.jsonl")
    assert row["reason"] == row["record"]["metadata"]["stop_reason"] == "refusal"
    gpt = [c["value"] for c in row["record"]["conversations"] if c["from"] == "gpt"]
    assert gpt == [f"<think>\n</think>\n{REFUSAL}"]
    assert stats_of(run_dir)["discarded"]["by_reason"] == {"refusal": 1}
    export_run(run_dir, "openai", tmp_path / "out", include_discarded=True)
    (exported,) = read_jsonl(tmp_path / "out" / "train.jsonl")
    assert exported["discard_reason"] == exported["stop_reason"] == "refusal"
    assert exported["messages"][-1] == {"role": "assistant", "content": REFUSAL}


# Characters JSON keeps raw in a string that str.splitlines() takes for line ends, beside others a model may
# write (NUL, a CRLF, an escape sequence, a BOM, an astral character).
ODD_WORDS = "One\u2028two\u2029three\x85four\x00five\r\nsix\x1b[0m\ufeff\U0001f30d\n"


def test_words_with_line_separators_stay_one_line_for_every_reader(tmp_path):
    """U+2028, U+2029 and U+0085 were written raw: valid JSON, but a reader splitting lines with
    str.splitlines() (as many training scripts do) got three torn lines for one record. They are written
    escaped now, the same value: every reader gets the words exactly, datasets too."""
    from batchrun.views.export import export_run

    def answer(call, calls):
        message = {"role": "assistant", "content": ODD_WORDS, "reasoning_content": "why"}
        return 200, {"model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}

    with ScriptedEndpoint(answer) as endpoint:
        run(endpoint, write_jsonl(tmp_path / "d.jsonl", ["Say odd things."]), tmp_path / "data")
    run_dir = tmp_path / "data" / "run"
    export_run(run_dir, "openai", tmp_path / "out")
    (kept,) = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text("utf-8").splitlines()]
    assert kept["conversations"][-1]["value"] == f"<think>\nwhy\n</think>\n{ODD_WORDS}"
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text("utf-8").splitlines()]
    assert row["messages"][-1]["content"] == ODD_WORDS
    (record,) = datasets.load_dataset("json", data_files=str(run_dir / "trajectories.jsonl"), split="train")
    assert record["conversations"][-1]["value"] == f"<think>\nwhy\n</think>\n{ODD_WORDS}"


def test_a_secret_the_model_writes_in_escapes_in_its_arguments_is_a_discard(tmp_path, monkeypatch):
    """A call's arguments are kept as the model wrote them; \\u escapes of the run's secret in them are the
    secret to any reader of the arguments: the sample is a discard, redacted in discarded.jsonl."""
    monkeypatch.setenv("PAYMENT_API_KEY", SECRET)
    arguments = '{"command": "true # ' + ESCAPED + '"}'

    def answer(call, calls):
        turns = sum(1 for m in (call["body"] or {}).get("messages", []) if m.get("role") == "assistant")
        if call["check"] or turns:
            message = {"role": "assistant", "content": "Done.", "reasoning_content": "why"}
            return 200, {"choices": [{"index": 0, "finish_reason": "stop", "message": message}]}
        message = {"role": "assistant", "content": "", "reasoning_content": "why",
                   "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": arguments}}]}  # fmt: skip
        return 200, {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}]}

    assert json.loads(arguments)["command"] == f"true # {SECRET}" and SECRET not in arguments
    with ScriptedEndpoint(answer) as endpoint:
        run(endpoint, write_jsonl(tmp_path / "d.jsonl", ["Run it."]), tmp_path / "data")
    run_dir = tmp_path / "data" / "run"
    assert not read_jsonl(run_dir / "trajectories.jsonl")
    assert [d["reason"] for d in read_jsonl(run_dir / "discarded.jsonl")] == ["secret_in_output"]
    text = (run_dir / "discarded.jsonl").read_text("utf-8")
    assert ESCAPED not in text and json.dumps(ESCAPED)[1:-1] not in text and SECRET not in text
