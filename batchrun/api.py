"""The reference's Python API: ``BatchRunner(...)`` and ``.run(resume=False)``, for scripts written for it.

    from batch_runner import BatchRunner
    runner = BatchRunner(dataset_file="data/prompts.jsonl", batch_size=10, run_name="my_run",
                         providers_allowed=["anthropic"], reasoning_config={"effort": "low"},
                         prefill_messages=[{"role": "user", "content": "..."}])
    runner.run(resume=False)

The arguments keep the reference's names and meanings (``max_iterations`` is the CLI's ``--max_turns``;
provider lists are lists; ``reasoning_config`` a dict; ``prefill_messages`` a list of messages), and
every value goes through the same checks as the command line's flags (:class:`batchrun.config.RunConfig`):
a bad one raises :class:`batchrun.config.UsageError` (a ``ValueError``) naming the argument, before
anything starts. Any other flag of the command line may be passed as a keyword (``output_dir``,
``sandbox``, ...). ``run()`` returns the command line's exit code (0 done, 3 too many failures,
130 interrupted) instead of exiting.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchrun.config import REASONING_EFFORTS, RunConfig, UsageError, _show, check_prefill, parse_bool

# The reference's argument -> this runner's flag, where the names differ.
RENAMED = {"max_iterations": "max_turns"}
DEFAULT_MAX_ITERATIONS = 10
EFFORTS_OFF = ("none",)


def reasoning_flags(reasoning_config: dict[str, Any] | None) -> dict[str, Any]:
    """The reference's ``reasoning_config`` as the flags that send it: ``{"effort": "none"}`` or
    ``{"enabled": False}`` -> --reasoning_disabled; ``{"enabled": True, "effort": E}`` -> --reasoning_effort=E.
    ``enabled`` is read as the command line reads a boolean (``0``, ``"false"``: off), never ignored."""
    if reasoning_config is None:
        return {}
    if not isinstance(reasoning_config, dict):
        raise UsageError(
            f"reasoning_config must be a dict such as {{'effort': 'low'}}, got {_show(reasoning_config)}"
        )
    unknown = sorted(set(reasoning_config) - {"enabled", "effort"}, key=str)
    if unknown:
        raise UsageError(f"reasoning_config: unknown key {_show(unknown[0])} (known: enabled, effort)")
    enabled, effort = reasoning_config.get("enabled"), reasoning_config.get("effort")
    if enabled is not None:
        try:
            enabled = parse_bool(enabled, "reasoning_config")
        except UsageError:
            raise UsageError(
                f"reasoning_config: 'enabled' must be true or false, got {_show(enabled)}"
            ) from None
    if effort is not None and effort not in REASONING_EFFORTS:
        raise UsageError(
            f"reasoning_config: 'effort' must be one of {', '.join(REASONING_EFFORTS)}, got {_show(effort)}"
        )
    if enabled is False or effort in EFFORTS_OFF:
        return {"reasoning_disabled": True}
    return {"reasoning_effort": effort} if effort is not None else {}


def given_twice(
    max_iterations: Any, reasoning_config: Any, prefill_messages: Any, flags: dict[str, Any]
) -> None:
    """A reference argument and the command line's flag for the same setting, both given: one would
    silently win (``max_iterations=3, max_turns=5`` ran 5 turns), so the run does not start."""
    pairs = [
        ("max_iterations", max_iterations not in (None, DEFAULT_MAX_ITERATIONS), ("max_turns",)),
        ("reasoning_config", reasoning_config is not None, ("reasoning_effort", "reasoning_disabled")),
        ("prefill_messages", prefill_messages is not None, ("prefill_messages_file",)),
    ]
    for name, given, flag_names in pairs:
        also = [f for f in flag_names if f in flags]
        if given and also:
            raise UsageError(f"{name} and {also[0]} both give the same setting; give one")


class BatchRunner:
    """A run configured as the reference's ``BatchRunner``; see the module docstring."""

    def __init__(
        self,
        dataset_file: str,
        batch_size: int,
        run_name: str,
        distribution: str = "default",
        max_iterations: int = 10,
        base_url: str | None = None,
        api_key: str | None = None,
        model: str | None = None,
        num_workers: int = 4,
        verbose: bool = False,
        ephemeral_system_prompt: str | None = None,
        log_prefix_chars: int = 100,
        providers_allowed: list[str] | None = None,
        providers_ignored: list[str] | None = None,
        providers_order: list[str] | None = None,
        provider_sort: str | None = None,
        max_tokens: int | None = None,
        reasoning_config: dict[str, Any] | None = None,
        prefill_messages: list[dict[str, Any]] | None = None,
        max_samples: int | None = None,
        **flags: Any,
    ) -> None:
        given = {
            "dataset_file": dataset_file,
            "batch_size": batch_size,
            "run_name": run_name,
            "distribution": distribution,
            "max_iterations": max_iterations,
            "base_url": base_url,
            "api_key": api_key,
            "model": model,
            "num_workers": num_workers,
            "verbose": verbose,
            "ephemeral_system_prompt": ephemeral_system_prompt,
            "log_prefix_chars": log_prefix_chars,
            "providers_allowed": providers_allowed,
            "providers_ignored": providers_ignored,
            "providers_order": providers_order,
            "provider_sort": provider_sort,
            "max_tokens": max_tokens,
            "max_samples": max_samples,
        }
        if "resume" in flags:
            raise UsageError("resume is an argument of run(), not of BatchRunner(...)")
        given_twice(max_iterations, reasoning_config, prefill_messages, flags)
        if "max_turns" in flags:  # the command line's name, max_iterations left at its default
            given.pop("max_iterations")
        self.flags = {RENAMED.get(k, k): v for k, v in given.items() if v is not None}
        self.flags.update(reasoning_flags(reasoning_config))
        self.flags.update(flags)
        if prefill_messages is not None and not isinstance(prefill_messages, list):
            raise UsageError(
                f"prefill_messages must be a list of {{role, content}} messages, got {_show(prefill_messages)}"
            )
        if prefill_messages is not None:
            check_prefill(prefill_messages, "prefill_messages")
        self.prefill_messages = prefill_messages
        # Every check now, before anything starts; as a resume when a flag given is one of a resume's
        # (resume is run()'s argument here, so --force_resume alone is not a flag that does nothing).
        resuming = bool(self.flags.get("force_resume") or self.flags.get("rerun_discarded"))
        with self._config(resume=resuming) as config:
            self.config = config
        if config.list_distributions:  # the command line's listing, which skips every check of a run
            raise UsageError(
                "list_distributions is the command line's listing, not a run: from Python use "
                "toolset_distributions.list_distributions() or print_distribution_info(name)"
            )

    # Where the run writes, under the reference's attribute names (scripts read their output from them).
    @property
    def output_dir(self) -> Path:
        """``data/<run_name>`` (``--output_dir``'s parent of run directories, then the run name)."""
        return self.config.run_dir

    @property
    def checkpoint_file(self) -> Path:
        return self.output_dir / "checkpoint.json"

    @property
    def stats_file(self) -> Path:
        return self.output_dir / "statistics.json"

    @contextmanager
    def _config(self, *, resume: bool) -> Iterator[RunConfig]:
        """The run's configuration; the prefill travels in a file, as --prefill_messages_file does."""
        path = None
        flags = dict(self.flags, resume=resume)
        try:
            if self.prefill_messages:
                fd, path = tempfile.mkstemp(prefix="batch-runner-prefill-", suffix=".json")
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    try:  # ASCII escapes: any str, a lone surrogate too, reads back as it was given
                        json.dump(self.prefill_messages, fh)
                    except (TypeError, ValueError) as exc:  # a value JSON cannot hold (bytes, a set)
                        raise UsageError(f"prefill_messages: {exc}") from None
                flags["prefill_messages_file"] = path
            config = RunConfig.from_flags(**flags)
            config.prefill_messages  # noqa: B018  (read now: the file goes when this block ends)
            yield config
        finally:
            if path is not None:
                os.unlink(path)

    def run(self, resume: bool = False) -> int:
        """Run (or, with ``resume``, continue) the batch; returns the exit code."""
        from batchrun.cli import run

        config = None
        try:
            with self._config(resume=resume) as config:
                return run(config)
        except UsageError as exc:  # what needs more than the arguments (the key, the run directory)
            from batchrun.cli import console_safe

            print(console_safe(f"error: {exc}", self.flags, config), file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\nInterrupted. Continue with run(resume=True).", file=sys.stderr)
            return 130
