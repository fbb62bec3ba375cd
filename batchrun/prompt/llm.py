"""The model client: an OpenAI-compatible endpoint over HTTP (:mod:`batchrun.prompt.httpclient`).

The worker's chat path does not import the ``openai`` SDK: its import costs a worker ~0.75 s of CPU
before its first request, and its request path ~1.7 ms of CPU per call. The tools that call other
endpoints through the SDK (vision, image generation, mixture of agents) import it when first used.

Retries go through the run-wide limiter (see :class:`LLMClient`). Reasoning controls are sent in the
dialect of the endpoint (:data:`DIALECTS`): OpenRouter's nested ``reasoning`` object, OpenAI's top-level
``reasoning_effort``, what local OpenAI-compatible servers (llama.cpp, vLLM, SGLang) read:
``chat_template_kwargs.enable_thinking`` plus ``reasoning_effort``, or Ollama's ``reasoning_effort``.
Nothing is sent the user did not ask for, and no endpoint sees a field of another's dialect (OpenAI
rejects unknown request fields).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from batchrun.prompt import httpclient
from batchrun.prompt.jsonbody import RequestEncoder, encode_json
from batchrun.prompt.limiter import Limiter, LimitTimeout, backoff_s
from batchrun.sharegpt import ENCRYPTED_REASONING, parse_json, unwrap_reasoning

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra")
# auto: openrouter.ai -> openrouter, api.openai.com -> openai, port 11434 -> ollama, anything else -> local
DIALECTS = ("auto", "openrouter", "openai", "local", "ollama")
OLLAMA_PORT = 11434  # Ollama's default port: how auto tells it from other local servers
PROVIDER_SORTS = ("price", "throughput", "latency")
NO_KEY = "no-key"  # placeholder for local endpoints that want no key; never written anywhere


@dataclass(frozen=True)
class LLMConfig:
    """Everything that shapes a model request. Built once from the CLI flags."""

    model: str
    base_url: str
    api_key: str | None = None
    max_tokens: int | None = None
    reasoning_effort: str | None = None
    reasoning_disabled: bool = False
    providers_allowed: tuple[str, ...] = ()
    providers_ignored: tuple[str, ...] = ()
    providers_order: tuple[str, ...] = ()
    provider_sort: str | None = None
    provider_allow_fallbacks: bool | None = None  # False pins the request to the listed providers
    provider_data_collection: str | None = None  # "allow" or "deny"
    request_timeout_s: float = 600.0  # one attempt of one model call, whole: connect, send, every read
    max_response_mb: float = 32.0  # the most an answer's decoded body (or a whole stream) may hold
    max_retries: int = 3  # retries of one call on 5xx, timeouts, dropped connections
    max_rate_limit_retries: int = 30  # 429s of one call waited out (run-wide pause) before it fails
    # A 429 whose Retry-After asks a longer wait (at least MIN_RATE_LIMIT_PATIENCE_S) fails the call at
    # once, a refusal (see refused): the run's --endpoint_grace. None: every 429 is waited out.
    rate_limit_patience_s: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # computed by build_extra_body when empty
    dialect: str = "auto"  # one of DIALECTS: how reasoning controls and routing are spelled
    stream: bool = False  # ask for server-sent events (usage through stream_options.include_usage)
    temperature: float | None = None  # sent when set; None: the endpoint's default
    top_p: float | None = None  # sent when set; None: the endpoint's default

    @property
    def rate_limit_patience(self) -> float | None:
        """The longest ``Retry-After`` a 429 may ask and be waited for: ``rate_limit_patience_s``, at least
        :data:`MIN_RATE_LIMIT_PATIENCE_S`; None: every 429 is waited out."""
        patience = self.rate_limit_patience_s
        return None if patience is None else max(patience, MIN_RATE_LIMIT_PATIENCE_S)

    @property
    def resolved_dialect(self) -> str:
        return resolve_dialect(self.base_url, self.dialect)

    def request_extra_body(self) -> dict[str, Any]:
        return self.extra_body or build_extra_body(self)


def resolve_dialect(base_url: str, dialect: str = "auto") -> str:
    """The request dialect of an endpoint: the flag when given, else what the host says it is.

    An unknown remote host gets the standard OpenAI fields only (``openai``): an OpenAI-style upstream
    rejects the ``local`` dialect's extra fields. ``local`` (and ``ollama`` on its port) is for hosts
    on this machine or a private network (:func:`is_local_host`)."""
    if dialect != "auto":
        return dialect
    host = (urlsplit(base_url).hostname or "").lower()
    if host == "openrouter.ai" or host.endswith(".openrouter.ai"):
        return "openrouter"
    if not is_local_host(host):
        return "openai"
    try:
        port = urlsplit(base_url).port
    except ValueError:
        port = None
    return "ollama" if port == OLLAMA_PORT else "local"


def is_local_host(host: str) -> bool:
    """A host on this machine or a private network: a loopback, private or link-local address,
    ``localhost``, a name without a dot (a container's or a LAN host's), or one under ``.local``,
    ``.lan``, ``.internal``, ``.localhost``, ``.home.arpa``. Nothing is resolved."""
    import ipaddress

    host = host.strip("[]").lower().rstrip(".")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return (
            host == "localhost"
            or "." not in host
            or host.endswith((".local", ".lan", ".internal", ".localhost", ".home.arpa"))
        )
    return ip.is_loopback or ip.is_private or ip.is_link_local


# OpenAI accepts these reasoning_effort values (none on GPT-5.1 and later); vLLM and SGLang validate
# the field against low/medium/high, so local servers get only those and are switched off through the
# chat template instead.
_OPENAI_EFFORT = {"minimal": "minimal", "low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh"}
_OPENAI_EFFORT |= {"max": "xhigh", "ultra": "xhigh", "none": "none"}
_LOCAL_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high"}
_LOCAL_EFFORT |= {"xhigh": "high", "max": "high", "ultra": "high"}


def build_extra_body(cfg: LLMConfig) -> dict[str, Any]:
    """The request fields the flags ask for, spelled in the endpoint's dialect (see :data:`DIALECTS`)."""
    dialect = cfg.resolved_dialect
    body: dict[str, Any] = {}
    if dialect == "openrouter":
        provider = openrouter_provider(cfg)
        if provider:
            body["provider"] = provider
        if "openrouter.ai" in cfg.base_url:
            body["usage"] = {"include": True}  # OpenRouter then reports the cost of each call
        if cfg.reasoning_disabled:
            body["reasoning"] = {"effort": "none"}
        elif cfg.reasoning_effort:
            body["reasoning"] = {"enabled": True, "effort": cfg.reasoning_effort}
        return body
    off = cfg.reasoning_disabled or cfg.reasoning_effort == "none"
    if dialect == "openai":
        if off:
            body["reasoning_effort"] = "none"
        elif cfg.reasoning_effort:
            body["reasoning_effort"] = _OPENAI_EFFORT[cfg.reasoning_effort]
        return body
    if dialect == "ollama":
        # Ollama's /v1 maps reasoning_effort (low/medium/high, none = off) to its think switch and
        # ignores chat_template_kwargs.
        if off:
            body["reasoning_effort"] = "none"
        elif cfg.reasoning_effort:
            body["reasoning_effort"] = _LOCAL_EFFORT[cfg.reasoning_effort]
        return body
    # local: llama.cpp reads both fields; vLLM and SGLang pass chat_template_kwargs to the template
    # (enable_thinking: Qwen3, GLM, Granite...; thinking: DeepSeek V3.1) and validate reasoning_effort.
    if off:
        body["chat_template_kwargs"] = {"enable_thinking": False, "thinking": False}
    elif cfg.reasoning_effort:
        body["chat_template_kwargs"] = {"enable_thinking": True, "thinking": True}
        body["reasoning_effort"] = _LOCAL_EFFORT[cfg.reasoning_effort]
    return body


def openrouter_provider(cfg: LLMConfig) -> dict[str, Any]:
    """OpenRouter's ``provider`` preferences, exactly as the flags define them."""
    provider: dict[str, Any] = {}
    if cfg.providers_allowed:
        provider["only"] = list(cfg.providers_allowed)
    if cfg.providers_ignored:
        provider["ignore"] = list(cfg.providers_ignored)
    if cfg.providers_order:
        provider["order"] = list(cfg.providers_order)
    if cfg.provider_sort:
        provider["sort"] = cfg.provider_sort
    if cfg.provider_allow_fallbacks is not None:
        provider["allow_fallbacks"] = cfg.provider_allow_fallbacks
    if cfg.provider_data_collection:
        provider["data_collection"] = cfg.provider_data_collection
    return provider


def dialect_warnings(cfg: LLMConfig) -> list[str]:
    """What the flags ask for that this endpoint's dialect cannot carry (said once, at start)."""
    dialect = cfg.resolved_dialect
    out = []
    if dialect != "openrouter" and openrouter_provider(cfg):
        out.append(
            f"provider routing flags apply to OpenRouter only; not sent to this {dialect} endpoint "
            "(set --endpoint_dialect=openrouter for an OpenRouter-compatible proxy)"
        )
    if dialect in ("local", "ollama") and cfg.reasoning_effort in ("minimal", "xhigh", "max", "ultra"):
        out.append(
            f"--reasoning_effort={cfg.reasoning_effort} is sent as {_LOCAL_EFFORT[cfg.reasoning_effort]!r}: "
            "local servers accept only low, medium and high"
        )
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # raw JSON text as the model sent it (may be invalid JSON)


@dataclass
class AssistantTurn:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    usage: dict[str, Any]
    served_model: str | None = (
        None  # the response's ``model``: what answered, which may differ from the request
    )
    # OpenAI's ``message.refusal``: the model declined, in words of its own sent apart from ``content``
    # (which is then null). None when the reply has none (absent, null or blank).
    refusal: str | None = None


# What a reply's ``finish_reason`` says, by the values real servers send: OpenAI, llama.cpp, vLLM and
# SGLang, Ollama, TGI, Mistral, LiteLLM and OpenRouter, and the raw provider values some proxies pass
# through (Anthropic's, Gemini's upper-case ones). Compared lower-cased.
FINISHED = frozenset(
    {"stop", "tool_calls", "function_call", "end_turn", "stop_sequence", "tool_use", "eos", "eos_token"}
)
# Finished to call tools: a reply that ends so but carries no call lost its calls on the way (a proxy, a
# stream whose call parts were not the shape read); its words are no final answer.
CALLED_TOOLS = frozenset({"tool_calls", "function_call", "tool_use"})
CUT_BY_LENGTH = frozenset({"length", "max_tokens", "model_length"})
FILTERED = frozenset(
    {
        "content_filter",
        "content_filtered",
        "safety",
        "recitation",
        "prohibited_content",
        "blocklist",
        "spii",
        "refusal",
    }
)
GENERATION_FAILED = frozenset({"error", "abort"})  # OpenRouter's upstream failure; vLLM's, SGLang's abort


def finish_kind(finish_reason: Any) -> str:
    """``finished``, ``length``, ``content_filter``, ``error``, or ``unknown``: null, missing, or a value
    no known server means as an ordinary end (the reply may have been cut short; nothing says it was not)."""
    reason = finish_reason.lower() if isinstance(finish_reason, str) else None
    if reason in FINISHED:
        return "finished"
    if reason in CUT_BY_LENGTH:
        return "length"
    if reason in FILTERED:
        return "content_filter"
    if reason in GENERATION_FAILED:
        return "error"
    return "unknown"


class LLMError(RuntimeError):
    """The endpoint failed after our client's retries; fails the prompt (retried on resume)."""

    def __init__(self, error_class: str, message: str, status: int | None = None):
        super().__init__(message)
        self.error_class = error_class
        self.status = status


class ContextLimitError(LLMError):
    """The conversation no longer fits the model's context: the prompt ends as partial."""


class PromptCapReached(LLMError):
    """The prompt's own cap (--max_prompt_tokens, --max_prompt_usd) was spent while one call was retried:
    no further attempt. The agent loop ends the prompt as partial (``prompt_budget``) when it has turns."""


class BudgetStop(LLMError):
    """The run's budget is spent: a prompt in flight stops at its next model call (failed, class ``budget``)."""

    def __init__(self) -> None:
        super().__init__(
            "budget",
            "the run is stopping (its budget was reached, or its endpoint died or refused its key) before this "
            "model call; "
            "--resume runs it again",
        )


def native_reasoning(message: dict[str, Any]) -> str | None:
    """Reasoning from the first native field present, in the order providers fill them.

    ``reasoning_content`` (vLLM, SGLang, llama.cpp, DeepSeek), ``reasoning`` (OpenRouter, Ollama),
    ``reasoning_details`` (OpenRouter's structured form; it repeats ``reasoning`` when both come, so
    only one is read). A turn whose only reasoning is encrypted still had reasoning: it is kept as a
    marker, so the record shows it and reasoning coverage counts it.
    """
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            return unwrap_reasoning(value)  # as the model wrote it; a field of blanks only is no reasoning
    details = message.get("reasoning_details")
    if isinstance(details, list):
        texts, encrypted = [], False
        for d in details:
            if isinstance(d, dict):
                text = d.get("text") or d.get("summary")
                if isinstance(text, list):  # summaries may come as a list of parts
                    text = "\n".join(t if isinstance(t, str) else str(t.get("text", "")) for t in text)
                if isinstance(text, str) and text.strip():
                    texts.append(unwrap_reasoning(text))
                elif d.get("type") == "reasoning.encrypted" or d.get("data"):
                    encrypted = True
        if texts:
            return "\n\n".join(texts)
        if encrypted:
            return ENCRYPTED_REASONING
    return None


MAX_CALL_TOKENS = 10_000_000  # more tokens than any model's context in one call: an absurd count
MAX_CALL_USD = 1000.0  # more than any one call costs: an absurd cost
# More tool calls than one reply can hold: each costs a model ~10 tokens at the least, so 20,000 is more
# than any model's longest output. The agent loop runs a reply's first 128 and answers the rest that they
# were not run, keeping them in the record; a million calls (a 3 MB body of ``{}`` items) took a worker
# to 2.3 GB and wrote a 341 MB line. Past this bound the answer is a bad response.
MAX_TOOL_CALLS_PER_REPLY = 20_000
ESTIMATE_BYTES_PER_TOKEN = 3  # the runner's own count: UTF-8 bytes / 3, rounded up (an over-estimate)


def estimate_tokens(text: str | bytes) -> int:
    """The runner's own token count of ``text``: its UTF-8 bytes / :data:`ESTIMATE_BYTES_PER_TOKEN`,
    rounded up. Tokenizers give ~4 bytes per token of English and code, so this errs high, on the
    side of a budget."""
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "replace"))
    return -(-size // ESTIMATE_BYTES_PER_TOKEN)


def _count_problem(value: Any, limit: float) -> str | None:
    """Why ``value`` is not a credible count (None: it is)."""
    if value is None:
        return "missing"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "not a number"
    if value != value or value in (float("inf"), float("-inf")):
        return "NaN or infinite"
    if value < 0:
        return "negative"
    if value > limit:
        return "absurd"
    if isinstance(value, float) and not value.is_integer() and limit == MAX_CALL_TOKENS:
        return "not a whole number"
    return None


# Where endpoints report the prompt tokens served from their cache, and those written to it, first found
# first: OpenAI, OpenRouter, vLLM, LiteLLM and llama.cpp's server in ``usage.prompt_tokens_details``;
# Anthropic-compatible ones (and LiteLLM, passing them through) at the top of ``usage``.
CACHE_READ_FIELDS = (("prompt_tokens_details", "cached_tokens"), (None, "cache_read_input_tokens"))
CACHE_WRITE_FIELDS = (("prompt_tokens_details", "cache_write_tokens"), (None, "cache_creation_input_tokens"))
# Beside Anthropic's input_tokens (which they are not part of), not beside a prompt_tokens (which holds them).
ANTHROPIC_CACHE_FIELDS = ("cache_read_input_tokens", "cache_creation_input_tokens")


def _cache_counts(usage: dict[str, Any], timings: Any, prompt_tokens: int) -> dict[str, int]:
    """The prompt tokens a call read from the endpoint's cache (``cached_tokens``) and wrote to it
    (``cache_write_tokens``), each where reported credibly: a count that is missing, not a whole number,
    negative, NaN or absurd is left out (unreported), never estimated (it changes no spend), and so is one
    more than the prompt's tokens (the read), or than what the read left of them (the write): the endpoint
    contradicts itself. (They were clipped to the prompt: a record said 100 of 100 tokens were cached where
    the endpoint had said 500 of 100.) llama.cpp's server also says ``timings.cache_n`` (read when its
    usage does not: servers before it had ``prompt_tokens_details``)."""
    found: dict[str, int] = {}
    for name, fields in (("cached_tokens", CACHE_READ_FIELDS), ("cache_write_tokens", CACHE_WRITE_FIELDS)):
        for parent, key in fields:
            holder = usage.get(parent) if parent else usage
            if isinstance(holder, dict) and key in holder:
                if _count_problem(holder[key], MAX_CALL_TOKENS) is None:
                    found[name] = int(holder[key])
                break  # the first place in usage that names it says it (timings.cache_n is read after)
    if "cached_tokens" not in found and isinstance(timings, dict):
        if _count_problem(timings.get("cache_n"), MAX_CALL_TOKENS) is None:
            found["cached_tokens"] = int(timings["cache_n"])
    if found.get("cached_tokens", 0) > prompt_tokens:
        del found["cached_tokens"]
    if found.get("cache_write_tokens", 0) > prompt_tokens - found.get("cached_tokens", 0):
        del found["cache_write_tokens"]
    return found


def credible_usage(
    raw: Any, prompt_estimate: int, completion_estimate: int, timings: Any = None
) -> tuple[dict[str, Any], str | None]:
    """An endpoint's ``usage`` made safe to add: counts that are missing, non-numeric, negative, NaN,
    absurd, or 0 where the runner's estimate is not, are replaced by the runner's estimates
    (:func:`estimate_tokens` of the request and the reply) and the result is marked ``estimated``; such
    a cost is dropped. The cache's counts it reports
    (:func:`_cache_counts`; ``timings``: llama.cpp's) are kept in ``prompt_tokens_details``. Returns it and
    the endpoint's fault in words (None: nothing was wrong)."""
    usage = raw if isinstance(raw, dict) else {}
    # The images API (and OpenAI's Responses API) name the counts input_tokens / output_tokens: an image
    # call's were read as missing, so a budget counted its prompt estimate alone (some 30 tokens).
    aliases = {"prompt_tokens": "input_tokens", "completion_tokens": "output_tokens"}
    anthropic_input = "prompt_tokens" not in usage and "input_tokens" in usage
    if any(k not in usage and v in usage for k, v in aliases.items()):
        usage = {**usage, **{k: usage[v] for k, v in aliases.items() if k not in usage and v in usage}}
    # Anthropic's way: input_tokens are the prompt's tokens neither read from its cache nor written to it,
    # and cache_read_input_tokens / cache_creation_input_tokens the rest of the prompt (each billed). Taken
    # for the whole prompt, a call resending 2,495 cached tokens counted 12.
    cache_parts = [int(usage[k]) for k in ANTHROPIC_CACHE_FIELDS if _is_count(usage.get(k))]
    if cache_parts and _is_count(usage.get("prompt_tokens")):
        prompt = int(usage["prompt_tokens"])
        # A prompt_tokens holds them (OpenAI's and LiteLLM's way) and is never less than their sum; one
        # that is less is a gateway's input_tokens passed on, with the cache reads or without (both are
        # seen): raised to their sum, which is the prompt's but for its few uncached tokens, either way.
        usage = {
            **usage,
            "prompt_tokens": prompt + sum(cache_parts) if anthropic_input else max(prompt, sum(cache_parts)),
        }
    clean: dict[str, Any] = {}
    faults = []
    if not usage:
        faults.append("no usage")
    for key, estimate in (("prompt_tokens", prompt_estimate), ("completion_tokens", completion_estimate)):
        problem = _count_problem(usage.get(key), MAX_CALL_TOKENS)
        if problem is None and usage[key] == 0 and estimate > 0:
            # 0 tokens for a request or a reply that is not empty: an endpoint (or a proxy) that zeroes
            # its counts was spent on without limit, every call counted free against --budget_tokens.
            problem = "zero for text that is not empty"
        if problem is None:
            clean[key] = int(usage[key])
        else:
            clean[key] = estimate
            if usage:
                faults.append(f"{key} {problem}")
    details = usage.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else None
    if not faults:
        # Reasoning counted apart from completion_tokens (xAI's way: total_tokens holds it, or a reasoning
        # count above the completion's) is billed too: it is added to the completion, which the budgets count.
        apart = reasoning if _is_count(reasoning) and reasoning > clean["completion_tokens"] else 0
        total = usage.get("total_tokens")
        if _is_count(total):
            apart = max(apart, int(total) - clean["prompt_tokens"] - clean["completion_tokens"])
        clean["completion_tokens"] += int(apart)
    if isinstance(details, dict) and _count_problem(details.get("reasoning_tokens"), MAX_CALL_TOKENS) is None:
        clean["completion_tokens_details"] = {
            "reasoning_tokens": min(int(details["reasoning_tokens"]), clean["completion_tokens"])
        }
    cache = _cache_counts(usage, timings, clean["prompt_tokens"])
    if cache:
        clean["prompt_tokens_details"] = cache
    if "cost" in usage:
        problem = _count_problem(usage["cost"], MAX_CALL_USD)
        if problem is None:
            clean["cost"] = float(usage["cost"])
        else:
            faults.append(f"cost {problem}")
    clean["total_tokens"] = clean["prompt_tokens"] + clean["completion_tokens"]
    if faults:
        clean["estimated"] = True
    return clean, (", ".join(faults) or None)


class Usage:
    """Tokens, cost and calls of one prompt (model calls and the calls tools make). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0  # requests sent, failed attempts included
        self.calls = self.prompt_tokens = self.completion_tokens = self.reasoning_tokens = 0  # answered calls
        self.cached_tokens = self.cache_write_tokens = 0  # prompt tokens read from / written to the cache
        self.estimated_calls = 0  # answered calls whose usage the endpoint did not report credibly
        # Estimated tokens of attempts that got no usable answer but may have been billed (a stream cut
        # or timed out mid-answer, a broken 200): the budgets count them; no call's counts hold them.
        self.unanswered_tokens = 0
        # The prompt's own caps (--max_prompt_tokens, --max_prompt_usd), held also between the retries
        # of one call: set by the agent loop.
        self.cap_tokens: int | None = None
        self.cap_usd: float | None = None
        self.cost_usd = 0.0
        self.retries = self.rate_limited = 0
        self.providers: list[str] = []
        self.reported: set[str] = set()  # the counts some response reported: the others are unknown (null)

    def add(self, usage: dict[str, Any] | None, provider: str | None = None) -> None:
        """Add one answered call's usage; anything not credible counts as 0 (see :func:`credible_usage`,
        which the model client applies first, so its counts are estimates rather than zeros)."""
        usage = usage or {}
        details = usage.get("completion_tokens_details") or {}
        with self._lock:
            self.calls += 1
            self.estimated_calls += bool(usage.get("estimated"))
            for key in ("prompt_tokens", "completion_tokens"):
                if _is_count(usage.get(key)):
                    self.reported.add(key)
            if isinstance(details, dict) and _is_count(details.get("reasoning_tokens")):
                self.reported.add("reasoning_tokens")
            self.prompt_tokens += _int(usage.get("prompt_tokens"))
            self.completion_tokens += _int(usage.get("completion_tokens"))
            self.reasoning_tokens += _int(details.get("reasoning_tokens") if isinstance(details, dict) else 0)
            cache = usage.get("prompt_tokens_details")
            for key in ("cached_tokens", "cache_write_tokens"):
                value = cache.get(key) if isinstance(cache, dict) else None
                if _is_count(value):
                    self.reported.add(key)
                    setattr(self, key, getattr(self, key) + int(value))
            cost = usage.get("cost")
            if _count_problem(cost, MAX_CALL_USD) is None:
                self.cost_usd += float(cost)
                self.reported.add("cost_usd")
            if provider and provider not in self.providers:
                self.providers.append(provider)

    def note_request(self) -> None:
        with self._lock:
            self.requests += 1

    def add_unanswered(self, tokens: int) -> None:
        with self._lock:
            self.unanswered_tokens += max(0, tokens)

    def over_cap(self, price: float = 0.0) -> bool:
        """Whether the prompt spent its caps: its answered tokens and its failed attempts' estimate;
        in USD, the costs reported plus the failed attempts' tokens at the higher of the price its
        answers paid and ``price`` (USD per token the client's answers showed)."""
        with self._lock:
            tokens = self.prompt_tokens + self.completion_tokens
            if self.cap_tokens is not None and tokens + self.unanswered_tokens >= self.cap_tokens:
                return True
            price = max(price, self.cost_usd / tokens if tokens else 0.0)
            return self.cap_usd is not None and self.cost_usd + self.unanswered_tokens * price >= self.cap_usd

    def note_retry(self, rate_limited: bool) -> None:
        with self._lock:
            self.retries += 1
            self.rate_limited += rate_limited

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        """The record's ``metadata.usage`` (``batchrun.record.USAGE``): a count no response reported is
        None, not 0, and no provider named is None, not an empty list of unknown type."""
        known = self.reported
        return {
            "requests": self.requests,
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens if "prompt_tokens" in known else None,
            "completion_tokens": self.completion_tokens if "completion_tokens" in known else None,
            "reasoning_tokens": self.reasoning_tokens if "reasoning_tokens" in known else None,
            "cached_tokens": self.cached_tokens if "cached_tokens" in known else None,
            "cache_write_tokens": self.cache_write_tokens if "cache_write_tokens" in known else None,
            "cost_usd": round(self.cost_usd, 8) if "cost_usd" in known else None,
            "retries": self.retries,
            "rate_limited": self.rate_limited,
            "providers": list(self.providers) or None,
            "estimated_calls": self.estimated_calls,
            "unanswered_tokens": self.unanswered_tokens,
        }


def _is_count(value: Any) -> bool:
    return _count_problem(value, MAX_CALL_TOKENS) is None


def _int(value: Any) -> int:
    return int(value) if _is_count(value) else 0


def record_usage(usage: Usage | None, resp: Any) -> None:
    """Add an SDK response's usage (and OpenRouter's ``provider``) to a tally; used by tools too."""
    if usage is None:
        return
    raw = resp.usage.model_dump() if getattr(resp, "usage", None) is not None else {}
    clean, _ = credible_usage(raw, 0, 0)
    usage.add(clean, getattr(resp, "provider", None))


ERROR_TEXT_CHARS = 1000  # of an endpoint's error message: it goes into every failed record and the log
RETRYABLE_STATUS = {408, 409, 425, 500, 502, 503, 504, 520, 522, 524, 529}
# The key or the account refused (a key revoked, credits spent, an account suspended) or the model gone
# (404: retired mid-run), or the request's own content did (a provider's moderation answers 403, and
# OpenRouter 404 when no provider takes its image): reported to ``on_failure`` as refused, whose watch
# tells the two apart with one probe (batchrun/run/endpoint_watch.py).
REFUSED_STATUS = frozenset({401, 402, 403, 404})
# OpenAI's 429 when the account's quota or credit is spent ("You exceeded your current quota"): not a rate
# limit, no wait ends it. Waited out as one, a run of 20 prompts made 111 doomed calls in 300 s.
QUOTA_SPENT = "insufficient_quota"
MIN_RATE_LIMIT_PATIENCE_S = 30.0  # the least LLMConfig.rate_limit_patience_s, whatever --endpoint_grace


def refused(exc: BaseException) -> bool:
    """Whether a call's final error is a refusal of the key or the account (:data:`REFUSED_STATUS`, a
    spent quota, a 429 asking a longer wait than the run's patience), which every later call will meet
    too, rather than of this request."""
    if not isinstance(exc, LLMError) or isinstance(exc, ContextLimitError):
        return False
    return exc.status in REFUSED_STATUS or exc.error_class == QUOTA_SPENT or isinstance(exc, LongRateLimit)


def quota_spent(body: Any) -> bool:
    """Whether an error answer's body says the account's quota is spent (:data:`QUOTA_SPENT`)."""
    err = body.get("error", body) if isinstance(body, dict) else None
    return isinstance(err, dict) and QUOTA_SPENT in (err.get("code"), err.get("type"))


USER_AGENT = "batch-runner/0.1 (OpenAI-compatible client)"


def endpoint_url(base_url: str, path: str) -> str:
    """``<base_url>/<path>``, the base's path prefix kept (``https://openrouter.ai/api/v1``), without
    the base's user and password (they go in a header, see :func:`request_headers`)."""
    parts = urlsplit(httpclient._safe_url(base_url))  # its query kept: it may carry the key (?api_key=)
    return parts._replace(path=parts.path.rstrip("/") + "/" + path).geturl()


def request_headers(api_key: str | None, base_url: str | None = None) -> dict[str, str]:
    """What every model request carries, as the ``openai`` SDK sent it: the key as a bearer token
    (:data:`NO_KEY` when none; HTTP Basic auth instead when ``base_url`` holds a user and password and
    no key is given), JSON both ways, and ``OPENAI_ORG_ID`` / ``OPENAI_PROJECT_ID`` from the
    environment as ``OpenAI-Organization`` / ``OpenAI-Project`` when set."""
    creds = httpclient.url_credentials(base_url)[1] if base_url else None
    auth = httpclient.basic_auth(*creds) if creds and not api_key else f"Bearer {api_key or NO_KEY}"
    headers = {
        "Authorization": auth,
        "Content-Type": "application/json",
        "Accept": "application/json",
        "User-Agent": USER_AGENT,
    }
    for env, header in (("OPENAI_ORG_ID", "OpenAI-Organization"), ("OPENAI_PROJECT_ID", "OpenAI-Project")):
        if os.environ.get(env):
            headers[header] = os.environ[env]
    return headers


class SpendGate(Protocol):
    """The run's budget as a model call sees it (the worker asks the parent, see batchrun/run/budget.py)."""

    def reserve(
        self, tokens: int, deadline: float, priority: int = 0, model: str | None = None
    ) -> tuple[Any, float]:
        """Wait until a call that may spend ``tokens`` fits the budget; returns a ticket and the seconds
        waited (they do not count against the prompt's deadline). :class:`BudgetStop` when it never will.
        ``priority``: the calls its prompt has made (a prompt under way goes first). ``model``: the model
        asked (a judge's or a tool's may cost more per token than the run's)."""

    def settle(self, ticket: Any, usage: dict[str, Any] | None) -> None:
        """The call is over: what it spent (None: no answer), in place of its reservation."""


# A judge's call ends a prompt whose agent is done (its sandbox still open for the verify, its record
# unwritten): it takes the next free request slot before any prompt still under way. Its own Usage made it
# a first call (priority 0): behind 3 prompts under way taking turns on one slot, it got the slot last.
JUDGE_SLOT_PRIORITY = 1 << 30


class LLMClient:
    """One per worker process: its HTTP client pools keep-alive connections shared by the worker's threads.

    Every model call of a prompt goes through it (the agent's turns, the tools' models, a judge), so
    each one takes the shared limiter, the run-wide 429 pause, the retry policy and the live budget.
    Retries are ours: a 429 pauses the whole run (Retry-After honoured up to a cap) and is retried until
    the prompt's deadline; 5xx, timeouts, dropped connections and bad answers are retried
    ``max_retries`` times with jitter. Each attempt is bounded whole by ``--request_timeout`` and by
    the prompt's deadline, and its answer by ``--max_response_mb`` (:mod:`httpclient`).
    """

    def __init__(
        self,
        cfg: LLMConfig,
        limiter: Limiter | None = None,
        *,
        stop: threading.Event | None = None,
        on_usage: Callable[[dict[str, Any]], None] | None = None,
        gate: SpendGate | None = None,
        on_failure: Callable[[str | None, bool, float], None] | None = None,
        headers: dict[str, str] | None = None,
    ):
        """``stop``: once set, every further call raises :class:`BudgetStop` before it is sent.
        ``on_usage``: called with each answered call's usage (the run's budget counts it at once).
        ``gate``: the run's budget, asked before every attempt (then ``on_usage`` is not called: the
        gate's ``settle`` reports the spend). ``on_failure(error_class, refused, sent_at)``: told after
        each attempt that failed for the endpoint's reasons (an error class; ``refused`` False) or whose
        final error is a refusal (:func:`refused`: ``refused`` True), and after each answered one (None,
        False), with the attempt's ``time.time()`` as it was sent (an answer to a call sent before the
        refusals began says nothing of the endpoint now): the run's dead-endpoint and refused-key watch."""
        self.cfg = cfg
        self.limiter = limiter or Limiter()
        self.stop = stop
        self.on_usage = on_usage
        self.gate = gate
        self.on_failure = on_failure
        bounds = httpclient.Bounds(body_bytes=max(1, int(cfg.max_response_mb * (1 << 20))))
        self._http = httpclient.Client(
            {**request_headers(cfg.api_key, cfg.base_url), **(headers or {})}, bounds=bounds
        )
        self._url = endpoint_url(cfg.base_url, "chat/completions")
        self._extra_body = cfg.request_extra_body()
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()
        # A Redactor of this client's key and URL credentials, made on its first error.
        self._credentials: Any = None
        self.usd_per_token = (
            0.0  # the most an answer of this client cost per token (its failed attempts' price)
        )
        # When set, only requests to this base URL take one of the limiter's request slots: they are
        # a llama-server's, and a judge's or a tool's model elsewhere is not held back by them. None:
        # every request takes one (--max_concurrent_requests bounds all of the run's model requests).
        self.slot_endpoint: str | None = None
        # When set, this client's place in the queue for a request slot (the judge's: JUDGE_SLOT_PRIORITY);
        # None: the calls its prompt has made (``usage.calls``), a prompt further under way first.
        self.slot_priority: int | None = None

    def _warn_once(self, key: str, text: str) -> None:
        with self._warn_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        print(f"warning: {text}", file=sys.stderr, flush=True)

    def _check_controls(self, turn: AssistantTurn) -> None:
        """Warn once per process when a reasoning control visibly did not take effect."""
        if self.cfg.reasoning_disabled and turn.reasoning:
            self._warn_once(
                "reasoning_disabled",
                f"--reasoning_disabled was sent ({self.cfg.resolved_dialect} dialect) but "
                f"{self.cfg.model} still answers with reasoning; the endpoint or its chat template "
                "ignores the control (see --endpoint_dialect)",
            )

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        deadline: float | None = None,
        usage: Usage | None = None,
        seed: int | None = None,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        extra_body: dict[str, Any] | None = None,
        encoder: RequestEncoder | None = None,
    ) -> AssistantTurn:
        """One model turn. ``deadline`` (time.monotonic) bounds every attempt and every wait.
        ``seed``: sent as the request's ``seed`` (--seed_per_request), the same on every retry.
        ``model``, ``max_tokens``, ``temperature``, ``extra_body``: a tool's or a judge's own call (its
        model, no reasoning fields of the run's dialect unless given). ``encoder``: the conversation's
        (:class:`~batchrun.prompt.jsonbody.RequestEncoder`), so that what earlier turns sent is not
        encoded again; its messages must not change once sent."""
        own = model is not None
        body = self._request_body(messages, tools, seed, model, max_tokens, temperature, extra_body)
        payload = _encode(body, encoder or RequestEncoder())

        def parse(raw: httpclient.Response, attempt_deadline: float) -> tuple[AssistantTurn, dict[str, Any]]:
            turn, data = self._parse_reply(raw, attempt_deadline)
            if not own:
                self._check_controls(turn)
            return turn, data

        limit = max_tokens or self.cfg.max_tokens
        turn, _ = self._call(
            self._url,
            payload,
            parse,
            deadline,
            usage,
            limit,
            stream=self.cfg.stream,
            model=model or self.cfg.model,
        )
        return turn

    def _request_body(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        seed: int | None,
        model: str | None,
        max_tokens: int | None,
        temperature: float | None,
        extra_body: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The chat request's fields, in the order they are sent. A call with its own ``model`` (a
        tool's, a judge's) gets none of the run's sampling or dialect fields it did not give."""
        own = model is not None
        body: dict[str, Any] = {"model": model or self.cfg.model, "messages": messages}
        if tools:
            body["tools"] = tools
        limit = max_tokens or self.cfg.max_tokens
        if limit:
            body["max_tokens"] = limit
        temperature = temperature if temperature is not None else (None if own else self.cfg.temperature)
        if temperature is not None:
            body["temperature"] = temperature
        if self.cfg.top_p is not None and not own:
            body["top_p"] = self.cfg.top_p
        if seed is not None:
            body["seed"] = seed
        if self.cfg.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}  # the last chunk then carries the usage
        body.update(self._extra_body if extra_body is None and not own else (extra_body or {}))
        return body

    def _parse_reply(
        self, raw: httpclient.Response, attempt_deadline: float
    ) -> tuple[AssistantTurn, dict[str, Any]]:
        """The answer's body (a stream assembled into the body a plain call returns) and its turn. A
        reply whose ``finish_reason`` says the generation failed is a bad response (retried)."""
        if self.cfg.stream and not _is_json(raw):
            data = _read_stream(raw, attempt_deadline, self._http.bounds.body_bytes)
        elif self.cfg.stream:
            # A server or proxy that does not stream answers a streamed request with the plain body:
            # it is the same reply. SSE mislabelled as JSON is still read as a stream.
            body = raw.read()
            try:
                data = parse_json(body)
            except ValueError:
                if not body.lstrip().startswith((b"data:", b":")):
                    raise
                data = _read_stream(raw, attempt_deadline, self._http.bounds.body_bytes)
        else:
            data = raw.json()
        if isinstance(data, dict):
            _note_partial(raw, None, data.get("usage"))
        turn = _parse_payload(data)
        if finish_kind(turn.finish_reason) == "error":
            raise LLMError(
                "bad_response",
                f"endpoint ended its reply with finish_reason {turn.finish_reason!r}: the generation failed",
            )
        return turn, data

    def post_json(
        self,
        path: str,
        body: dict[str, Any],
        *,
        deadline: float | None = None,
        usage: Usage | None = None,
        worst_tokens: int = 0,
    ) -> dict[str, Any]:
        """Another endpoint of the same server (``images/generations``) through the same limiter,
        pause, retries, bounds and budget; its JSON answer. Its ``usage``, when it has one, is counted."""

        def parse(raw: httpclient.Response, attempt_deadline: float) -> tuple[AssistantTurn, dict[str, Any]]:
            data = raw.json()
            if not isinstance(data, dict):
                raise LLMError("bad_response", f"endpoint answered {path} with {str(data)[:200]!r}")
            u = data.get("usage")
            return AssistantTurn("", None, [], None, u if isinstance(u, dict) else {}), data

        _, data = self._call(
            endpoint_url(self.cfg.base_url, path),
            _encode(body),
            parse,
            deadline,
            usage,
            worst_tokens,
            stream=False,
            model=body.get("model") if isinstance(body.get("model"), str) else None,
        )
        return data

    def _call(self, *args: Any, **kwargs: Any) -> tuple[AssistantTurn, dict[str, Any]]:
        """:meth:`_call_retrying`, its error's text without this client's own credentials: an endpoint
        refusing them may quote them ("invalid key Bearer vk-..."), and a tool's error (vision, moa,
        image_gen) goes to the run's model, another endpoint, in the conversation."""
        try:
            return self._call_retrying(*args, **kwargs)
        except LLMError as exc:
            exc.args = (self._without_credentials(str(exc)),)
            raise

    def _without_credentials(self, text: str) -> str:
        if self._credentials is None:
            from batchrun.secrets import Redactor  # batchrun.secrets imports this module

            self._credentials = Redactor.for_endpoint(self.cfg.api_key, self.cfg.base_url, environ={})
        return self._credentials(text)

    def _call_retrying(
        self,
        url: str,
        payload: bytes,
        parse: Callable[[httpclient.Response, float], tuple[AssistantTurn, dict[str, Any]]],
        deadline: float | None,
        usage: Usage | None,
        completion_limit: int | None,
        *,
        stream: bool,
        model: str | None = None,
    ) -> tuple[AssistantTurn, dict[str, Any]]:
        deadline = deadline if deadline is not None else time.monotonic() + 10 * self.cfg.request_timeout_s
        prompt_estimate = estimate_tokens(payload)
        worst = prompt_estimate + (completion_limit or 0)
        failures = rate_limited = 0
        slotted = self.slot_endpoint is None or self.slot_endpoint.rstrip("/") == self.cfg.base_url.rstrip(
            "/"
        )
        while True:
            if self.stop is not None and self.stop.is_set():
                raise BudgetStop()
            ticket = None
            priority = usage.calls if usage is not None else 0  # a prompt under way goes first
            slot_priority = priority if self.slot_priority is None else self.slot_priority
            if self.gate is not None:
                ticket, waited = self.gate.reserve(worst, deadline, priority, model)
                # Waiting for the budget is not the prompt's time: credited to it as a slot wait is, from
                # the same allowance. Moved for this call alone, the prompt's deadline passed under a long
                # wait, the call was sent and paid all the same, and the loop then ended the prompt as
                # timed out, its answer lost; past the allowance, the call is not sent (_attempt).
                deadline += self.limiter.credit(waited)
            answered: dict[str, Any] | None = None
            sent_at = time.time()  # for on_failure; set again as the attempt goes out
            try:
                try:
                    # A run-wide pause (another prompt's 429) does not count against this prompt's time.
                    deadline += self.limiter.acquire(deadline, slot_priority, slotted)
                except LimitTimeout as exc:
                    raise LLMError("timeout", str(exc)) from exc
                try:
                    if self.stop is not None and self.stop.is_set():  # set while this call waited
                        raise BudgetStop()
                    # Only now, the run not stopped meanwhile: once stopped, every prompt still queued for
                    # a slot was granted one in turn only to stop, and would start its sandbox first.
                    self.limiter.granted()  # (the prompt's sandbox start, on its first request)
                    sent_at = time.time()
                    turn, data, answered = self._attempt(
                        url, payload, parse, deadline, usage, prompt_estimate, stream, completion_limit
                    )
                    if self.on_failure is not None:
                        self.on_failure(None, False, sent_at)
                    return turn, data
                except (_Retry, LLMError) as exc:
                    if getattr(exc, "unanswered_tokens", 0):
                        answered = {"unanswered_tokens": exc.unanswered_tokens}
                    if self.on_failure is not None and refused(exc):
                        self.on_failure(exc.error_class, True, sent_at)  # final, never retried
                    raise
                finally:
                    self.limiter.release(slotted)
            except _Retry as retry:
                error, retry_after = retry.error, retry.retry_after
                if self.on_failure is not None and retry.endpoint_fault:
                    self.on_failure(error.error_class, False, sent_at)
                if retry.rate_limited:
                    patience = self.cfg.rate_limit_patience
                    if patience is not None and retry_after is not None and retry_after > patience:
                        # Asked to come back later than the run waits for its endpoint (a quota over for
                        # the day): waited out 120 s at a time, each prompt failed at its deadline, 35 min
                        # on, and the next ones after it. Failed now, a refusal the run's watch counts.
                        final = LongRateLimit(error, retry_after)
                        if self.on_failure is not None:
                            self.on_failure(final.error_class, True, sent_at)
                        raise final from None
                    rate_limited += 1
                    wait = backoff_s(rate_limited, retry_after)
                    self.limiter.pause(wait)
                    if usage is not None:
                        usage.note_retry(rate_limited=True)
                    if rate_limited > self.cfg.max_rate_limit_retries:
                        raise LLMError(
                            "http_429", f"{error} (still rate limited after {rate_limited - 1} waits)", 429
                        ) from None
                    if time.monotonic() + wait >= deadline:
                        raise LLMError(
                            "http_429", f"{error} (rate limited until the prompt's deadline)", 429
                        ) from None
                    continue  # the limiter holds this and every other request until the pause ends
            finally:
                if self.gate is not None:
                    self.gate.settle(ticket, answered)
            failures += 1
            wait = backoff_s(failures, retry_after, cap_s=30.0)
            if failures > self.cfg.max_retries or time.monotonic() + wait >= deadline:
                if failures > 1:  # say it was retried, so one failure is not read as several requests
                    raise LLMError(
                        error.error_class,
                        f"{error} (failed {failures} times: 1 try + {failures - 1} retries)",
                        error.status,
                    )
                raise error
            if usage is not None and usage.over_cap(self.usd_per_token):  # broken attempts were billed too
                raise PromptCapReached(
                    "prompt_budget",
                    f"{error} (not retried: the prompt's --max_prompt_tokens or --max_prompt_usd is spent)",
                    error.status,
                )
            if usage is not None:
                usage.note_retry(rate_limited=False)
            time.sleep(wait)

    def _attempt(
        self,
        url: str,
        payload: bytes,
        parse: Callable[[httpclient.Response, float], tuple[AssistantTurn, dict[str, Any]]],
        deadline: float,
        usage: Usage | None,
        prompt_estimate: int,
        stream: bool,
        completion_limit: int | None = None,
    ) -> tuple[AssistantTurn, dict[str, Any], dict[str, Any]]:
        """One request, bounded whole by --request_timeout and the prompt's deadline; raises :class:`_Retry`
        for what may pass on another try, :class:`LLMError` for what will not."""
        if time.monotonic() >= deadline:
            raise LLMError("timeout", "no time left for the model call")
        attempt_deadline = min(deadline, time.monotonic() + self.cfg.request_timeout_s)
        if usage is not None:
            usage.note_request()
        raw = None
        try:
            raw = self._http.request(
                "POST",
                url,
                body=payload,
                timeout_s=self.cfg.request_timeout_s,
                stream=stream,
                deadline=attempt_deadline,
            )
            turn, data = parse(raw, attempt_deadline)
        except (httpclient.HTTPError, ValueError, LLMError) as exc:
            error = self._attempt_error(exc, deadline)
            # Failed, but perhaps billed: the budgets count it (see unanswered_tokens).
            error.unanswered_tokens = unanswered_tokens(exc, raw, prompt_estimate, completion_limit)
            if usage is not None:
                usage.add_unanswered(error.unanswered_tokens)
            try:
                raise error from None
            finally:
                # The error's traceback holds this frame, which held the error: a cycle that only the
                # garbage collector ends, so the failed attempt's frames (the reply as far as it was
                # read, up to --max_response_mb) outlived it, through the back-off and the next attempt.
                error = None
        clean = self._account(turn, data, usage, prompt_estimate)
        return turn, data, clean

    def _attempt_error(self, exc: Exception, deadline: float) -> Exception:
        """What a failed attempt raises: :class:`_Retry` when another attempt may pass, else the
        :class:`LLMError` that fails the call."""
        if isinstance(exc, httpclient.StatusError):
            return _status_error(exc)
        if isinstance(exc, httpclient.RequestTimeout):
            if time.monotonic() >= deadline:
                return LLMError("timeout", f"model call timed out at the prompt's deadline: {exc}")
            return _Retry(LLMError("timeout", f"model call timed out: {exc}"), endpoint_fault=True)
        if isinstance(exc, httpclient.InvalidRequest):  # e.g. a key with a line break: every try would fail
            return LLMError("bad_request", f"the model request cannot be sent: {exc}")
        if isinstance(exc, httpclient.BadResponse):
            return _Retry(LLMError("bad_response", f"endpoint answered with a bad response: {exc}"))
        if isinstance(exc, httpclient.TransportError):
            # A connection that ended before any answer counts as a retry here, never as a silent
            # resend: the endpoint may have run (and billed) the call (see httpclient's doc).
            error = LLMError("connection", f"cannot reach {safe_url(self.cfg.base_url)}: {exc}")
            return _Retry(error, endpoint_fault=True)
        if isinstance(exc, LLMError):  # raised while reading the answer (a stream's error event)
            if exc.error_class == "bad_response" and not isinstance(exc, ContextLimitError):
                return _Retry(exc)
            if exc.error_class == "connection":  # a stream cut short: a dropped connection mid-answer
                return _Retry(exc, endpoint_fault=True)
            if exc.error_class == "stream_error" or (exc.status is not None and exc.status >= 500):
                # An error event mid-answer from the server's side (an upstream that went away): asked
                # again like a 5xx before the answer began; a 4xx event (the request's fault) is final.
                return _Retry(exc, endpoint_fault=True)
            return _retry_or_final(exc)  # an error said in the body with a status: as that status is
        if isinstance(exc, ValueError):  # a body that is not JSON (JSONDecodeError, UnicodeDecodeError)
            return _Retry(LLMError("bad_response", f"endpoint answered with an invalid response: {exc}"))
        return exc

    def _account(
        self, turn: AssistantTurn, data: dict[str, Any], usage: Usage | None, prompt_estimate: int
    ) -> dict[str, Any]:
        """An answered call's usage, made credible (the runner's estimates where the endpoint's counts
        are not), added to the prompt's tally and reported for the run's budget; returns it."""
        reply = turn.content + (turn.reasoning or "") + "".join(c.name + c.arguments for c in turn.tool_calls)
        clean, fault = credible_usage(
            turn.usage, prompt_estimate, estimate_tokens(reply), data.get("timings")
        )
        turn.usage = clean
        provider = data.get("provider") if isinstance(data.get("provider"), str) else None
        if fault:
            clean["fault"] = fault
            if self.on_usage is None and self.gate is None:  # no parent to warn once per run: once here
                self._warn_once("usage", usage_warning(self.cfg.base_url, fault))
        if usage is not None:
            usage.add(clean, provider)
        cost, tokens = clean.get("cost"), clean["prompt_tokens"] + clean["completion_tokens"]
        if isinstance(cost, float) and tokens > 0:
            self.usd_per_token = max(self.usd_per_token, cost / tokens)
        if self.on_usage is not None and self.gate is None:
            self.on_usage(clean)
        return clean

    def for_endpoint(self, base_url: str, api_key: str | None) -> LLMClient:
        """The client of a tool's own endpoint (vision, mixture of agents, images, a judge): its own
        connections and key, and this client's limiter, run-wide pause, retry policy, bounds and budget.
        The run's own endpoint is this client."""
        if base_url.rstrip("/") == self.cfg.base_url.rstrip("/") and api_key == self.cfg.api_key:
            return self
        key = (base_url.rstrip("/"), api_key)
        with self._warn_lock:
            siblings = self.__dict__.setdefault("_siblings", {})
            client = siblings.get(key)
            if client is None:
                cfg = dataclasses.replace(
                    self.cfg,
                    base_url=base_url,
                    api_key=api_key,
                    stream=False,
                    extra_body={},
                    dialect="auto",
                    reasoning_effort=None,
                    reasoning_disabled=False,
                )
                client = siblings[key] = LLMClient(
                    cfg, self.limiter, stop=self.stop, on_usage=self.on_usage, gate=self.gate
                )
                client.slot_endpoint = self.slot_endpoint
        return client

    def close(self) -> None:
        self._http.close()


class _Retry(Exception):
    """An attempt that failed in a way another attempt may not (inside :meth:`LLMClient._call`)."""

    def __init__(
        self,
        error: LLMError,
        retry_after: float | None = None,
        *,
        rate_limited: bool = False,
        endpoint_fault: bool = False,
    ):
        super().__init__(str(error))
        self.error, self.retry_after = error, retry_after
        self.rate_limited, self.endpoint_fault = rate_limited, endpoint_fault


def usage_warning(base_url: str, fault: str) -> str:
    return (
        f"the endpoint {safe_url(base_url)} reports usage that cannot be trusted ({fault}); such calls are "
        "counted by the runner's own estimate (UTF-8 bytes / 3 of the request and the reply) and marked "
        "in metadata.usage.estimated_calls"
    )


def _encode(body: dict[str, Any], encoder: RequestEncoder | None = None) -> bytes:
    try:  # UTF-8, no NaN
        return encoder.encode(body) if encoder is not None else encode_json(body)
    except ValueError as exc:  # a NaN: every try would fail the same way
        raise LLMError("bad_request", f"the request cannot be sent as JSON: {exc}") from None


def safe_url(url: str) -> str:
    """``url`` without a user or password, the values of its query's credentials (``?api_key=``,
    ``&token=``) shown as ``[REDACTED]`` (for every message and the start line)."""
    from batchrun.secrets import REDACTED, SECRET_PARAM  # batchrun.secrets imports this module

    shown = httpclient._safe_url(url)
    base, sep, query = shown.partition("?")
    if not sep:
        return shown
    query, hash_, fragment = query.partition("#")
    pairs = [
        f"{p.partition('=')[0]}={REDACTED}" if SECRET_PARAM.search(p.partition("=")[0]) and "=" in p else p
        for p in query.split("&")
    ]
    return f"{base}?{'&'.join(pairs)}{hash_}{fragment}"


def retry_after_s(exc: httpclient.StatusError) -> float | None:
    """Retry-After (seconds or HTTP date) or retry-after-ms, when the provider sent one."""
    headers = getattr(exc.response, "headers", None) or {}
    try:
        if headers.get("retry-after-ms"):
            return float(headers["retry-after-ms"]) / 1000.0
        value = headers.get("retry-after")
        if value:
            try:
                return float(value)
            except ValueError:
                import email.utils  # only for a date, which few send (~10 ms to import)

                when = email.utils.parsedate_to_datetime(value)
                # A date already past by our clock says nothing of how long to wait (the server's clock
                # runs behind ours): taken for 0 s, a 429 that lasted 2 s was retried 31 times in 0.23 s
                # and the call failed. Backed off as when no Retry-After came.
                left = when.timestamp() - time.time()
                return left if left > 0 else None
    except (TypeError, ValueError):
        return None
    return None


def _answered_error(body: dict[str, Any], *, streamed: bool) -> LLMError:
    """The error an answer carries in its body (``{"error": {"code": 402, "message": ...}}``), as its
    status would say it: OpenRouter answers 200 and puts an error met while the model was producing
    the output in the body, or in a stream's event. Its ``code``, when a status, gives the class
    (``http_402``; a spent quota's 429 is ``insufficient_quota``), read as that status is
    (:meth:`LLMClient._attempt_error`: a 5xx tried again, a 4xx final, a refusal counted); without
    one, a stream's is ``stream_error`` (tried again), a plain body's a ``bad_response`` (tried again)."""
    err = body["error"]
    msg = err.get("message") if isinstance(err, dict) else str(err)
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else None
    text = f"HTTP {status or ('stream' if streamed else 200)}: {str(msg)[:ERROR_TEXT_CHARS]}"
    if status is not None:
        return _error_of_status(status, body, text)
    if is_context_limit(status, body, text):
        return ContextLimitError("context_limit", text, status)
    if streamed:
        return LLMError("stream_error", text)
    return LLMError("bad_response", f"endpoint answered an error without choices: {text}")


def _parse_payload(data: Any) -> AssistantTurn:
    """A chat.completion JSON body → AssistantTurn (reasoning from any of the native fields)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices and isinstance(data, dict) and data.get("error") is not None:
        raise _answered_error(data, streamed=False)
    if (
        not isinstance(choices, list)
        or not choices
        or not isinstance(choices[0], dict)
        or not isinstance(choices[0].get("message"), dict)
    ):
        raise LLMError("bad_response", f"endpoint answered without choices: {str(data)[:200]!r}")
    # One choice was asked for (no request sends ``n``), and it is the assistant's: a reply of several,
    # or of another role, does not say which of its texts is the model's turn. Read as its first, such
    # a reply was kept as a good sample.
    if len(choices) > 1:
        raise httpclient.BadResponse(f"the answer holds {len(choices)} choices where one was asked for")
    choice = choices[0]
    message = choice["message"]
    _assistant_role(message.get("role"))
    # A call that is not an object (a bare name, a number) is a bad response: dropped, the reply's other
    # calls or its words were kept as though the model had not called it.
    raw_calls = [
        _shaped(c, dict, "a tool call")
        for c in _many_calls(_shaped(message.get("tool_calls"), list, "tool_calls"))
    ]
    functions = [_shaped(c.get("function"), dict, "a tool call's function") for c in raw_calls]
    calls = [
        ToolCall(
            id=_call_id(c.get("id")) or f"call_{i}",
            name=str(fn.get("name") or ""),
            arguments=_arguments_text(fn.get("arguments")),
        )
        for i, (c, fn) in enumerate(zip(raw_calls, functions, strict=True))
    ]
    content, thinking = _content_parts(message.get("content"))
    reasoning = native_reasoning(message)
    if reasoning is None and thinking.strip():  # Mistral's thinking parts: its reasoning, not words
        reasoning = unwrap_reasoning(thinking)
    return AssistantTurn(
        content=content,
        reasoning=reasoning,
        tool_calls=calls,
        finish_reason=choice.get("finish_reason"),
        usage=data.get("usage") if isinstance(data.get("usage"), dict) else {},
        served_model=data.get("model") if isinstance(data.get("model"), str) and data.get("model") else None,
        refusal=_refusal_text(message.get("refusal")),
    )


def _assistant_role(role: Any) -> None:
    """A reply's message is the assistant's: a ``role`` of another name (``user``, ``tool``, ...) is a bad
    response. None or "" (some servers leave it out, or send it empty after a stream's first chunk) is the
    assistant's."""
    if role not in (None, "") and not (isinstance(role, str) and role.lower() == "assistant"):
        raise httpclient.BadResponse(f"the answer's message has the role {str(role)[:40]!r}, not 'assistant'")


def _call_id(value: Any) -> str | None:
    """A call's ``id`` as text: a string as sent, an integer as its digits; None when it has none. Any
    other type is a bad response: ``str()`` of an object, ``"{'a': 1}"``, was kept in the sample as its id."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise httpclient.BadResponse(
        f"the answer holds a tool call's id of the wrong type ({type(value).__name__}, not str)"
    )


def _many_calls(calls: list[Any]) -> list[Any]:
    """``calls``, unless there are more than any model can write in one reply: a bad response."""
    if len(calls) > MAX_TOOL_CALLS_PER_REPLY:
        raise _too_many_calls(f"{len(calls):,}")
    return calls


def _too_many_calls(count: str) -> httpclient.BadResponse:
    return httpclient.BadResponse(
        f"the answer holds {count} tool calls, more than any model's reply can ({MAX_TOOL_CALLS_PER_REPLY:,})"
    )


def _refusal_text(refusal: Any) -> str | None:
    """A reply's ``refusal`` exactly as sent, or None when it has none (absent, null, not text, blank)."""
    return refusal if isinstance(refusal, str) and refusal.strip() else None


def _shaped(value: Any, kind: type, what: str) -> Any:
    """``value``, or an empty ``kind`` when it is empty or missing; of another type (a number where a
    list belongs) the answer is a bad response, not a TypeError that fails the prompt as a bug."""
    if not value:
        return kind()
    if not isinstance(value, kind):
        raise httpclient.BadResponse(
            f"the answer holds {what} of the wrong type ({type(value).__name__}, not {kind.__name__})"
        )
    return value


def _note_partial(raw: Any, generated: int | None, usage: Any) -> None:
    """What an answer had said when it was read: the characters generated (a stream's) and its usage,
    for :func:`unanswered_tokens` should the answer then be refused or break."""
    try:
        if generated is not None:
            raw.partial_chars = generated
        if isinstance(usage, dict):
            raw.partial_usage = usage
    except AttributeError:  # an answer object that takes no attributes (a test's): nothing known
        pass


def unanswered_tokens(
    exc: BaseException, raw: Any, prompt_estimate: int, completion_limit: int | None
) -> int:
    """The tokens a failed attempt may have been billed for: 0 when its request cannot have reached
    the endpoint or the endpoint refused it (a status of 300 or more: an error, a 429, a redirect);
    otherwise (a stream cut or timed out mid-answer, a 200 whose body broke or was refused, no answer
    before the timeout) the usage the answer reported, when it did, else the request's estimated
    tokens plus what had arrived of the answer (its characters, or its bytes when not streamed), or,
    when nothing had, the completion limit (``--max_tokens``) when one is set: the endpoint may still
    have been generating it."""
    if not getattr(exc, "sent", True) or isinstance(exc, httpclient.StatusError):
        return 0
    if isinstance(exc, LLMError) and exc.status is not None and exc.status < 500:
        return 0  # a stream's 4xx error event: the request's fault, refused
    chars = getattr(raw, "partial_chars", None)
    got = chars if chars is not None else (raw.received if isinstance(raw, httpclient.Response) else 0)
    completion = -(-got // ESTIMATE_BYTES_PER_TOKEN) if got else (completion_limit or 0)
    if completion_limit:
        completion = min(completion, completion_limit)
    reported = getattr(raw, "partial_usage", None)
    if isinstance(reported, dict):
        clean, _ = credible_usage(reported, prompt_estimate, completion)
        return clean["prompt_tokens"] + clean["completion_tokens"]
    return prompt_estimate + completion


def _read_stream(raw: Any, deadline: float | None = None, max_bytes: int | None = None) -> dict[str, Any]:
    """Server-sent chat.completion.chunk events -> the chat.completion body a non-streaming call returns.

    Content, reasoning (every native field) and tool-call argument deltas are concatenated; tool calls
    are assembled by their ``index``; usage comes from the last chunk (``stream_options.include_usage``).
    An error event mid-stream raises like an HTTP error would. The read timeout bounds each wait for a
    chunk; ``deadline`` (time.monotonic) bounds a stream that keeps trickling; ``max_bytes`` the
    assembled reply (the HTTP client bounds each line and the stream's bytes as well).
    """
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    assembled = 0
    texts: dict[str, list[str]] = {"content": [], "reasoning_content": [], "reasoning": [], "refusal": []}
    thinking: list[str] = []  # Mistral's thinking content parts
    details: list[dict[str, Any]] = []
    calls: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    finish_reason = None
    done = False
    generated = 0  # characters of the reply so far: what a stream cut short had cost (see unanswered_tokens)
    chosen = False  # a chunk carried a choice
    try:
        for line in raw.iter_lines():
            if deadline is not None and time.monotonic() > deadline:
                raise LLMError("timeout", "the streamed reply did not finish before the prompt's deadline")
            if not line.startswith("data:"):
                continue  # comments (": keep-alive"), event names, blank separators
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            assembled += len(data)
            if max_bytes is not None and assembled > max_bytes:
                raise httpclient.BadResponse(f"the streamed reply grew past {max_bytes:,} bytes")
            chunk = parse_json(data)
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error") is not None:
                raise _answered_error(chunk, streamed=True)
            for key in ("model", "provider", "id"):
                if isinstance(chunk.get(key), str):
                    out[key] = chunk[key]
            if isinstance(chunk.get("usage"), dict):
                out["usage"] = chunk["usage"]
            # llama.cpp's server: its prompt cache's count (cache_n), the last chunk's.
            if isinstance(chunk.get("timings"), dict):
                out["timings"] = chunk["timings"]
            for choice in _shaped(chunk.get("choices"), list, "choices"):
                if not isinstance(choice, dict):
                    continue
                chosen = True
                if choice.get("index", 0) != 0:  # a second choice: see _parse_payload
                    raise httpclient.BadResponse(
                        f"the streamed answer holds a choice of index {str(choice.get('index'))[:40]!r} "
                        "where one was asked for"
                    )
                finish_reason = choice.get("finish_reason") or finish_reason
                delta = _shaped(choice.get("delta"), dict, "delta")
                _assistant_role(delta.get("role"))
                for key, parts in texts.items():
                    if isinstance(delta.get(key), str):
                        parts.append(delta[key])
                        generated += len(delta[key])
                if isinstance(delta.get("content"), list):  # content parts: words and thinking
                    words, thought = _content_parts(delta["content"])
                    texts["content"].append(words)
                    thinking.append(thought)
                    generated += len(words) + len(thought)
                for d in _shaped(delta.get("reasoning_details"), list, "reasoning_details"):
                    if isinstance(d, dict):
                        _merge_detail(details, d)
                for i, c in enumerate(_shaped(delta.get("tool_calls"), list, "tool_calls")):
                    c = _shaped(c, dict, "a tool call")  # not skipped: a call dropped is a call not seen
                    index = c.get("index", i)
                    if not isinstance(index, int) or isinstance(index, bool):  # "1" would not sort beside 0
                        raise httpclient.BadResponse(f"a streamed tool call has the index {index!r}")
                    if index not in calls and len(calls) >= MAX_TOOL_CALLS_PER_REPLY:
                        raise _too_many_calls("more")
                    # The name's and the arguments' pieces, joined at the end: appended to a string one
                    # at a time, each piece copied all before it (a 512 KB argument in 128,000 pieces, 8 s).
                    call = calls.setdefault(index, {"id": None, "type": "function", "function": ([], [])})
                    call["id"] = c.get("id") or call["id"]
                    fn = _shaped(c.get("function"), dict, "a tool call's function")
                    name = _shaped(fn.get("name"), str, "a tool call's name")
                    args = fn.get("arguments")
                    args = args if isinstance(args, str) else _arguments_text(args)
                    call["function"][0].append(name)
                    call["function"][1].append(args)
                    generated += len(name) + len(args)
    finally:
        raw.close()
        _note_partial(raw, generated, out.get("usage"))
    # A stream ends with a chunk holding finish_reason, then [DONE] (OpenAI, llama.cpp, vLLM, LiteLLM);
    # some servers (ik_llama.cpp, older llama.cpp) close after the finish_reason without [DONE]. A
    # stream with neither was cut (a closed connection, a body ended early): retried like a body cut
    # short, never kept as an answer. [DONE] without a finish_reason is an end the server chose that
    # does not say why (no known server sends it; a proxy may, after its upstream failed): the reply
    # is kept with finish_reason null, which the agent loop does not take as a finished answer.
    if finish_reason is None and not done:
        raise LLMError(
            "connection",
            f"the streamed reply from {getattr(raw, 'url', 'the endpoint')} ended mid-answer "
            "(no finish_reason and no [DONE]: the connection closed or the body ended early)",
        )
    if not chosen:
        # No chunk held a choice (a bare [DONE], or usage alone): no answer at all, as a body without
        # choices is (_parse_payload). Kept, it was an empty answer with no finish_reason, set aside as
        # the model's own (a discard no --resume runs again) where a plain reply's was retried.
        raise httpclient.BadResponse("the streamed reply held no choice: no answer in it")
    message["content"] = "".join(texts["content"])
    if any(thinking):  # as a plain reply carries them, so that both are read by one parser
        thought = {"type": "thinking", "thinking": [{"type": "text", "text": "".join(thinking)}]}
        message["content"] = [thought, {"type": "text", "text": message["content"]}]
    for key in ("reasoning_content", "reasoning", "refusal"):
        if texts[key]:
            message[key] = "".join(texts[key])
    if details:
        message["reasoning_details"] = _joined_details(details)
    if calls:
        message["tool_calls"] = [
            {**calls[k], "function": {"name": "".join(name), "arguments": "".join(args)}}
            for k in sorted(calls)
            for name, args in [calls[k]["function"]]
        ]
    out["choices"] = [{"index": 0, "message": message, "finish_reason": finish_reason}]
    return out


def _is_json(raw: Any) -> bool:
    """Whether an answer says it is a JSON body (``application/json``, any parameters)."""
    headers = getattr(raw, "headers", None) or {}
    return headers.get("content-type", "").split(";")[0].strip().lower() == "application/json"


class _Pieces(list):
    """A streamed text's pieces, joined once the stream ends (:func:`_joined_details`): appended to a string
    one at a time, each piece copied all before it (reasoning in 128,000 pieces took 7 s)."""


def _merge_detail(details: list[dict[str, Any]], d: dict[str, Any]) -> None:
    """A streamed reasoning_details part extends the previous one of the same index and type."""
    last = details[-1] if details else None
    if last is not None and last.get("type") == d.get("type") and last.get("index") == d.get("index"):
        for key in ("text", "summary", "data"):
            if isinstance(d.get(key), str):
                if not isinstance(last.get(key), _Pieces):
                    last[key] = _Pieces([last[key]] if isinstance(last.get(key), str) else [])
                last[key].append(d[key])
        return
    details.append(dict(d))


def _joined_details(details: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The streamed reasoning_details with their pieces joined."""
    return [{k: "".join(v) if isinstance(v, _Pieces) else v for k, v in d.items()} for d in details]


def _arguments_text(arguments: Any) -> str:
    """Tool-call arguments as a JSON string: some servers send an object instead of a string."""
    if arguments is None:
        return ""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _content_parts(content: Any) -> tuple[str, str]:
    """Message content as (words, thinking): a string is words; a list of content parts gives the words of
    its text parts and the reasoning of its thinking parts (Mistral's reasoning models answer
    ``[{"type": "thinking", "thinking": [{"type": "text", "text": ...}]}, {"type": "text", "text": ...}]``),
    each joined as sent. Before, the thinking parts were dropped: the model's reasoning was in no record."""
    if isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        return "", ""
    words, thinking = [], []
    for p in content:
        if not isinstance(p, dict):
            continue
        if p.get("type") == "thinking":
            thinking.append(_part_text(p.get("thinking")))
        elif isinstance(p.get("text"), str):
            words.append(p["text"])
    return "".join(words), "".join(thinking)


def _part_text(value: Any) -> str:
    """A thinking part's text: a string, or the text of its list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(v["text"] for v in value if isinstance(v, dict) and isinstance(v.get("text"), str))
    return ""


def _status_error(exc: httpclient.StatusError) -> Exception:
    """An error answer: a 429 waits out the run-wide pause, a context limit ends the prompt as
    partial, a retryable status (:data:`RETRYABLE_STATUS`) is tried again, any other fails the call."""
    message = error_message(exc)
    return _retry_or_final(_error_of_status(exc.status_code, exc.body, message), retry_after_s(exc))


def _error_of_status(status: int, body: Any, message: str) -> LLMError:
    """The error a status says, with the answer's body: a 429 is ``http_429``, or ``insufficient_quota``
    when the body says the quota is spent (no wait ends it); a context limit ends the prompt as
    partial; any other is ``http_<status>``."""
    if status == 429:
        return LLMError(QUOTA_SPENT if quota_spent(body) else "http_429", message, status)
    if is_context_limit(status, body, message):
        return ContextLimitError("context_limit", message, status)
    return LLMError(f"http_{status}", message, status)


def _retry_or_final(error: LLMError, retry_after: float | None = None) -> Exception:
    """What an error of a status makes of the attempt: a rate limit (``http_429``) waits out the run-wide
    pause, a retryable status (:data:`RETRYABLE_STATUS`) is tried again (a 5xx counted an endpoint
    failure), any other fails the call."""
    if error.error_class == "http_429":
        return _Retry(error, retry_after, rate_limited=True)
    if error.status in RETRYABLE_STATUS and not isinstance(error, ContextLimitError):
        return _Retry(error, retry_after, endpoint_fault=error.status >= 500)
    return error


class LongRateLimit(LLMError):
    """A 429 whose Retry-After asks a wait beyond the client's patience (LLMConfig.rate_limit_patience_s):
    the call fails at once, a refusal (see :func:`refused`), saying the wait asked."""

    def __init__(self, error: LLMError, retry_after_s: float):
        super().__init__("http_429", f"{error} (Retry-After asks a wait of {retry_after_s:,.0f} s)", 429)
        self.retry_after_s = retry_after_s


def error_message(exc: httpclient.StatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {exc.status_code}: {str(err['message'])[:ERROR_TEXT_CHARS]}"
    return f"HTTP {exc.status_code}: {exc.message}"


@dataclass(frozen=True)
class ContextLimitSign:
    """One way a server says "the conversation no longer fits": an error code/type, or message wording."""

    server: str
    field: str  # "code" or "type" (exact, in the error object), or "message" (regex, case-insensitive)
    pattern: str
    example: str  # a real message or error object of that server, for the tests


# Learned from each server's source and documentation. Order does not matter: any match is a context limit.
CONTEXT_LIMIT_SIGNS: tuple[ContextLimitSign, ...] = (
    ContextLimitSign(
        "OpenAI",
        "code",
        "context_length_exceeded",
        "This model's maximum context length is 128000 tokens. However, your messages resulted "
        "in 130000 tokens. Please reduce the length of the messages.",
    ),
    ContextLimitSign(
        "OpenAI, DeepSeek, vLLM",
        "message",
        r"maximum context length is \d+ tokens",
        "This model's maximum context length is 4096 tokens. However, you requested 4120 tokens "
        "(3120 in the messages, 1000 in the completion).",
    ),
    ContextLimitSign(
        "OpenAI (Responses)",
        "message",
        r"exceeds the context window",
        "Your input exceeds the context window of this model. Please adjust your input and try again.",
    ),
    ContextLimitSign(
        "OpenRouter",
        "message",
        r"maximum context length is \d+",
        "This endpoint's maximum context length is 40960 tokens. However, you requested about "
        "42988 tokens (38892 of text input, 4096 in the output).",
    ),
    ContextLimitSign(
        "vLLM",
        "message",
        r"max(imum)? model length",
        "The decoder prompt (length 9000) is longer than the maximum model length of 8192.",
    ),
    ContextLimitSign(
        "vLLM",
        "message",
        r"'?max_(completion_)?tokens'? .*is too large",
        "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context "
        "length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).",
    ),
    ContextLimitSign(
        "SGLang, Together",
        "message",
        r"longer than the model's context length",
        "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
    ),
    ContextLimitSign(
        "SGLang",
        "message",
        r"exceeds the model's maximum context length",
        "Requested token count exceeds the model's maximum context length of 8192 tokens. You "
        "requested a total of 9000 tokens: 8000 tokens from the input messages and 1000 tokens "
        "for the completion.",
    ),
    ContextLimitSign(
        "llama.cpp",
        "type",
        "exceed_context_size_error",
        "request (5566 tokens) exceeds the available context size (1024 tokens), try increasing it",
    ),
    ContextLimitSign(
        "llama.cpp",
        "message",
        r"exceeds the available context size|larger than the max context size",
        "input (9000 tokens) is larger than the max context size (8192 tokens). skipping",
    ),
    ContextLimitSign(
        "Ollama",
        "message",
        r"input length exceeds the context length",
        "the input length exceeds the context length",
    ),
    ContextLimitSign(
        "Anthropic (behind OpenRouter)",
        "message",
        r"prompt is too long",
        "prompt is too long: 210000 tokens > 200000 maximum",
    ),
    ContextLimitSign(
        "Google (behind OpenRouter)",
        "message",
        r"input token count .*exceeds the maximum",
        "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
    ),
    ContextLimitSign(
        "Mistral (behind OpenRouter)",
        "message",
        r"too large for model with \d+ maximum context",
        "Prompt contains 140000 tokens, too large for model with 131072 maximum context length",
    ),
    ContextLimitSign(
        "Groq",
        "message",
        r"reduce the length of the messages",
        "Please reduce the length of the messages or completion.",
    ),
    ContextLimitSign(
        "TGI",
        "message",
        r"max_new_tokens` must be <= \d+",
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 8192. Given: 9000",
    ),
    ContextLimitSign("generic", "code", "context_window_exceeded", "model_context_window_exceeded"),
    ContextLimitSign(
        "generic", "message", r"context[ _](length|window)[ _]exceeded", "context window exceeded"
    ),
)
_CONTEXT_IDS = {c.pattern for c in CONTEXT_LIMIT_SIGNS if c.field != "message"}


def is_context_limit(status: int | None, body: Any, message: str) -> bool:
    """Whether an error answer means the conversation outgrew the model's context (see CONTEXT_LIMIT_SIGNS).

    Looks at the error object's ``code`` and ``type``, OpenRouter's upstream ``metadata.raw`` and the
    message. By wording only a 4xx or a 500 (Ollama has answered 500 with its wording); other 5xx are
    retried unless their code says so.
    """
    texts = [message]
    ids: set[str] = set()
    err = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(err, dict):
        for key in ("code", "type"):
            if isinstance(err.get(key), str):
                ids.add(err[key])
        meta = err.get("metadata")
        if isinstance(meta, dict) and meta.get("raw") is not None:
            raw = meta["raw"]
            texts.append(raw if isinstance(raw, str) else json.dumps(raw))
    if ids & _CONTEXT_IDS:
        return True
    if status is not None and not (400 <= status < 500 or status == 500):
        return False
    return any(r.search(t) for r in _context_res() for t in texts)


@functools.cache
def _context_res() -> list[re.Pattern[str]]:
    """The wordings, compiled at the first error answer rather than in every process's start."""
    return [re.compile(c.pattern, re.IGNORECASE) for c in CONTEXT_LIMIT_SIGNS if c.field == "message"]
