"""The model client: an OpenAI-compatible endpoint through the ``openai`` SDK.

Retries (408/409/429/5xx, connection errors, with backoff and Retry-After) belong to the SDK;
we only configure ``max_retries`` and ``timeout``. OpenRouter routing and reasoning settings
travel in ``extra_body`` and are only sent when the user asked for them, so plain endpoints
(vLLM, SGLang, Ollama, llama.cpp) never see fields they do not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    request_timeout_s: float = 600.0  # one model call, including the SDK's retries' individual attempts
    max_retries: int = 3  # SDK retries on 408/409/429/5xx and connection errors
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
    if provider:
        body["provider"] = provider
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


class LLMError(RuntimeError):
    """The endpoint failed after the SDK's retries; fails the prompt (retried on resume)."""

    def __init__(self, error_class: str, message: str, status: int | None = None):
        super().__init__(message)
        self.error_class = error_class
        self.status = status


class ContextLimitError(LLMError):
    """The conversation no longer fits the model's context: the prompt ends as partial."""


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


class LLMClient:
    """One per worker process: the SDK client holds a connection pool shared by the worker's threads."""

    def __init__(self, cfg: LLMConfig):
        self.cfg = cfg
        self._client = openai.OpenAI(
            base_url=cfg.base_url,
            api_key=cfg.api_key or NO_KEY,
            max_retries=cfg.max_retries,
            timeout=cfg.request_timeout_s,
        )
        self._extra_body = cfg.request_extra_body()

    def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, timeout_s: float | None = None
    ) -> AssistantTurn:
        kwargs: dict[str, Any] = {"model": self.cfg.model, "messages": messages}
        if tools:
            kwargs["tools"] = tools
        if self.cfg.max_tokens:
            kwargs["max_tokens"] = self.cfg.max_tokens
        if self._extra_body:
            kwargs["extra_body"] = self._extra_body
        client = self._client
        if timeout_s is not None:
            # Bound the call by what is left of the prompt's time: once less than one request
            # timeout is left, one attempt gets all of it and there is no retry after it.
            per_attempt = max(1.0, min(timeout_s, self.cfg.request_timeout_s))
            retries = self.cfg.max_retries if timeout_s >= self.cfg.request_timeout_s else 0
            client = client.with_options(timeout=per_attempt, max_retries=retries)
        try:
            resp = client.chat.completions.create(**kwargs)
        except openai.APIStatusError as exc:
            message = _error_message(exc)
            if exc.status_code == 400 and _looks_like_context_limit(message):
                raise ContextLimitError("context_limit", message, exc.status_code) from exc
            raise LLMError(f"http_{exc.status_code}", message, exc.status_code) from exc
        except openai.APITimeoutError as exc:
            raise LLMError("timeout", f"model call timed out: {exc}") from exc
        except openai.APIConnectionError as exc:
            raise LLMError("connection", f"cannot reach {self.cfg.base_url}: {exc}") from exc
        except (openai.APIResponseValidationError, ValueError) as exc:
            # The SDK raises a bare JSONDecodeError (a ValueError) for a body that is not JSON.
            raise LLMError("bad_response", f"endpoint answered with an invalid response: {exc}") from exc
        return _parse_response(resp)


def _parse_response(resp: Any) -> AssistantTurn:
    if isinstance(resp, str) or not getattr(resp, "choices", None):
        raise LLMError("bad_response", f"endpoint answered without choices: {str(resp)[:200]!r}")
    choice = resp.choices[0]
    message = choice.message.model_dump() if hasattr(choice.message, "model_dump") else dict(choice.message)
    reasoning = native_reasoning(message)
    calls = [
        ToolCall(
            id=c.get("id") or f"call_{i}",
            name=(c.get("function") or {}).get("name") or "",
            arguments=(c.get("function") or {}).get("arguments") or "",
        )
        for i, c in enumerate(message.get("tool_calls") or [])
    ]
    usage = resp.usage.model_dump() if getattr(resp, "usage", None) is not None else {}
    return AssistantTurn(
        content=message.get("content") or "",
        reasoning=reasoning,
        tool_calls=calls,
        finish_reason=choice.finish_reason,
        usage=usage,
    )


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
