"""The ``image_gen`` toolset: image_generate through an OpenAI-compatible images endpoint.

The image (returned by the endpoint as base64 or as a URL) is saved under the run directory,
``<run_dir>/images/``, and the result names that file: base64 never reaches a trajectory.

A URL is fetched here, on the host, so it gets the web tools' address check (web.py): unless
WEB_ALLOW_PRIVATE_ADDRESSES is set, it (and every redirect hop) must resolve to public addresses, except
on the images endpoint's own origin (a local server handing back its own files), which the operator chose.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from batchrun.prompt.llm import LLMError
from batchrun.prompt.tools.config import (
    ASPECT_RATIOS,
    allow_private_addresses,
    image_gen_config,
    model_client,
)
from batchrun.prompt.tools.registry import (
    Tool,
    ToolArgumentError,
    ToolContext,
    register,
    register_toolset_check,
)
from batchrun.prompt.tools.vision import sniff_image
from batchrun.prompt.tools.web import AddressRefused, FetchError, fetch_url

IMAGES_DIR = "images"
_EXTENSIONS = {
    "image/png": "png",
    "image/jpeg": "jpg",
    "image/gif": "gif",
    "image/webp": "webp",
    "image/bmp": "bmp",
}


def save_image(base_dir: str, subdir: str, stem: str, data: bytes, mime: str) -> Path:
    """Write ``data`` to ``<base_dir>/<subdir>/<stem>_<sha12>.<ext>`` atomically; the final path."""
    folder = Path(base_dir) / subdir
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}_{hashlib.sha256(data).hexdigest()[:12]}.{_EXTENSIONS[mime]}"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# What an image call may spend beyond its prompt, reserved with a run-wide budget: output tokens (OpenAI
# counts an image as tokens: 6,240 for gpt-image-1's largest size at high quality), rounded up. It was 0,
# so image calls in flight were reserved at their prompt's size alone.
IMAGE_WORST_TOKENS = 8192


def prompt_stem(ctx: ToolContext) -> str:
    spec = getattr(ctx.sandbox, "spec", None)
    index = getattr(spec, "prompt_index", None)
    return f"prompt{index}" if index is not None else "prompt"


def image_generate(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    prompt = args["prompt"].strip()
    if not prompt:
        raise ToolArgumentError("prompt must not be empty")
    aspect = args.get("aspect_ratio") or "landscape"
    if aspect not in ASPECT_RATIOS:
        raise ToolArgumentError(f"aspect_ratio must be one of {', '.join(ASPECT_RATIOS)}, got {aspect!r}")
    cfg = image_gen_config(ctx.settings)
    if cfg is None:
        return {"error": "image generation is not configured (set IMAGE_GEN_MODEL)"}
    out_dir = ctx.settings.run_dir
    if out_dir is None:
        return {"error": "image generation has nowhere to save images (the runner gave no run_dir)"}
    timeout_s = min(cfg.timeout_s, ctx.tool_timeout_s)
    deadline = time.monotonic() + ctx.tool_timeout_s  # the generation and the download together
    kwargs: dict[str, Any] = {
        "model": cfg.endpoint.model,
        "prompt": prompt,
        "n": 1,
        "size": cfg.sizes[aspect],
    }
    if cfg.response_format:
        kwargs["response_format"] = cfg.response_format
    client = model_client(ctx, cfg.endpoint.base_url, cfg.endpoint.api_key)
    try:
        resp = client.post_json(
            "images/generations",
            kwargs,
            deadline=time.monotonic() + timeout_s,
            usage=ctx.usage,
            worst_tokens=IMAGE_WORST_TOKENS,
        )
    except LLMError as exc:
        return {"error": f"image generation failed: {exc}"}
    items = resp.get("data") if isinstance(resp.get("data"), list) else []
    if not items or not isinstance(items[0], dict):
        return {"error": "the image endpoint returned no image"}
    item = items[0]
    source_url = None
    b64 = item.get("b64_json")
    url = item.get("url")
    if isinstance(url, str) and url.startswith("data:") and not (isinstance(b64, str) and b64):
        # An image inline as a data: URL (urllib's data handler read it, then fetch_url failed on it)
        header, _, b64 = url.partition(",")
        if not header.endswith(";base64"):
            return {"error": "the image endpoint returned a data: URL that is not base64"}
    if isinstance(b64, str) and b64:
        try:
            data = base64.b64decode(b64)
        except (binascii.Error, ValueError):
            return {"error": "the image endpoint returned invalid base64"}
    elif isinstance(url, str) and url:
        source_url = url
        left = min(timeout_s, deadline - time.monotonic())
        if left <= 0:
            return {
                "error": f"the generated image could not be downloaded: no time left of {ctx.tool_timeout_s:g} s"
            }
        try:
            # The URL is the endpoint's answer: one answering http://169.254.169.254/... (or a URL of its own
            # that redirects there) had this host fetch it, and the model read 200 characters of the reply.
            data = fetch_url(
                source_url,
                max_bytes=cfg.max_bytes,
                timeout_s=left,
                public_only=not allow_private_addresses(ctx.settings.env()),
                trusted_origin=cfg.endpoint.base_url,
            ).body
        except AddressRefused as exc:
            return {"error": f"image_generate: {exc}"}
        except FetchError as exc:
            return {"error": f"the generated image could not be downloaded: {exc}"}
    else:
        return {"error": "the image endpoint returned neither b64_json nor url"}
    mime = sniff_image(data)
    if mime is None:
        return {"error": f"the image endpoint returned {len(data)} bytes that are not an image"}
    path = save_image(out_dir, IMAGES_DIR, prompt_stem(ctx), data, mime)
    result: dict[str, Any] = {
        "success": True,
        "image": str(path),
        "relative_path": str(path.relative_to(out_dir)),
        "mime_type": mime,
        "bytes": len(data),
        "size": cfg.sizes[aspect],
        "aspect_ratio": aspect,
    }
    if source_url:
        result["url"] = source_url
    if isinstance(item.get("revised_prompt"), str) and item["revised_prompt"]:
        result["revised_prompt"] = item["revised_prompt"]
    return result


register_toolset_check(
    "image_gen",
    lambda settings: image_gen_config(settings) is not None,
    "IMAGE_GEN_MODEL (an OpenAI-compatible images endpoint)",
)

register(
    Tool(
        name="image_generate",
        toolset="image_gen",
        description=(
            "Generate an image from a text prompt. The image is saved as a file and the result gives "
            "its path (`image`) and, when the generator provides one, its URL. Describe the subject, "
            "style, composition and lighting in detail."
        ),
        parameters={
            "type": "object",
            "properties": {
                "prompt": {
                    "type": "string",
                    "description": "Detailed description of the image to generate.",
                },
                "aspect_ratio": {
                    "type": "string",
                    "enum": list(ASPECT_RATIOS),
                    "description": "'landscape' (wide, the default), 'square', or 'portrait' (tall).",
                },
            },
            "required": ["prompt"],
        },
        handler=image_generate,
        sandbox_network=False,  # on the host, or files only
    )
)
