"""Load benchmark of ``specgraph serve``: N concurrent streaming chat clients, a fixed request count.

Starts the server in a subprocess (SmolLM2-135M-Instruct by default), waits for ``/health``, then
for each concurrency level sends ``--requests`` streaming chat completions, ``N`` at a time, and
prints throughput, time to first token and inter-token latency (p50/p99), the speculative
acceptance rate and the prefix-cache hit rate (from ``/metrics``), as a table, plus a PNG plot of
latency against concurrency.

    .venv/bin/python benchmarks/bench_serve.py --concurrency 1,2,4,8 --requests 16 --max-tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_description, fmt, format_table, load_average, log, print_report  # noqa: E402
from prompts import CHAT_PROMPTS, CODE_PROMPTS  # noqa: E402

MODEL = "smollm2-135m-instruct"


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"finish_reason": null' in line and '"role"' not in line:
                times.append(time.perf_counter())
    return {"ttft": times[0] - t0 if times else float("nan"),
            "itl": [b - a for a, b in zip(times, times[1:])], "tokens": len(times)}


async def run_level(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    prompts = [p for pair in zip(CODE_PROMPTS, CHAT_PROMPTS) for p in pair]
    queue = [prompts[i % len(prompts)] + f" (request {i})" for i in range(requests)]
    results = []

    async def worker(client):
        while queue:
            results.append(await one_request(client, url, queue.pop(0), max_tokens))

    before = scrape(url)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(concurrency))), timeout=3600)
    elapsed = time.perf_counter() - t0
    after = scrape(url)
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    preempt = after.get("specgraph_preemptions_total", 0) - before.get("specgraph_preemptions_total", 0)
    return {"concurrency": concurrency, "requests": len(results), "elapsed_s": elapsed, "tokens": tokens,
            "tok_per_s": tokens / elapsed, "req_per_s": len(results) / elapsed,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "acceptance": after.get("specgraph_spec_acceptance_rate", 0.0),
            "hit_rate": after.get("specgraph_prefix_cache_hit_rate", 0.0), "preemptions": preempt}


def start_server(args) -> tuple[subprocess.Popen, str]:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "specgraph.runtime.cli", "serve", "--model", MODEL, "--port", str(args.port),
           "--log-level", "warning", "--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs)]
    if args.draft != "none":
        cmd += ["--draft", args.draft]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"server did not answer /health within {args.startup_timeout} s")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [r["ttft_p50"] * 1e3 for r in rows], "o-", label="TTFT p50")
    a.plot(c, [r["ttft_p99"] * 1e3 for r in rows], "o--", label="TTFT p99")
    a.plot(c, [r["itl_p50"] * 1e3 for r in rows], "s-", label="inter-token p50")
    a.plot(c, [r["itl_p99"] * 1e3 for r in rows], "s--", label="inter-token p99")
    a.set_xlabel("concurrent clients")
    a.set_ylabel("ms")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.legend()
    a.set_title("latency")
    b.plot(c, [r["tok_per_s"] for r in rows], "o-")
    b.set_xlabel("concurrent clients")
    b.set_ylabel("generated tokens/s")
    b.set_xscale("log", base=2)
    b.set_title("throughput")
    fig.suptitle(f"specgraph serve, {MODEL}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--draft", default="none", help="none, ngram, ...")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--plot", default="bench_serve.png")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]

    log("starting the server (load + compile)")
    proc, url = start_server(args)
    try:
        log("warm-up request")
        asyncio.run(run_level(url, 1, 1, 4))
        rows = []
        for n in levels:
            log(f"concurrency {n}: {args.requests} requests")
            rows.append(asyncio.run(run_level(url, n, args.requests, args.max_tokens)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    table = format_table(
        ["clients", "requests", "tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
         "acceptance", "hit rate", "preemptions"],
        [[str(r["concurrency"]), str(r["requests"]), fmt(r["tok_per_s"], ".1f"), fmt(r["req_per_s"], ".2f"),
          fmt(r["ttft_p50"] * 1e3, ".0f"), fmt(r["ttft_p99"] * 1e3, ".0f"), fmt(r["itl_p50"] * 1e3, ".1f"),
          fmt(r["itl_p99"] * 1e3, ".1f"), fmt(r["acceptance"], ".2f"), fmt(r["hit_rate"], ".2f"),
          str(int(r["preemptions"]))] for r in rows])
    lines = [f"specgraph serve load benchmark: {MODEL}, draft={args.draft}, {args.max_tokens} tokens per request, "
             f"greedy, {args.threads} threads", f"CPU: {cpu_description()}; load average {load_average()}", "",
             table]
    plot(rows, args.plot)
    lines.append(f"\nplot: {args.plot}")
    print_report(lines, {"args": vars(args), "cpu": cpu_description(), "levels": rows}, args.json)


if __name__ == "__main__":
    main()
