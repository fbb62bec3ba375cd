"""Everything that runs ONE prompt: the agent loop, the model client, tools, sandboxes, trajectories."""
