"""Benchmark: culling cycles over 2,000 GPU kernels, and the reclaim latency.

What runs: the real culler (``culler.app.GPUCuller``, its real loop, HTTP client, decision and
reclaim) against one real tornado HTTP server, in another process, that serves what the culler
talks to, in the real formats: the hub's broker (``GET /hub/api/gpu/kernels``, ``GET|DELETE
/hub/api/gpu/kernels/<id>``, ``GET /hub/api/gpu/pool``) and 2,000 users' jupyter-servers behind the
proxy (``GET|DELETE /user/<name>/api/kernels[/<id>]``). A server's DELETE takes
``--shutdown-ms`` (the provisioner stopping the kernel and the broker releasing its slice)
before the slice shows free.

What does not run: the Kubernetes emulator. The culler never talks to Kubernetes (only to the
hub and the users' servers), and 2,000 real kernel pods, each a kernel process under the
emulator's kubelet, plus 2,000 jupyter-servers do not fit on a 2-core machine. So this measures
the culler's own cost and latency at that scale, not the broker's or the servers'.

The population: most kernels were GPU-idle for long but used in Jupyter recently (every server
must be asked, every cycle: the worst case for the gather), some launch GPU work (skipped without
asking), and ``--victims`` reach their idle timeout at staggered moments during the run. Reclaim
latency = slice free (the broker says so) - the moment the kernel's idle timeout was reached.

    python bench/culler.py [--kernels 2000] [--interval 10] [--cycles 4]

The last line is ``culler kernels=<n> cycle_s=<n> interval_s=<n> reclaim_latency_s=<n>``
(cycle_s: the slowest cycle; reclaim_latency_s: the worst kernel). Target: latency <= interval + 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOKEN = "bench-culler-token"
TIMEOUT_S = 3600.0


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


# ---- the served side: broker + users' servers ------------------------------------------------------


def serve(port: int, kernels: int, victims: int, interval: float, shutdown_ms: float, seed: int) -> None:
    from tornado import web
    from tornado.ioloop import IOLoop

    rng = random.Random(seed)
    now = time.time()
    records: dict[str, dict] = {}
    jupyter: dict[str, dict] = {}  # user -> kernel model
    due: dict[str, float] = {}  # victims: when their idle timeout is reached
    freed: dict[str, float] = {}
    busy_gpu = kernels // 10
    for i in range(kernels):
        user = f"user{i:05d}"
        kid = f"{i:08x}-0000-4000-8000-{rng.getrandbits(48):012x}"
        bid = f"{i:032x}"
        if i < victims:  # idle on both signals; the timeout is reached during the run
            reached = now + 2 + (i / max(1, victims - 1)) * interval * 2.5
            last_activity, last_launch = reached - TIMEOUT_S, reached - TIMEOUT_S - 60
            due[bid] = reached
        elif i < victims + busy_gpu:  # training with no browser: GPU busy, Jupyter idle
            last_activity, last_launch = now - 5 * TIMEOUT_S, None
        else:  # GPU idle for long, but the user ran a cell in the last 10 minutes
            last_activity, last_launch = now - rng.uniform(0, 600), now - 2 * TIMEOUT_S
        records[bid] = {
            "id": bid,
            "kernel_id": kid,
            "user": user,
            "server_name": "",
            "allocation_id": f"alloc-{i}",
            "memory_mib": rng.choice([5120, 10240, 20480]),
            "cores_percent": 25,
            "priority_class": rng.choice(["default", "default", "low", "high"]),
            "profile": "gpu-10g",
            "workspace": "default",
            "state": "running",
            "created_at": now - 6 * TIMEOUT_S,
            "last_launch": last_launch,
            "memory_used_mib": rng.randint(0, 4096),
            "_busy_gpu": last_launch is None,
        }
        jupyter[user] = {
            "id": kid,
            "name": "python3",
            "last_activity": iso(last_activity),
            "execution_state": "idle",
            "connections": 0,
            "_bid": bid,
        }

    def public(record: dict) -> dict:
        out = {k: v for k, v in record.items() if not k.startswith("_")}
        if record["_busy_gpu"]:
            out["last_launch"] = time.time() - rng.uniform(0, 5)  # the shim keeps seeing launches
        return out

    class Base(web.RequestHandler):
        def prepare(self) -> None:
            if self.request.headers.get("Authorization") != f"token {TOKEN}":
                raise web.HTTPError(403)
            self.set_header("Content-Type", "application/json")

    class Kernels(Base):
        def get(self) -> None:
            self.finish(json.dumps({"kernels": [public(r) for r in records.values()]}))

    class Kernel(Base):
        def get(self, bid: str) -> None:
            if bid not in records:
                raise web.HTTPError(404)
            self.finish(json.dumps(public(records[bid])))

        def delete(self, bid: str) -> None:
            free(bid)
            self.set_status(204)

    class Pool(Base):
        def get(self) -> None:
            self.finish(json.dumps({"queue": [], "nodes": []}))

    class ServerKernels(Base):
        def get(self, user: str) -> None:
            model = jupyter.get(user)
            models = [] if model is None else [{k: v for k, v in model.items() if not k.startswith("_")}]
            self.finish(json.dumps(models))

    class ServerKernel(Base):
        async def delete(self, user: str, kid: str) -> None:
            model = jupyter.get(user)
            if model is None or model["id"] != kid:
                raise web.HTTPError(404)
            await asyncio.sleep(shutdown_ms / 1000)  # the provisioner stops the kernel, the broker frees it
            jupyter.pop(user, None)
            free(model["_bid"])
            self.set_status(204)

    class Results(web.RequestHandler):
        def get(self) -> None:
            self.finish(json.dumps({"due": due, "freed": freed, "remaining": len(records)}))

    def free(bid: str) -> None:
        if records.pop(bid, None) is not None:
            freed[bid] = time.time()

    app = web.Application(
        [
            (r"/hub/api/gpu/kernels", Kernels),
            (r"/hub/api/gpu/kernels/([^/]+)", Kernel),
            (r"/hub/api/gpu/pool", Pool),
            (r"/user/([^/]+)/api/kernels", ServerKernels),
            (r"/user/([^/]+)/api/kernels/([^/]+)", ServerKernel),
            (r"/bench/results", Results),
        ],
        log_function=lambda handler: None,
    )
    app.listen(port, "127.0.0.1", backlog=1024)
    signal.signal(signal.SIGTERM, lambda *_: IOLoop.current().add_callback_from_signal(IOLoop.current().stop))
    print("ready", flush=True)
    IOLoop.current().start()


# ---- the culler side -----------------------------------------------------------------------------------


def run_culler(url: str, interval: float, cycles: int, concurrency: int) -> list:
    from traitlets.config import Config

    from culler.app import GPUCuller

    reports, checks = [], []

    class BenchCuller(GPUCuller):
        async def run_cycle(self):
            report = await super().run_cycle()
            reports.append(report)
            if len(reports) >= cycles:
                self._stop.set()
            return report

        async def run_due_checks(self):
            report = await super().run_due_checks()
            checks.append(report)
            return report

    cfg = Config()
    cfg.GPUCuller.api_url = url + "/hub/api"
    cfg.GPUCuller.api_token = TOKEN
    cfg.GPUCuller.proxy_url = url
    cfg.GPUCuller.interval_seconds = interval
    cfg.GPUCuller.idle_timeout_seconds = TIMEOUT_S
    cfg.GPUCuller.warning_seconds = 300
    cfg.GPUCuller.concurrency = concurrency
    cfg.GPUCuller.state_file = ""
    cfg.GPUCuller.log_level = "WARN"
    app = BenchCuller(config=cfg)
    app.setup()
    asyncio.run(app.main())
    return reports, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=2000)
    parser.add_argument("--victims", type=int, default=100, help="kernels reaching their idle timeout in the run")
    parser.add_argument("--interval", type=float, default=10.0, help="the culler's interval_seconds")
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32, help="the culler's concurrency")
    parser.add_argument("--shutdown-ms", type=float, default=100.0, help="server DELETE -> slice free")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.kernels, args.victims, args.interval, args.shutdown_ms, args.seed)
        return

    from tests.hubrunner import free_port

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            str(port),
            "--kernels",
            str(args.kernels),
            "--victims",
            str(args.victims),
            "--interval",
            str(args.interval),
            "--shutdown-ms",
            str(args.shutdown_ms),
            "--seed",
            str(args.seed),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert server.stdout.readline().strip() == "ready", "the bench server did not start"
        url = f"http://127.0.0.1:{port}"
        started = time.time()
        reports, checks = run_culler(url, args.interval, args.cycles, args.concurrency)
        with urllib.request.urlopen(url + "/bench/results", timeout=30) as resp:
            results = json.loads(resp.read())
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(10)

    due, freed = results["due"], results["freed"]
    reached = {bid: t for bid, t in due.items() if t <= reports[-1].started}
    latencies = [freed[bid] - t for bid, t in reached.items() if bid in freed]
    missed = [bid for bid in reached if bid not in freed]
    wrongly = [bid for bid in freed if bid not in due]
    cycles = [r.seconds for r in reports]
    asked = [r.servers_asked for r in reports]
    print(
        f"culler bench: {args.kernels} GPU kernels on {args.kernels} servers, interval {args.interval:g} s, "
        f"concurrency {args.concurrency}, server shutdown {args.shutdown_ms:g} ms; ran {time.time() - started:.1f} s"
    )
    for i, r in enumerate(reports):
        print(
            f"  cycle {i}: {r.seconds:.2f} s, {r.kernels} kernels, {r.servers_asked} servers asked, "
            f"{sum(1 for c in r.culls if c.freed)} culled{' ERROR ' + r.error if r.error else ''}"
        )
    print(
        f"  due checks between cycles: {len(checks)}, {sum(r.kernels for r in checks)} kernels looked at again, "
        f"{sum(1 for r in checks for c in r.culls if c.freed)} culled"
    )
    print(
        f"  cycle seconds: mean {statistics.mean(cycles):.2f}, max {max(cycles):.2f}; servers asked per cycle "
        f"{min(asked)}..{max(asked)}"
    )
    if latencies:
        print(
            f"  reclaim latency over {len(latencies)} kernels: p50 {statistics.median(latencies):.2f} s, "
            f"max {max(latencies):.2f} s (target <= interval + 2 = {args.interval + 2:g} s)"
        )
    print(f"  idle kernels not reclaimed in time: {len(missed)}; kernels culled that were not idle: {len(wrongly)}")
    worst = max(latencies) if latencies else float("nan")
    if missed or wrongly:
        worst = float("inf") if missed else worst
    print(
        f"culler kernels={args.kernels} cycle_s={max(cycles):.2f} interval_s={args.interval:g} "
        f"reclaim_latency_s={worst:.2f}"
    )


if __name__ == "__main__":
    main()
