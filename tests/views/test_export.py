"""The trainer exporter (batchrun/views/export.py) over a real run: the CLI with the built-in fake model
(``--model=mock``), then every format checked with the ``openai`` package's own message types and
loaded with the real ``datasets`` loader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from helpers import read_jsonl, write_jsonl
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
)
from pydantic import TypeAdapter

from batchrun.sharegpt import first_human, parse_tool_calls
from batchrun.views import export

REPO = Path(__file__).resolve().parents[2]
PLAIN = [f"Plain task number {i}: list the files" for i in range(12)]
PROMPTS = [
    *PLAIN,
    "Draft an email [scratchpad] [calls:2]",
    "Describe a cat [reasoning_details] [calls:1]",
    "Quick reply [no_reasoning] [calls:0]",  # discarded: no reasoning
    "Keep going forever [loop]",  # partial: stops at --max_turns
]
MESSAGE_TYPES = {
    "user": ChatCompletionUserMessageParam,
    "assistant": ChatCompletionAssistantMessageParam,
    "tool": ChatCompletionToolMessageParam,
}
ANY_MESSAGE = TypeAdapter(ChatCompletionMessageParam)
TOOL = TypeAdapter(ChatCompletionFunctionToolParam)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One real run of the CLI against the built-in fake model (no key, no network)."""
    root = tmp_path_factory.mktemp("export-run")
    write_jsonl(root / "p.jsonl", PROMPTS)
    done = subprocess.run(
        [
            sys.executable, str(REPO / "batch_runner.py"), "--dataset_file=p.jsonl", "--batch_size=4",
            "--run_name=r", "--model=mock", "--num_workers=1", "--distribution=terminal_only", "--max_turns=3",
        ],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "data" / "r"


def rows(path: Path) -> list[dict]:
    return [row for file in sorted(path.glob("*.jsonl")) for row in read_jsonl(file)]


def check_openai_message(msg: dict) -> None:
    """The message validates as the openai package's type for its role, with no key that type lacks."""
    kind = MESSAGE_TYPES[msg["role"]]
    TypeAdapter(kind).validate_python(msg)
    ANY_MESSAGE.validate_python(msg)
    allowed = set(kind.__annotations__) | ({"reasoning_content"} if msg["role"] == "assistant" else set())
    assert set(msg) <= allowed, msg


def test_openai_format_messages_validate_and_match_the_records(run_dir, tmp_path):
    result = export.export_run(run_dir, "openai", tmp_path / "out")
    records = {first_human(r["conversations"]): r for r in read_jsonl(run_dir / "trajectories.jsonl")}
    exported = rows(tmp_path / "out")
    assert result.rows["train"] == len(exported) == len(records) == len(PROMPTS) - 1
    assert "test" not in result.files  # no split asked for
    saw_parallel = saw_partial = False
    for row in exported:
        messages = row["messages"]
        for msg in messages:
            check_openai_message(msg)
        for tool in json.loads(row["tools"]):
            TOOL.validate_python(tool)
        assert {t["function"]["name"] for t in json.loads(row["tools"])} >= {"terminal", "read_file"}
        record = records[messages[0]["content"]]
        assert messages[0]["role"] == "user"  # the preamble is not a message: its tool list is `tools`
        saw_partial |= row["partial"]
        gpt = [t for t in record["conversations"] if t["from"] == "gpt"]
        assistants = [m for m in messages if m["role"] == "assistant"]
        assert len(assistants) == len(gpt)
        pending: list[str] = []
        for msg, turn in zip(assistants, gpt, strict=True):
            # Calls only in tool_calls: the text markup is gone from content, and reasoning has its own field.
            for tag in ("<tool_call>", "</tool_call>", "<think>", "</think>", "REASONING_SCRATCHPAD"):
                assert tag not in (msg.get("content") or ""), msg
            calls = msg.get("tool_calls", [])
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
                (c["name"], c["arguments"]) for c in parse_tool_calls(turn["value"])
            ]
            assert [c["id"] for c in calls] == [c["id"] for c in turn.get("tool_calls", [])]
            if "[no_reasoning]" not in messages[0]["content"]:
                assert msg["reasoning_content"] and msg["reasoning_content"] in turn["value"]
            saw_parallel |= len(calls) > 1
        # Each tool message answers one call of the assistant message before it, in order.
        for msg in messages:
            if msg["role"] == "assistant":
                pending = [c["id"] for c in msg.get("tool_calls", [])]
            elif msg["role"] == "tool":
                assert msg["tool_call_id"] == pending.pop(0)
        tool_messages = [m for m in messages if m["role"] == "tool"]
        assert len(tool_messages) == sum(s["count"] for s in record["tool_stats"].values())
    assert saw_parallel and saw_partial


def test_reasoning_from_each_source_lands_in_reasoning_content(run_dir, tmp_path):
    export.export_run(run_dir, "openai", tmp_path / "out")
    by_prompt = {r["messages"][0]["content"]: r["messages"] for r in rows(tmp_path / "out")}
    scratch = [m for m in by_prompt["Draft an email [scratchpad] [calls:2]"] if m["role"] == "assistant"]
    details = [
        m for m in by_prompt["Describe a cat [reasoning_details] [calls:1]"] if m["role"] == "assistant"
    ]
    for msgs in (scratch, details):
        assert all(m["reasoning_content"].startswith("The user asks:") for m in msgs), msgs
        assert all(not (m.get("content") or "").startswith("The user asks:") for m in msgs)


def test_partial_and_discarded_are_chosen_by_flags(run_dir, tmp_path):
    without = export.export_run(run_dir, "openai", tmp_path / "a", include_partial=False)
    assert without.skipped["partial"] == 1
    assert not any(r["partial"] for r in rows(tmp_path / "a"))
    everything = export.export_run(run_dir, "openai", tmp_path / "b", include_discarded=True)
    discarded = [r for r in rows(tmp_path / "b") if r["discard_reason"]]
    assert [(r["messages"][0]["content"], r["discard_reason"]) for r in discarded] == [
        ("Quick reply [no_reasoning] [calls:0]", "no_reasoning")
    ]
    assert sum(everything.rows.values()) == len(PROMPTS)
    for msg in discarded[0]["messages"]:
        check_openai_message(msg)


@pytest.mark.parametrize("fmt", ["openai", "sharegpt", "messages"])
def test_an_export_with_discarded_samples_and_one_without_load_together_in_either_order(
    run_dir, tmp_path, fmt
):
    """discard_reason is a string in every row ("" for a kept sample): a file of kept samples only does
    not give the column the null type, which datasets could not then read with a file holding reasons."""
    export.export_run(run_dir, fmt, tmp_path / "kept")
    export.export_run(run_dir, fmt, tmp_path / "all", include_discarded=True)
    kept, every = sorted((tmp_path / "kept").glob("*.jsonl")), sorted((tmp_path / "all").glob("*.jsonl"))
    assert {r["discard_reason"] for r in rows(tmp_path / "kept")} == {""}
    for i, files in enumerate((kept + every, every + kept)):
        loaded = datasets.load_dataset(
            "json", data_files=[str(f) for f in files], split="train", cache_dir=str(tmp_path / f"c{i}")
        )
        assert loaded.num_rows == 2 * len(PROMPTS) - 1  # the discarded sample in one of them
        assert sorted(r for r in loaded["discard_reason"] if r) == ["no_reasoning"]


def test_split_is_deterministic_by_seed_and_each_format_loads_with_datasets(run_dir, tmp_path):
    def split_of_prompts(fmt: str, seed: int, name: str) -> dict[str, list[str]]:
        out = tmp_path / name
        export.export_run(run_dir, fmt, out, test_fraction=0.3, seed=seed)
        loaded = datasets.load_dataset(str(out))  # through the dataset card, as from the Hub
        assert set(loaded) == {"train", "test"}
        assert loaded["train"].features == loaded["test"].features
        key = "conversations" if fmt == "sharegpt" else "messages"
        firsts = {}
        for split in loaded:
            if fmt == "sharegpt":
                firsts[split] = sorted(r[key][1]["value"] for r in loaded[split])
            else:
                firsts[split] = sorted(r[key][0]["content"] for r in loaded[split])
        return firsts

    a = split_of_prompts("openai", 7, "a")
    assert a == split_of_prompts("openai", 7, "a2")  # same seed, same split
    assert a == split_of_prompts("parquet", 7, "p")  # and the same in every format
    assert a == split_of_prompts("sharegpt", 7, "s")
    assert a != split_of_prompts("openai", 8, "b")  # another seed, another split
    assert len(a["train"]) + len(a["test"]) == len(PROMPTS) - 1 and a["test"]


def test_parquet_has_one_typed_schema_and_messages_validate_once_nulls_are_dropped(run_dir, tmp_path):
    export.export_run(run_dir, "parquet", tmp_path / "out")
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "train.parquet"))["train"]
    assert loaded.features["tools"] == datasets.Value("string")
    messages = loaded.features["messages"]  # datasets 5: List(...); older versions: [dict]
    assert set(messages[0] if isinstance(messages, list) else messages.feature) == {
        "role", "content", "reasoning_content", "tool_calls", "tool_call_id",
    }  # fmt: skip
    assert len(loaded) == len(PROMPTS) - 1
    for row in loaded:
        for msg in row["messages"]:
            check_openai_message({k: v for k, v in msg.items() if v is not None})


def test_sharegpt_keeps_the_records_text_without_structured_calls(run_dir, tmp_path):
    export.export_run(run_dir, "sharegpt", tmp_path / "out")
    records = {first_human(r["conversations"]): r for r in read_jsonl(run_dir / "trajectories.jsonl")}
    for row in rows(tmp_path / "out"):
        record = records[first_human(row["conversations"])]
        assert row["conversations"] == [
            {"from": t["from"], "value": t["value"]} for t in record["conversations"]
        ]
        assert json.loads(row["tools"])


def test_cli_refuses_a_non_empty_output_and_skips_malformed_lines(run_dir, tmp_path):
    copy = tmp_path / "run"
    copy.mkdir()
    text = (run_dir / "trajectories.jsonl").read_text("utf-8")
    (copy / "trajectories.jsonl").write_text('{"torn": \n' + text + "not json\n", "utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    argv = [str(copy), "--format=openai", f"--out={out}"]
    assert export.main(argv) == 2  # would upload stale.txt with the export
    assert export.main([*argv, "--overwrite"]) == 0
    result = export.export_run(copy, "openai", tmp_path / "out2")
    assert result.skipped["malformed lines"] == 2
    assert result.rows["train"] == len(PROMPTS) - 1
    done = subprocess.run(
        [sys.executable, "-m", "batchrun.views.export", str(tmp_path / "nothing"), "--format=parquet",
         f"--out={tmp_path / 'o'}"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2 and "no trajectories.jsonl" in done.stderr


@pytest.mark.parametrize("fmt", ["openai", "rewards"])
def test_cli_on_an_output_that_is_a_file_or_cannot_be_made(run_dir, tmp_path, fmt):
    # --out naming a file, or a folder that cannot be made (its parent is a file), ended in a
    # NotADirectoryError traceback (exit 1): one line naming the path, exit 2, as for a bad request.
    a_file = tmp_path / "export.jsonl"
    a_file.write_text("keep me\n")
    for out in (a_file, a_file / "sub"):
        done = subprocess.run(
            [sys.executable, "-m", "batchrun.views.export", str(run_dir), f"--format={fmt}", f"--out={out}"],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and done.stderr.startswith("error: ")
        assert str(out) in done.stderr
    assert a_file.read_text() == "keep me\n"


def test_parquet_without_pyarrow_is_a_clear_error(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    assert export.main([str(run_dir), "--format=parquet", f"--out={tmp_path / 'out'}"]) == 2
    assert "needs pyarrow: pip install 'batch-runner[export]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_records_that_do_not_parse_back_are_left_out_and_counted(run_dir, tmp_path):
    records = read_jsonl(run_dir / "trajectories.jsonl")
    with_calls = [r for r in records if any(t.get("tool_calls") for t in r["conversations"])]
    first, second = with_calls[0], with_calls[1]
    next(t for t in first["conversations"] if t.get("tool_calls"))["tool_calls"][0]["function"][
        "arguments"
    ] = '{"command": "not what the text says"}'
    next(t for t in second["conversations"] if t.get("tool_calls"))["tool_calls"][0]["id"] = 5
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    result = export.export_run(copy, "parquet", tmp_path / "out")
    assert result.skipped == {"unparsable (ValueError)": 2}
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "train.parquet"))["train"]
    assert len(loaded) == len(records) - 2
    assert first["prompt_index"] not in loaded["prompt_index"]


@pytest.mark.parametrize("value", ["nan", "1.5", "-0.1"])
def test_a_min_score_outside_the_scores_range_is_refused(run_dir, tmp_path, capsys, value):
    """--min_score=nan left nothing out (every comparison with nan is false) and 1.5 everything, silently."""
    assert (
        export.main([str(run_dir), "--format=openai", f"--out={tmp_path / 'o'}", f"--min_score={value}"]) == 2
    )
    assert "--min_score must be a score from 0 to 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_discarded_sample_run_again_is_exported_once(tmp_path):
    """--rerun_discarded runs a discarded sample again; its old line stays in discarded.jsonl (append-only).
    An export with --include_discarded gave the sample twice (its old discard beside its new outcome),
    where statistics.json counts it once: training data with a duplicated sample."""
    from helpers import run

    dataset = write_jsonl(tmp_path / "d.jsonl", ["terse [no_reasoning]", "fine"])
    out = tmp_path / "data"
    run(None, dataset, out)
    run(None, dataset, out, resume=True, rerun_discarded=True)  # discarded again
    run(None, dataset, out, resume=True, rerun_discarded=True, keep_no_reasoning=True, force_resume=True)
    assert len(read_jsonl(out / "run" / "discarded.jsonl")) == 2  # both old discards stay
    result = export.export_run(out / "run", "openai", tmp_path / "o", include_discarded=True)
    exported = rows(tmp_path / "o")
    assert sorted(
        r["messages"][0 if r["messages"][0]["role"] == "user" else 1]["content"] for r in exported
    ) == [
        "fine",
        "terse [no_reasoning]",
    ]
    assert result.skipped["discarded sample run again"] == 2


def test_a_rows_system_prompt_that_mentions_tools_markup_does_not_cost_the_sample_its_tools(tmp_path):
    """A row's own system prompt comes before the preamble's ``<tools>`` list in the system entry. One that
    writes ``<tools>`` and a line break without closing it made the exporter read its tool list from there
    up to the preamble's ``</tools>``: not JSON, so the kept sample was left out of every format as
    "unparsable"; the report read a ``<tools>`` block of the row's own as the tools offered."""
    from helpers import run, write_rows

    from batchrun.views.report import _offered_tools

    systems = {
        "open": "Tools you know:\n<tools>\nnone listed here",
        "block": 'Use <tools>\n[{"name": "fake_tool"}]\n</tools> wisely.',
    }
    dataset = write_rows(
        tmp_path / "d.jsonl", [{"prompt": f"{k} [calls:1]", "system": v} for k, v in systems.items()]
    )
    run(None, dataset, tmp_path / "data")
    records = {
        first_human(r["conversations"]): r
        for r in read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    }
    assert len(records) == 2
    for fmt in ("openai", "messages"):
        result = export.export_run(tmp_path / "data" / "run", fmt, tmp_path / fmt)
        assert not result.skipped
        exported = rows(tmp_path / fmt)
        assert len(exported) == 2
        for row in exported:
            prompt = next(m["content"] for m in row["messages"] if m["role"] == "user")
            assert row["messages"][0] == {"role": "system", "content": systems[prompt.split()[0]]}
            tools = row["tools"] if fmt == "messages" else json.loads(row["tools"])
            assert [t["function"]["name"] for t in tools] == records[prompt]["metadata"]["tools_offered"]
    for record in records.values():
        offered = record["metadata"]["tools_offered"]
        assert _offered_tools(record["conversations"][0]["value"]) == offered


def test_the_export_names_the_discarded_and_failed_samples_it_leaves_out(tmp_path, capsys):
    """An export without --include_discarded said "Not exported: none" (card and summary) for a run whose
    discarded.jsonl held samples set aside by the filters and whose failed.jsonl held a sample with no
    outcome: a trainer reading the card could not tell the dataset was missing them, nor why."""
    from helpers import run

    dataset = write_jsonl(
        tmp_path / "d.jsonl",
        ["fine [calls:1]", "terse [no_reasoning]", "nothing said [empty_answer]", "broken [error:500]"],
    )
    out = tmp_path / "data"
    run(None, dataset, out)
    run(None, dataset, out, resume=True)  # the failing sample fails again: two attempts, one sample
    assert len(read_jsonl(out / "run" / "failed.jsonl")) == 2
    want = {
        "discarded (no_reasoning)": 1,
        "discarded (empty_answer)": 1,
        "failed (no outcome yet; --resume runs it again)": 1,
    }
    assert export.main([str(out / "run"), "--format=openai", f"--out={tmp_path / 'o'}"]) == 0
    assert (
        "not exported: 1 discarded (empty_answer), 1 discarded (no_reasoning), 1 failed"
        in capsys.readouterr().out
    )
    card = (tmp_path / "o" / "README.md").read_text("utf-8")
    assert (
        "- Not exported: 1 discarded (empty_answer), 1 discarded (no_reasoning), 1 failed (no outcome" in card
    )
    assert len(rows(tmp_path / "o")) == 1
    everything = export.export_run(out / "run", "openai", tmp_path / "all", include_discarded=True)
    assert everything.skipped == {"failed (no outcome yet; --resume runs it again)": 1}
    assert sum(everything.rows.values()) == 3
    assert export.export_run(out / "run", "sharegpt", tmp_path / "s").skipped == want


def test_reasoning_the_provider_sent_encrypted_only_is_not_exported_as_the_models_thinking(tmp_path):
    """A provider that sends its reasoning only encrypted (OpenRouter's ``reasoning_details`` of type
    ``reasoning.encrypted``) leaves the record's think blocks holding the runner's marker. The exporter
    gave that marker to trainers as the model's own reasoning: ``reasoning_content`` of every assistant
    turn, or ``<think>`` text in ``content`` with --reasoning=think, which a model trained on learns to say."""
    from helpers import ScriptedEndpoint, run

    from batchrun.sharegpt import ENCRYPTED_REASONING

    encrypted = [{"type": "reasoning.encrypted", "data": "gAAAAB-opaque==", "id": "rs_1", "index": 0}]

    def answer(call: dict, calls: list[dict]):
        if call["check"]:
            return 200, {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "OK"}}]}
        if not any(m.get("role") == "tool" for m in call["body"]["messages"]):
            tc = [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "terminal", "arguments": '{"command": "echo hi"}'},
                }
            ]
            msg = {"role": "assistant", "content": "", "reasoning_details": encrypted, "tool_calls": tc}
            return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls"}]}
        msg = {"role": "assistant", "content": "It printed hi.", "reasoning_details": encrypted}
        return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}

    with ScriptedEndpoint(answer) as endpoint:
        run(None, write_jsonl(tmp_path / "d.jsonl", ["Say hi"]), tmp_path / "data", model="m",
            base_url=endpoint.base_url, api_key="sk-scripted-test", num_workers=1)  # fmt: skip
    (record,) = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert ENCRYPTED_REASONING in record["conversations"][-1]["value"]  # the record's marker, as documented
    for fmt, mode in [
        ("openai", "field"),
        ("messages", "think"),
        ("prompt_completion", "field"),
        ("parquet", "think"),
    ]:
        export.export_run(tmp_path / "data" / "run", fmt, tmp_path / f"{fmt}-{mode}", reasoning=mode)
        if fmt == "parquet":
            (row,) = datasets.load_dataset(
                "parquet", data_files=str(tmp_path / f"{fmt}-{mode}" / "train.parquet")
            )["train"]
        else:
            (row,) = rows(tmp_path / f"{fmt}-{mode}")
        messages = row["messages"] if "messages" in row else row["prompt"] + row["completion"]
        assistant = [m for m in messages if m["role"] == "assistant"]
        assert [m["content"] for m in assistant] == [None, "It printed hi."], fmt
        assert not any(m.get("reasoning_content") for m in assistant), fmt
        assert "encrypted" not in json.dumps(messages), fmt


@pytest.mark.parametrize("fmt", ["messages", "openai", "prompt_completion", "sharegpt"])
def test_a_record_s_non_finite_usage_counts_are_exported_as_unreported_not_as_nan(run_dir, tmp_path, fmt):
    # A record another tool wrote (or a hand edited) with NaN or Infinity in metadata.usage: the export
    # wrote them as they were, lines that strict JSON readers (JSON.parse, serde, Python with
    # parse_constant) refuse. Such a count is one no response reported: 0, named in ``unreported``.
    records = read_jsonl(run_dir / "trajectories.jsonl")
    usage = records[0]["metadata"]["usage"]
    usage.update(prompt_tokens=float("nan"), cost_usd=float("inf"), completion_tokens=float("-inf"))
    usage["retries"] = "three"
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    assert "NaN" in (copy / "trajectories.jsonl").read_text("utf-8")
    export.export_run(copy, fmt, tmp_path / "out")

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    lines = [
        json.loads(line, parse_constant=refuse)
        for file in sorted((tmp_path / "out").glob("*.jsonl"))
        for line in file.read_text("utf-8").splitlines()
    ]
    assert len(lines) == len(records)
    first = next(r for r in lines if r["prompt_index"] == records[0]["prompt_index"])
    assert (first["usage"]["prompt_tokens"], first["usage"]["cost_usd"], first["usage"]["retries"]) == (
        0,
        0.0,
        0,
    )
    assert {"prompt_tokens", "completion_tokens", "cost_usd"} <= set(json.loads(first["usage"]["unreported"]))


def test_an_export_never_goes_into_a_run_directory(run_dir, tmp_path, capsys):
    # --out naming the run directory itself (or another run's) with --overwrite: the export's dataset card
    # replaced the run's README.md (the record schema load_dataset reads the run with) and its train.jsonl
    # went in beside the run's files, so load_dataset of the run loaded the export instead.
    import shutil

    copy = tmp_path / "r"
    shutil.copytree(run_dir, copy)
    card = (copy / "README.md").read_text("utf-8")
    names = sorted(p.name for p in copy.iterdir())
    for out in (copy, run_dir):
        capsys.readouterr()
        assert export.main([str(copy), "--format=messages", f"--out={out}", "--overwrite"]) == 2
        assert f"--out {out} is a run directory" in capsys.readouterr().err
    assert (copy / "README.md").read_text("utf-8") == card
    assert sorted(p.name for p in copy.iterdir()) == names
    assert (
        export.main([str(copy), "--format=messages", f"--out={copy / 'export'}"]) == 0
    )  # inside: a folder of its own
