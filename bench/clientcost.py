"""The door's CPU per request, as real clients send their requests (issue 33).

    .venv/bin/python -m bench.clientcost [--requests 600] [--kinds ...]

About 2 minutes. forged on the accelerator's stand-in (bench/tinymodel.py), one
client making one request after another, each kind in turn: the daemon process's CPU
(the door: HTTP, the pool, the frames; its worker apart) per request. ``bench.door``
loads the door with wrk and a lean raw-socket client; this shows what the requests of
the official SDKs cost, headers and all, since a header the hot door does not take
sends a request through hypercorn, h11 and Quart:

- ``sdk-models``: the openai SDK's ``client.models.list()`` (httpx, keep-alive);
- ``sdk-chat``: its ``client.chat.completions.create``, one token, not streamed;
- ``sdk-stream``: the same, streamed;
- ``raw-models``: ``GET /v1/models`` with no header but ``Host`` (wrk's shape), on
  one connection;
- ``close-chat``: a one-token streamed chat on a new connection each
  (``Connection: close``, as ``bench.door``'s stream callers send).

Each kind runs ``--requests`` times after 30 to warm, and ``--rounds`` (2) times in
turn: the machine's slow spells move one run by a fifth. Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import openai
import trio

from bench.door import WORDS, start_forged
from bench.frontdoor import cpu_seconds
from bench.tinymodel import write_tiny_llama

KINDS = ("sdk-models", "sdk-chat", "sdk-stream", "raw-models", "close-chat")


def _question(rng: random.Random) -> str:
    return "Explain: " + " ".join(rng.choice(WORDS) for _ in range(30))


def _sdk(url: str, kind: str) -> Callable[[random.Random], None]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0)
    model = client.models.list().data[0].id

    def one(rng: random.Random) -> None:
        if kind == "sdk-models":
            client.models.list()
            return
        messages = [{"role": "user", "content": _question(rng)}]
        if kind == "sdk-chat":
            client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=1)
            return
        for _ in client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                max_tokens=1, stream=True):
            pass

    return one


def _raw(url: str, kind: str) -> Callable[[random.Random], None]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    if kind == "raw-models":
        plain = b"GET /v1/models HTTP/1.1\r\nHost: bench\r\n\r\n"
        sock = socket.create_connection((host, int(port)))

        def models(rng: random.Random) -> None:
            sock.sendall(plain)
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(65536)
            head, _, body = head.partition(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head)[1])  # type: ignore[index]
            while len(body) < length:
                body += sock.recv(65536)

        return models

    async def close_chat(rng: random.Random) -> None:
        body = json.dumps({"messages": [{"role": "user", "content": _question(rng)}],
                           "max_tokens": 1, "stream": True}).encode()
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                                  b"Content-Type: application/json\r\nConnection: close\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            out = b""
            while data := await stream.receive_some(65536):
                out += data
            assert out.startswith(b"HTTP/1.1 200 "), out[:200]

    return lambda rng: trio.run(close_chat, rng)


def run_kind(url: str, pid: int, kind: str, requests: int) -> float:
    """The daemon's CPU µs per request of ``kind``."""
    one = _sdk(url, kind) if kind.startswith("sdk-") else _raw(url, kind)
    rng = random.Random(1)
    for _ in range(30):
        one(rng)
    cpu0 = cpu_seconds(pid)
    for _ in range(requests):
        one(rng)
    return (cpu_seconds(pid) - cpu0) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        server = start_forged(tmp, write_tiny_llama(tmp / "tiny.gguf"), "forged-tiny")
        try:
            figures: dict[str, list[float]] = {k: [] for k in kinds}
            started = time.monotonic()
            for _ in range(args.rounds):
                for kind in kinds:
                    figures[kind].append(run_kind(server.url, server.pid, kind, args.requests))
        finally:
            server.stop()
    print(f"{args.requests} requests a kind, {args.rounds} rounds, "
          f"{time.monotonic() - started:.0f} s\n")
    print("| kind | daemon CPU µs/request, each round |\n|---|---|")
    for kind, values in figures.items():
        print(f"| {kind} | {', '.join(f'{v:,.0f}' for v in values)} |")


if __name__ == "__main__":
    main()
