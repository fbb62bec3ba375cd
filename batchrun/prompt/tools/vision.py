"""The ``vision`` toolset: vision_analyze asks a vision-capable model about an image.

The image is an http(s) URL (fetched here, so the model's provider need not reach it), a
``data:`` URL, or a file in the prompt's sandbox (read through the sandbox, so it works in every
backend). It travels to the model as a base64 data URL inside the request only; results carry
the answer and a short description of the image, never its bytes.
"""

from __future__ import annotations

import base64
import binascii
import time
import urllib.parse
from typing import Any

from batchrun.prompt.llm import LLMError
from batchrun.prompt.tools.config import (
    VisionConfig,
    allow_private_addresses,
    extract_config,
    model_client,
    vision_config,
)
from batchrun.prompt.tools.registry import (
    Tool,
    ToolArgumentError,
    ToolContext,
    register,
    register_toolset_check,
)
from batchrun.prompt.tools.web import AddressRefused, FetchError, fetch_url

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


class VisionError(Exception):
    """The image could not be loaded or the model did not answer; shown to the model."""


def sniff_image(data: bytes) -> str | None:
    """The media type of an image format vision models take (png, jpeg, gif, webp, bmp), else None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    return None


def load_image(ctx: ToolContext, source: str, max_bytes: int) -> tuple[bytes, str, str]:
    """(bytes, media type, how to name the source in results) of an image URL, data URL or sandbox file."""
    source = source.strip()
    if not source:
        raise ToolArgumentError("image_url must not be empty")
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        web = extract_config(ctx.settings)
        try:
            page = fetch_url(
                source,
                max_bytes=max_bytes,
                timeout_s=min(web.timeout_s, ctx.tool_timeout_s),
                user_agent=web.user_agent,
                headers={"Accept": "image/*"},
                # The URL is the model's choice: the host's private network is off limits (see web.py).
                public_only=not allow_private_addresses(ctx.settings.env()),
            )
        except AddressRefused as exc:  # named as web_extract's, image_generate's and the browser's are
            raise VisionError(f"vision_analyze: {exc}") from None
        except FetchError as exc:
            raise VisionError(str(exc)) from None
        data, label = page.body, source
    elif scheme == "data":
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise VisionError("a data: URL must be base64 encoded (data:image/png;base64,...)")
        try:
            data = base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError):
            raise VisionError("the data: URL is not valid base64") from None
        if len(data) > max_bytes:
            raise VisionError(f"the image is {len(data)} bytes, over the limit of {max_bytes}")
        label = f"data URL ({len(data)} bytes)"
    else:
        from batchrun.prompt.tools.file import read_bytes  # the file toolset's sandbox reader

        path = source[len("file://") :] if scheme == "file" else source
        got = read_bytes(ctx, path, max_bytes=max_bytes)
        if isinstance(got, dict):
            raise VisionError(got["error"])
        data, label = got, path
    mime = sniff_image(data)
    if mime is None:
        raise VisionError(
            f"{label} is not an image this tool can show (PNG, JPEG, GIF, WebP or BMP expected, "
            f"got {len(data)} bytes starting {data[:12]!r})"
        )
    return data, mime, label


def ask_about_image(
    cfg: VisionConfig,
    question: str,
    data: bytes,
    mime: str,
    timeout_s: float,
    usage: Any = None,
    ctx: Any = None,
) -> str:
    """The vision model's answer to ``question`` about the image, through the run's model client."""
    data_url = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    client = model_client(ctx, cfg.endpoint.base_url, cfg.endpoint.api_key)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": question},
                {"type": "image_url", "image_url": {"url": data_url}},
            ],
        }
    ]
    try:
        turn = client.chat(
            messages,
            [],
            deadline=time.monotonic() + timeout_s,
            usage=usage,
            model=cfg.endpoint.model,
            max_tokens=cfg.max_tokens,
        )
    except LLMError as exc:
        raise VisionError(f"the vision model failed: {exc}") from None
    text = (turn.content or "").strip()
    if not text:
        raise VisionError("the vision model returned an empty answer")
    return text


def vision_analyze(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    question = args["question"].strip() or "Describe this image in detail."
    cfg = vision_config(ctx.settings)
    if cfg is None:
        return {"error": "vision is not configured (no vision model or endpoint)"}
    # The fetch and the model's answer share the tool's timeout: each had all of it, so a slow image
    # and a slow model together held the call (and the prompt) for twice as long.
    deadline = time.monotonic() + ctx.tool_timeout_s
    try:
        data, mime, label = load_image(ctx, args["image_url"], cfg.max_image_bytes)
        left = min(cfg.timeout_s, deadline - time.monotonic())
        if left <= 0:
            raise VisionError(
                f"the image took the whole time limit of {ctx.tool_timeout_s:g} s; not analysed"
            )
        answer = ask_about_image(cfg, question, data, mime, left, ctx.usage, ctx=ctx)
    except VisionError as exc:
        return {"error": str(exc)}
    return {
        "success": True,
        "analysis": answer,
        "image": {"source": label, "mime_type": mime, "bytes": len(data)},
    }


register_toolset_check(
    "vision",
    lambda settings: vision_config(settings) is not None,
    "a model endpoint (the run's, or VISION_BASE_URL) and a model (VISION_MODEL)",
)

register(
    Tool(
        name="vision_analyze",
        toolset="vision",
        description=(
            "Look at an image with a vision model and answer a question about it: describe it, read its "
            "text, interpret a chart or screenshot. `image_url` is an http(s) URL, a data: URL, or the "
            "path of an image file in the working environment (e.g. one you downloaded or made). PNG, "
            "JPEG, GIF, WebP and BMP are supported."
        ),
        parameters={
            "type": "object",
            "properties": {
                "image_url": {
                    "type": "string",
                    "description": "Image URL (http/https or data:) or path of an image file in the sandbox.",
                },
                "question": {
                    "type": "string",
                    "description": "What you want to know about the image; be specific.",
                },
            },
            "required": ["image_url", "question"],
        },
        handler=vision_analyze,
        sandbox_network=False,  # on the host, or files only
    )
)
