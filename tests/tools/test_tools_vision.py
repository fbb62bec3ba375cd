"""vision_analyze against the fake endpoint, which names each image it receives (type, size, sha256)."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import replace

import pytest

from batchrun.fakes.fake_services import BLUE, make_png
from batchrun.prompt.tools.catalog import available_toolsets
from batchrun.prompt.tools.config import ToolSettings, vision_config


def sha12(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def last_image_request(server) -> dict:
    chats = [r for r in server.stats()["last_requests"] if r.get("messages")]  # not an image generation's
    return [r for r in chats if isinstance(r["messages"][-1]["content"], list)][-1]


@pytest.fixture
def tool_ctx(local_tool_ctx):
    """The fake site listens on 127.0.0.1 (see local_tool_ctx)."""
    return local_tool_ctx


def test_image_url_is_fetched_and_sent_to_the_model(fake_web, tools_llm, tool_ctx, call_tool):
    red = fake_web.pages["/img/red.png"].body
    out = call_tool(
        tool_ctx(), "vision_analyze", image_url=fake_web.url("/img/red.png"), question="What colour?"
    )
    assert out["success"] is True
    assert f"image/png 8x6, sha256 {sha12(red)}" in out["analysis"]
    assert out["image"] == {
        "source": fake_web.url("/img/red.png"),
        "mime_type": "image/png",
        "bytes": len(red),
    }
    request = last_image_request(tools_llm)
    assert request["model"] == "mock"
    text, image = request["messages"][-1]["content"]
    assert text == {"type": "text", "text": "What colour?"}
    assert image["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(red).decode()


def test_image_url_on_the_hosts_private_network_is_refused(fake_web, tools_llm, tool_ctx, call_tool):
    """The URL is the model's choice: by default it may not reach 127.0.0.1 (or any private address)."""
    before = len(tools_llm.stats()["last_requests"])
    ctx = tool_ctx({"WEB_ALLOW_PRIVATE_ADDRESSES": "0"})
    out = call_tool(ctx, "vision_analyze", image_url=fake_web.url("/img/red.png"), question="What colour?")
    # Named as the other tools' refusals are (web_extract:, image_generate:, browser_navigate:).
    url = fake_web.url("/img/red.png")
    assert out["error"] == f"vision_analyze: {url} resolves to a private address (127.0.0.1); refused"
    assert len(tools_llm.stats()["last_requests"]) == before  # no model call either


def test_file_in_the_sandbox(tool_ctx, call_tool):
    ctx = tool_ctx()
    png = make_png(5, 3, BLUE)
    res = ctx.sandbox.run("mkdir -p pics && cat > pics/blue.png", timeout_s=10, stdin=png)
    assert res.exit_code == 0
    out = call_tool(ctx, "vision_analyze", image_url="pics/blue.png", question="Describe it")
    assert f"image/png 5x3, sha256 {sha12(png)}" in out["analysis"]
    assert out["image"]["source"] == "pics/blue.png"


def test_data_url(tool_ctx, call_tool):
    png = make_png(2, 7, (1, 2, 3))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    out = call_tool(tool_ctx(), "vision_analyze", image_url=url, question="Size?")
    assert f"image/png 2x7, sha256 {sha12(png)}" in out["analysis"]
    assert "base64" not in json.dumps(out)  # the bytes never come back in the result


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("/site/plain.txt", "not an image"),
        ("/site/nope.png", "HTTP 404"),
        ("missing/file.png", "File not found"),
        ("data:image/png,notbase64", "base64"),
    ],
)
def test_bad_images_are_errors(source, expected, fake_web, tool_ctx, call_tool):
    url = fake_web.base_url + source if source.startswith("/site") else source
    out = call_tool(tool_ctx(), "vision_analyze", image_url=url, question="What is it?")
    assert expected in out["error"]


def test_image_too_large(fake_web, tool_ctx, call_tool):
    ctx = tool_ctx({"VISION_MAX_IMAGE_BYTES": "50"})
    out = call_tool(ctx, "vision_analyze", image_url=fake_web.url("/img/red.png"), question="?")
    assert "limit of 50 bytes" in out["error"]


def test_model_failure_is_an_observation(fake_web, tool_ctx, call_tool):
    out = call_tool(
        tool_ctx(), "vision_analyze", image_url=fake_web.url("/img/blue.png"), question="x [error:400]"
    )
    assert "HTTP 400" in out["error"] and "Scripted error 400" in out["error"]


def test_configured_model_and_endpoint(fake_web, tools_llm, tool_ctx, call_tool):
    ctx = tool_ctx({"VISION_MODEL": "vision-model-x"})
    call_tool(ctx, "vision_analyze", image_url=fake_web.url("/img/blue.png"), question="Which model?")
    assert last_image_request(tools_llm)["model"] == "vision-model-x"


def test_run_key_goes_only_to_the_run_endpoint(clean_tool_env):
    run = ToolSettings(llm_base_url="https://router.example/api/v1", llm_api_key="sk-run", llm_model="m")
    same = vision_config(run).endpoint
    assert (same.base_url, same.api_key, same.model) == ("https://router.example/api/v1", "sk-run", "m")
    other = vision_config(replace(run, tool_env={"VISION_BASE_URL": "http://vllm:8000/v1"})).endpoint
    assert (other.base_url, other.api_key) == ("http://vllm:8000/v1", None)
    keyed = vision_config(replace(run, tool_env={"VISION_BASE_URL": "http://v/v1", "VISION_API_KEY": "k2"}))
    assert keyed.endpoint.api_key == "k2"


def test_vision_is_offered_with_an_endpoint(clean_tool_env):
    assert "vision" not in available_toolsets()
    assert "vision" in available_toolsets(ToolSettings(llm_base_url="http://x/v1", llm_model="m"))
    assert "vision" in available_toolsets(
        ToolSettings(tool_env={"VISION_BASE_URL": "http://x/v1", "VISION_MODEL": "m"})
    )


def test_agent_loop_with_vision(fake_web, tool_ctx, run_tool_loop):
    ctx = tool_ctx()
    messages = run_tool_loop(ctx, fake_web.url("/img/red.png"), ["vision"])
    tool = next(m for m in messages if m["role"] == "tool")
    assert tool["name"] == "vision_analyze"
    assert "image/png 8x6" in json.loads(tool["content"])["analysis"]


def test_an_endpoint_quoting_the_vision_key_never_shows_it_to_the_model(tools_llm, tool_ctx, call_tool):
    """The vision endpoint's 401 quoting the key it got went into the tool's result, which the run's model,
    another endpoint, reads in the next request: the vision provider's key was sent to it."""
    key, token = "vk-Vision0Key-31415926", "at-Vision0Token-2718"
    ctx = tool_ctx({"VISION_BASE_URL": f"{tools_llm.base_url}?access_token={token}", "VISION_API_KEY": key})
    png = "data:image/png;base64," + base64.b64encode(make_png(2, 2, BLUE)).decode()
    out = call_tool(ctx, "vision_analyze", image_url=png, question="x [error:401] [quote_auth]")
    assert "HTTP 401" in out["error"] and "auth=Bearer [REDACTED]" in out["error"]  # it was quoted
    assert key not in out["error"] and token not in out["error"]
