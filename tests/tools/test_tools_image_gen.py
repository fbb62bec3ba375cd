"""image_generate against the fake endpoint's /v1/images/generations; images land under the run dir."""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from batchrun.fakes.fake_services import color_for, make_png
from batchrun.prompt.tools.catalog import available_toolsets
from batchrun.prompt.tools.config import ToolConfigError, ToolSettings

ENV = {"IMAGE_GEN_MODEL": "mock-image"}


def png_size(data: bytes) -> tuple[int, int]:
    return struct.unpack(">II", data[16:24])


def test_image_is_saved_under_the_run_dir(tools_llm, tool_ctx, call_tool, tmp_path):
    ctx = tool_ctx(ENV, prompt_index=42)
    out = call_tool(ctx, "image_generate", prompt="a lighthouse at dusk", aspect_ratio="square")
    assert out["success"] is True
    path = Path(out["image"])
    assert path.parent == tmp_path / "run" / "images" and path.name.startswith("prompt42_")
    assert out["relative_path"] == f"images/{path.name}"
    data = path.read_bytes()
    assert data == make_png(1024, 1024, color_for("a lighthouse at dusk"))
    assert (out["size"], out["mime_type"], out["bytes"]) == ("1024x1024", "image/png", len(data))
    assert len(json.dumps(out)) < 1000  # a path, never the image itself
    request = tools_llm.stats()["last_requests"][-1]
    assert request == {"model": "mock-image", "prompt": "a lighthouse at dusk", "n": 1, "size": "1024x1024"}


def test_default_aspect_is_landscape_and_sizes_are_configurable(tool_ctx, call_tool):
    out = call_tool(tool_ctx(ENV), "image_generate", prompt="wide view")
    assert out["size"] == "1536x1024" and png_size(Path(out["image"]).read_bytes()) == (1536, 1024)
    ctx = tool_ctx({**ENV, "IMAGE_GEN_SIZES": "portrait=64x128"})
    out = call_tool(ctx, "image_generate", prompt="tall view", aspect_ratio="portrait")
    assert png_size(Path(out["image"]).read_bytes()) == (64, 128)


def test_url_responses_are_downloaded(tools_llm, tool_ctx, call_tool):
    ctx = tool_ctx({**ENV, "IMAGE_GEN_RESPONSE_FORMAT": "url", "IMAGE_GEN_SIZES": "square=16x16"})
    out = call_tool(ctx, "image_generate", prompt="a red fox", aspect_ratio="square")
    assert out["url"].startswith(tools_llm.base_url + "/images/files/")
    assert Path(out["image"]).read_bytes() == make_png(16, 16, color_for("a red fox"))


def test_endpoint_errors_are_observations(tool_ctx, call_tool):
    out = call_tool(tool_ctx(ENV), "image_generate", prompt="forbidden [error:403]")
    assert "HTTP 403" in out["error"]


def test_argument_checks(tool_ctx, call_tool):
    ctx = tool_ctx(ENV)
    assert (
        "aspect_ratio must be one of"
        in call_tool(ctx, "image_generate", prompt="x", aspect_ratio="wide")["error"]
    )
    assert "must not be empty" in call_tool(ctx, "image_generate", prompt="  ")["error"]


def test_no_run_dir_is_an_error(tool_ctx, call_tool):
    out = call_tool(tool_ctx(ENV, run_dir=None), "image_generate", prompt="x")
    assert "run_dir" in out["error"]


def test_offered_only_with_an_image_model(clean_tool_env):
    run = ToolSettings(llm_base_url="http://x/v1", llm_model="chat-model")
    assert "image_gen" not in available_toolsets(run)
    assert "image_gen" in available_toolsets(replace(run, tool_env=ENV))
    assert "image_gen" not in available_toolsets(ToolSettings(tool_env=ENV))  # no endpoint at all
    for sizes in ("square=big", "square=0x0", "portrait=1024x0", "landscape=99999x1024"):
        with pytest.raises(ToolConfigError, match="IMAGE_GEN_SIZES"):
            available_toolsets(replace(run, tool_env={**ENV, "IMAGE_GEN_SIZES": sizes}))
    assert "image_gen" in available_toolsets(
        replace(run, tool_env={**ENV, "IMAGE_GEN_SIZES": "square=16384x1"})
    )
    with pytest.raises(ToolConfigError, match="IMAGE_GEN_RESPONSE_FORMAT"):
        available_toolsets(replace(run, tool_env={**ENV, "IMAGE_GEN_RESPONSE_FORMAT": "png"}))


def test_agent_loop_with_image_gen(tool_ctx, run_tool_loop):
    messages = run_tool_loop(tool_ctx(ENV), "a watercolour of a harbour", ["image_gen"])
    tool = next(m for m in messages if m["role"] == "tool")
    result = json.loads(tool["content"])
    assert tool["name"] == "image_generate" and Path(result["image"]).is_file()


def test_an_image_call_reserves_an_image_s_output_tokens(tools_llm, tool_ctx, call_tool):
    """With a run-wide budget every attempt reserves its worst case: an image call reserved its prompt's
    size alone (no completion), so images in flight could pass the budget by an image's tokens each."""
    from batchrun.prompt.llm import LLMClient, LLMConfig
    from batchrun.prompt.tools.image_gen import IMAGE_WORST_TOKENS

    reserved = []

    class Gate:
        def reserve(self, tokens, deadline, priority=0, model=None):
            reserved.append((tokens, model))
            return len(reserved), 0.0

        def settle(self, ticket, usage):
            pass

    ctx = tool_ctx(ENV)
    ctx.llm = LLMClient(LLMConfig(model="mock", base_url=tools_llm.base_url, api_key="sk-run-key"))
    ctx.llm.gate = Gate()
    out = call_tool(ctx, "image_generate", prompt="a lighthouse at dusk", aspect_ratio="square")
    assert out["success"] is True
    ((tokens, model),) = reserved
    assert tokens >= IMAGE_WORST_TOKENS and model == "mock-image"


# ----------------------------------------------------------------------------- the URL the endpoint answers


class Host:
    """A loopback HTTP server: POST (an images endpoint) answers ``{"data": [{"url": self.answer}]}``;
    GET /image.png a PNG, GET /to?<url> a redirect to <url>. ``hits`` are the GETs it got."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.hits: list[str] = []
        self.answer = ""

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._send(200, json.dumps({"data": [{"url": outer.answer}]}).encode(), "application/json")

            def do_GET(self):
                outer.hits.append(self.path)
                if self.path.startswith("/to?"):
                    self.send_response(302)
                    self.send_header("Location", self.path[len("/to?") :])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:  # what a host-local service would not want read: an image stands for it here
                    self._send(200, make_png(4, 4, (9, 9, 9)), "image/png")

            def _send(self, status, data, kind):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def hosts():
    endpoint, internal = Host(), Host()  # two loopback ports: the images endpoint, a host-local service
    yield endpoint, internal
    endpoint.close()
    internal.close()


def image_env(endpoint: Host, **more: str) -> dict[str, str]:
    return {**ENV, "IMAGE_GEN_BASE_URL": endpoint.url + "/v1", **more}


@pytest.mark.parametrize("where", ["internal", "metadata"])
def test_an_image_url_on_a_private_address_is_refused_and_not_fetched(hosts, tool_ctx, call_tool, where):
    # fetched unchecked: an endpoint answering a host-local URL had this host GET it, and the model read
    # 200 characters of the answer (an HTTP error's body) in the tool's error
    endpoint, internal = hosts
    url, ip = {
        "internal": (internal.url + "/latest/meta-data/iam", "127.0.0.1"),
        "metadata": ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
    }[where]
    endpoint.answer = url
    out = call_tool(tool_ctx(image_env(endpoint)), "image_generate", prompt="a cat")
    assert out == {"error": f"image_generate: {url} resolves to a private address ({ip}); refused"}
    assert internal.hits == []


def test_a_redirect_from_the_endpoints_own_url_to_a_private_address_is_refused(hosts, tool_ctx, call_tool):
    endpoint, internal = hosts
    target = internal.url + "/secret.png"
    endpoint.answer = f"{endpoint.url}/to?{target}"  # the endpoint's own origin: fetched, its hops checked
    out = call_tool(tool_ctx(image_env(endpoint)), "image_generate", prompt="a cat")
    assert out == {"error": f"image_generate: {target} resolves to a private address (127.0.0.1); refused"}
    assert endpoint.hits == [f"/to?{target}"] and internal.hits == []


def test_the_endpoints_own_urls_and_allowed_private_addresses_are_fetched(hosts, tool_ctx, call_tool):
    endpoint, internal = hosts
    endpoint.answer = endpoint.url + "/v1/files/own.png"  # a local server handing back its own file
    out = call_tool(tool_ctx(image_env(endpoint)), "image_generate", prompt="a cat")
    assert out["success"] is True and endpoint.hits == ["/v1/files/own.png"]
    endpoint.answer = internal.url + "/elsewhere.png"
    ctx = tool_ctx(image_env(endpoint, WEB_ALLOW_PRIVATE_ADDRESSES="1"))
    out = call_tool(ctx, "image_generate", prompt="a cat")
    assert out["success"] is True and out["url"] == endpoint.answer and internal.hits == ["/elsewhere.png"]


def test_an_image_url_that_is_not_http_is_not_opened(hosts, tool_ctx, call_tool):
    # urllib's opener read file: URLs (the tool then failed on an AttributeError) and connected ftp: ones
    # to any port, past the address check: a loopback service got "USER anonymous"
    from helpers import RawServer

    class Listener(RawServer):
        seen: list[bytes] = []

        def _serve(self, conn):
            self.seen.append(b"connected")
            conn.close()

    listener = Listener()
    endpoint, _ = hosts
    try:
        for url in (f"ftp://127.0.0.1:{listener.port}/x.png", "file:///etc/hostname"):
            endpoint.answer = url
            out = call_tool(tool_ctx(image_env(endpoint)), "image_generate", prompt="a cat")
            assert out == {
                "error": f"the generated image could not be downloaded: could not fetch {url}: not an http(s) URL"
            }
        assert listener.seen == []
    finally:
        listener.close()


def test_an_image_given_as_a_data_url_is_saved(hosts, tool_ctx, call_tool):
    endpoint, _ = hosts
    png = make_png(3, 2, (1, 2, 3))
    endpoint.answer = "data:image/png;base64," + base64.b64encode(png).decode()
    out = call_tool(tool_ctx(image_env(endpoint)), "image_generate", prompt="a cat")
    assert out["success"] is True and Path(out["image"]).read_bytes() == png and "url" not in out
    assert endpoint.hits == []
