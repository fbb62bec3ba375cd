"""batchrun/secrets.py: no secret in any file or stream, including what an endpoint quotes back."""

from __future__ import annotations

import json

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
