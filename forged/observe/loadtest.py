"""``forged bench``: the appliance's load tester, for any OpenAI-compatible server.

It measures what callers feel: time to first token, inter-token latency and end-to-end
latency at p50/p95/p99, plus requests/s, output tokens/s and errors by status.

* closed loop: ``--concurrency 1,8,32`` keeps that many requests in flight (a sweep);
* open loop: ``--rate R`` sends Poisson arrivals at R requests/s, whatever the answers;
* prompt mixes: ``short``, ``mixed`` (25% ~700-token code prompts), ``shared-prefix``
  (one ~1,500-token repo context) and ``chat``;
* ``--compare URL`` runs the same load against a second server in the same run,
  alternating (request by request at one caller), and prints forged ÷ other ratios.

Every run is bounded by ``--requests`` and ``--duration`` and stops by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from forged.observe.stats import percentile

MIXES = ("short", "mixed", "shared-prefix", "chat")
_WORDS = ("def", "return", "self", "value", "items", "index", "result", "config", "for",
          "in", "if", "else", "None", "True", "len", "range", "dict", "list", "key", "data",
          "request", "response", "stream", "token", "cache", "worker", "queue", "limit")


def _code(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 7)))
        out.append(f"    {words}  # line {i}")
    return "\n".join(out)


@dataclass(frozen=True)
class Prompt:
    kind: str  # short or long
    body: dict[str, Any]


def repo_context(seed: int, lines: int = 110) -> str:
    """A repository context of code-like lines (110 lines: about 1,300 SmolLM2 tokens);
    each seed gives another one."""
    return "# repository context\n" + _code(random.Random(seed), lines) + "\n"


def make_prompts(mix: str, n: int, max_tokens: int, seed: int = 0) -> list[Prompt]:
    """``n`` request bodies of a mix; the same seed gives the same sequence."""
    rng = random.Random(seed)
    context = repo_context(1234)
    out = []
    for i in range(n):
        question = f"# Question {i}: explain what {rng.choice(_WORDS)} does here.\n"
        if mix == "short" or (mix == "mixed" and rng.random() >= 0.25):
            kind, text = "short", f"def task_{i}():\n" + _code(rng, 2) + "\n" + question
        elif mix == "mixed":
            kind, text = "long", f"# file {i}\n" + _code(rng, 52) + "\n" + question
        elif mix == "shared-prefix":
            kind, text = "long", context + question
        else:
            kind, text = "short", question
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if mix == "chat":
            body["messages"] = [{"role": "system", "content": "You are a coding assistant."},
                                {"role": "user", "content": text}]
        else:
            body["prompt"] = text
        out.append(Prompt(kind, body))
    return out


@dataclass
class Sample:
    kind: str
    status: int
    retry_after: bool = False
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    out_tokens: int = 0
    prompt_tokens: int = 0
    # Prompt tokens the server says it served from its cache (forged and OpenAI:
    # usage.prompt_tokens_details.cached_tokens; llama-server: timings.cache_n).
    cached_tokens: int | None = None
    text: str = ""  # the first choice's text, for a conversation's next turn

    def arrived(self, t0: float, last: float) -> float:
        """Text arrived now: the first is the TTFT (since ``t0``), each next an
        inter-token gap (since ``last``). Returns now, the next ``last``."""
        now = time.monotonic()
        if self.ttft is None:
            self.ttft = now - t0
        else:
            self.itl.append(now - last)
        return now


async def one_request(client: httpx.AsyncClient, base: str, model: str | None,
                      prompt: Prompt) -> Sample:
    body = dict(prompt.body)
    if model:
        body["model"] = model
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    s = Sample(prompt.kind, 0)
    t0 = last = time.monotonic()
    try:
        async with client.stream("POST", base + path, json=body) as r:
            s.status = r.status_code
            if r.status_code != 200:
                s.retry_after = "retry-after" in r.headers
                await r.aread()
                s.e2e = time.monotonic() - t0
                return s
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                _note_usage(s, data)
                if "error" in data:
                    s.status = 599  # the stream started, then ended with an error event
                    continue
                if not _has_text(data):
                    continue
                s.text += _first_text(data)
                last = s.arrived(t0, last)
                chunks += 1
            s.out_tokens = s.out_tokens or chunks
    except httpx.HTTPError:
        s.status = 598  # transport error: refused, reset, timed out
    s.e2e = time.monotonic() - t0
    return s


def _has_text(chunk: dict[str, Any]) -> bool:
    return any(_choice_text(c) for c in chunk.get("choices") or [])


def _first_text(chunk: dict[str, Any]) -> str:
    return "".join(_choice_text(c) for c in chunk.get("choices") or []
                   if c.get("index", 0) == 0)


def _choice_text(choice: dict[str, Any]) -> str:
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def _note_usage(s: Sample, chunk: dict[str, Any]) -> None:
    if usage := chunk.get("usage"):
        s.out_tokens = int(usage.get("completion_tokens", 0))
        s.prompt_tokens = int(usage.get("prompt_tokens", 0))
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            s.cached_tokens = int(cached)
    if (timings := chunk.get("timings")) and "cache_n" in timings:
        s.cached_tokens = int(timings["cache_n"])


def summarise(samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    short_ttft = [s.ttft for s in ok if s.ttft is not None and s.kind == "short"]
    itl = [g for s in ok for g in s.itl]
    e2e = [s.e2e for s in ok]
    errors: dict[str, int] = {}
    for s in samples:
        if s.status != 200:
            errors[str(s.status)] = errors.get(str(s.status), 0) + 1
    out: dict[str, Any] = {"requests": len(samples), "ok": len(ok), "errors": errors,
                           "wall_s": wall, "req_per_s": len(ok) / wall if wall else 0.0,
                           "out_tok_per_s": sum(s.out_tokens for s in ok) / wall if wall else 0}
    for name, vals in (("ttft", ttft), ("short_ttft", short_ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 95, 99):
            out[f"{name}_p{q}"] = percentile(vals, q)
    # The worst gaps too (issue 34): a stream's longest freeze is what a user sees.
    out["itl_p99_9"] = percentile(itl, 99.9)
    out["itl_max"] = max(itl) if itl else None
    out["decode_tok_per_s"] = (1 / out["itl_p50"]) if out["itl_p50"] else None
    out["prompt_tokens"] = sum(s.prompt_tokens for s in ok)
    reported = [s.cached_tokens for s in ok if s.cached_tokens is not None]
    out["cached_tokens"] = sum(reported) if reported else None
    rejected = [s for s in samples if s.status in (429, 503)]
    out["reject_p99"] = percentile([s.e2e for s in rejected], 99)
    out["rejections_with_retry_after"] = sum(s.retry_after for s in rejected)
    return out


class _Progress:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.tty = sys.stderr.isatty()

    def tick(self) -> None:
        self.done += 1
        if self.tty:
            width = 30
            filled = int(width * self.done / max(1, self.total))
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


async def run_load(base: str, prompts: list[Prompt], *, concurrency: int | None,
                   rate: float | None, duration: float, model: str | None,
                   label: str = "", seed: int = 7,
                   headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One bounded run: closed loop at ``concurrency`` or open loop at ``rate``;
    ``headers`` go with every request (an API key)."""
    samples: list[Sample] = []
    progress = _Progress(label or base, len(prompts))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    timeout = httpx.Timeout(duration + 60, connect=30)
    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        with trio.move_on_after(duration):
            if rate:
                await _open_loop(client, base, model, prompts, rate, samples, progress, seed)
            else:
                await _closed_loop(client, base, model, prompts, concurrency or 1, samples,
                                   progress)
    progress.close()
    return summarise(samples, time.monotonic() - t0)


async def run_alternating(bases: tuple[str, ...], prompts: list[Prompt], *, duration: float,
                          models: tuple[str | None, ...] | None = None,
                          headers: dict[str, str] | None = None,
                          ) -> tuple[dict[str, Any], ...]:
    """One caller, several servers, taking turns request by request (each prompt goes
    to every server, the first of them rotating from prompt to prompt): at one caller
    a drift in the machine's speed then reaches all alike, where back-to-back runs
    would each see a different part of it. Each server's rates are over the time it
    spent answering."""
    k = len(bases)
    names = models if models is not None else (None,) * k
    samples: list[list[Sample]] = [[] for _ in bases]
    busy = [0.0] * k
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration + 60, connect=30),
                                 headers=headers) as client:
        with trio.move_on_after(duration):
            for i, p in enumerate(prompts):
                for j in range(k):
                    at = (i + j) % k
                    s = await one_request(client, bases[at], names[at], p)
                    samples[at].append(s)
                    busy[at] += s.e2e
    return tuple(summarise(samples[j], busy[j]) for j in range(k))


async def _closed_loop(client: httpx.AsyncClient, base: str, model: str | None,
                       prompts: list[Prompt], concurrency: int, samples: list[Sample],
                       progress: _Progress) -> None:
    queue = iter(prompts)

    async def caller() -> None:
        for p in queue:
            samples.append(await one_request(client, base, model, p))
            progress.tick()

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)


async def _open_loop(client: httpx.AsyncClient, base: str, model: str | None,
                     prompts: list[Prompt], rate: float, samples: list[Sample],
                     progress: _Progress, seed: int) -> None:
    rng = random.Random(seed)  # the same arrivals for every server given the same seed

    async def fire(p: Prompt) -> None:
        samples.append(await one_request(client, base, model, p))
        progress.tick()

    async with trio.open_nursery() as nursery:
        for p in prompts:
            nursery.start_soon(fire, p)
            await trio.sleep(rng.expovariate(rate))


async def model_id(base: str, headers: dict[str, str] | None = None) -> str | None:
    try:
        async with httpx.AsyncClient(timeout=10, headers=headers) as c:
            data = (await c.get(base + "/v1/models")).json()["data"]
            return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


RATIO_KEYS = ("req_per_s", "out_tok_per_s", "ttft_p50", "ttft_p95", "ttft_p99",
              "short_ttft_p50", "short_ttft_p95", "short_ttft_p99", "itl_p50", "itl_p99",
              "itl_p99_9", "itl_max", "e2e_p50", "decode_tok_per_s")


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    return {k: (a[k] / b[k]) if a.get(k) and b.get(k) else None for k in RATIO_KEYS}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    urls = [args.url.rstrip("/")] + ([args.compare.rstrip("/")] if args.compare else [])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    models = [await model_id(u, headers) for u in urls]
    levels = [None] if args.rate else [int(c) for c in str(args.concurrency).split(",")]
    runs: list[dict[str, Any]] = []
    for level in levels:
        n = args.requests or max(16, 4 * (level or 1))
        prompts = make_prompts(args.mix, n, args.max_tokens, args.seed)
        pair = []
        if level == 1 and len(urls) == 2:  # one caller: take turns request by request
            summaries = await run_alternating((urls[0], urls[1]), prompts,
                                              duration=args.duration,
                                              models=(models[0], models[1]),
                                              headers=headers)
            for url, summary in zip(urls, summaries, strict=True):
                runs.append({"url": url, "mix": args.mix, "concurrency": level,
                             "rate": args.rate, "summary": summary})
            runs[-2]["ratio_vs_compare"] = ratios(*summaries)
            continue
        for url, model in zip(urls, models, strict=True):  # alternating, same prompts
            label = f"{url} c={level}" if level else f"{url} rate={args.rate}"
            summary = await run_load(url, prompts, concurrency=level, rate=args.rate,
                                     duration=args.duration, model=model, label=label,
                                     headers=headers)
            run = {"url": url, "mix": args.mix, "concurrency": level, "rate": args.rate,
                   "summary": summary}
            runs.append(run)
            pair.append(summary)
        if len(pair) == 2:
            runs[-2]["ratio_vs_compare"] = ratios(pair[0], pair[1])
    return {"runs": runs, "args": {k: v for k, v in vars(args).items() if k != "func"}}


def _fmt(v: float | None, unit: str = "s") -> str:
    if v is None:
        return "-"
    return f"{v:.3f}{unit}" if unit == "s" else f"{v:.1f}"


def report(result: dict[str, Any]) -> str:
    lines = []
    for run in result["runs"]:
        s = run["summary"]
        where = f"c={run['concurrency']}" if run["concurrency"] else f"rate={run['rate']}/s"
        lines.append(f"{run['url']}  {run['mix']}  {where}: {s['ok']}/{s['requests']} ok, "
                     f"{s['req_per_s']:.2f} req/s, {s['out_tok_per_s']:.1f} out tok/s, "
                     f"errors {s['errors'] or 'none'}")
        for name in ("ttft", "itl", "e2e"):
            lines.append(f"    {name:5s} p50 {_fmt(s[name + '_p50'])}  p95 "
                         f"{_fmt(s[name + '_p95'])}  p99 {_fmt(s[name + '_p99'])}")
        if "ratio_vs_compare" in run:
            r = run["ratio_vs_compare"]
            lines.append("    ratio (this ÷ compare): " + ", ".join(
                f"{k} {v:.2f}" for k, v in r.items() if v is not None))
    return "\n".join(lines)


def _series(result: dict[str, Any]) -> list[tuple[str, list[tuple[float, float]], bool]]:
    """Per server: p99 TTFT and p99 inter-token latency against concurrency."""
    out = []
    for url in dict.fromkeys(r["url"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["url"] == url and r["concurrency"]]
        for key, dashed in (("ttft_p99", False), ("itl_p99", True)):
            out.append((f"{key} {url}", [(float(r["concurrency"]), r["summary"][key])
                                         for r in runs if r["summary"][key] is not None],
                        dashed))
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """An SVG (no dependency: the package can plot too), or a PNG with matplotlib."""
    if path.suffix.lower() == ".svg":
        from forged.observe.svgplot import svg

        path.write_text(svg(_series(result), "latency versus concurrency",
                            "concurrent requests", "seconds"))
        return
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"forged bench: --plot {path}: a PNG needs matplotlib, which this "
                         "installation lacks; name an .svg file instead") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points, dashed in _series(result):
        ax.plot([p[0] for p in points], [p[1] for p in points], "--s" if dashed else "-o",
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("seconds")
    ax.set_title("latency versus concurrency")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    p.add_argument("--api-key", default=os.environ.get("FORGED_API_KEY"),
                   help="the API key to send (default: $FORGED_API_KEY); a production "
                        "appliance needs one")
    p.add_argument("--compare", help="a second server to run the same load against")
    p.add_argument("--mix", choices=MIXES, default="mixed",
                   help="the prompts: short, mixed (25%% ~700-token code prompts), "
                        "shared-prefix (one ~1,500-token context) or chat")
    p.add_argument("--concurrency", default="8", help="closed loop: N or a sweep like 1,8,32")
    p.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per run (default: max(16, 4 x concurrency))")
    p.add_argument("--duration", type=float, default=120.0, help="seconds per run at most")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--seed", type=int, default=0, help="the prompts' and arrivals' seed")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    p.add_argument("--plot", type=Path, help="write latency against concurrency: FILE.svg "
                   "(always), or FILE.png (with matplotlib)")


def main(args: argparse.Namespace) -> int:
    result = trio.run(bench, args)
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    if args.plot:
        plot(result, args.plot)
    return 0
