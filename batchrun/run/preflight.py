"""Preflight, before any token is spent: the endpoint answers, the backend works, every image is there.

What cannot work stops the run here (exit 2, one clear message). A missing image fails only its
own prompts, without a model call. The backend's own steps live on its class (see
``batchrun.prompt.sandboxes.base.Sandbox``): nothing here names a backend.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from batchrun.config import UsageError
from batchrun.prompt import httpclient
from batchrun.prompt.llm import (
    QUOTA_SPENT,
    LLMClient,
    LLMConfig,
    LLMError,
    LongRateLimit,
    SpendGate,
    Usage,
    endpoint_url,
    error_message,
    finish_kind,
    request_headers,
    retry_after_s,
    safe_url,
)
from batchrun.prompt.sandboxes import backend_class
from batchrun.prompt.sandboxes.base import Preflight, SetupError
from batchrun.prompt.tools.mcp import McpConfigError, McpSetup, probe
from batchrun.protocol import PromptJob
from batchrun.secrets import Redactor

REFUSALS = (400, 401, 403, 404, 422)  # the start check's answers that mean: this run cannot work
CHECK_HEADER = "X-Batch-Runner-Check"  # marks the start check's call (the fake model does not count it)
UNAVAILABLE = 503  # "there, not ready yet": llama.cpp's answer to every request while it loads its model
UNAVAILABLE_POLL_S = 2.0  # how often the start check asks again an endpoint that answers 503
# How a 503 says "loading": llama-server's {"error": {"message": "Loading model", "type":
# "unavailable_error"}}, a Hugging Face endpoint's "Model ... is currently loading". Any other 503 (a
# proxy whose upstream is gone) is a failed start check at once, not --endpoint_grace later.
LOADING = re.compile(r"\bloading\b", re.IGNORECASE)


def says_loading(text: str) -> bool:
    """Whether a 503's message says the server is loading its model (it will answer once loaded)."""
    return LOADING.search(text) is not None


class Unavailable:
    """The start check's patience with an endpoint that answers 503 saying it is loading its model
    (llama-server's ``Loading model``, for as long as its weights take to load, :func:`says_loading`):
    it is there and will answer, so the check asks again every :data:`UNAVAILABLE_POLL_S` (or its
    Retry-After) for up to ``grace_s`` seconds, the ``--endpoint_grace`` a run gives an endpoint to come
    back, shared by ``/models`` and the chat call. Before, the check gave up after two tries half a
    second apart: a run started beside a llama-server still loading its model exited 2 in 0.6 s. A 503
    that does not say so is not waited for (every 503 was: a dead proxy's took 120 s to exit 2)."""

    def __init__(
        self, grace_s: float, who: str, shown: str, redact: Callable[[str], str] = lambda text: text
    ) -> None:
        self.until = time.monotonic() + grace_s
        self.grace_s, self.who, self.shown = grace_s, who, shown
        # The server's own words are shown: one that quotes the request's key must not show it.
        self.redact = redact
        self.waited = False

    def wait(self, message: str, retry_after_s: float | None = None) -> bool:
        """Wait before asking again; False when the grace is spent (the caller gives up)."""
        left = self.until - time.monotonic()
        if left <= 0:
            return False
        if not self.waited:
            self.waited = True
            print(
                f"warning: {self.who} {self.shown} is not ready ({self.redact(message)}), as a server loading its model "
                f"answers; the start check asks again for up to {self.grace_s:g} s (--endpoint_grace)",
                file=sys.stderr,
                flush=True,
            )
        pause = retry_after_s if retry_after_s is not None and retry_after_s > 0 else UNAVAILABLE_POLL_S
        time.sleep(min(left, pause, 30.0))
        return True


MAIN_KEY_HINT = "pass --api_key or set OPENROUTER_API_KEY or OPENAI_API_KEY"  # the run's own endpoint's key


def judge_key_hint(variable: str) -> str:
    """Where a judge's key comes from (``key_hint``): the variable --judge_api_key_env names."""
    return f"set {variable} (the variable --judge_api_key_env names)"


def check_endpoint(
    cfg: LLMConfig,
    *,
    needs_cost: str | None = None,
    who: str = "the endpoint",
    gate: SpendGate | None = None,
    grace_s: float = 0.0,
    on_slots: Callable[[int], None] | None = None,
    key_hint: str = MAIN_KEY_HINT,
) -> Usage:
    """Before any prompt: the endpoint answers, and one minimal real chat call works.

    ``GET <base_url>/models`` first: a rejected key (401) stops here, and when the endpoint lists its
    models and the requested one is not among them, say so once. Then the start check: one chat call
    of a few tokens with the run's model, key and dialect fields, through the workers' own model client
    (headers, CA variables, proxies, bounds). Any refusal of it (400, 401, 403, 404, 422: a wrong key
    behind a proxy, a model name the server rejects, a field its dialect does not take) is exit 2 naming
    the status and the server's own message, so no prompt sends a doomed request. ``needs_cost``
    (the flag: --budget_usd, --max_prompt_usd): the answer must report its cost, or the run could not
    keep that cap. Returns what
    the check spent (its answer's usage, made credible): the run's spend and budget count it. ``who``:
    how the messages name the endpoint (the judge's has its own check). ``gate``: the run's budget
    (batchrun/run/budget.py's CheckGate), asked before the call is sent; it counts what the call spent.
    ``grace_s``: how long an endpoint that answers 503 (still loading its model) is waited for
    (:class:`Unavailable`). ``on_slots``: told how many requests the endpoint serves at once, when it
    is a llama-server (:func:`server_slots`). ``key_hint``: where the key comes from, said when the endpoint
    wants one and none was sent (a judge's is not the run's --api_key).
    """
    redact = Redactor.for_endpoint(cfg.api_key, cfg.base_url)
    unavailable = Unavailable(grace_s, who, safe_url(cfg.base_url), redact)
    list_models(cfg, who=who, unavailable=unavailable, on_slots=on_slots, key_hint=key_hint)
    return check_chat(cfg, needs_cost=needs_cost, who=who, gate=gate, unavailable=unavailable)


def list_models(
    cfg: LLMConfig,
    *,
    who: str = "the endpoint",
    unavailable: Unavailable | None = None,
    on_slots: Callable[[int], None] | None = None,
    key_hint: str = MAIN_KEY_HINT,
) -> None:
    """``GET <base_url>/models``: a rejected key stops here; a model it does not list is warned of.
    ``on_slots``: when the answer says it comes from llama.cpp, told its slots (:func:`server_slots`)."""
    client = httpclient.Client(request_headers(cfg.api_key, cfg.base_url))
    shown = safe_url(cfg.base_url)
    try:
        attempt = 0
        while attempt < 2:
            try:
                # At most 15 s, and never longer than the user allows one model call to take.
                timeout_s = min(15.0, cfg.request_timeout_s)
                answer = client.request("GET", endpoint_url(cfg.base_url, "models"), timeout_s=timeout_s)
                body = answer.json()
                if on_slots is not None and answer.headers.get("server", "").lower().startswith("llama.cpp"):
                    slots = server_slots(client, cfg.base_url, timeout_s)
                    if slots is not None:
                        on_slots(slots)
                break
            except httpclient.StatusError as exc:
                if (
                    exc.status_code == 401
                    and not cfg.api_key
                    and not httpclient.url_credentials(cfg.base_url)[1]
                ):
                    # Not "rejected the API key": none was sent (llama-server --api-key wants one).
                    raise UsageError(
                        f"{who} {shown} wants an API key (HTTP 401) and none was given: {key_hint}"
                    ) from None
                if exc.status_code == 401:
                    # With the server's own words, as the start check gives them ("Invalid or missing API
                    # key", "key expired"), redacted: a server may echo the key it was sent.
                    said = " ".join(exc.message.partition(" - ")[2].split())[:300]
                    raise UsageError(
                        f"{who} {shown} rejected the API key (HTTP {exc.status_code})"
                        + (f": {Redactor.for_endpoint(cfg.api_key, cfg.base_url)(said)}" if said else "")
                    ) from None
                message = error_message(exc)
                if (
                    exc.status_code == UNAVAILABLE
                    and unavailable is not None
                    and says_loading(f"{message} {_error_text(exc.body)}")
                    and unavailable.wait(f"GET /models: {message}", retry_after_s(exc))
                ):
                    continue  # the key and the model's name are checked once it is ready
                return  # some servers have no /models; the start check's chat call tells
            except (httpclient.TransportError, httpclient.RequestTimeout, httpclient.InvalidRequest) as exc:
                if attempt:
                    raise UsageError(f"cannot reach {who} {shown}: {exc}") from None
                attempt += 1
            except (ValueError, httpclient.HTTPError):  # not JSON, or too large: the chat call tells
                return
    finally:
        client.close()
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list):
        warn_unlisted_model(cfg.model, listed_names(data), who=who)


def server_slots(client: httpclient.Client, base_url: str, timeout_s: float) -> int | None:
    """llama-server's parallel slots (``--parallel``): ``total_slots`` of its ``/props``, served beside
    ``/v1`` (at the base's root). None when it does not say (an older build, a proxy in front)."""
    parts = urlsplit(endpoint_url(base_url, "props"))
    path = parts.path
    if path.endswith("/v1/props"):  # /props is not under /v1 (404 there)
        path = path[: -len("/v1/props")] + "/props"
    try:
        body = client.request("GET", parts._replace(path=path).geturl(), timeout_s=timeout_s).json()
    except (httpclient.HTTPError, ValueError):
        return None
    slots = body.get("total_slots") if isinstance(body, dict) else None
    return slots if type(slots) is int and slots > 0 else None


def _error_text(body: Any) -> str:
    """An error body's ``error`` when it is text (Hugging Face: ``{"error": "Model ... is currently
    loading"}``), which :func:`error_message` does not show."""
    err = body.get("error") if isinstance(body, dict) else None
    return err[:200] if isinstance(err, str) else ""


def listed_names(data: list) -> list[str]:
    """The model names a ``/models`` answer's ``data`` serves: each entry's ``id``, then its ``aliases``
    (llama-server started with ``--alias a,b`` lists one of them as the id and both as aliases, and
    answers to either: a run asking for the other was warned that the model was not listed)."""
    names: list[str] = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        aliases = entry.get("aliases") if isinstance(entry.get("aliases"), list) else []
        for name in (entry.get("id"), *aliases):
            if isinstance(name, str) and name not in names:
                names.append(name)
    return names


def check_chat(
    cfg: LLMConfig,
    *,
    needs_cost: str | None = None,
    who: str = "the endpoint",
    gate: SpendGate | None = None,
    unavailable: Unavailable | None = None,
) -> Usage:
    """The start check: one minimal chat call; a refusal is a UsageError (exit 2) with the server's words.
    ``needs_cost``: an answer that reports no cost (``usage.cost``: OpenAI, vLLM and llama.cpp report
    none) is a UsageError too, naming that flag (--budget_usd, --max_prompt_usd), which the run could not keep: it would spend on
    with no cost counted. So is an answer with no finish_reason (or one no server sends), since every
    final answer of the run would then be a discard; with --stream a warning only (the check is not
    streamed, the run's answers may carry one). Returns the check's usage (nothing counted when it was
    rate limited or refused for its context: no answer came). ``unavailable``: an endpoint that answers
    503 is asked again while it lasts (:class:`Unavailable`)."""
    check = dataclasses.replace(
        cfg,
        max_tokens=16,
        max_retries=1,
        max_rate_limit_retries=1,
        stream=False,
        request_timeout_s=min(cfg.request_timeout_s, 120.0),
    )
    # A 429 asking a longer wait than the run gives an endpoint to come back is not waited for: a quota
    # over for the day (Retry-After: 86400) was waited 110 s, then the run started, each prompt to fail.
    check = dataclasses.replace(
        check, rate_limit_patience_s=unavailable.grace_s if unavailable is not None else 0.0
    )
    patience = check.rate_limit_patience
    client = LLMClient(
        check, headers={CHECK_HEADER: "1"}, on_usage=lambda usage: None, gate=gate
    )  # the run warns of odd usage
    shown = safe_url(cfg.base_url)
    usage = Usage()
    try:
        while True:
            try:
                turn = client.chat(
                    [{"role": "user", "content": "Reply with OK."}],
                    [],
                    deadline=time.monotonic() + 240,
                    usage=usage,
                )
                break
            except LLMError as exc:
                if (
                    exc.status != UNAVAILABLE
                    or unavailable is None
                    or not says_loading(str(exc))
                    or not unavailable.wait(str(exc))
                ):
                    raise
    except LLMError as exc:
        if exc.status in REFUSALS or exc.error_class == QUOTA_SPENT:  # a spent quota's 429: no wait helps
            raise UsageError(
                f"{who} {shown} refused the start check (one minimal chat call with model {cfg.model!r}): "
                f"{exc}"
            ) from None
        if isinstance(exc, LongRateLimit):
            raise UsageError(
                f"{who} {shown} rate limits the run for longer than --endpoint_grace ({patience:g} s): "
                f"{exc}. No prompt was run; start the run again when the limit is over"
            ) from None
        if exc.status == 429:
            print(
                f"warning: the start check was rate limited by {who} {shown}; the run starts and waits as it must",
                file=sys.stderr,
            )
            return usage
        if exc.error_class == "context_limit":
            return usage  # the server is there and says so: the prompts will tell
        raise UsageError(f"{who} {shown} failed the start check: {exc}") from None
    finally:
        client.close()
    if finish_kind(turn.finish_reason) == "unknown":
        said = "no finish_reason" if turn.finish_reason is None else f"finish_reason {turn.finish_reason!r}"
        why = (
            f"{who} {shown} answered the start check with {said} (a proxy that drops it?): every final "
            "answer like it is discarded (unknown_finish_reason), since nothing says it was not cut short"
        )
        if not cfg.stream:
            raise UsageError(f"{why}. No prompt was run")
        print(f"warning: {why}; the run's streamed answers may carry it", file=sys.stderr)
    if needs_cost and "cost_usd" not in usage.reported:
        instead = "--max_prompt_tokens" if needs_cost == "--max_prompt_usd" else "--budget_tokens"
        raise UsageError(
            f"{needs_cost} needs each answer's cost, and {shown} reports none (no usage.cost in the start "
            "check's answer; OpenRouter reports it, OpenAI, vLLM and llama.cpp do not): the run could not "
            f"keep that budget. Bound the spend with {instead} instead"
        )
    return usage


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


def warn_unlisted_model(model: str, listed: list[str], *, who: str = "the endpoint") -> bool:
    """Print one warning when ``listed`` (the endpoint's /models) is not empty and lacks ``model``."""
    if not listed or model in listed:
        return False
    shown = ", ".join(map(repr, listed[:5])) + (f" (and {len(listed) - 5} more)" if len(listed) > 5 else "")
    print(
        f"warning: {who} does not list the requested model {model!r}; it lists {shown}. "
        "Records keep the requested name in metadata.model and the one that answered in metadata.served_model",
        file=sys.stderr,
    )
    return True


@dataclasses.dataclass(frozen=True)
class Preflighted:
    """What preflight hands the dispatch: the jobs (some marked to fail), the isolation really in force,
    the workers' sandbox options and what statistics.json says of the sandboxes (e.g. the disk cap)."""

    batches: list[list[PromptJob]]
    isolation: str
    sandbox_options: dict[str, Any]
    sandbox_facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    after_check: Callable[[], Preflight] | None = None  # the backend's slow rest: finish_sandbox_preflight


def preflight_sandboxes(
    batches: list[list[PromptJob]],
    backend: str,
    options: dict[str, Any],
    *,
    real_model: bool,
    network: bool,
    dataset: str,
) -> Preflighted:
    """The backend's preflight, before the start check (a backend that cannot work here costs no token);
    prompts it cannot run fail without a model call. Its slow rest (image pulls) waits for
    :func:`finish_sandbox_preflight`, after the start check; :func:`prepare_sandboxes` follows."""
    try:
        found = backend_class(backend).preflight(
            [j for b in batches for j in b], options, real_model=real_model, network=network, dataset=dataset
        )
    except SetupError as exc:
        raise UsageError(str(exc)) from None
    return _found(Preflighted(batches=batches, isolation=found.isolation, sandbox_options=options), found)


def finish_sandbox_preflight(preflighted: Preflighted) -> Preflighted:
    """The backend's slow preflight steps (Docker's image pulls), once the start check passed: a wrong
    key or model exits 2 in seconds, not after minutes of pulls."""
    if preflighted.after_check is None:
        return preflighted
    try:
        found = preflighted.after_check()
    except SetupError as exc:
        raise UsageError(str(exc)) from None
    return _found(dataclasses.replace(preflighted, after_check=None), found)


def _found(preflighted: Preflighted, found: Preflight) -> Preflighted:
    """``preflighted`` with what a backend's preflight (or its rest) found laid over it."""
    batches = preflighted.batches
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
    return dataclasses.replace(
        preflighted,
        batches=batches,
        isolation=found.isolation,
        sandbox_options=found.options if found.options is not None else preflighted.sandbox_options,
        sandbox_facts={**preflighted.sandbox_facts, **found.facts},
        after_check=found.after_check,
    )


def will_call_the_model(batches: list[list[PromptJob]]) -> bool:
    """Whether any job is left that calls the model (preflight fails the others without a call)."""
    return any(j.fail_reason is None for batch in batches for j in batch)


def prepare_sandboxes(
    preflighted: Preflighted, backend: str, *, run_name: str, workers_here: bool
) -> Preflighted:
    """The backend's run preparation (its run directory, a sweep of what dead runs left), once the run
    starts, and what statistics.json says of what it settled (e.g. Docker's network). A run that starts
    no sandbox (a ``--resume`` with nothing left to run) still sweeps what a killed runner left."""
    sandbox = backend_class(backend)
    if not preflighted.batches:
        if workers_here:
            sandbox.sweep_dead(run_name)
        return preflighted
    try:
        options = sandbox.prepare_run(run_name, preflighted.sandbox_options, workers_here=workers_here)
    except SetupError as exc:
        raise UsageError(str(exc)) from None
    facts = {**preflighted.sandbox_facts, **sandbox.run_facts(options, workers_here=workers_here)}
    return dataclasses.replace(preflighted, sandbox_options=options, sandbox_facts=facts)


def sweep_prepared(preflighted: Preflighted, backend: str) -> None:
    """What :func:`prepare_sandboxes` made for the run (its sandbox directory, its cgroups), removed when the
    run stops before its workers' end would sweep it: Ctrl-C or SIGTERM while the manifest is written or
    the workers start, a disk full there."""
    if preflighted.batches:
        backend_class(backend).sweep(preflighted.sandbox_options)
