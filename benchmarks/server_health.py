"""Does the event loop stay free? /health latency of `python -m engine.serve` (tiny V4.1), idle and while
64 streams decode and clients keep sending 20 MB bodies (refused with 413 while being read).

``python -m benchmarks.server_health [--seconds 15] [--streams 64] [--big-senders 2]``

Prints p50 / p99 / max of /health in both phases, side by side in one run, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BIG = b'{"prompt": "' + b"x" * (20 * 2**20) + b'"}'


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "engine.serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up")


async def health_latencies(client: httpx.AsyncClient, seconds: float) -> list[float]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        assert (await client.get("/health")).status_code == 200
        out.append(time.perf_counter() - start)
        await asyncio.sleep(0.02)
    return out


async def streams_forever(client: httpx.AsyncClient, stop: asyncio.Event) -> int:
    done = 0
    body = {"prompt": "Tell me a story", "max_tokens": 32, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass
        done += 1
    return done


async def big_bodies_forever(client: httpx.AsyncClient, stop: asyncio.Event) -> int:
    refused = 0
    while not stop.is_set():
        try:
            r = await client.post(
                "/v1/completions", content=BIG, headers={"Content-Type": "application/json"}
            )
            refused += r.status_code == 413
        except httpx.TransportError:  # the server closes a connection whose body it refused
            refused += 1
    return refused


def summary(latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return (
        f"p50 {statistics.median(ms):7.2f} ms   p99 {p99:7.2f} ms   max {ms[-1]:7.2f} ms   ({len(ms)} probes)"
    )


async def run(url: str, seconds: float, streams: int, senders: int) -> None:
    limits = httpx.Limits(max_connections=streams + senders + 4)
    async with (
        httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as load,
        httpx.AsyncClient(base_url=url, timeout=30) as probe,
    ):
        idle = await health_latencies(probe, seconds / 3)
        stop = asyncio.Event()
        workers = [asyncio.ensure_future(streams_forever(load, stop)) for _ in range(streams)]
        workers += [asyncio.ensure_future(big_bodies_forever(load, stop)) for _ in range(senders)]
        await asyncio.sleep(1.0)
        loaded = await health_latencies(probe, seconds)
        stop.set()
        counts = await asyncio.gather(*workers)
    print(f"idle:                         {summary(idle)}")
    print(f"{streams} streams + 20 MB bodies:  {summary(loaded)}")
    print(f"streams completed: {sum(counts[:streams])}, 20 MB bodies refused: {sum(counts[streams:])}")
    p99 = sorted(loaded)[int(0.99 * len(loaded))] / sorted(idle)[int(0.99 * len(idle))]
    print(f"p99 loaded / idle: {p99:.1f}x  (goal: loaded p99 under 100 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--big-senders", type=int, default=2)
    args = parser.parse_args()
    proc, url = start_server()
    try:
        asyncio.run(run(url, args.seconds, args.streams, args.big_senders))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
