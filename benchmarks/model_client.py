#!/usr/bin/env python3
"""CPU per model call: the runner's model client (batchrun/prompt/httpclient.py) against the ``openai``
SDK's low-level ``post`` it replaced, over keep-alive HTTP to the fake endpoint in its own process.

    python benchmarks/model_client.py            # 500 calls each
    python benchmarks/model_client.py --calls 2000

The client's figure is a whole ``LLMClient.chat`` (request JSON, HTTP, response JSON, the turn parsed);
the SDK's is only its ``post`` and the JSON body, as the worker used it before.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import Endpoint  # noqa: E402

from batchrun.prompt.llm import LLMClient, LLMConfig  # noqa: E402

MESSAGES = [{"role": "user", "content": "Task 1: inspect the working directory and write a note. [calls:0]"}]
TERMINAL = {
    "type": "function",
    "function": {
        "name": "terminal",
        "description": "run a command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def per_call_ms(call, n: int) -> float:
    for _ in range(20):  # connection up, caches warm
        call()
    t = time.process_time()
    for _ in range(n):
        call()
    return 1000 * (time.process_time() - t) / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=500)
    n = p.parse_args().calls
    endpoint = Endpoint(0.0)
    try:
        for stream in (False, True):
            client = LLMClient(LLMConfig(model="m", base_url=endpoint.base_url, api_key="k", stream=stream))
            ms = per_call_ms(lambda c=client: c.chat(MESSAGES, [TERMINAL]), n)
            print(f"  model client, {'streamed' if stream else 'plain':8}  {ms:6.3f} ms CPU per call")
        import httpx2  # the SDK's HTTP library (httpx before openai 3)
        import openai

        sdk = openai.OpenAI(base_url=endpoint.base_url, api_key="k", max_retries=0, timeout=60)
        body = {"model": "m", "messages": MESSAGES, "tools": [TERMINAL]}
        ms = per_call_ms(lambda: sdk.post("/chat/completions", body=body, cast_to=httpx2.Response).json(), n)
        print(f"  openai SDK post, plain  {ms:6.3f} ms CPU per call")
    finally:
        endpoint.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
