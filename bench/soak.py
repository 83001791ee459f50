"""Soak: many concurrent clients against a real `qv serve` for a while, with the production mix
(non-streamed and streamed chats, completions, Clef decisions) and clients that hang up early.
Reports failures by kind, latency percentiles, and the server's resident memory over time (and
the GPU's, from nvidia-smi) so "0 failures, flat memory" is read off one table.

    python bench/soak.py --smoke                     # CPU: the embedded tiny model, 20 s
    python bench/soak.py --model DIR --clients 64 --seconds 3600 -- --load-format random ...

Everything after `--` goes to `qv serve`. A request fails when it gets anything but its 200 (or,
for a client that hung up on purpose, when the server stops answering others). Memory is "flat"
when the last sample is within 10% of the first one taken after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

WORDS = "order refund outage login invoice latency shipping urgent billing fraud customer delay".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _gpu_mib() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return float("nan")


def _preset_folder(preset: str, layers: int) -> Path:
    """A config-only folder of the preset's shapes plus a Clef head (bench/clef.py's layout)."""
    import tempfile

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from clef import add_clef
    from prefix import write_model

    root = Path(tempfile.mkdtemp(prefix="qv-soak-"))
    return add_clef(write_model(root, preset, layers, 40960, torch.bfloat16, weights=False), preset)


class Soak:
    def __init__(self, base: str, model: str, clef: bool, max_tokens: int, hangup: float, seed: int):
        self.base, self.model, self.clef, self.max_tokens, self.hangup = base, model, clef, max_tokens, hangup
        self.rng = random.Random(seed)
        self.ok, self.failed, self.hung_up = Counter(), Counter(), 0
        self.latency: dict[str, list[float]] = {}
        self.errors: list[str] = []

    def _prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randrange(8, 200)))

    def _request(self) -> tuple[str, str, dict]:
        kinds = ["chat", "chat_stream", "completion"] + (["clef"] if self.clef else [])
        kind = self.rng.choice(kinds)
        if kind == "clef":
            return kind, "/v1/systemone", {"model": "clef", "state": self._prompt(), "questions": {
                "team": {"type": "choice", "criteria": {"billing": None, "tech": None, "ops": None}},
                "urgency": {"type": "score", "criteria": ["later", "today"]}}}
        if kind == "completion":
            return kind, "/v1/completions", {"model": self.model, "prompt": self._prompt(),
                                             "max_tokens": self.rng.randrange(1, self.max_tokens)}
        body = {"model": self.model, "messages": [{"role": "user", "content": self._prompt()}],
                "max_tokens": self.rng.randrange(1, self.max_tokens), "stream": kind == "chat_stream"}
        return kind, "/v1/chat/completions", body

    async def one(self, client: httpx.AsyncClient) -> None:
        kind, path, body = self._request()
        hang = self.rng.random() < self.hangup
        t0 = time.perf_counter()
        try:
            if body.get("stream") or hang:
                if kind != "clef":  # a hang-up mid-stream; a Clef decision is hung up on after its first bytes
                    body = {**body, "stream": True}
                async with client.stream("POST", self.base + path, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    done = False
                    async for line in r.aiter_lines():
                        if hang:  # hang up after the first bytes
                            self.hung_up += 1
                            return
                        if line.startswith("data: ") and '"error"' in line:
                            raise RuntimeError(f"stream error event: {line[:200]}")
                        done |= line == "data: [DONE]"
                    if kind != "clef" and not done:
                        raise RuntimeError("stream ended without [DONE]")
            else:
                r = await client.post(self.base + path, json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                json.loads(r.text)
            self.ok[kind] += 1
            self.latency.setdefault(kind, []).append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - every failure is counted and a few are printed
            self.failed[kind] += 1
            if len(self.errors) < 10:
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")

    async def client(self, client: httpx.AsyncClient, until: float) -> None:
        while time.perf_counter() < until:
            await self.one(client)


async def run(args, base: str, pid: int) -> dict:
    soak = Soak(base, args.served_name, args.clef, args.max_tokens, args.hangup, args.seed)
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients)
    samples = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        until = time.perf_counter() + args.warmup
        await asyncio.gather(*(soak.client(client, until) for _ in range(min(args.clients, 4))))
        t0 = time.perf_counter()
        until = t0 + args.seconds
        tasks = [asyncio.create_task(soak.client(client, until)) for _ in range(args.clients)]
        while time.perf_counter() < until:
            health = await client.get(base + "/health")
            samples.append((time.perf_counter() - t0, _rss_mib(pid), _gpu_mib(), health.status_code))
            await asyncio.sleep(min(args.sample_every, max(0.0, until - time.perf_counter())))
        await asyncio.gather(*tasks)
        samples.append((time.perf_counter() - t0, _rss_mib(pid), _gpu_mib(),
                        (await client.get(base + "/health")).status_code))
    return {"soak": soak, "samples": samples, "wall": time.perf_counter() - t0}


def report(args, res: dict) -> str:
    soak, samples = res["soak"], res["samples"]
    lines = [f"Soak: {args.clients} clients for {res['wall']:.0f} s against `qv serve {args.model or '(tiny)'}` "
             f"({args.hangup:.0%} hang up early; mix: chat, streamed chat, completion{', Clef' if args.clef else ''})",
             "", "| kind | ok | failed | p50 s | p95 s | p99 s |", "|---|---:|---:|---:|---:|---:|"]
    for kind in sorted(set(soak.ok) | set(soak.failed)):
        lat = sorted(soak.latency.get(kind, [])) or [float("nan")]
        pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
        lines.append(f"| {kind} | {soak.ok[kind]} | {soak.failed[kind]} | {statistics.median(lat):.3f} | "
                     f"{pct(0.95):.3f} | {pct(0.99):.3f} |")
    lines.append(f"| hung up on purpose | {soak.hung_up} | - | - | - | - |")
    rss = [s[1] for s in samples]
    gpu = [s[2] for s in samples]
    flat = abs(rss[-1] - rss[0]) <= 0.1 * rss[0]
    lines += ["", f"server RSS MiB: first {rss[0]:.0f}, max {max(rss):.0f}, last {rss[-1]:.0f} "
              f"({'flat' if flat else 'NOT flat'}); GPU MiB used: first {gpu[0]:.0f}, max {max(gpu):.0f}, "
              f"last {gpu[-1]:.0f}; /health non-200 samples: {sum(s[3] != 200 for s in samples)}",
              f"failures: {sum(soak.failed.values())}"]
    lines += [f"  {e}" for e in soak.errors]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU: the embedded tiny model, 8 clients, 20 s")
    ap.add_argument("--model", default="", help="checkpoint folder (default: the embedded tiny model)")
    ap.add_argument("--preset", default="", help="serve a preset's shapes with random GPTQ-Int8 weights and a random "
                    "Clef head (e.g. 27b; bench/prefix.py's presets) instead of --model")
    ap.add_argument("--layers", type=int, default=8, help="with --preset: layers to keep (0: all)")
    ap.add_argument("--served-name", default="", help="model name to send (default: what /v1/models lists first)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--hangup", type=float, default=0.1, help="share of requests whose client hangs up early")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--clef", type=int, default=1, help="1: send Clef decisions too (the model must have a head)")
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the numbers here")
    args, serve_args = ap.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    if args.smoke:
        args.clients, args.seconds, args.warmup, args.max_tokens, args.sample_every = 8, 20.0, 3.0, 16, 2.0
    if args.preset:
        args.model = str(_preset_folder(args.preset, args.layers))
        serve_args += ["--load-format", "random", "--quantization", "gptq-int8"]
    port = _free_port()
    cmd = [sys.executable, "-m", "qv.cli", "serve", *([args.model] if args.model else []), "--port", str(port),
           *serve_args]
    log_path = Path(args.json or "/tmp/qv-soak").with_suffix(".server.log")
    log = log_path.open("w")  # a file, not a pipe: a full pipe would block the server's logging
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            if server.poll() is not None:
                sys.exit(f"qv serve exited:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                sys.exit("qv serve did not become healthy in 900 s")
            time.sleep(1)
        if not args.served_name:
            args.served_name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        res = asyncio.run(run(args, base, server.pid))
        print(report(args, res), flush=True)
        if args.json:
            soak = res["soak"]
            Path(args.json).write_text(json.dumps({"ok": soak.ok, "failed": soak.failed, "hung_up": soak.hung_up,
                                                   "samples": res["samples"], "errors": soak.errors}, indent=1))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


if __name__ == "__main__":
    main()
