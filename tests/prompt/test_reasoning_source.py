"""Reasoning from the field it came in (issue 25, item 9): words become reasoning only where the endpoint
sent no reasoning field and reasoning is not disabled; two fields with the same text are one reasoning."""

from __future__ import annotations

import json

from batchrun.prompt.llm import AssistantTurn, _parse_payload, _read_stream
from batchrun.prompt.loop import _assistant_messages
from batchrun.prompt.trajectory import ambiguous_markup, to_sharegpt
from batchrun.sharegpt import reasoning_counts


def turn(content: str, reasoning: str | None = None) -> AssistantTurn:
    return AssistantTurn(content=content, reasoning=reasoning, tool_calls=[], finish_reason="stop", usage={})


def test_a_stray_close_tag_is_not_reasoning_when_the_server_sent_its_own_field():
    saved, _ = _assistant_messages(turn("I compared them </think> and chose B.", reasoning="real reasoning"))
    assert saved["reasoning"] == "real reasoning"
    assert saved["content"] == "I compared them </think> and chose B."  # words left as they came


def test_with_reasoning_disabled_words_are_never_reasoning():
    saved, _ = _assistant_messages(turn("Half a thought </think> The answer is 4."), reasoning_disabled=True)
    assert saved["reasoning"] is None
    assert "</think>" in saved["content"]


def test_such_samples_are_ambiguous_markup_and_count_no_reasoning():
    """--reasoning_disabled against a server that produced none: 0 % coverage, the sample set aside."""
    saved, _ = _assistant_messages(turn("Half a thought </think> The answer is 4."), reasoning_disabled=True)
    messages = [{"role": "user", "content": "q"}, saved]
    conversations = to_sharegpt(messages, [], None)
    assert ambiguous_markup(messages, conversations)
    assert reasoning_counts(conversations)[0] == 0


def test_a_leading_think_block_is_reasoning_when_no_field_came():
    saved, sent = _assistant_messages(turn("<think>\nplan\n</think>\nThe answer."))
    assert saved["reasoning"] == "plan" and saved["content"] == "The answer."
    assert sent["content"] == "<think>\nplan\n</think>\nThe answer."  # the model sees what it wrote


def test_two_reasoning_fields_with_the_same_text_are_one_reasoning():
    body = {
        "choices": [{"index": 0, "message": {"content": "A", "reasoning_content": "why", "reasoning": "why"}}]
    }
    assert _parse_payload(body).reasoning == "why"


class Lines:
    def __init__(self, lines):
        self.lines = lines

    def iter_lines(self):
        yield from self.lines

    def close(self):
        pass


def test_a_stream_with_both_reasoning_fields_is_not_doubled():
    """LiteLLM streams an upstream's reasoning in both reasoning_content and reasoning."""
    deltas = [
        {"reasoning_content": "step one, ", "reasoning": "step one, "},
        {"reasoning_content": "step two", "reasoning": "step two"},
        {"content": "Done."},
    ]
    lines = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': d}]})}" for d in deltas] + [
        "data: [DONE]"
    ]
    parsed = _parse_payload(_read_stream(Lines(lines)))
    assert parsed.reasoning == "step one, step two" and parsed.content == "Done."


# Mistral's reasoning models answer with content parts: thinking (its reasoning) and text (its words).
MISTRAL_THINKING = "The user greets me;\nreply in kind."


def test_mistral_thinking_parts_are_reasoning_and_text_parts_words():
    """The thinking parts were dropped: the reasoning was in no record (a no_reasoning discard, or a kept
    sample without it under --keep_no_reasoning)."""
    content = [
        {"type": "thinking", "thinking": [{"type": "text", "text": MISTRAL_THINKING}]},
        {"type": "text", "text": "Hello!"},
    ]
    parsed = _parse_payload(
        {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": content}}]}
    )
    assert (parsed.reasoning, parsed.content) == (MISTRAL_THINKING, "Hello!")


def test_mistral_thinking_parts_streamed_are_reasoning_too():
    """Streamed, a delta whose content is a list of parts was dropped whole: the words too."""
    deltas = [
        {"role": "assistant", "content": ""},
        *({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": t}]}]} for t in ("The user ", MISTRAL_THINKING[9:])),
        {"content": [{"type": "text", "text": "Hel"}]},
        {"content": "lo!"},
    ]  # fmt: skip
    lines = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': d}]})}" for d in deltas]
    lines += ['data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}', "data: [DONE]"]
    parsed = _parse_payload(_read_stream(Lines(lines)))
    assert (parsed.reasoning, parsed.content) == (MISTRAL_THINKING, "Hello!")


def _kept_value(content: str) -> tuple[str, bool]:
    """The gpt value of a reply of these words, and whether the sample is set aside as ambiguous_markup."""
    saved, _ = _assistant_messages(turn(content))
    messages = [{"role": "user", "content": "q"}, saved]
    conversations = to_sharegpt(messages, [], None)
    return conversations[-1]["value"], ambiguous_markup(messages, conversations)


def test_a_scratchpad_in_the_words_is_not_taken_out_of_them():
    """Scratchpads anywhere were moved into the reasoning and the words around them rejoined: this reply
    was kept as the words 'Let me check.Done.', which the model never wrote."""
    content = "<REASONING_SCRATCHPAD>plan</REASONING_SCRATCHPAD>\n\nLet me check.<REASONING_SCRATCHPAD>more</REASONING_SCRATCHPAD>\nDone."
    value, ambiguous = _kept_value(content)
    assert value.endswith("\nLet me check.<REASONING_SCRATCHPAD>more</REASONING_SCRATCHPAD>\nDone.")
    assert ambiguous  # a discard, kept as written in discarded.jsonl


def test_a_leading_scratchpad_keeps_its_spacing_and_the_words_after_it():
    """Its text was stripped and the blank line after it dropped: now only the envelope's line breaks go."""
    value, ambiguous = _kept_value("<REASONING_SCRATCHPAD>\n  plan\n</REASONING_SCRATCHPAD>\n\nAnswer: 4")
    assert value == "<think>\n  plan\n</think>\n\nAnswer: 4" and not ambiguous
    value, ambiguous = _kept_value("<REASONING_SCRATCHPAD>\nplan\n</REASONING_SCRATCHPAD>\nAnswer: 4")
    assert value == "<think>\nplan\n</think>\nAnswer: 4" and not ambiguous


def test_a_think_block_after_a_line_break_is_not_reasoning_read_without_it():
    """A leading line break was dropped with the block taken as reasoning; it stays the model's words."""
    value, ambiguous = _kept_value("\n<think>\nplan\n</think>\nAnswer: 4")
    assert value == "<think>\n</think>\n\n<think>\nplan\n</think>\nAnswer: 4" and ambiguous
