"""The model client: an OpenAI-compatible endpoint through the ``openai`` SDK.

Retries go through the run-wide limiter (see :class:`LLMClient`). OpenRouter routing and reasoning settings
travel in ``extra_body`` and are only sent when the user asked for them, so plain endpoints
(vLLM, SGLang, Ollama, llama.cpp) never see fields they do not know.
"""

from __future__ import annotations

import email.utils
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchrun.prompt.limiter import Limiter, LimitTimeout, backoff_s

if TYPE_CHECKING:
    import openai

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra")
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
    request_timeout_s: float = 600.0  # one attempt of one model call (our client retries; the SDK does not)
    max_retries: int = 3  # retries of one call on 5xx, timeouts, dropped connections
    max_rate_limit_retries: int = 30  # 429s of one call waited out (run-wide pause) before it fails
    extra_body: dict[str, Any] = field(default_factory=dict)  # computed by build_extra_body when empty

    def request_extra_body(self) -> dict[str, Any]:
        return self.extra_body or build_extra_body(self)


def build_extra_body(cfg: LLMConfig) -> dict[str, Any]:
    """OpenRouter ``provider`` preferences and ``reasoning`` config, exactly as the flags define them."""
    body: dict[str, Any] = {}
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
    if provider:
        body["provider"] = provider
    if "openrouter.ai" in cfg.base_url:
        body["usage"] = {"include": True}  # OpenRouter then reports the cost of each call
    if cfg.reasoning_disabled:
        body["reasoning"] = {"effort": "none"}
    elif cfg.reasoning_effort:
        body["reasoning"] = {"enabled": True, "effort": cfg.reasoning_effort}
    return body


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
    model: str | None = None  # the response's ``model``: the model that served the call, when it says


class LLMError(RuntimeError):
    """The endpoint failed after our client's retries; fails the prompt (retried on resume)."""

    def __init__(self, error_class: str, message: str, status: int | None = None):
        super().__init__(message)
        self.error_class = error_class
        self.status = status


class ContextLimitError(LLMError):
    """The conversation no longer fits the model's context: the prompt ends as partial."""


class BudgetStop(LLMError):
    """The run's budget is spent: a prompt in flight stops at its next model call (failed, class ``budget``)."""

    def __init__(self) -> None:
        super().__init__(
            "budget", "the run's budget was reached before this model call; --resume runs it again"
        )


def native_reasoning(message: dict[str, Any]) -> str | None:
    """Reasoning from ``reasoning``, ``reasoning_content`` or ``reasoning_details`` (first present)."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    details = message.get("reasoning_details")
    if isinstance(details, list):
        texts = []
        for d in details:
            if isinstance(d, dict):
                text = d.get("text") or d.get("summary")
                if isinstance(text, str) and text.strip():
                    texts.append(text.strip())
        if texts:
            return "\n\n".join(texts)
    return None


class Usage:
    """Tokens, cost and calls of one prompt (model calls and the calls tools make). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0  # requests sent, failed attempts included
        self.calls = self.prompt_tokens = self.completion_tokens = self.reasoning_tokens = 0  # answered calls
        self.cost_usd = 0.0
        self.retries = self.rate_limited = 0
        self.providers: list[str] = []
        self.reported: set[str] = set()  # the counts some response reported: the others are unknown (null)

    def add(self, usage: dict[str, Any] | None, provider: str | None = None) -> None:
        usage = usage or {}
        details = usage.get("completion_tokens_details") or {}
        with self._lock:
            self.calls += 1
            for key in ("prompt_tokens", "completion_tokens"):
                if _is_count(usage.get(key)):
                    self.reported.add(key)
            if isinstance(details, dict) and _is_count(details.get("reasoning_tokens")):
                self.reported.add("reasoning_tokens")
            self.prompt_tokens += _int(usage.get("prompt_tokens"))
            self.completion_tokens += _int(usage.get("completion_tokens"))
            self.reasoning_tokens += _int(details.get("reasoning_tokens") if isinstance(details, dict) else 0)
            cost = usage.get("cost")
            if isinstance(cost, (int, float)) and not isinstance(cost, bool):
                self.cost_usd += float(cost)
                self.reported.add("cost_usd")
            if provider and provider not in self.providers:
                self.providers.append(provider)

    def note_request(self) -> None:
        with self._lock:
            self.requests += 1

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
            "cost_usd": round(self.cost_usd, 8) if "cost_usd" in known else None,
            "retries": self.retries,
            "rate_limited": self.rate_limited,
            "providers": list(self.providers) or None,
        }


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def record_usage(usage: Usage | None, resp: Any) -> None:
    """Add an SDK response's usage (and OpenRouter's ``provider``) to a tally; used by tools too."""
    if usage is None:
        return
    raw = resp.usage.model_dump() if getattr(resp, "usage", None) is not None else {}
    usage.add(raw, getattr(resp, "provider", None))


RETRYABLE_STATUS = {408, 409, 425, 500, 502, 503, 504, 520, 522, 524, 529}


def _sdk() -> tuple[Any, type]:
    """The ``openai`` module and the HTTP response class of its HTTP library, imported on first use.

    Importing the SDK takes about 0.6 s. The parent process needs it only for its endpoint check,
    so it is not paid before the run starts, and meanwhile the workers' forkserver imports it.
    """
    import openai

    try:  # the openai SDK's own HTTP library: httpx2 in current releases, httpx before
        from httpx2 import Response
    except ImportError:  # pragma: no cover - older openai releases
        from httpx import Response
    return openai, Response


class LLMClient:
    """One per worker process: the SDK client holds a connection pool shared by the worker's threads.

    Retries are ours, not the SDK's, because they must go through the run-wide limiter: a 429
    pauses the whole run (Retry-After honoured up to a cap) and is retried until the prompt's
    deadline; 5xx, timeouts and dropped connections are retried ``max_retries`` times with jitter.
    """

    def __init__(
        self,
        cfg: LLMConfig,
        limiter: Limiter | None = None,
        *,
        stop: threading.Event | None = None,
        on_usage: Callable[[dict[str, Any]], None] | None = None,
    ):
        """``stop``: once set, every further call raises :class:`BudgetStop` before it is sent.
        ``on_usage``: called with each answered call's usage (the run's budget counts it at once)."""
        self.cfg = cfg
        self.limiter = limiter or Limiter()
        self.stop = stop
        self.on_usage = on_usage
        self._openai, self._response_class = _sdk()
        self._client = self._openai.OpenAI(
            base_url=cfg.base_url,
            api_key=cfg.api_key or NO_KEY,
            max_retries=0,
            timeout=cfg.request_timeout_s,
        )
        self._extra_body = cfg.request_extra_body()

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        deadline: float | None = None,
        usage: Usage | None = None,
    ) -> AssistantTurn:
        """One model turn. ``deadline`` (time.monotonic) bounds every attempt and every wait."""
        body: dict[str, Any] = {"model": self.cfg.model, "messages": messages}
        if tools:
            body["tools"] = tools
        if self.cfg.max_tokens:
            body["max_tokens"] = self.cfg.max_tokens
        body.update(self._extra_body)
        deadline = deadline if deadline is not None else time.monotonic() + 10 * self.cfg.request_timeout_s
        openai = self._openai  # for its exception classes below
        failures = rate_limited = 0
        while True:
            if self.stop is not None and self.stop.is_set():
                raise BudgetStop()
            try:
                # A run-wide pause (another prompt's 429) does not count against this prompt's time.
                deadline += self.limiter.acquire(deadline)
            except LimitTimeout as exc:
                raise LLMError("timeout", str(exc)) from exc
            if self.stop is not None and self.stop.is_set():  # set while this call waited for the limiter
                self.limiter.release()
                raise BudgetStop()
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise LLMError("timeout", "no time left for the model call")
                per_attempt = max(0.5, min(remaining, self.cfg.request_timeout_s))
                if usage is not None:
                    usage.note_request()
                # The SDK's low-level POST: its auth, timeouts and status errors, without the typed-params
                # transform and response models (a third of a worker's CPU per prompt, measured).
                raw = self._client.post(
                    "/chat/completions",
                    body=body,
                    cast_to=self._response_class,
                    options={"timeout": per_attempt},
                )
                data = raw.json()  # not JSON: ValueError, reported as bad_response below
                turn = _parse_payload(data)
                if usage is not None:
                    usage.add(
                        turn.usage, data.get("provider") if isinstance(data.get("provider"), str) else None
                    )
                if self.on_usage is not None:
                    self.on_usage(turn.usage)
                return turn
            except openai.APIStatusError as exc:
                message = _error_message(exc)
                status = exc.status_code
                if status == 429:
                    rate_limited += 1
                    wait = backoff_s(rate_limited, _retry_after_s(exc))
                    self.limiter.pause(wait)
                    if usage is not None:
                        usage.note_retry(rate_limited=True)
                    if rate_limited > self.cfg.max_rate_limit_retries:
                        raise LLMError(
                            "http_429",
                            f"{message} (still rate limited after {rate_limited - 1} waits)",
                            status,
                        ) from exc
                    if time.monotonic() + wait >= deadline:
                        raise LLMError(
                            "http_429", f"{message} (rate limited until the prompt's deadline)", status
                        ) from exc
                    continue  # the limiter holds this and every other request until the pause ends
                if status == 400 and _looks_like_context_limit(message):
                    raise ContextLimitError("context_limit", message, status) from exc
                error = LLMError(f"http_{status}", message, status)
                if status not in RETRYABLE_STATUS:
                    raise error from exc
                retry_after = _retry_after_s(exc)
            except openai.APITimeoutError as exc:
                error, retry_after = LLMError("timeout", f"model call timed out: {exc}"), None
            except openai.APIConnectionError as exc:
                error, retry_after = LLMError("connection", f"cannot reach {self.cfg.base_url}: {exc}"), None
            except (openai.APIResponseValidationError, ValueError) as exc:
                # The SDK raises a bare JSONDecodeError (a ValueError) for a body that is not JSON.
                error = LLMError("bad_response", f"endpoint answered with an invalid response: {exc}")
                retry_after = None
            finally:
                self.limiter.release()
            failures += 1
            wait = backoff_s(failures, retry_after, cap_s=30.0)
            if failures > self.cfg.max_retries or time.monotonic() + wait >= deadline:
                raise error
            if usage is not None:
                usage.note_retry(rate_limited=False)
            time.sleep(wait)


def _retry_after_s(exc: openai.APIStatusError) -> float | None:
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
                when = email.utils.parsedate_to_datetime(value)
                return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return None
    return None


def _parse_payload(data: Any) -> AssistantTurn:
    """A chat.completion JSON body → AssistantTurn (reasoning from any of the native fields)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
        raise LLMError("bad_response", f"endpoint answered without choices: {str(data)[:200]!r}")
    choice = choices[0]
    message = choice["message"]
    calls = [
        ToolCall(
            id=str(c.get("id") or f"call_{i}"),
            name=str((c.get("function") or {}).get("name") or ""),
            arguments=_arguments_text((c.get("function") or {}).get("arguments")),
        )
        for i, c in enumerate(message.get("tool_calls") or [])
        if isinstance(c, dict)
    ]
    return AssistantTurn(
        content=_content_text(message.get("content")),
        reasoning=native_reasoning(message),
        tool_calls=calls,
        finish_reason=choice.get("finish_reason"),
        usage=data.get("usage") if isinstance(data.get("usage"), dict) else {},
        model=data.get("model") if isinstance(data.get("model"), str) and data.get("model") else None,
    )


def _arguments_text(arguments: Any) -> str:
    """Tool-call arguments as a JSON string: some servers send an object instead of a string."""
    if arguments is None:
        return ""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _content_text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _error_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {exc.status_code}: {err['message']}"
    return f"HTTP {exc.status_code}: {exc.message}"


def _looks_like_context_limit(message: str) -> bool:
    text = message.lower()
    return any(
        k in text
        for k in ("context length", "context_length", "maximum context", "too many tokens", "context window")
    )
