"""Preflight, before any token is spent: the endpoint answers, the backend works, every image is there.

What cannot work stops the run here (exit 2, one clear message). A missing image fails only its
own prompts, without a model call. The backend's own steps live on its class (see
``batchrun.prompt.sandboxes.base.Sandbox``): nothing here names a backend.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from batchrun.config import UsageError
from batchrun.prompt import httpclient
from batchrun.prompt.llm import LLMConfig, endpoint_url, request_headers
from batchrun.prompt.sandboxes import backend_class
from batchrun.prompt.sandboxes.base import SetupError
from batchrun.prompt.tools.mcp import McpConfigError, McpSetup, probe
from batchrun.protocol import PromptJob
from batchrun.secrets import Redactor


def check_endpoint(cfg: LLMConfig) -> None:
    """One cheap request: an unreachable endpoint or a rejected key is a clear error, once.

    When the endpoint lists its models and the requested one is not among them, say so once: the
    server may answer with another model (each record's ``metadata.served_model`` says which).
    A ``GET <base_url>/models`` through the workers' own model client (the same headers, CA
    variables and proxies as every model call), with one retry.
    """
    client = httpclient.Client(request_headers(cfg.api_key))
    try:
        for attempt in range(2):
            try:
                body = client.request("GET", endpoint_url(cfg.base_url, "models"), timeout_s=15).json()
                break
            except httpclient.StatusError as exc:
                if exc.status_code == 401:
                    raise UsageError(
                        f"the endpoint {cfg.base_url} rejected the API key (HTTP {exc.status_code})"
                    ) from None
                return  # some servers have no /models; the first real request will tell
            except (httpclient.TransportError, httpclient.RequestTimeout, httpclient.InvalidRequest) as exc:
                if attempt:
                    raise UsageError(f"cannot reach the endpoint {cfg.base_url}: {exc}") from None
            except ValueError:  # not JSON
                return
    finally:
        client.close()
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list):
        warn_unlisted_model(
            cfg.model, [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        )


def probe_mcp_servers(config: Any) -> McpSetup:
    """Start each --mcp_config server once and list its tools; one that cannot is a clear error (exit 2).

    Its stderr's last lines are quoted, redacted like every output (the config's env values too)."""
    redact = Redactor.for_config(config)
    try:
        setup = probe(config.mcp_servers, redact)
    except McpConfigError as exc:
        raise UsageError(f"--mcp_config: {exc}") from None
    for server in setup.servers:
        names = [t.exposed for t in setup.tools if t.server == server.name]
        print(
            f"{server.describe()}: toolset {server.toolset}, {len(names)} tools: {', '.join(names) or 'none'}"
        )
    return setup


def warn_unlisted_model(model: str, listed: list[str]) -> bool:
    """Print one warning when ``listed`` (the endpoint's /models) is not empty and lacks ``model``."""
    if not listed or model in listed:
        return False
    shown = ", ".join(listed[:5]) + (f" (and {len(listed) - 5} more)" if len(listed) > 5 else "")
    print(
        f"warning: the endpoint does not list the requested model {model!r}; it lists {shown}. "
        "Records keep the requested name in metadata.model and the one that answered in metadata.served_model",
        file=sys.stderr,
    )
    return True


@dataclasses.dataclass(frozen=True)
class Ready:
    """What preflight hands the dispatch: the jobs (some marked to fail), the isolation, the workers' options."""

    batches: list[list[PromptJob]]
    isolation: str
    sandbox_options: dict[str, Any]
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)  # for statistics.json


def preflight_sandboxes(
    batches: list[list[PromptJob]],
    backend: str,
    options: dict[str, Any],
    *,
    run_name: str,
    real_model: bool,
    network: bool,
    workers_here: bool,
    dataset: str,
) -> Ready:
    """The backend's preflight and run preparation; prompts it cannot run fail without a model call."""
    cls = backend_class(backend)
    try:
        found = cls.preflight(
            [j for b in batches for j in b], options, real_model=real_model, network=network, dataset=dataset
        )
        options = found.options if found.options is not None else options
        if batches:
            options = cls.prepare_run(run_name, options, workers_here=workers_here)
    except SetupError as exc:
        raise UsageError(str(exc)) from None
    if found.failed:
        batches = [
            [
                dataclasses.replace(j, fail_reason=found.failed[j.prompt_index])
                if j.prompt_index in found.failed
                else j
                for j in batch
            ]
            for batch in batches
        ]
    return Ready(batches=batches, isolation=found.isolation, sandbox_options=options, facts=found.facts)
