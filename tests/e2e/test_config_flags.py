"""Flags that reach the sandbox, end to end (batchrun/config.py -> the prompt's SandboxSpec)."""

from __future__ import annotations

from helpers import (
    write_jsonl,
)

from batchrun.cli import tool_settings, worker_settings
from batchrun.config import RunConfig


def test_sandbox_network_flag_reaches_the_sandbox_spec(server, tmp_path, monkeypatch):

    import batchrun.prompt.attempt as runner_mod
    from batchrun.prompt.attempt import run_prompt
    from batchrun.prompt.llm import LLMClient
    from batchrun.protocol import PromptJob

    specs = []
    real = runner_mod.create_sandbox

    def spy(name, spec, options=None):
        specs.append(spec)
        return real(name, spec, options)

    monkeypatch.setattr(runner_mod, "create_sandbox", spy)
    config = RunConfig.from_flags(
        dataset_file=str(write_jsonl(tmp_path / "d.jsonl", ["x"])),
        batch_size=1,
        run_name="net",
        output_dir=str(tmp_path / "out"),
        base_url=server.base_url,
        api_key="k",
        distribution="terminal_only",
        sandbox_network=False,
    )
    llm = config.llm_config(server.base_url)
    settings = worker_settings(
        config, llm, config.sandbox_options(), tool_settings(config, llm.base_url, llm.api_key)
    )
    job = PromptJob(batch_num=0, prompt_index=0, prompt="offline please [calls:1]", toolsets=("terminal",))
    outcome = run_prompt(job, settings, LLMClient(settings.llm))
    assert outcome.kind == "trajectory"
    assert specs and all(spec.network is False for spec in specs)
