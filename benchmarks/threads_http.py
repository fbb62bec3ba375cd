#!/usr/bin/env python3
"""CPU per model call when many threads make them at once: the runner's model client
(``LLMClient.chat``, keep-alive HTTP) from N threads of one process against the fake endpoint in its
own process, with the endpoint's latency, so that the calls are really in flight together.

    python benchmarks/threads_http.py                          # 8 and 250 threads, 0.5 s a call
    python benchmarks/threads_http.py --threads 8,64,250 --latency 2

It separates what a thread-per-prompt worker pays for its threads on its model calls (GIL hand-offs,
wake-ups, a connection per thread) from what its prompts' sandboxes cost: ``worker_cpu.py
--in_flight 8|250`` measures the whole prompt, this only its calls. "sys" is the kernel's share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from throughput import Endpoint  # noqa: E402
from worker_cpu import own_cpu_s  # noqa: E402

from batchrun.prompt.llm import LLMClient, LLMConfig  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant with a terminal. " * 40},
    {"role": "user", "content": "Task 1: inspect the working directory and write a note. [answer:done]"},
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="8,250", help="comma-separated thread counts")
    p.add_argument("--latency", type=float, default=0.5, help="the endpoint's seconds a call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=1000, help="calls a round (at least 4 per thread)")
    args = p.parse_args()
    endpoint = Endpoint(args.latency)
    llm = LLMClient(LLMConfig(model="fake", base_url=endpoint.base_url, api_key="sk-benchmark"))
    try:
        for n in (int(x) for x in args.threads.split(",")):
            pool = ThreadPoolExecutor(n)
            list(pool.map(lambda _: llm.chat(MESSAGES, []), range(n)))  # one connection per thread
            calls = max(args.calls, 4 * n)
            figures = []
            for _ in range(args.rounds):
                user0, sys0 = own_cpu_s()
                list(pool.map(lambda _: llm.chat(MESSAGES, []), range(calls)))
                user1, sys1 = own_cpu_s()
                spent = (user1 - user0) + (sys1 - sys0)
                figures.append((spent / calls * 1000, (sys1 - sys0) / calls * 1000))
            pool.shutdown()
            print(
                f"{n} threads, {calls} calls a round at {args.latency} s: ms of CPU a call "
                + " ".join(f"{a:.3f} (sys {b:.3f})" for a, b in figures)
                + f"; median {statistics.median(a for a, _ in figures):.3f}"
            )
    finally:
        endpoint.proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
