"""The preference and rewards exports through TRL's own dataset helpers (``trl.data_utils``), when TRL
and transformers are importable (they are not test dependencies: TRL pulls in torch). TRL applies a
chat template to each example and checks that the prompt's rendering is a prefix of the prompt plus
the completion: the pairs must render as conversations, tool calls and results included."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def tokenizer():
    model = tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = TEMPLATE
    return fast


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
