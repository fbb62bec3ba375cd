"""The preference and rewards exports through TRL's own dataset helpers (``trl.data_utils``), when TRL
and transformers are importable (they are not test dependencies: TRL pulls in torch). TRL applies a
chat template to each example and checks that the prompt's rendering is a prefix of the prompt plus
the completion: the pairs must render as conversations, tool calls and results included."""

from __future__ import annotations

import json
import re

import pytest
from helpers import run, write_rows

from batchrun.views import export

data_utils = pytest.importorskip("trl.data_utils")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# A chat template in the usual Hermes style (system with the tools, <tool_call> blocks, tool results
# as <tool_response>), written for this test.
TEMPLATE = (
    "{% if tools %}<|system|>Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function']['name'] }} {{ c['function']['arguments'] }}</tool_call>{% endfor %}"
    "<|end|>\n"
    "{% elif m['role'] == 'tool' %}<|tool|><tool_response>{{ m['content'] }}</tool_response><|end|>\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(template: str):
    """A real transformers tokenizer (one word-level vocabulary, built here: no download) with ``template``."""
    model = tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer(TEMPLATE)


ROWS = [
    # Sample 0 answers 41 (fails), sample 1 42 (passes): one pair, judged alike.
    {"id": "flip", "prompt": "Say 42, try 0 [calls:1] [answers:42|41]", "answer": "42"},
    {"id": "right", "prompt": "Say 7 [calls:1] [answer:7]", "answer": "7"},
]


def test_preference_and_rewards_rows_through_trl(tmp_path, tokenizer):
    dataset = write_rows(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "data"
    run(None, dataset, out, samples_per_prompt=2, seed_per_request=True)
    pref, rewards = tmp_path / "pref", tmp_path / "rewards"
    assert export.main([str(out / "run"), "--format=preference", f"--out={pref}"]) == 0
    assert export.main([str(out / "run"), "--format=rewards", f"--out={rewards}"]) == 0
    (row,) = [json.loads(line) for line in (pref / "train.jsonl").read_text("utf-8").splitlines()]
    example = {k: row[k] for k in ("prompt", "chosen", "rejected")}
    assert data_utils.is_conversational(example)
    rendered = data_utils.apply_chat_template(example, tokenizer, tools=json.loads(row["tools"]))
    assert rendered["prompt"].endswith("<|assistant|>") and "Say 42" in rendered["prompt"]
    assert "<tool_call>terminal" in rendered["chosen"] and "<tool_response>" in rendered["chosen"]
    # The completions follow the prompt's generation prompt: the model's words, its call, the result.
    assert rendered["rejected"].startswith("Let me use terminal.<tool_call>terminal")
    for line in (rewards / "train.jsonl").read_text("utf-8").splitlines():
        group = json.loads(line)
        for completion in group["completions"]:
            one = {"prompt": group["prompt"], "completion": completion["messages"]}
            assert data_utils.is_conversational(one)
            text = data_utils.apply_chat_template(one, tokenizer)["completion"]
            assert "<|tool|><tool_response>" in text and text.rstrip().endswith("<|end|>")


# Qwen2.5's way with a call (written here, not downloaded): ``arguments | tojson``. A string comes out
# JSON-encoded a second time, ``"arguments": "{\"command\": ...}"``: a call the model never made.
QWEN25_CALLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c['function'] %}"
    '\n<tool_call>\n{"name": "{{ f["name"] }}", "arguments": {{ f["arguments"] | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _record_calls(run_dir, sample_index: int) -> list[dict]:
    """The calls a sample's record holds, its arguments as the model wrote them (parsed)."""
    lines = (run_dir / "trajectories.jsonl").read_text("utf-8").splitlines()
    lines += [json.dumps(d["record"]) for d in map(json.loads, _lines(run_dir / "discarded.jsonl"))]
    for rec in map(json.loads, lines):
        if rec["metadata"]["sample_index"] == sample_index and "Say 42" in json.dumps(rec["conversations"]):
            return [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for turn in rec["conversations"]
                for c in turn.get("tool_calls") or []
            ]
    raise AssertionError(f"no record of sample {sample_index}")


def _lines(path) -> list[str]:
    return path.read_text("utf-8").splitlines() if path.exists() else []


def test_a_preference_row_renders_the_models_own_arguments_with_a_tojson_template(tmp_path):
    """The scored formats kept each call's arguments as a JSON string, which a Qwen2.5-style template
    (``arguments | tojson``, as DPOTrainer renders chosen and rejected) double-encoded: the pair taught
    the model to write its arguments as a string. They are JSON objects now, as in ``messages``."""
    out = tmp_path / "data"
    run(None, write_rows(tmp_path / "d.jsonl", ROWS), out, samples_per_prompt=2, seed_per_request=True)
    pref = tmp_path / "pref"
    assert export.main([str(out / "run"), "--format=preference", f"--out={pref}"]) == 0
    (row,) = [json.loads(line) for line in (pref / "train.jsonl").read_text("utf-8").splitlines()]
    example = {k: row[k] for k in ("prompt", "chosen", "rejected")}
    rendered = data_utils.apply_chat_template(example, _tokenizer(QWEN25_CALLS))
    for side in ("chosen", "rejected"):
        blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", rendered[side], re.S)
        assert blocks, rendered[side]
        assert [json.loads(b) for b in blocks] == _record_calls(out / "run", row[f"{side}_sample_index"])
        assert '"arguments": "' not in rendered[side]
