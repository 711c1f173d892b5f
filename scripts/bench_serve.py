"""A chat workload over HTTP: ``mlxkv serve`` against ``mlx_lm.server`` and vllm-mlx 0.6.0's server.

The workload of ``mlxkv run``, as a client sends it: 4 system prompts of 512
tokens, 16 two-turn conversations (turn 1: system + a 48-token user message;
turn 2: turn 1's messages, its answer and another 48-token user message),
at most 8 requests in flight, greedy (``--temperature`` samples instead: the
answers are then not compared), 32 tokens per answer, every request a
streamed ``/v1/chat/completions`` with ``stream_options.include_usage``.
Every server gets the same messages (texts cut to exact token counts with
the model's tokenizer, rendered by each server with the same chat template,
so turn 1's token sequences are the same for all); turn 2 carries the
server's own turn-1 answer, as a real client's would.

Servers, each a fresh process per round, on the same model (the built-in
one, or ``--model``):

- ``mlxkv``: ``mlxkv serve`` (this checkout);
- ``mlxkv-plain``: the same with ``--transpose-weights off`` (the model's
  own weight layout, as the other servers run it: what mlxkv gains without
  its CPU weight layout);
- ``mlx-lm``: ``python -m mlx_lm.server`` (mlx-lm from this environment);
- ``vllm-mlx`` and ``vllm-mlx-paged``: vllm-mlx 0.6.0's
  ``python -m vllm_mlx.cli serve MODEL --continuous-batching
  --enable-prefix-cache --offline`` (with ``--use-paged-cache`` for the
  second), in its own environment and with a fresh ``HOME`` per run (it
  reloads a saved cache from there). Set the environment up with::

      python3 -m venv .bench/vllm-serve
      .bench/vllm-serve/bin/pip install "mlx[cpu]" "mlx-lm>=0.31.3,<0.32"
      .bench/vllm-serve/bin/pip install --no-deps vllm-mlx==0.6.0
      .bench/vllm-serve/bin/pip install fastapi uvicorn starlette prometheus-client \\
          psutil pyyaml tabulate requests pillow jsonschema python-multipart

  Without it (``--vllm-python``), those two are skipped.

Per server and round: generated tokens per second of wall time (the usage's
completion tokens), time to first token (to the first chunk with text, as a
user sees it) p50/p95 for each turn, the prompt tokens the server says it
reused (``usage.prompt_tokens_details.cached_tokens``; vllm-mlx does not
report them), and the greedy answers compared with mlxkv's in the same
round (a trailing U+FFFD aside: servers differ in how they flush a last
incomplete UTF-8 character at ``max_tokens``; the time to the first text
includes the decode steps until a first complete character, often two or
three on the built-in model's random bytes). Turn 2's answers agree with
mlxkv's in few conversations, by design: mlxkv continues from the tokens it
generated in turn 1 (its conversation memory), the other servers from the
answer's text tokenized again, which on the built-in model's bytes (many
not UTF-8, sent back as U+FFFD) is another prompt (its turn-2 prompt token
count differs too); the others then agree with each other. Each server first runs
``--warmup`` untimed passes of the same workload over other texts (1), so
that the timed pass meets a server that has been up a while (kernels for
every prefill and batch shape built, buffers allocated); ``--warmup 0``
times a fresh process's first requests. Rounds alternate the servers'
order; the table shows the medians over rounds, then mlxkv's paired ratios
against each server (the median over rounds of each round's own ratio,
steadier than a ratio of medians on a machine whose load drifts).

    .venv/bin/python scripts/bench_serve.py [--rounds 3] [--servers mlxkv,mlxkv-plain,mlx-lm,vllm-mlx,vllm-mlx-paged]
                                            [--model DIR] [--warmup 1] [--json FILE] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import anyio
import attrs
import httpx

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = REPO / ".bench" / "vllm-serve" / "bin" / "python"
SERVERS = ("mlxkv", "mlxkv-plain", "mlx-lm", "vllm-mlx", "vllm-mlx-paged")
LABELS = {
    "mlxkv": "mlxkv serve",
    "mlxkv-plain": "mlxkv --transpose-weights off",
    "mlx-lm": "mlx_lm.server",
    "vllm-mlx": "vllm-mlx",
    "vllm-mlx-paged": "vllm-mlx --use-paged-cache",
}
_WORDS = (
    "cache block prefix token model answer question system user assistant memory request stream "
    "thread actor latency value policy context window layer batch kernel vector matrix schedule "
    "review careful precise helpful concise polite explain summarize compare translate reason"
).split()


def command(
    server: str, model: str, port: int, vllm_python: Path, mlxkv_args: str = ""
) -> list[str]:
    """The command line that starts ``server`` on ``port``."""
    if server in ("mlxkv", "mlxkv-plain"):
        base = [sys.executable, "-m", "mlxkv.cli", "serve", "--model", model, "--port", str(port)]
        if server == "mlxkv-plain":
            base += ["--transpose-weights", "off"]
        return base + shlex.split(mlxkv_args)
    if server == "mlx-lm":
        return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
    flags = ["--continuous-batching", "--enable-prefix-cache", "--offline", "--port", str(port)]
    if server == "vllm-mlx-paged":
        flags.append("--use-paged-cache")
    return [str(vllm_python), "-m", "vllm_mlx.cli", "serve", model, *flags]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@attrs.frozen
class Texts:
    """One pass of the workload: the system prompts and each conversation's two user messages."""

    systems: list[str]
    users: list[list[str]]


def workload(model: str, args: argparse.Namespace, *, seed: int, label: str) -> Texts:
    """The texts of one pass, cut to exact token counts with the model's tokenizer."""
    import mlx_lm  # noqa: F401  (quiets transformers' advisory warnings)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)

    def text(prefix: str, tokens: int) -> str:
        words = prefix + " ".join(rng.choice(_WORDS) for _ in range(tokens))
        ids = tokenizer.encode(words, add_special_tokens=False)[:tokens]
        cut = tokenizer.decode(ids)
        assert len(tokenizer.encode(cut, add_special_tokens=False)) == tokens, (
            "text does not round-trip"
        )
        return cut

    systems = [
        text(f"{label} {i}: you are a helpful assistant. ", args.system_tokens)
        for i in range(args.system_prompts)
    ]
    users = [
        [text("User: ", args.user_tokens) for _ in range(2)] for _ in range(args.conversations)
    ]
    return Texts(systems, users)


async def ask(
    client: httpx.AsyncClient, name: str, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0
) -> dict[str, Any]:
    """One streamed chat completion: its text, usage and time to first text."""
    body = {
        "model": name, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    first: Optional[float] = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    ended = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": "".join(pieces),
        "ttft_ms": 1e3 * ((first or ended) - started),
        "completion_tokens": usage.get("completion_tokens"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


async def conversations(
    client: httpx.AsyncClient, name: str, texts: Texts, args: argparse.Namespace
) -> tuple[dict[tuple[int, int], dict[str, Any]], float]:
    """One pass: every conversation's two turns, at most ``concurrency`` requests
    in flight; each request's record by (conversation, turn), and the wall time."""
    limiter = anyio.CapacityLimiter(args.concurrency)
    records: dict[tuple[int, int], dict[str, Any]] = {}

    async def conversation(index: int) -> None:
        messages = [{"role": "system", "content": texts.systems[index % len(texts.systems)]}]
        for turn in range(2):
            messages.append({"role": "user", "content": texts.users[index][turn]})
            async with limiter:
                record = await ask(client, name, messages, args.max_tokens, args.temperature)
            records[index, turn] = record
            messages.append({"role": "assistant", "content": record["text"]})

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        # Turns of one conversation are sequential; conversations start in order.
        for index in range(args.conversations):
            tg.start_soon(conversation, index)
    return records, time.perf_counter() - started


async def run_workload(
    url: str, name: str, passes: list[Texts], args: argparse.Namespace
) -> dict[str, Any]:
    """Every pass but the last untimed (the warm-up), then the last; its measures."""
    limits = httpx.Limits(
        max_connections=2 * args.concurrency, max_keepalive_connections=2 * args.concurrency
    )
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for texts in passes[:-1]:
            await conversations(client, name, texts, args)
        records, wall = await conversations(client, name, passes[-1], args)
    generated = [r["completion_tokens"] for r in records.values()]
    result: dict[str, Any] = {
        "wall_s": round(wall, 3),
        "generated_tokens": sum(generated) if None not in generated else None,
        "tokens_per_s": round(sum(generated) / wall, 1) if None not in generated else None,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in records.values()),
        "outputs": [[records[c, t]["text"] for t in range(2)] for c in range(args.conversations)],
    }
    for turn in range(2):
        ttfts = [records[c, turn]["ttft_ms"] for c in range(args.conversations)]
        cached = [records[c, turn]["cached_tokens"] for c in range(args.conversations)]
        result[f"ttft_t{turn + 1}_p50_ms"] = round(percentile(ttfts, 50), 1)
        result[f"ttft_t{turn + 1}_p95_ms"] = round(percentile(ttfts, 95), 1)
        result[f"reused_t{turn + 1}"] = sum(cached) if None not in cached else None
        result[f"prompt_t{turn + 1}"] = sum(
            records[c, turn]["prompt_tokens"] or 0 for c in range(args.conversations)
        )
    return result


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def one_run(
    server: str, model: str, passes: list[Texts], args: argparse.Namespace, logs: Path, round_: int
) -> dict[str, Any]:
    """Start ``server`` fresh, wait until it answers, run the workload, stop it."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    home = None
    if server.startswith("vllm-mlx"):
        home = tempfile.mkdtemp(prefix="vllm-home-")
        env["HOME"] = home  # it reloads a saved prefix cache from ~/.cache
    log = open(logs / f"{server}-round{round_}.log", "w")
    process = subprocess.Popen(
        command(server, model, port, args.vllm_python, args.mlxkv_args),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_ready(url, process, timeout=180)
        # Every server takes the model's path as its name.
        result = anyio.run(run_workload, url, model, passes, args)
        if "compute" in health:  # mlxkv's: what serves on the device
            result["compute"] = health["compute"]
        return result
    finally:
        stop(process)
        log.close()


def stop(process: subprocess.Popen) -> None:
    """Ctrl-C the server, and kill it if it has not exited 20 s later."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """Poll ``/health`` (all three servers have one) until the server answers
    200; its body where it is a JSON object, else an empty one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} (see its log)")
        try:
            answer = httpx.get(url + "/health", timeout=2)
            if answer.status_code == 200:
                try:
                    body = answer.json()
                except ValueError:
                    return {}
                return body if isinstance(body, dict) else {}
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"no answer from {url} within {timeout:.0f} s")


def same(a: str, b: str) -> bool:
    """Equal answers, a last incomplete character aside."""
    return a.rstrip("\ufffd") == b.rstrip("\ufffd")


def compare(outputs: list[list[str]], reference: list[list[str]]) -> tuple[int, int]:
    """How many turn-1 and turn-2 answers equal the reference's."""
    return tuple(sum(same(o[t], r[t]) for o, r in zip(outputs, reference)) for t in range(2))  # type: ignore[return-value]


MEASURES = (
    "tokens_per_s",
    "ttft_t1_p50_ms",
    "ttft_t1_p95_ms",
    "ttft_t2_p50_ms",
    "ttft_t2_p95_ms",
    "reused_t1",
    "reused_t2",
)


def median(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def _shown(measures: dict[str, Any], key: str) -> str:
    return "n/a" if measures[key] is None else f"{measures[key]:g}"


def table(summary: dict[str, dict[str, Any]], conversations: int) -> str:
    """The medians as aligned text, with mlxkv's ratios."""
    head = [
        "server",
        "gen tok/s",
        "TTFT t1 p50/p95 ms",
        "TTFT t2 p50/p95 ms",
        "reused t1/t2",
        "greedy = mlxkv t1/t2",
    ]
    rows = [head]
    for server, m in summary.items():
        agree = m.get("agree")
        rows.append([
            LABELS[server],
            _shown(m, "tokens_per_s"),
            f"{_shown(m, 'ttft_t1_p50_ms')} / {_shown(m, 'ttft_t1_p95_ms')}",
            f"{_shown(m, 'ttft_t2_p50_ms')} / {_shown(m, 'ttft_t2_p95_ms')}",
            f"{_shown(m, 'reused_t1')} / {_shown(m, 'reused_t2')}",
            "-" if agree is None else f"{agree[0]}/{conversations}, {agree[1]}/{conversations}",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    ]
    for server, m in summary.items():
        paired = m.get("paired")
        if paired:
            lines.append(
                f"mlxkv vs {LABELS[server]} (median of each round's ratio):"
                f" {paired['tokens_per_s']:.2f}x generated tokens/s,"
                f" TTFT p95 {paired['ttft_t1_p95_ms']:.2f}x lower on turn 1,"
                f" {paired['ttft_t2_p95_ms']:.2f}x on turn 2"
            )
    return "\n".join(lines)


def paired_ratios(runs: list[dict[str, Any]], server: str) -> dict[str, float]:
    """The median over rounds of mlxkv's advantage over ``server`` in that round
    (runs next to each other: steadier than a ratio of medians when the machine drifts)."""
    ratios: dict[str, list[float]] = {
        "tokens_per_s": [],
        "ttft_t1_p95_ms": [],
        "ttft_t2_p95_ms": [],
    }
    for theirs in (r for r in runs if r["server"] == server):
        ours = next(r for r in runs if r["server"] == "mlxkv" and r["round"] == theirs["round"])
        if theirs["tokens_per_s"]:
            ratios["tokens_per_s"].append(ours["tokens_per_s"] / theirs["tokens_per_s"])
        for key in ("ttft_t1_p95_ms", "ttft_t2_p95_ms"):
            ratios[key].append(theirs[key] / ours[key])
    return {key: statistics.median(values) for key, values in ratios.items() if values}


def add_workload_options(parser: argparse.ArgumentParser, *, system_prompts: int, conversations: int) -> None:
    """The chat workload's options (:func:`workload`, :func:`conversations`), for every script that runs it."""
    parser.add_argument("--system-prompts", type=int, default=system_prompts)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--conversations", type=int, default=conversations)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="sampling temperature of every request (0: greedy, the answers compared; OpenAI's default is 1)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed passes over other texts first (1)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per server (3)")
    parser.add_argument(
        "--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}"
    )
    parser.add_argument(
        "--model",
        help="an mlx-lm model directory, or a built-in model's name (bench-llama-722m-bf16: the"
        " GPU measurements' model; default: the built-in model)",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON,
        help="vllm-mlx's environment's python",
    )
    add_workload_options(parser, system_prompts=4, conversations=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mlxkv-args",
        default="",
        metavar="ARGS",
        help="more options for mlxkv serve, e.g. '--block-size 32'",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="also write every round and the medians as JSON"
    )
    parser.add_argument(
        "--logs", type=Path, help="keep the servers' logs here (default: a temporary directory)"
    )
    args = parser.parse_args()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}")
    if any(s.startswith("vllm-mlx") for s in servers) and not args.vllm_python.is_file():
        print(
            f"no vllm-mlx environment at {args.vllm_python}: vllm-mlx skipped (see the docstring)",
            file=sys.stderr,
        )
        servers = [s for s in servers if not s.startswith("vllm-mlx")]
    from mlxkv.default_model import model_path

    model = model_path(args.model)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    logs.mkdir(parents=True, exist_ok=True)
    passes = [
        workload(model, args, seed=args.seed + 1 + i, label=f"Warm-up {i}")
        for i in range(args.warmup)
    ]
    passes.append(workload(model, args, seed=args.seed, label="System prompt"))
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = servers if round_ % 2 == 0 else servers[::-1]
        for server in order:
            result = one_run(server, model, passes, args, logs, round_)
            result.update(server=server, round=round_)
            runs.append(result)
            if round_ == 0 and result.get("compute"):
                print(f"{LABELS[server]} computes on {result['compute']}", file=sys.stderr, flush=True)
            print(
                f"round {round_ + 1}/{args.rounds} {LABELS[server]}: {result['tokens_per_s']} tok/s,"
                f" TTFT p95 {result['ttft_t1_p95_ms']} / {result['ttft_t2_p95_ms']} ms,"
                f" reused {result['reused_t1']} / {result['reused_t2']}",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    summary: dict[str, dict[str, Any]] = {}
    for server in servers:
        mine = [r for r in runs if r["server"] == server]
        summary[server] = {key: median([r[key] for r in mine]) for key in MEASURES}
        if server != "mlxkv" and "mlxkv" in servers:
            if args.temperature == 0:
                summary[server]["agree"] = min(
                    compare(r["outputs"], next(o["outputs"] for o in runs if o["server"] == "mlxkv" and o["round"] == r["round"]))
                    for r in mine
                )
            summary[server]["paired"] = paired_ratios(runs, server)
    total = args.conversations * 2
    print(
        f"{args.conversations} two-turn conversations over {args.system_prompts} system prompts of"
        f" {args.system_tokens} tokens, {args.user_tokens}-token user turns, {args.max_tokens} tokens per"
        f" answer, {args.concurrency} in flight ({total} requests); medians of {args.rounds} rounds"
    )
    print(table(summary, args.conversations))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "model": model,
                                               "runs": runs, "medians": summary}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
