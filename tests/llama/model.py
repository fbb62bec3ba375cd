"""Write a tiny llama-architecture GGUF whose replies follow a script, in well under a second.

No weights can be downloaded here, and random weights never stop nor call tools, so the weights
are set by hand. The model is two layers of a 64-wide llama:

* Every token's embedding lives on one channel. Ordinary tokens (the 256 byte-level tokens and the
  chat markers) share a faint "generic" channel; ``</think>`` has a faint channel of its own; each
  scripted reply token has a loud channel of its own.
* Layer 0's attention has zero queries and keys, so it averages over the whole prompt; its values
  read only the ``<tool_response>`` channel. The average therefore says "a tool result is in the
  conversation" and drowns the faint channels, whatever the prompt's length (up to 8k tokens).
  Everything else (layer 1, both FFNs) is zero, so the residual stream is embedding + that average.
* The LM head maps each state to its next token: the generation prompt's last token (generic, or
  ``</think>`` when the template closed an empty think block because thinking is disabled),
  split by "tool result seen", picks the first reply token; each reply token names its successor,
  and the last one ``<|im_end|>``.

So the first turn of a conversation calls the scripted tools, the turn after the tool results
answers, and with thinking enabled each reply starts with a ``<think>`` block. Replies are whole
tokens, so they come back in a few stream chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

D = 64  # embedding width; one attention head of 64
GENERIC, TOOL_SEEN, TOOL_RESPONSE, THINK_CLOSED = 0, 1, 2, 3  # channels; reply tokens use 4, 5, ...
FAINT, LOUD = 0.01, 1e5
VALUE_GAIN = 1024.0  # one <tool_response> in 8192 tokens still gives TOOL_SEEN 1.0 = 100 x FAINT
SPLIT = (
    20000.0  # weight on the faint channels that tells "generic" from "</think>" once a tool result is seen
)

MARKERS = ["<|im_start|>", "<|im_end|>"]  # control tokens
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with Hermes tool calls (<tool_call>{json}</tool_call>, results in <tool_response> inside a user
# turn) and, when ``thinking``, Qwen3-style reasoning: an empty think block when enable_thinking=false.
# Every literal is an expression and every tag trims around itself, so the output is the same with and
# without the trim_blocks/lstrip_blocks settings that chat-template engines differ on.
_TEMPLATE = """\
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}
{{- 'You can call functions. Their JSON signatures are listed here:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\nFor each call, reply with a JSON object in tags:\\n<tool_call>\\n' -}}
{{- '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
THINK_HISTORY
{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- set call = tool_call.function if tool_call.function else tool_call -%}
{{- '\\n<tool_call>\\n{\\"name\\": \\"' + call.name + '\\", \\"arguments\\": ' -}}
{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
THINK_OFF
{%- endif -%}
"""
_THINK_HISTORY = """\
{%- if message.reasoning_content -%}{{- '\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n' -}}{%- endif -%}"""
_THINK_OFF = """\
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>' -}}{%- endif -%}"""


def chat_template(thinking: bool) -> str:
    history = _THINK_HISTORY if thinking else ""
    off = _THINK_OFF if thinking else ""
    return _TEMPLATE.replace("THINK_HISTORY", history).replace("THINK_OFF", off)


def tool_call_text(name: str, arguments: dict | str) -> str:
    """A Hermes call; ``arguments`` as a dict (JSON-encoded here) or as the exact text the model writes."""
    if isinstance(arguments, str):
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@dataclass(frozen=True)
class Script:
    """What the model says: ``calls`` on the first turn, ``answer`` once a tool result is in the prompt."""

    calls: list[tuple[str, dict | str]] = field(
        default_factory=lambda: [("terminal", {"command": "echo hello"})]
    )
    answer: str = "The command printed hello."
    thinking: bool = False  # a reasoning model (template honours enable_thinking; replies start with <think>)
    think_call: str = "The user wants a command run; I will call the terminal tool."
    think_answer: str = "The tool answered; I can reply now."
    words: str | None = None  # the first turn says this instead of calling tools (a judge's verdict)

    def replies(self) -> dict[str, str]:
        call = (
            self.words if self.words is not None else "\n".join(tool_call_text(n, a) for n, a in self.calls)
        )
        out = {"CALL": call, "ANSWER": self.answer}
        if self.thinking:
            out["THINK_CALL"] = f"<think>\n{self.think_call}\n</think>\n\n"
            out["THINK_ANSWER"] = f"<think>\n{self.think_answer}\n</think>\n\n"
        return out


def _byte_units() -> list[str]:
    """GPT-2's byte -> printable character table, which llama.cpp's BPE vocab uses for raw bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {b: b for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return [chr(chars[b]) for b in range(256)]


def write_model(path: Path, script: Script, *, ctx: int = 8192) -> Path:
    """Write the scripted model to ``path`` (a .gguf file) and return it."""
    import gguf

    units = _byte_units()
    encode = {b: units[b] for b in range(256)}
    tokens = list(units) + [units[32] * 2] + MARKERS + TAGS  # "ĠĠ" so the merges list is not empty
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.USER_DEFINED] * 6
    replies = script.replies()
    reply_ids: dict[str, int] = {}
    for name, text in replies.items():
        reply_ids[name] = len(tokens)
        tokens.append("".join(encode[b] for b in text.encode()))
        types.append(gguf.TokenType.NORMAL)
    ids = {t: i for i, t in enumerate(tokens)}
    im_end, tool_resp, think_end = ids["<|im_end|>"], ids["<tool_response>"], ids["</think>"]
    vocab = len(tokens)
    if 4 + len(reply_ids) > D:
        raise ValueError("too many reply tokens for the model width")

    embd = np.zeros((vocab, D), dtype=np.float32)
    embd[:, GENERIC] = FAINT
    embd[tool_resp] = 0.0
    embd[tool_resp, TOOL_RESPONSE] = 1.0
    embd[think_end] = 0.0
    embd[think_end, THINK_CLOSED] = FAINT
    channel = {}
    for k, (name, tid) in enumerate(reply_ids.items()):
        channel[name] = 4 + k
        embd[tid] = 0.0
        embd[tid, 4 + k] = LOUD

    head = np.zeros((vocab, D), dtype=np.float32)
    g, t, c = GENERIC, TOOL_SEEN, THINK_CLOSED
    think = script.thinking
    first_call = reply_ids["THINK_CALL" if think else "CALL"]
    first_answer = reply_ids["THINK_ANSWER" if think else "ANSWER"]
    # The four states at the end of a generation prompt (see the module docstring), scaled by RMSNorm to
    # about 8 on their loudest channel.
    head[first_call, [g, t, c]] += [3 * SPLIT, -3 * SPLIT, -3 * SPLIT]  # generic, no tool result yet
    head[first_answer, [g, t, c]] += [SPLIT, 10.0, -SPLIT]  # generic, a tool result seen
    if think:
        head[reply_ids["CALL"], [g, t, c]] += [-3 * SPLIT, -3 * SPLIT, 3 * SPLIT]  # </think>, no tool result
        head[reply_ids["ANSWER"], [g, t, c]] += [-SPLIT, 10.0, SPLIT]  # </think>, a tool result seen
    chain = {"THINK_CALL": "CALL", "THINK_ANSWER": "ANSWER"}
    for name in reply_ids:
        nxt = reply_ids[chain[name]] if name in chain else im_end
        head[nxt, channel[name]] += 100.0

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("batch-runner scripted test model")
    w.add_context_length(ctx)
    w.add_embedding_length(D)
    w.add_block_count(2)
    w.add_feed_forward_length(D)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_rope_dimension_count(D)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([int(x) for x in types])
    w.add_token_merges([f"{units[32]} {units[32]}"])
    w.add_bos_token_id(ids["<|im_start|>"])
    w.add_eos_token_id(im_end)
    w.add_eot_token_id(im_end)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template(script.thinking))

    zeros = np.zeros((D, D), dtype=np.float32)
    ones = np.ones(D, dtype=np.float32)
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", head)
    for layer in range(2):
        value = zeros.copy()
        out = zeros.copy()
        if layer == 0:
            value[0, TOOL_RESPONSE] = VALUE_GAIN
            out[TOOL_SEEN, 0] = 1.0
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", zeros)
        w.add_tensor(p + "attn_k.weight", zeros)
        w.add_tensor(p + "attn_v.weight", value)
        w.add_tensor(p + "attn_output.weight", out)
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", zeros)
        w.add_tensor(p + "ffn_up.weight", zeros)
        w.add_tensor(p + "ffn_down.weight", zeros)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
