"""A toolset plugin whose only tool has a schema that is not an object schema."""

TOOLS = [
    {"name": "broken", "description": "x", "parameters": {"type": "string"}, "handler": lambda ctx, args: {}}
]
