"""batchrun/secrets.py: no secret in any file or stream, including what an endpoint quotes back."""

from __future__ import annotations

import json

import pytest
from helpers import read_jsonl, run, write_jsonl

from batchrun.secrets import Redactor

PROMPT_SECRET = "ds.secret.value.777"  # an env secret that also appears inside one prompt
SECRET_PROMPT = f"Remember the code {PROMPT_SECRET} in a note"


def test_verbose_previews_never_show_part_of_a_secret(server, tmp_path, monkeypatch, capsys):
    import hashlib

    monkeypatch.setenv("DATASET_SECRET", PROMPT_SECRET)
    prompt = f"Store {PROMPT_SECRET} [calls:2]"
    dataset = write_jsonl(tmp_path / "d.jsonl", [prompt])
    # The fake's second [calls:2] step is write_file with "Notes for: <prompt without directives>";
    # aim the preview's cut 10 characters into the secret, in the arguments and in the whole line.
    hash8 = hashlib.sha256(prompt.encode()).hexdigest()[:8]
    args_head = '{"path": "notes/answer_' + hash8 + '.txt", "content": "Notes for: Store '
    for cut in (len(args_head) + 10, len("tool write_file(") + len(args_head) + 10):
        run(server, dataset, tmp_path / "data", run_name=f"cut{cut}", verbose=True, log_prefix_chars=cut)
    err = capsys.readouterr().err
    assert "write_file" in err and "notes/answer_" in err  # previews were logged
    assert PROMPT_SECRET[:10] not in err


EPHEMERAL = 'You are "careful".\nSecret house rule marker-5f1c: never say the word banana.'
PREFILL = [
    {"role": "user", "content": "PREFILL question marker-6a2b: what is 1+1?"},
    {"role": "assistant", "content": "ok"},  # too short to be a secret: ordinary words stay
]


def test_an_endpoint_quoting_the_request_leaks_neither_system_prompt_nor_prefill(server, tmp_path, capsys):
    prefill = tmp_path / "prefill.json"
    prefill.write_text(json.dumps(PREFILL), "utf-8")
    dataset = write_jsonl(tmp_path / "d.jsonl", ["bad request [error:400] [quote_request]", "a fine task"])
    out = tmp_path / "data"
    run_dir = out / "run"
    run(
        server,
        dataset,
        out,
        ephemeral_system_prompt=EPHEMERAL,
        prefill_messages_file=str(prefill),
        verbose=True,
    )
    # The endpoint did quote them: the test would see a leak.
    (failed,) = read_jsonl(run_dir / "failed.jsonl")
    assert failed["error_class"] == "http_400" and "[REDACTED]" in failed["error"]
    assert "Invalid request" in failed["error"]
    captured = capsys.readouterr()
    texts = {p.name: p.read_text("utf-8") for p in run_dir.iterdir() if p.is_file()}
    texts["stdout"], texts["stderr"] = captured.out, captured.err
    assert "report.html" in texts and "failed.jsonl" in texts
    for name, text in texts.items():
        for marker in ("marker-5f1c", "marker-6a2b", "never say the word banana"):
            assert marker not in text, (name, marker)
    assert "[REDACTED]" in texts["report.html"]


def test_redactor_covers_escaped_forms_of_multiline_secrets():
    redact = Redactor(None, environ={}, secrets=(EPHEMERAL, "ok", "short"))
    once = json.dumps(EPHEMERAL)
    twice = json.dumps(once)
    for text in (EPHEMERAL, once, twice, json.dumps(EPHEMERAL, ensure_ascii=False)):
        assert "marker-5f1c" not in redact(text)
    assert redact("ok, short") == "ok, short"


def _everything_said_about(exc: BaseException) -> str:
    """An exception's text, repr, traceback and attributes, down its chain of causes."""
    import traceback

    texts = ["".join(traceback.format_exception(exc))]
    while exc is not None:
        texts += [str(exc), repr(exc), repr(vars(exc)), repr(exc.args)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(texts)


def test_errors_of_the_model_client_never_carry_the_key():
    """Every way a model call fails over HTTP: the key is in no error's text, repr, attributes or traceback."""
    import socket

    from batchrun.fakes.fake_model import FakeModelServer
    from batchrun.prompt.llm import LLMClient, LLMConfig, LLMError

    key = "sk-live-0123456789abcdef"
    refused = socket.create_server(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{refused.getsockname()[1]}/v1"
    refused.close()
    with FakeModelServer(api_key="another-key-entirely") as wrong_key, FakeModelServer() as srv:
        cases = [
            (wrong_key.base_url, key, "hi", "http_401"),
            (srv.base_url, key, "slow [slow:2] [calls:0]", "timeout"),
            (srv.base_url, key, "dropped [hangup]", "connection"),
            (srv.base_url, key, "broken [error:503]", "http_503"),
            (dead_url, key, "hi", "connection"),
            (srv.base_url, key + "\n", "a key with a line break", "bad_request"),
        ]
        for url, api_key, prompt, error_class in cases:
            client = LLMClient(
                LLMConfig(model="m", base_url=url, api_key=api_key, max_retries=1, request_timeout_s=0.5)
            )
            assert key not in repr(client._http)
            with pytest.raises(LLMError) as info:
                client.chat([{"role": "user", "content": prompt}], [])
            assert info.value.error_class == error_class
            said = _everything_said_about(info.value)
            assert key not in said and key[:12] not in said, (error_class, said)


def test_finds_secret_answers_as_the_patterns_do_on_every_kind_of_text():
    """The ASCII fast path (substring tests) gives the patterns' answer: letter case folded for the
    text forms, not for base64; non-ASCII text (a Kelvin sign that re folds with k) on the patterns."""
    import base64
    import random

    key = "sk-Live-9f3KQz7p"
    redact = Redactor(key, environ={"TOOL_TOKEN": "tok_a1b2c3d4e5"})
    b64 = base64.b64encode(f"Bearer {key}".encode()).decode()
    texts = [
        "",
        "nothing here",
        f"the key {key} in plain text",
        f"upper {key.upper()} and lower {key.lower()}",
        json.dumps({"v": json.dumps(key)}),
        "url " + key.replace("-", "%2D"),
        f"base64 {b64}",
        f"base64 in the wrong case {b64.swapcase()}",
        "almost " + key[:-1],
        "TOK_A1B2C3D4E5 shouted",
        key.replace("k", "\u212a"),  # KELVIN SIGN: re.IGNORECASE folds it with k
        key.replace("s", "\u017f"),  # LATIN SMALL LETTER LONG S, folded with s
        f"non-ASCII around {key} \u00e9",
        f"a lone surrogate \ud800 and {key}",
    ]
    rng = random.Random(7)
    for _ in range(300):  # the key with random letter cases inside random ASCII
        mixed = "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in key)
        cut = rng.randrange(len(mixed) + 1)
        noise = "".join(rng.choice('abcXYZ019-_ "\\') for _ in range(rng.randrange(8)))
        texts.append(noise + (mixed if rng.random() < 0.7 else mixed[:cut]) + noise)
    assert redact._ascii_forms is not None
    for text in texts:
        by_patterns = any(p.search(text) for p in redact._secrets)
        assert redact.finds_secret(text) is by_patterns, text
    assert redact.finds_secret(f"x {key.upper()} y") and not redact.finds_secret(b64.swapcase())
    assert redact.finds_secret(key.replace("k", "\u212a"))  # on the patterns: folded as before
    # A non-ASCII secret: every text goes through the patterns.
    other = Redactor(None, environ={}, secrets=("gehe1m-w\u00f6rt-42",))
    assert other._ascii_forms is None
    assert other.finds_secret("GEHE1M-W\u00d6RT-42") and not other.finds_secret("gehe1m-wort-42")


def test_wrapped_base64_is_found_and_redacted_across_its_line_breaks():
    """`base64` wraps at 76 characters by default (MIME too, with CRLF; PEM at 64): a secret's encoded
    form may straddle a break, in the text as written or JSON-escaped once or twice (a tool's output
    inside a record). Found at every offset; redacted from its first character to its last."""
    import base64

    secret = "Zq8xK2mP9vL4wR7tYb3N"
    redact = Redactor(None, environ={"MY_SERVICE_TOKEN": secret})
    for lead in range(0, 80):
        data = ("y" * lead + secret + "\n").encode()
        for width, eol in ((76, "\n"), (76, "\r\n"), (64, "\n")):
            flat = base64.b64encode(data).decode()
            wrapped = eol.join(flat[i : i + width] for i in range(0, len(flat), width)) + eol
            for text in (wrapped, json.dumps(wrapped), json.dumps(json.dumps(wrapped))):
                assert redact.finds_secret(text), (lead, width, text)
            cleaned = redact.sample(wrapped)
            assert "[REDACTED]" in cleaned
            rest = "".join(cleaned.replace("[REDACTED]", "\n").split())
            assert not redact.finds_secret(rest), (lead, cleaned)
    # Ordinary text with line breaks is no secret, and is left as it is.
    ordinary = "hello\nworld\n" * 50 + "Zq8x\nK2mP\n"
    assert not redact.finds_secret(json.dumps(ordinary)) and redact.sample(ordinary) == ordinary


# ----------------------------------------------------------------------------- audit: credentials in URLs and headers

URL_KEY = "qk-Query0Key-1122334455"  # ?api_key= of --base_url
JUDGE_PASSWORD = "pw-Judge0Pass-99001122"  # the password of --judge_base_url (sent as Basic auth)
BASE_PASSWORD = "pw-Base0Pass-55667788"  # the password of --base_url


def _run_texts(run_dir, captured) -> dict[str, str]:
    texts = {p.name: p.read_text("utf-8") for p in run_dir.iterdir() if p.is_file()}
    texts["stdout"], texts["stderr"] = captured.out, captured.err
    return texts


def _leaks(texts: dict[str, str], *secrets: str) -> list[tuple[str, str]]:
    """Where a secret shows, as written, URL-quoted or inside a Basic auth header."""
    import base64
    import re
    import urllib.parse

    found = []
    for name, text in texts.items():
        basic = [
            base64.b64decode(m + "==").decode("utf-8", "replace")
            for m in re.findall(r"Basic ([\w+/]+)", text)
        ]
        for secret in secrets:
            if any(secret in t for t in (text, urllib.parse.unquote(text), *basic)):
                found.append((name, secret))
    return found


def test_a_key_in_the_query_of_base_url_is_a_secret(server, tmp_path, capsys):
    """--base_url=https://host/v1?api_key=KEY (Azure-style and key-in-URL gateways): the key was shown on
    the start line and in the resume command, written to failed.jsonl and report.html when the endpoint
    quoted the URL, and a reply quoting it was kept as a good sample in trajectories.jsonl."""
    dataset = write_jsonl(
        tmp_path / "d.jsonl",
        ["quote it [calls:0] [quote_auth]", "refused [error:401] [quote_auth]", "fine [calls:0]"],
    )
    out = tmp_path / "data"
    run(server, dataset, out, base_url=f"{server.base_url}?api_key={URL_KEY}", api_key="", verbose=True)
    run_dir = out / "run"
    # The endpoint did get (and quote) it: the run used the URL as given.
    assert server.stats()["requests"] >= 3
    (discard,) = read_jsonl(run_dir / "discarded.jsonl")
    assert discard["reason"] == "secret_in_output" and "[REDACTED]" in json.dumps(discard)
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert [r["conversations"][1]["value"] for r in kept] == ["fine [calls:0]"]
    (failed,) = read_jsonl(run_dir / "failed.jsonl")
    assert "api_key=[REDACTED]" in failed["error"]
    texts = _run_texts(run_dir, capsys.readouterr())
    assert "api_key=[REDACTED]" in texts["stdout"]  # the start line
    assert _leaks(texts, URL_KEY) == []


def test_the_judge_urls_password_and_query_key_never_reach_a_kept_sample(
    server, tmp_path, monkeypatch, capsys
):
    """--judge_base_url=http://user:PASSWORD@host/v1?key=KEY and no judge key: the judge is called with Basic
    auth. A judge that quotes its request's credentials put both into the kept record's score (the
    trajectory was kept, in trajectories.jsonl) and into report.html."""
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    judge_url = server.base_url.replace("http://", f"http://judge:{JUDGE_PASSWORD}@") + f"?key={URL_KEY}"
    rows = [
        {"prompt": "Grade me [calls:0] [quote_auth]", "rubric": "r"},
        {"prompt": "plain [calls:0]", "rubric": "r"},
    ]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    out = tmp_path / "data"
    run(server, dataset, out, api_key="", scorer="judge", judge_model="judge-model", judge_base_url=judge_url)
    run_dir = out / "run"
    assert any(r["model"] == "judge-model" for r in server.stats()["last_requests"])
    (discard,) = read_jsonl(run_dir / "discarded.jsonl")
    assert discard["reason"] == "secret_in_output"
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert [r["conversations"][1]["value"] for r in kept] == ["plain [calls:0]"]
    assert _leaks(_run_texts(run_dir, capsys.readouterr()), JUDGE_PASSWORD, URL_KEY) == []


def test_an_endpoint_quoting_basic_auth_at_the_start_check_never_shows_the_password(tmp_path, capsys):
    """--base_url=http://user:PASSWORD@host/v1 (no key: Basic auth) to an endpoint that refuses the start
    check quoting the header it got: the console printed the password's base64 (console_safe knew the
    key and the environment only, not the URL's credentials)."""
    from batchrun.fakes.fake_model import FakeModelServer

    dataset = write_jsonl(tmp_path / "d.jsonl", ["hi"])
    with FakeModelServer(api_key="another-key", quote_auth=True) as refusing:
        url = refusing.base_url.replace("http://", f"http://user:{BASE_PASSWORD}@")
        with pytest.raises(SystemExit) as info:
            run(refusing, dataset, tmp_path / "data", base_url=url, api_key="")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "refused the start check" in err and "auth=Basic " in err  # the endpoint did quote the header
    assert _leaks({"stderr": err}, BASE_PASSWORD) == []


def test_credentials_inside_headers_and_environment_urls_are_secrets():
    """An MCP header 'Authorization: Bearer TOKEN' was a secret only as the whole value: a server that
    quotes the token alone ('invalid token TOKEN') was not redacted, nor a sample holding it discarded.
    A URL in the environment (a proxy's, a tool's endpoint) carries its own credentials."""
    import base64

    token = "tok-Mcp0Token-44556677"
    basic = base64.b64encode(b"svc:pw-Header0Pass-123").decode()
    redact = Redactor(None, environ={}, secrets=(f"Bearer {token}", f"Basic {basic}"))
    for text in (f"invalid token {token}", "password pw-Header0Pass-123 refused"):
        assert redact.finds_secret(text) and "Header0Pass" not in redact(text) and token not in redact(text)
    env = {
        "HTTPS_PROXY": "http://me:pw-Proxy0Pass-42@proxy:3128",
        "VISION_BASE_URL": "https://vision.example/v1?model=gpt-4o-mini&access_token=at-Vision0Token-77",
        "NOTE_URL": "https://docs.example/page?lang=en&page=12345678",  # no credential in it
    }
    redact = Redactor(None, environ=env)
    assert redact("proxy said pw-Proxy0Pass-42, vision said at-Vision0Token-77") == (
        "proxy said [REDACTED], vision said [REDACTED]"
    )
    assert not redact.finds_secret("gpt-4o-mini on page 12345678 in en")


def test_safe_url_hides_the_credentials_of_a_query_but_requests_keep_them():
    from batchrun.prompt.llm import endpoint_url, safe_url

    url = f"https://u:pw@host/v1?api-version=2024-06-01&api_key={URL_KEY}&sig=abc#frag"
    assert safe_url(url) == "https://host/v1?api-version=2024-06-01&api_key=[REDACTED]&sig=[REDACTED]#frag"
    assert endpoint_url(url, "chat/completions") == (
        f"https://host/v1/chat/completions?api-version=2024-06-01&api_key={URL_KEY}&sig=abc#frag"
    )


def test_query_parameters_that_only_contain_a_credential_word_are_no_secrets():
    """?keyword=, ?passage=, ?author=, ?signal= hold search words, not credentials: a sample quoting them
    must not be discarded as secret_in_output."""
    from batchrun.secrets import url_secrets

    assert (
        url_secrets("https://h/?keyword=abcdefgh123&passage=zzzzzzzz99&author=x12345678&signal=1234567x")
        == []
    )
    assert url_secrets("https://h/?apiKey=abcd1234efgh&X-Amz-Signature=abc123def456") == [
        "abcd1234efgh",
        "abc123def456",
    ]


def test_a_tool_result_holding_a_secret_is_never_sent_on_to_the_model(server, tmp_path, monkeypatch):
    """A tool result with a secret of the run in it (here a command reading the runner's environment, as
    --local_isolation=none allows; elsewhere a tool's key quoted in its error, an MCP server's token) went
    to the model's endpoint in the next request, and the sample was discarded only when it was recorded.
    The prompt now ends at that result: no request carries it, and the sample is the same discard."""
    token = "svc-Token-2f9a7c31e5b8"
    monkeypatch.setenv("BRTEST_SERVICE_TOKEN", token)
    cmd = r"grep -a -h -o -m1 'BRTEST_SERVICE_TOKEN=.\{22\}' /proc/*/environ 2>/dev/null | head -1"
    dataset = tmp_path / "d.jsonl"
    rows = [{"prompt": f"leak [run:{cmd}] [run:echo after]"}, {"prompt": "fine [calls:0]"}]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "data"
    run(server, dataset, out, local_isolation="none", distribution="terminal_only")
    run_dir = out / "run"
    (discard,) = read_jsonl(run_dir / "discarded.jsonl")
    assert discard["reason"] == "secret_in_output"
    assert discard["record"]["metadata"]["stop_reason"] == "secret_in_output"
    assert "[REDACTED]" in json.dumps(discard) and token not in json.dumps(discard)
    assert discard["record"]["api_calls"] == 1  # the result was not sent back: no second call
    requests = server.stats()["last_requests"]
    assert requests and all(token not in json.dumps(r) for r in requests)
    assert [r["conversations"][1]["value"] for r in read_jsonl(run_dir / "trajectories.jsonl")] == [
        "fine [calls:0]"
    ]
