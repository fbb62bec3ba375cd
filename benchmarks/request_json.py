#!/usr/bin/env python3
"""CPU of encoding one prompt's model requests: ``json.dumps`` of each whole body, the conversation's
``RequestEncoder`` (batchrun/prompt/jsonbody.py), and ``orjson`` when it is installed.

    python benchmarks/request_json.py              # 2,000 prompts, 3 rounds
    python benchmarks/request_json.py --prompts 5000 --rounds 5

The conversation is the benchmark's (``terminal_only``, as the fake model plays it): the prompt,
then two turns of a terminal call and its result, each request with the file and terminal tools.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from batchrun.prompt.jsonbody import RequestEncoder
from batchrun.prompt.tools.catalog import all_tools

TOOL_NAMES = ("terminal", "write_file", "read_file", "patch", "search_files")


def conversation():
    """The growing message list, as each of the prompt's three requests sends it."""
    sent = [{"role": "user", "content": "Task 7: inspect the working directory and write a note."}]
    yield sent
    for i in range(2):
        args = json.dumps({"command": "echo slug && pwd"})
        call = {"id": f"c{i}", "type": "function", "function": {"name": "terminal", "arguments": args}}
        sent.append({"role": "assistant", "content": "", "tool_calls": [call]})
        result = json.dumps({"output": "slug\n/workspace\n", "exit_code": 0})
        sent.append({"role": "tool", "tool_call_id": f"c{i}", "name": "terminal", "content": result})
        yield sent


def one_prompt(kind: str, tools: list) -> None:
    schemas = [t.openai_schema() for t in tools]  # made anew per prompt, as the loop does
    encoder = RequestEncoder()
    for sent in conversation():
        body = {"model": "fake", "messages": sent, "tools": schemas}
        if kind == "json.dumps":
            json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        elif kind == "encoder":
            encoder.encode(body)
        else:
            import orjson

            orjson.dumps(body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tools = [t for name, t in all_tools().items() if name in TOOL_NAMES]
    kinds = ["json.dumps", "encoder"]
    try:
        import orjson  # noqa: F401

        kinds.append("orjson")
    except ImportError:
        pass
    print(f"{len(tools)} tool schemas, 3 requests a prompt, {args.prompts} prompts a figure")
    for _ in range(args.rounds):
        figures = []
        for kind in kinds:
            start = time.process_time()
            for _ in range(args.prompts):
                one_prompt(kind, tools)
            figures.append(f"{kind} {1000 * (time.process_time() - start) / args.prompts:.3f}")
        print("  ms CPU per prompt: " + "  ".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
