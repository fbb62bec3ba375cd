"""A recording proxy between the runner and a real server, and what its recording says each reply was.

The proxy forwards every request as it came and every answer as it went (a streamed answer in one piece:
its bytes are the same), keeping both, so a test can hold a kept sample against what the server
really said and what the runner really sent it. It reads the replies with no code of the runner's.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Exchange:
    method: str
    check: str | None  # the runner's start check or probe (its X-Batch-Runner-Check header)
    request: dict | None
    status: int
    content_type: str
    response: bytes


@dataclass
class Reply:
    """One assistant message as the server sent it."""

    content: str
    reasoning: str | None
    calls: list[tuple[str | None, str, str]] = field(default_factory=list)  # (id, name, arguments)


class RecordingProxy:
    def __init__(self, upstream_base_url: str):
        parts = urllib.parse.urlsplit(upstream_base_url)
        self.exchanges: list[Exchange] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

            def _forward(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                up = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                up.request(method, self.path, body=raw or None, headers=headers)
                resp = up.getresponse()
                data = resp.read()
                up.close()
                with lock:
                    outer.exchanges.append(
                        Exchange(
                            method,
                            self.headers.get("X-Batch-Runner-Check"),
                            json.loads(raw) if raw else None,
                            resp.status,
                            resp.getheader("content-type", ""),
                            data,
                        )
                    )
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._httpd.server_address[1]}{parts.path}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def prompt_calls(self) -> list[Exchange]:
        """The chat calls prompts made that the server answered (not start checks, probes or model lists)."""
        return [
            e for e in self.exchanges if e.method == "POST" and not e.check and e.request and e.status == 200
        ]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> RecordingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reply_of(exchange: Exchange) -> Reply:
    """The assistant message of an answer, plain or streamed (its deltas joined, calls by their index)."""
    if "text/event-stream" not in exchange.content_type:
        message = json.loads(exchange.response)["choices"][0]["message"]
        calls = [
            (c.get("id"), c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
        return Reply(message.get("content") or "", message.get("reasoning_content") or None, calls)
    content, reasoning, by_index = [], [], {}
    for line in exchange.response.decode("utf-8").split("\n"):
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        for choice in json.loads(line[5:]).get("choices") or []:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or "")
            for piece in delta.get("tool_calls") or []:
                call = by_index.setdefault(piece.get("index", 0), [None, "", ""])
                call[0] = piece.get("id") or call[0]
                call[1] += (piece.get("function") or {}).get("name") or ""
                call[2] += (piece.get("function") or {}).get("arguments") or ""
    calls = [tuple(by_index[i]) for i in sorted(by_index)]
    return Reply("".join(content), "".join(reasoning) or None, calls)
