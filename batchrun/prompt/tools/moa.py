"""The ``moa`` toolset: mixture_of_agents asks several reference models in parallel, then one
aggregator model writes the answer from theirs. All calls go to an OpenAI-compatible endpoint.

A reference model that fails is left out; the aggregation needs ``MOA_MIN_SUCCESSFUL`` answers.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchrun.prompt.llm import LLMError
from batchrun.prompt.tools.config import MoaConfig, moa_config, model_client
from batchrun.prompt.tools.registry import (
    Tool,
    ToolArgumentError,
    ToolContext,
    register,
    register_toolset_check,
)

AGGREGATOR_SYSTEM_PROMPT = (
    "Several assistants answered the user's request below. Write the single best answer to it. "
    "Weigh their answers critically, since some may be wrong or incomplete; keep what is correct, "
    "resolve disagreements by reasoning, and do not mention that several answers were given.\n\n"
    "The assistants' answers:"
)


def _ask(
    cfg: MoaConfig,
    model: str,
    messages: list[dict[str, str]],
    temperature: float,
    timeout_s: float,
    usage: Any = None,
    ctx: Any = None,
) -> str:
    client = model_client(ctx, cfg.base_url, cfg.api_key)
    try:
        turn = client.chat(
            messages,
            [],
            deadline=time.monotonic() + timeout_s,
            usage=usage,
            model=model,
            max_tokens=cfg.max_tokens,
            temperature=temperature,
        )
    except LLMError as exc:
        raise RuntimeError(str(exc)) from None
    text = (turn.content or "").strip()
    if not text:
        raise RuntimeError("empty answer")
    return text


def mixture_of_agents(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    user_prompt = args["user_prompt"].strip()
    if not user_prompt:
        raise ToolArgumentError("user_prompt must not be empty")
    cfg = moa_config(ctx.settings)
    if cfg is None:
        return {"error": "mixture_of_agents is not configured (no models or endpoint)"}
    # The reference calls run in parallel and the aggregator after them: each gets half the budget.
    timeout_s = min(cfg.timeout_s, ctx.tool_timeout_s / 2)
    question = [{"role": "user", "content": user_prompt}]

    def reference(model: str) -> tuple[str, str | None, str | None]:
        try:
            return (
                model,
                _ask(cfg, model, question, cfg.reference_temperature, timeout_s, ctx.usage, ctx),
                None,
            )
        except RuntimeError as exc:
            return model, None, str(exc)

    with ThreadPoolExecutor(max_workers=len(cfg.reference_models), thread_name_prefix="moa") as pool:
        # Each reference runs in a copy of this thread's context: the worker's prompt (its budget, its
        # live spend) goes with it.
        contexts = [contextvars.copy_context() for _ in cfg.reference_models]
        answers = list(pool.map(lambda c, m: c.run(reference, m), contexts, cfg.reference_models))
    good = [(m, text) for m, text, _ in answers if text is not None]
    failed = {m: err for m, _, err in answers if err is not None}
    if len(good) < cfg.min_successful:
        return {
            "error": f"only {len(good)} of {len(answers)} reference models answered "
            f"(need {cfg.min_successful}): " + "; ".join(f"{m}: {e}" for m, e in failed.items())
        }
    listing = "\n\n".join(f"{i}. {text}" for i, (_, text) in enumerate(good, 1))
    messages = [{"role": "system", "content": f"{AGGREGATOR_SYSTEM_PROMPT}\n\n{listing}"}, *question]
    try:
        final = _ask(
            cfg, cfg.aggregator_model, messages, cfg.aggregator_temperature, timeout_s, ctx.usage, ctx
        )
    except RuntimeError as exc:
        return {"error": f"the aggregator model {cfg.aggregator_model} failed: {exc}"}
    result: dict[str, Any] = {
        "success": True,
        "response": final,
        "models_used": {"reference_models": [m for m, _ in good], "aggregator_model": cfg.aggregator_model},
    }
    if failed:
        result["failed_models"] = failed
    return result


register_toolset_check(
    "moa",
    lambda settings: moa_config(settings) is not None,
    "a model endpoint (the run's, or MOA_BASE_URL) and models (MOA_REFERENCE_MODELS, MOA_AGGREGATOR_MODEL)",
)

register(
    Tool(
        name="mixture_of_agents",
        toolset="moa",
        description=(
            "Put a hard problem to several language models at once and get one answer synthesised from "
            "theirs. Slow and costly (several model calls): use it for genuinely difficult questions "
            "such as tricky math, algorithm design or multi-step analysis, not for simple lookups. "
            "State the problem completely: the models see nothing but `user_prompt`."
        ),
        parameters={
            "type": "object",
            "properties": {
                "user_prompt": {
                    "type": "string",
                    "description": "The complete problem or question for the models to solve.",
                }
            },
            "required": ["user_prompt"],
        },
        handler=mixture_of_agents,
        sandbox_network=False,  # on the host, or files only
    )
)
