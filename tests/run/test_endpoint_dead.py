"""The dead-endpoint stop (batchrun/run/endpoint_watch.py): an endpoint that dies during the run pauses
it, is probed, and stops it cleanly (exit 4, the resume command printed) instead of every remaining
prompt failing after its retries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from helpers import OK_REPLY, ROOT, ScriptedEndpoint, exit_code, read_jsonl, write_jsonl

from batchrun.run.endpoint_watch import DEAD_AFTER, EXIT_ENDPOINT_DEAD, EndpointWatch


def dies_after_the_start_check(call: dict, calls: list[dict]):
    """Answers the start check once, then 503 to everything (probes included)."""
    if call["check"] and sum(1 for c in calls if c["check"]) == 1:
        return 200, OK_REPLY
    return 503, {"error": {"message": "upstream connect error"}}


def test_a_dead_endpoint_stops_the_run_with_its_own_exit_code(tmp_path, capsys):
    endpoint = ScriptedEndpoint(dies_after_the_start_check)
    prompts = [f"task {i}" for i in range(40)]
    dataset = write_jsonl(tmp_path / "d.jsonl", prompts)
    try:
        code = exit_code(
            None, dataset, tmp_path / "data", model="m", base_url=endpoint.base_url, api_key="sk-dead-test",
            num_workers=2, prompts_per_worker=4, max_retries=1, endpoint_grace=3, batch_size=10,
        )  # fmt: skip
    finally:
        endpoint.close()
    err = capsys.readouterr().err
    assert code == EXIT_ENDPOINT_DEAD
    assert "the run is paused and the endpoint probed" in err
    assert (
        "did not come back within 3 s" in err and "resume=True" in err
    )  # started from Python: its call, resumed
    assert endpoint.checks() >= 2  # the start check, then at least one probe
    # Without the stop: 40 prompts x 2 tries = 80 doomed requests. With it: about the failures that
    # tripped it, plus what was in flight.
    assert endpoint.prompt_calls() < 40
    run_dir = tmp_path / "data" / "run"
    failed = read_jsonl(run_dir / "failed.jsonl") if (run_dir / "failed.jsonl").exists() else []
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["remaining_for_resume"] == 40  # nothing lost: every prompt is left for --resume
    assert len(failed) < 40
    # status.json said "finished" as after a whole run: its exit code tells the stop apart
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("finished", EXIT_ENDPOINT_DEAD)


def test_an_endpoint_that_comes_back_ends_the_pause():
    pauses = []
    watch = EndpointWatch(cfg=None, grace_s=60, pause=pauses.append, probe=lambda cfg, usage: True)
    lines = [watch.report("http_503") for _ in range(DEAD_AFTER)]
    assert lines[-1] and "paused" in lines[-1] and pauses
    watch._back.wait(5)
    assert watch.tick() == "the endpoint answers again; the run continues"
    assert not watch.dead and watch.failures == 0


def test_the_probes_answers_are_counted_in_the_runs_spend(tmp_path):
    """A probe that gets an answer was billed like any call: the run's spend (and so its budget) counts
    it with the start check, apart from the samples' own (before, it was in no count)."""
    reply = {**OK_REPLY, "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}

    def down_until_probed(call: dict, calls: list[dict]):
        if sum(1 for c in calls if c["check"]) >= 2 or call["check"]:
            return 200, reply  # the start check, a probe, and every call after the first probe
        return 503, {"error": {"message": "upstream connect error"}}

    endpoint = ScriptedEndpoint(down_until_probed)
    dataset = write_jsonl(tmp_path / "d.jsonl", [f"task {i}" for i in range(12)])
    try:
        code = exit_code(
            None, dataset, tmp_path / "data", model="m", base_url=endpoint.base_url, api_key="sk-probe-test",
            num_workers=1, prompts_per_worker=12, max_retries=0, endpoint_grace=30, budget_tokens=10**6,
        )  # fmt: skip
        checks = endpoint.checks()
    finally:
        endpoint.close()
    stats = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    budget = stats["this_run"]["budget"]
    assert code == 0 and checks >= 2  # the start check and at least one probe, all answered
    assert budget["check_calls"] == checks and budget["check_tokens"] == 10 * checks
    samples = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    kept = sum(
        r["metadata"]["usage"]["prompt_tokens"] + r["metadata"]["usage"]["completion_tokens"] for r in samples
    )
    assert budget["spent_tokens"] >= kept + 10 * checks


def test_ctrl_c_while_a_dead_endpoints_prompts_drain_exits_130(tmp_path):
    """Ctrl-C after the endpoint was declared dead, while the prompts in flight drained (up to 30 s): the
    run exited 5 and status.json said "interrupted" with exit_code 5. Interrupted is 130, as at any other
    moment (README's exit codes), status.json agreeing; the dead endpoint's message is still printed."""

    class Endpoint(BaseHTTPRequestHandler):
        checks = 0

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("X-Batch-Runner-Check"):
                Endpoint.checks += 1
                if Endpoint.checks == 1:  # the start check; probes find it dead
                    return self._send(200, OK_REPLY)
            elif b"stall-me" in body:
                time.sleep(60)  # in flight when the endpoint is declared dead
            self._send(503, {"error": {"message": "upstream connect error"}})

        def _send(self, status, reply):
            data = json.dumps(reply).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dataset = write_jsonl(
        tmp_path / "d.jsonl", ["stall-me 0", "stall-me 1", *(f"task {i}" for i in range(20))]
    )
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=5",
         "--run_name=run", f"--output_dir={tmp_path / 'data'}", "--model=m", "--api_key=sk-x",
         f"--base_url=http://127.0.0.1:{server.server_address[1]}/v1", "--distribution=terminal_only",
         "--num_workers=1", "--prompts_per_worker=4", "--max_retries=0", "--endpoint_grace=2"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        for line in proc.stderr:
            if "did not come back" in line:  # declared dead; the two hanging prompts still in flight
                time.sleep(1)
                proc.send_signal(signal.SIGINT)
                break
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
        server.shutdown()
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "the endpoint stopped answering" in err and "--resume" in err
    status = json.loads((tmp_path / "data" / "run" / "status.json").read_text("utf-8"))
    assert (status["state"], status["exit_code"]) == ("interrupted", 130)
