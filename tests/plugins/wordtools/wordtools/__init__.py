"""A toolset plugin: two tools, one of which runs a command in the prompt's sandbox."""

from __future__ import annotations


def word_count(ctx, args):
    """Count the words of a text with wc, inside the prompt's sandbox."""
    res = ctx.sandbox.run("wc -w", timeout_s=ctx.tool_timeout_s, stdin=args["text"].encode())
    if res.exit_code != 0:
        return {"words": None, "error": f"wc failed: {res.output}"}
    return {"words": int(res.output.split()[0]), "error": None}


def shout(ctx, args):
    return {"text": args["text"].upper(), "error": None}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "word_count",
            "description": "Count the words of a text.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "description": "The text."}},
                "required": ["text"],
            },
        },
        "handler": word_count,
    },
    {
        "name": "shout",
        "description": "The text in capitals.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        "handler": shout,
    },
]
