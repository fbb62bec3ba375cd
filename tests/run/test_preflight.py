"""The endpoint check before the first prompt (batchrun/run/preflight.py): a model the endpoint does not
list is a warning, a rejected key a clear error without the key in it, a missing /models route nothing."""

from __future__ import annotations

import pytest
from helpers import RawServer

from batchrun.fakes.fake_model import FakeModelServer
from batchrun.prompt.llm import LLMConfig
from batchrun.run.preflight import check_endpoint, list_models, warn_unlisted_model


def test_endpoint_check_warns_once_when_models_does_not_list_the_requested_name(capsys):
    with FakeModelServer(latency_s=0) as srv:
        check_endpoint(LLMConfig(model="Qwen/Qwen3-8B", base_url=srv.base_url, api_key="sk-local"))
        err = capsys.readouterr().err
        assert err.count("warning:") == 1 and "'Qwen/Qwen3-8B'" in err and "it lists 'mock'" in err
        check_endpoint(LLMConfig(model="mock", base_url=srv.base_url, api_key="sk-local"))
        assert "warning" not in capsys.readouterr().err
    assert warn_unlisted_model("x", []) is False  # no list: nothing to say
    assert warn_unlisted_model("x", [f"m{i}" for i in range(9)]) is True
    assert "(and 4 more)" in capsys.readouterr().err


def test_endpoint_check_refuses_a_rejected_key_and_tolerates_a_missing_models_route():
    """401 on /models is a clear error without the key in it; any other status leaves it to the first call."""
    import http.server
    import threading

    from batchrun.config import UsageError

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status = 401 if self.headers.get("Authorization") == "Bearer sk-wrong" else 404
            # The server's own words (it echoes the key it was sent, as some do): said, the key redacted.
            body = b'{"error": {"message": "Invalid key sk-wrong: expired"}}' if status == 401 else b""
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        with pytest.raises(UsageError) as rejected:
            list_models(LLMConfig(model="m", base_url=base, api_key="sk-wrong"))
        assert "rejected the API key (HTTP 401): Invalid key " in str(rejected.value), rejected.value
        assert str(rejected.value).endswith(": expired") and "sk-wrong" not in str(rejected.value)
        list_models(LLMConfig(model="m", base_url=base, api_key="sk-right"))  # 404: no error
    finally:
        server.shutdown()


def test_the_models_probe_waits_no_longer_than_the_request_timeout(monkeypatch):
    """An endpoint that drips its /models answer is given up on after --request_timeout (here 2 s), not
    after the probe's own 15 s, twice."""
    from batchrun.config import UsageError
    from batchrun.prompt import httpclient

    asked: list[float] = []

    def request(self, method, url, **kw):
        asked.append(kw["timeout_s"])
        raise httpclient.RequestTimeout(f"{url} sent nothing more mid-answer before the request's deadline")

    monkeypatch.setattr(httpclient.Client, "request", request)
    with pytest.raises(UsageError, match="cannot reach the endpoint"):
        list_models(LLMConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key="k", request_timeout_s=2))
    assert asked == [2, 2]
    asked.clear()
    with pytest.raises(UsageError):
        list_models(LLMConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key="k"))
    assert asked == [15, 15]  # the default request timeout (600 s) leaves the probe's own bound


@pytest.mark.parametrize(
    ("server", "props", "told"),
    [
        ("llama.cpp", {"total_slots": 2, "model_path": "/models/x.gguf"}, [2]),
        ("llama.cpp", {"total_slots": "2"}, []),  # not a count: nothing said, no limit
        ("llama.cpp", {"total_slots": 0}, []),
        ("uvicorn", {"total_slots": 2}, []),  # vLLM, SGLang, a proxy: /props is never asked
    ],
)
def test_a_llama_servers_slots_are_read_from_its_props_and_no_other_server_is_asked(server, props, told):
    """llama-server says it in its Server header and serves /props beside /v1 (404 under it); any
    other endpoint gets exactly the requests it got before (/models, then the chat call)."""
    import http.server
    import json
    import threading

    paths: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            paths.append(self.path)
            body = json.dumps(
                props if self.path == "/props" else {"object": "list", "data": [{"id": "m"}]}
            ).encode()
            self.send_response(200 if self.path in ("/props", "/v1/models") else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def version_string(self):
            return server

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    slots: list[int] = []
    try:
        list_models(
            LLMConfig(model="m", base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="k"),
            on_slots=slots.append,
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert slots == told
    assert paths == (["/v1/models", "/props"] if server == "llama.cpp" else ["/v1/models"])


# ----------------------------------------------------------------------------- audit: the backend before the start check


@pytest.mark.parametrize("case", ["no_bwrap", "cwd_outside_root"])
def test_a_sandbox_that_cannot_work_here_exits_2_before_the_start_check(
    tmp_path, capsys, monkeypatch, server, case
):
    """The backend's preflight ran after the start check (one billed chat call), so a local sandbox
    without bubblewrap, a row's cwd outside --cwd_root, Docker not running or no Apptainer cost a
    model call before exit 2."""
    import json

    from helpers import exit_code, write_jsonl

    if case == "no_bwrap":
        from batchrun.prompt.sandboxes.local import host, sandbox

        for module in (host, sandbox):  # the probe, and the sandbox's own reference to it
            monkeypatch.setattr(module, "bwrap_problem", lambda: "bubblewrap is not installed")
        dataset, kw, said = write_jsonl(tmp_path / "d.jsonl", ["x"]), {}, "cannot isolate commands"
    else:
        root = tmp_path / "root"
        root.mkdir()
        dataset = tmp_path / "d.jsonl"
        dataset.write_text(json.dumps({"prompt": "x", "cwd": "/etc"}) + "\n")
        kw, said = {"local_isolation": "none", "cwd_root": str(root)}, "may not use"
    code = exit_code(server, dataset, tmp_path / "data", sandbox="local", **kw)
    assert code == 2
    assert said in capsys.readouterr().err
    stats = server.stats()
    assert stats["check_calls"] == 0 and stats["requests"] == 0
    assert not (tmp_path / "data" / "run").exists()


def test_rows_whose_cwd_a_bubblewrap_sandbox_cannot_have_are_named_by_line(tmp_path, capsys, server):
    """The start's warning counted them ("2 prompt(s) name a cwd ...") without saying which: the user had
    to search the dataset for them. It names their lines, as a bad line is named."""
    import json

    from helpers import run

    from batchrun.prompt.sandboxes.local import local_isolation_available

    if not local_isolation_available():
        pytest.skip("needs bubblewrap")
    dataset = tmp_path / "d.jsonl"
    rows = [{"prompt": "ok [calls:0]"}, {"prompt": "x", "cwd": "/proc"}, {"prompt": "y", "cwd": "/usr/lib"}]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(server, dataset, tmp_path / "data", sandbox="local", local_isolation="bwrap")
    out = capsys.readouterr()
    warning = next(line for line in (out.out + out.err).splitlines() if "name a cwd" in line)
    assert f"{dataset}:2: cwd '/proc' would replace" in warning, warning
    assert f"{dataset}:3: cwd '/usr/lib' lies in the read-only system directory" in warning, warning


# ----------------------------------------------------------------------------- audit: Docker's pulls after the start check


class Registry(RawServer):
    """A "registry" on a loopback port that records each connection: ``hang`` keeps it open unanswered
    (a pull would wait on it for minutes), else it closes it (the pull fails at once)."""

    def __init__(self, *, hang: bool):
        self.connected: list[float] = []  # time.monotonic() of each connection
        self._held: list = []
        self._hang = hang
        super().__init__()
        self.address = f"127.0.0.1:{self.port}"

    def _serve(self, conn) -> None:  # noqa: ANN001
        import time

        self.connected.append(time.monotonic())
        self._held.append(conn) if self._hang else conn.close()

    def close(self) -> None:
        super().close()
        for conn in self._held:
            conn.close()


@pytest.mark.docker
@pytest.mark.parametrize("status", [401, 200])
def test_docker_pulls_come_after_the_start_check(tmp_path, capsys, docker_test_image, status):
    """Docker's preflight pulled every missing image before the start check: a wrong key was found only
    after the pulls (here 25 s on a registry that never answers). Now the image's presence is
    checked first, the pull follows a start check that passed, and a refused one exits 2 without it."""
    import json
    import time

    from docker.errors import ImageNotFound
    from helpers import ScriptedEndpoint, exit_code

    from batchrun.prompt.sandboxes.docker.sandbox import docker_client

    checked: list[float] = []

    def answer(call: dict, calls: list[dict]):
        checked.append(time.monotonic())
        if status == 200:
            return 200, {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "OK"}}]}
        return 401, {"error": {"message": "Incorrect API key provided", "code": "401"}}

    registry = Registry(hang=status == 401)
    image = f"{registry.address}/br-audit/never:1"
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(
        json.dumps({"prompt": "a", "image": image}) + "\n" + json.dumps({"prompt": "b"}) + "\n"
    )
    try:
        with ScriptedEndpoint(answer) as ep:
            t0 = time.monotonic()
            code = exit_code(
                None, dataset, tmp_path / "data", model="m", base_url=ep.base_url, api_key="sk-wrong",
                sandbox="docker", default_image=docker_test_image,
            )  # fmt: skip
            took = time.monotonic() - t0
    finally:
        registry.close()
    out, err = capsys.readouterr()
    if status == 401:
        assert (registry.connected, "pulling" in out, len(checked)) == ([], False, 1), f"{took:.1f} s"
        assert code == 2 and "HTTP 401" in err and "Incorrect API key" in err
    else:
        assert registry.connected and checked and checked[0] < registry.connected[0]
        assert f"pull of {image} failed" in out
    assert f"{image}  missing" in out
    if status == 200:
        assert "1 prompt(s) will fail without a model call" in out
    with pytest.raises(ImageNotFound):
        docker_client().images.get(image)


@pytest.mark.docker
def test_docker_pulls_of_a_silent_registry_end_by_the_prompt_timeout_and_once_for_it(
    tmp_path, capsys, docker_test_image
):
    """Before, each pull waited for the engine's own ~25 s on a registry that takes the connection and
    never answers, 4 at a time: 6 such rows held this run 52 s before any prompt. Now a pull ends by
    --prompt_timeout, and once one found the registry silent the other images of it fail at once."""
    import json
    import time

    from helpers import read_jsonl, run

    registry = Registry(hang=True)
    images = [f"{registry.address}/br-audit/silent{i}:1" for i in range(6)]
    rows = [{"prompt": f"row {i}", "image": image, "toolsets": []} for i, image in enumerate(images)]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {"prompt": "good", "toolsets": []}]))
    try:
        t0 = time.monotonic()
        run(
            None,
            dataset,
            tmp_path / "data",
            sandbox="docker",
            default_image=docker_test_image,
            prompt_timeout=4,
        )
        took = time.monotonic() - t0
    finally:
        registry.close()
    out = capsys.readouterr().out
    assert took < 20, f"{took:.1f} s"
    assert len(registry.connected) <= 4  # the first round's pulls; the rest were not tried
    failed = {f["prompt"]: f for f in read_jsonl(tmp_path / "data" / "run" / "failed.jsonl")}
    assert sorted(failed) == [f"row {i}" for i in range(6)]
    for i, image in enumerate(images):
        assert failed[f"row {i}"]["error_class"] == "preflight" and image in failed[f"row {i}"]["error"]
    assert "no answer from the registry within 4 s" in out
    assert f"its registry {registry.address} gave no answer" in out
    assert [r["prompt_index"] for r in read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")] == [6]


def test_modal_without_credentials_exits_2_before_the_start_check(tmp_path, capsys, monkeypatch, server):
    """The real Modal SDK with no token (no `modal token new`, no MODAL_TOKEN_ID): the preflight only
    checked that the SDK imports, so every prompt made its first model call and then failed at its
    sandbox's start. The app's lookup is now made once before the run."""
    from helpers import exit_code, write_jsonl

    modal = pytest.importorskip("modal")
    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(name, raising=False)
    if modal.config.config.get("token_id"):
        pytest.skip("this machine has Modal credentials")
    code = exit_code(server, write_jsonl(tmp_path / "d.jsonl", ["x"]), tmp_path / "data", sandbox="modal")
    err = capsys.readouterr().err
    assert code == 2 and "--sandbox=modal: cannot use Modal (AuthError" in err, err
    assert "modal token new" in err
    stats = server.stats()
    assert stats["check_calls"] == 0 and stats["requests"] == 0
    assert not (tmp_path / "data" / "run").exists()
