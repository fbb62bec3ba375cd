"""Exports that chat templates render correctly, and the exporter's choice of samples (issue 22).

The templates below are written here and follow the conventions of the real ones that trainers use:
Qwen2.5's (``tojson`` on each call's arguments, ``tools`` iterated, ``reasoning_content`` ignored),
Qwen3's (``reasoning_content`` rendered as a think block) and Hermes-3's (``tools`` iterated without a
guard, so ``tools: null`` crashes it). Jinja is the engine transformers renders them with, and ``tojson``
is registered as transformers registers it (``json.dumps``, no HTML escaping).
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
from helpers import read_jsonl, run, write_rows

from batchrun.sharegpt import reasoning_counts, system_value
from batchrun.views import export

jinja2 = pytest.importorskip("jinja2")
datasets = pytest.importorskip("datasets")

QWEN25_LIKE = """
{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role in ('system', 'user') %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}{% set f = tool_call.function %}
<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}"""

# Qwen3's: the assistant's reasoning_content becomes a think block before its words.
QWEN3_LIKE = QWEN25_LIKE.replace(
    "{% if message.content %}{{ message.content }}{% endif %}",
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{% if message.content %}{{ message.content }}{% endif %}",
)

# Hermes-3's: the tool list is iterated unconditionally.
HERMES3_LIKE = (
    "<|im_start|>system\n<tools>{% for tool in tools %} {{ tool | tojson }}{% endfor %} </tools><|im_end|>\n"
    + (QWEN25_LIKE.split("{% endif %}", 1)[1])
)


def render(template: str, messages: list[dict], tools) -> str:
    env = jinja2.Environment()
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(template).render(messages=messages, tools=tools)


PROMPTS = [
    {"prompt": "List the files [calls:2]", "id": 1},
    {"prompt": "Two at once, then answer"},  # the default plan: parallel calls in one turn
    {"prompt": "Draft it [scratchpad] [calls:1]", "id": "s"},
    {"prompt": "Describe [reasoning_details] [calls:1]"},
    {"prompt": "Answer with markup [literal_tool_call] [calls:1]"},  # discarded: ambiguous_markup
    {"prompt": "Broken arguments [bad_json] [calls:1]"},  # discarded: invalid_tool_call
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exports")
    run(None, write_rows(root / "p.jsonl", PROMPTS), root / "data", run_name="tpl", batch_size=3)
    return root / "data" / "tpl"


def _export(run_dirs, fmt: str, out: Path, *flags: str) -> list[dict]:
    dirs = [str(d) for d in (run_dirs if isinstance(run_dirs, list) else [run_dirs])]
    assert export.main([*dirs, f"--format={fmt}", f"--out={out}", *flags]) == 0
    return read_jsonl(out / "train.jsonl")


def _calls(messages: list[dict]) -> collections.Counter:
    return collections.Counter(
        json.dumps(
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
        )
        for m in messages
        for c in m.get("tool_calls") or []
    )


def test_messages_format_renders_every_call_result_and_reasoning_once(run_dir, tmp_path):
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    rows = _export(run_dir, "messages", tmp_path / "m")
    thinking = _export(run_dir, "messages", tmp_path / "t", "--reasoning=think")
    assert len(rows) == len(thinking) == len(kept) == 4
    total_reasoning = sum(reasoning_counts(r["conversations"])[0] for r in kept)
    rendered_reasoning = {"qwen3": 0, "qwen25_think": 0, "qwen25_field": 0}
    for row, think_row in zip(rows, thinking, strict=True):
        assert isinstance(row["tools"], list) and row["tools"]
        calls = _calls(row["messages"])
        assert calls and all(isinstance(m, dict) for m in [json.loads(c)["arguments"] for c in calls])
        results = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        assert len(results) == sum(calls.values())
        for template in (QWEN25_LIKE, QWEN3_LIKE, HERMES3_LIKE):
            text = render(template, row["messages"], row["tools"])
            for call, n in calls.items():
                assert text.count(call) == n, call
            assert '"arguments": "' not in text  # no double-encoded arguments
            for result in results:
                assert text.count(f"<tool_response>\n{result}\n</tool_response>") == results.count(result)
        for msg in row["messages"]:
            if msg.get("reasoning_content"):
                block = f"<think>\n{msg['reasoning_content']}\n</think>"
                rendered_reasoning["qwen3"] += render(QWEN3_LIKE, row["messages"], row["tools"]).count(block)
                rendered_reasoning["qwen25_field"] += render(
                    QWEN25_LIKE, row["messages"], row["tools"]
                ).count(block)
                rendered_reasoning["qwen25_think"] += render(
                    QWEN25_LIKE, think_row["messages"], think_row["tools"]
                ).count(block)
        assert not any("reasoning_content" in m for m in think_row["messages"])
    assert total_reasoning > 0
    # Qwen3-style templates read reasoning_content; Qwen2.5-style ones drop it unless folded into content.
    assert rendered_reasoning == {
        "qwen3": total_reasoning,
        "qwen25_think": total_reasoning,
        "qwen25_field": 0,
    }


def test_the_openai_format_keeps_string_arguments_which_such_templates_double_encode(run_dir, tmp_path):
    rows = _export(run_dir, "openai", tmp_path / "o")
    row = next(r for r in rows if any(m.get("tool_calls") for m in r["messages"]))
    call = next(c for m in row["messages"] for c in m.get("tool_calls") or [])
    assert isinstance(call["function"]["arguments"], str)
    assert '"arguments": "{' in render(QWEN25_LIKE, row["messages"], json.loads(row["tools"]))
    dropped = _export(run_dir, "openai", tmp_path / "d", "--reasoning=drop")
    assert not any(
        "reasoning_content" in m or "<think>" in (m.get("content") or "")
        for r in dropped
        for m in r["messages"]
    )


def test_tools_is_always_a_list_and_hermes_style_templates_render_a_sample_without_tools(run_dir, tmp_path):
    no_tools = tmp_path / "runs" / "no_tools"
    no_tools.mkdir(parents=True)
    rec = read_jsonl(run_dir / "trajectories.jsonl")[0]
    rec["conversations"] = (
        [{"from": "system", "value": system_value([]), "tool_calls": []}]
        + [{**t, "tool_calls": []} for t in rec["conversations"][1:2]]
        + [{"from": "gpt", "value": "<think>\nhm\n</think>\nHello.", "tool_calls": []}]
    )
    (no_tools / "trajectories.jsonl").write_text(json.dumps(rec) + "\n", "utf-8")
    (row,) = _export(no_tools, "messages", tmp_path / "nt")
    assert row["tools"] == []
    assert "Hello." in render(HERMES3_LIKE, row["messages"], row["tools"])
    with pytest.raises(TypeError):  # what a null tools column does to such a template
        render(HERMES3_LIKE, row["messages"], None)


def test_prompt_completion_is_trls_conversational_layout(run_dir, tmp_path):
    rows = _export(run_dir, "messages", tmp_path / "m")
    pairs = _export(run_dir, "prompt_completion", tmp_path / "pc")
    assert len(pairs) == len(rows)
    for row, pair in zip(rows, pairs, strict=True):
        assert {m["role"] for m in pair["prompt"]} <= {"system", "user"} and pair["prompt"]
        assert pair["completion"][0]["role"] == "assistant"
        assert pair["prompt"] + pair["completion"] == row["messages"]
        assert pair["tools"] == row["tools"]
    for fmt in ("messages", "prompt_completion"):
        loaded = datasets.load_dataset(
            str(tmp_path / ("m" if fmt == "messages" else "pc")),
            split="train",
            cache_dir=str(tmp_path / f"c{fmt}"),
        )
        assert loaded.num_rows == len(rows)


def test_every_row_carries_the_columns_a_trainer_joins_on(run_dir, tmp_path):
    for fmt in ("messages", "openai", "sharegpt"):
        for row in _export(run_dir, fmt, tmp_path / fmt):
            assert row["run_name"] == "tpl" and row["stop_reason"] == "final_answer"
            assert row["sample_index"] == 0 and isinstance(row["row_id"], str)
            assert row["usage"]["calls"] >= 1 and isinstance(row["usage"]["providers"], str)
    export.main([str(run_dir), "--format=parquet", f"--out={tmp_path / 'pq'}"])
    loaded = datasets.load_dataset(str(tmp_path / "pq"), split="train", cache_dir=str(tmp_path / "cpq"))
    assert set(loaded.column_names) >= {"run_name", "stop_reason", "sample_index", "usage", "row_id"}
    assert sorted(loaded["row_id"]) == ["", "", "1", "s"]


def test_discarded_samples_come_out_split_correctly(run_dir, tmp_path):
    discards = {d["reason"]: d for d in read_jsonl(run_dir / "discarded.jsonl")}
    assert set(discards) == {"ambiguous_markup", "invalid_tool_call"}
    rows = _export(run_dir, "messages", tmp_path / "all", "--include_discarded")
    by_reason = {r["discard_reason"]: r for r in rows}
    assert set(by_reason) == {"", "ambiguous_markup", "invalid_tool_call"} and len(rows) == 6
    ambiguous = by_reason["ambiguous_markup"]["messages"]
    gpt = [t["value"] for t in discards["ambiguous_markup"]["record"]["conversations"] if t["from"] == "gpt"]
    # The last turn's text as written, reasoning markup and the literal <tool_call> words included.
    assert ambiguous[-1]["content"] == gpt[-1] and "<tool_call>" in gpt[-1]
    assert not any("reasoning_content" in m for m in ambiguous)
    bad = [c for m in by_reason["invalid_tool_call"]["messages"] for c in m.get("tool_calls") or []]
    raw = [c for c in bad if "raw_arguments" in c]
    assert len(raw) == 1 and raw[0]["function"]["arguments"] == {}
    recorded = [
        c["function"]["arguments"]
        for t in discards["invalid_tool_call"]["record"]["conversations"]
        for c in t["tool_calls"]
    ]
    assert raw[0]["raw_arguments"] in recorded
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw[0]["raw_arguments"])


def test_an_openai_export_with_raw_arguments_loads_by_its_card(run_dir, tmp_path):
    """An invalid_tool_call discard's call carries raw_arguments in the openai rows too; the card's
    features did not declare it, so load_dataset(<export dir>) refused the whole export."""
    _export(run_dir, "openai", tmp_path / "o", "--include_discarded")
    loaded = datasets.load_dataset(str(tmp_path / "o"), split="train", cache_dir=str(tmp_path / "c"))
    calls = [c for row in loaded for m in row["messages"] for c in m["tool_calls"] or []]
    raw = [c["raw_arguments"] for c in calls if c["raw_arguments"] is not None]
    assert len(raw) == 1 and raw[0] == next(c["function"]["arguments"] for c in calls if c["raw_arguments"])


def _run_copy(run_dir: Path, dest: Path, edit=None) -> Path:
    dest.mkdir(parents=True)
    records = read_jsonl(run_dir / "trajectories.jsonl")
    if edit:
        edit(records)
    (dest / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    shutil.copy(run_dir / "discarded.jsonl", dest / "discarded.jsonl")
    return dest


def test_stop_reason_filters_leave_out_model_faults_by_default(run_dir, tmp_path):
    def fault(records):
        records[0]["metadata"]["stop_reason"] = "invalid_tool_calls"
        records[0]["partial"], records[0]["completed"] = True, False

    faulty = _run_copy(run_dir, tmp_path / "runs" / "faulty", fault)
    assert len(_export(faulty, "openai", tmp_path / "a")) == 3
    card = (tmp_path / "a" / "README.md").read_text("utf-8")
    assert "1 stop_reason invalid_tool_calls" in card
    assert len(_export(faulty, "openai", tmp_path / "b", "--exclude_stop_reasons=max_turns")) == 4
    only = _export(faulty, "openai", tmp_path / "c", "--stop_reasons=invalid_tool_calls")
    assert [r["stop_reason"] for r in only] == ["invalid_tool_calls"]
    assert (
        export.main(
            [
                str(faulty),
                "--format=openai",
                f"--out={tmp_path / 'd'}",
                "--stop_reasons=a",
                "--exclude_stop_reasons=b",
            ]
        )
        == 2
    )


def test_a_reply_cut_by_the_length_limit_is_not_exported_for_training_by_default(run_dir, tmp_path):
    """A truncated sample's last reply stops mid-sentence; a trainer's chat template closes it with the
    end-of-turn token, so the model learns to stop there. It was exported by default with only a
    stop_reason column to tell (3 of 6 exported samples of a 16-row run were partial, 2 of them cut)."""

    def cut(records):
        records[1]["metadata"]["stop_reason"] = "truncated"
        records[1]["partial"], records[1]["completed"] = True, False

    cut_run = _run_copy(run_dir, tmp_path / "runs" / "cut", cut)
    rows = _export(cut_run, "messages", tmp_path / "a")
    assert len(rows) == 3 and "truncated" not in {r["stop_reason"] for r in rows}
    assert "1 stop_reason truncated" in (tmp_path / "a" / "README.md").read_text("utf-8")
    asked = _export(cut_run, "messages", tmp_path / "b", "--exclude_stop_reasons=invalid_tool_calls")
    assert [r["stop_reason"] for r in asked].count("truncated") == 1


def test_dedup_removes_byte_identical_samples_within_and_across_runs(run_dir, tmp_path):
    twin = _run_copy(run_dir, tmp_path / "runs" / "twin", lambda recs: recs.append(recs[0]))
    assert len(_export([run_dir, twin], "openai", tmp_path / "all")) == 9
    deduped = _export([run_dir, twin], "openai", tmp_path / "dedup", "--dedup")
    assert len(deduped) == 4 and {r["run_name"] for r in deduped} == {"tpl"}
    assert "5 duplicate" in (tmp_path / "dedup" / "README.md").read_text("utf-8")


def test_an_export_with_nothing_to_export_never_leaves_a_dataset_that_cannot_load(tmp_path, capsys):
    empty = tmp_path / "runs" / "empty"
    empty.mkdir(parents=True)
    (empty / "trajectories.jsonl").write_text("", "utf-8")
    for fmt in ("messages", "parquet"):
        assert export.main([str(empty), f"--format={fmt}", f"--out={tmp_path / fmt}"]) == 1
        assert "nothing to export" in capsys.readouterr().err and not (tmp_path / fmt).exists()
    # Everything left out by the filters: the message says why.
    assert (
        export.main([str(empty), "--format=openai", f"--out={tmp_path / 'o'}", "--no-include_partial"]) == 1
    )


@pytest.mark.parametrize("mode", ["field", "drop"])
def test_one_warning_counts_the_samples_whose_markup_stays_unsplit(run_dir, tmp_path, capsys, mode):
    """An ambiguous_markup discard's assistant text is exported unsplit (documented), so --reasoning=drop
    or field is not applied to it: its <think> blocks stay in content. Nothing said so; one line now
    counts them (not one per sample)."""
    twin = _run_copy(run_dir, tmp_path / "runs" / "twin")
    rows = _export([run_dir, twin], "messages", tmp_path / "m", "--include_discarded", f"--reasoning={mode}")
    ambiguous = [r for r in rows if r["discard_reason"] == "ambiguous_markup"]
    assert len(ambiguous) == 2 and all("<think>" in r["messages"][-1]["content"] for r in ambiguous)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "unsplit" in line]
    assert warnings == [
        "warning: 2 exported samples (ambiguous_markup discards) kept their assistant text unsplit, "
        f"<think> markup included: --reasoning={mode} was not applied to them"
    ]
    # Nothing to warn of: no such sample exported, or their reasoning asked for in content anyway.
    _export(run_dir, "messages", tmp_path / "kept", f"--reasoning={mode}")
    _export(run_dir, "messages", tmp_path / "think", "--include_discarded", "--reasoning=think")
    assert "unsplit" not in capsys.readouterr().err


def test_one_warning_counts_the_samples_whose_invalid_calls_templates_render_as_empty_objects(
    run_dir, tmp_path, capsys
):
    """A call whose arguments are no JSON object (an invalid_tool_call discard, or a sample kept by
    --keep_invalid_tool_calls) is {} in the template formats, its text in raw_arguments: a chat template
    renders a call the model never wrote. Nothing said so."""
    rows = _export(run_dir, "messages", tmp_path / "m", "--include_discarded")
    bad = [r for r in rows if r["discard_reason"] == "invalid_tool_call"]
    calls = [c for r in bad for m in r["messages"] for c in m.get("tool_calls") or []]
    assert bad and any(c["function"]["arguments"] == {} and c.get("raw_arguments") for c in calls)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "no JSON object" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {len(bad)} exported sample"), warnings
    # The API's shape keeps the model's text in arguments: nothing to warn of; nor without such samples.
    _export(run_dir, "openai", tmp_path / "o", "--include_discarded")
    _export(run_dir, "messages", tmp_path / "kept")
    assert "no JSON object" not in capsys.readouterr().err


def test_an_exclusion_list_without_a_default_reason_says_those_samples_are_now_exported(
    run_dir, tmp_path, capsys
):
    """--exclude_stop_reasons replaces the default exclusions (documented), so naming another reason
    silently exported the cut-off samples. The semantics stay; one note says what is exported now."""
    _export(run_dir, "messages", tmp_path / "a", "--exclude_stop_reasons=invalid_tool_calls")
    _export(run_dir, "messages", tmp_path / "b", "--exclude_stop_reasons=max_turns")
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: --exclude_stop_reasons replaces the default (invalid_tool_calls,truncated): "
        "samples that stopped for truncated are exported",
        "note: --exclude_stop_reasons replaces the default (invalid_tool_calls,truncated): "
        "samples that stopped for invalid_tool_calls or truncated are exported",
    ]
    # The defaults named again, or a format whose default excludes nothing: nothing to say.
    _export(
        run_dir, "messages", tmp_path / "c", "--exclude_stop_reasons=truncated,max_turns,invalid_tool_calls"
    )
    _export(run_dir, "messages", tmp_path / "d")
    assert "note:" not in capsys.readouterr().err
