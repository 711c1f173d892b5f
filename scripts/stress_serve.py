"""A hostile stress run: ``mlxkv serve`` under well-formed load and the attacks of issue 32 at once.

Starts ``mlxkv serve`` (the built-in model, or ``--model``) with an API key,
small admission limits and a short body timeout, then for ``--duration``
seconds runs ``--clients`` well-formed clients (streamed and plain chat and
completions, greedy and sampled, a quarter of them of 2-4 choices, a quarter
of the chats after a tool call and its result, some held to JSON, a quarter
of the completions a batch of two prompts, a quarter
with log-probabilities, a quarter with penalties and a bias) beside
``--attackers`` that cycle through
the attacks, each on its own connection:

- ``close``: a request sent, and the connection closed at once;
- ``top_k``: a sampled request with ``top_k`` past the vocabulary;
- ``huge_prompt``: a 5 MB prompt, completion or chat;
- ``withheld``: a 4 MiB body, its last bytes never sent;
- ``trickle``: a body sent a byte at a time;
- ``bad_json``: nested 1,000 deep, ``"role": []``, a lone surrogate, a
  5,000-digit integer, UTF-16, 2.5 million empty lists;
- ``long_chat``: a chat whose tokens fill the context;
- ``many_choices``: a billion choices (``n``) of one prompt;
- ``many_tools``: 100,000 tools offered (the built-in model calls none, and
  a model that does takes at most 128);
- ``hostile_schema``: a ``response_format`` schema whose alternatives are
  too alike (at once, or doubling with each ``[``), too large, with a
  keyword the grammar does not hold text to, or with patterns at or past
  their compile budgets (many large ones, length bounds on large ones);
- ``no_key``: /metrics, /health and a completion without the key.

Then it waits for the server to settle and reports: well-formed requests
served (and any that failed: there should be none), each attack's answers by
HTTP status, the server's resident memory (``VmRSS``) before the run and
after it, ``/health`` and the blocks and admission slots still held (from
``/metrics``). Exit status 1 if a well-formed request failed, the server
died, or anything stays held.

    .venv/bin/python scripts/stress_serve.py [--duration 30] [--clients 4] [--attackers 4]
                                             [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, stop, wait_ready  # noqa: E402

KEY = "stress-key"
MiB = 1 << 20


def server_rss(pid: int) -> int:
    """The server process's resident set, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _post(path: str, body: bytes, *, length: int | None = None, key: bool = True) -> bytes:
    auth = f"Authorization: Bearer {KEY}\r\n" if key else ""
    declared = len(body) if length is None else length
    head = (
        f"POST {path} HTTP/1.1\r\nHost: stress\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {declared}\r\n\r\n"
    )
    return head.encode() + body


async def _status(stream: Any) -> int:
    """The status of the response on ``stream`` (read until its head is in)."""
    data = b""
    with anyio.fail_after(60):
        while b"\r\n" not in data:
            chunk = await stream.receive()
            data += chunk
    return int(data.split(b" ", 2)[1])


class Attacks:
    """The attacks, each a coroutine returning the HTTP status it got (0: none, by design)."""

    def __init__(self, url: str, rng: random.Random) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.url = parts.hostname, parts.port, url
        self.rng = rng

    async def _connect(self) -> Any:
        return await anyio.connect_tcp(self.host, self.port)

    async def _raw(self, data: bytes) -> int:
        async with await self._connect() as stream:
            await stream.send(data)
            return await _status(stream)

    async def close(self) -> int:
        async with await self._connect() as stream:
            body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 64}).encode()
            await stream.send(_post("/v1/completions", body))
        return 0

    async def top_k(self) -> int:
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 1.0, "top_k": 10**9}
        return await self._raw(_post("/v1/completions", json.dumps(body).encode()))

    async def huge_prompt(self) -> int:
        text = "x" * (5 * MiB)
        if self.rng.random() < 0.5:
            body = {"prompt": text}
            path = "/v1/completions"
        else:
            body = {"messages": [{"role": "user", "content": text}]}
            path = "/v1/chat/completions"
        return await self._raw(_post(path, json.dumps(body).encode()))

    async def withheld(self) -> int:
        async with await self._connect() as stream:
            await stream.send(_post("/v1/completions", b"", length=5 * MiB))
            with contextlib.suppress(anyio.BrokenResourceError, OSError):
                for _ in range(4):
                    await stream.send(b" " * MiB)
            return await _status(stream)

    async def trickle(self) -> int:
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        async with await self._connect() as stream:
            await stream.send(_post("/v1/completions", b"", length=len(body)))

            async def drip() -> None:
                with contextlib.suppress(anyio.BrokenResourceError, OSError):
                    for byte in body:
                        await stream.send(bytes([byte]))
                        await anyio.sleep(0.5)

            async with anyio.create_task_group() as tg:
                tg.start_soon(drip)
                status = await _status(stream)
                tg.cancel_scope.cancel()
            return status

    async def bad_json(self) -> int:
        raw = self.rng.choice(
            [
                b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
                b'{"model": "m", "messages": [{"role": [], "content": "hi"}]}',
                b'{"prompt": "hi \\ud800"}',
                b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}",
                '{"prompt": "hi"}'.encode("utf-16"),
                b'{"prompt": [' + b"[]," * 2_500_000 + b"[]]}",  # 7.5 MB that would parse to 160 MB
            ]
        )
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        return await self._raw(_post(path, raw))

    async def long_chat(self) -> int:
        body = {"messages": [{"role": "user", "content": "y" * 40000}], "max_tokens": 4}
        return await self._raw(_post("/v1/chat/completions", json.dumps(body).encode()))

    async def many_choices(self) -> int:
        body = {"prompt": "hello", "max_tokens": 4, "n": 10**9}
        return await self._raw(_post("/v1/completions", json.dumps(body).encode()))

    async def many_tools(self) -> int:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [tool] * 100_000}
        return await self._raw(_post("/v1/chat/completions", json.dumps(body).encode()))

    async def hostile_schema(self) -> int:
        alike = [{"type": "object", "properties": {"a": {"const": i}}} for i in range(300)]
        schema = random.choice(
            [
                {"anyOf": alike},  # 300 readings at once after "{"
                {"enum": list(range(5000))},  # past the schema's size
                {"anyOf": [{"type": "array", "items": {"$ref": "#"}}] * 2},  # doubling with each "["
                {"not": {"type": "integer"}},  # a keyword not held to
                {"type": "string", "pattern": "(a)\\1"},  # a pattern outside the syntax taken
                # Patterns at the compile budgets: many large ones, length bounds on large ones.
                {"properties": {f"k{i}": {"pattern": f"^[a-{chr(98 + i)}]{{0,1000}}$"} for i in range(24)}},
                {"properties": {f"k{i}": {"pattern": f"^.{{1,{4 + i}}}$", "maxLength": 99} for i in range(60)}},
                # Held: a ruled string whose automaton is large (a random model rarely ends it).
                {"type": "string", "pattern": f"^[a-z]{{0,{random.randrange(500, 3000)}}}$", "maxLength": 4},
            ]
        )
        body = {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }  # fmt: skip
        return await self._raw(_post("/v1/chat/completions", json.dumps(body).encode()))

    async def no_key(self) -> int:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            metrics = await http.get("/metrics")
            health = await http.get("/health")
            assert set(health.json()) <= {"status", "detail"}, "an unkeyed /health shows details"
            reply = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        return metrics.status_code if metrics.status_code != 401 else reply.status_code

    def all(self) -> dict[str, Callable[[], Any]]:
        names = (
            "close", "top_k", "huge_prompt", "withheld", "trickle", "bad_json", "long_chat", "many_choices",
            "many_tools", "hostile_schema", "no_key",
        )  # fmt: skip
        return {name: getattr(self, name) for name in names}


def _entries(logprobs: dict[str, Any]) -> list[Any]:
    """A choice's log-probability entries, in either endpoint's shape."""
    return logprobs["content"] if "content" in logprobs else logprobs["tokens"]


async def well_formed(url: str, rng: random.Random, served: collections.Counter, failures: list[str]) -> None:
    """One well-formed request: chat (a quarter of them after a tool call and
    its result) or completion (of one prompt or two),
    streamed or not, greedy or sampled, with penalties or not, of 1-4
    choices a prompt, with log-probabilities
    or not, echoed or not (an answer's entries must be as many as its
    tokens, and its prompt's where echoed)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    system = "You are a terse assistant. " * rng.randint(4, 24)
    options: dict[str, Any] = {"max_tokens": rng.randint(4, 16)}
    if rng.random() < 0.5:
        options.update(temperature=1.0, top_p=0.9)
    else:
        options.update(temperature=0)
    if rng.random() < 0.25:
        options.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={"42": -100})
    n = rng.randint(2, 4) if rng.random() < 0.25 else 1
    if n > 1:
        options["n"] = n
    choices = n
    logprobs = rng.randint(0, 5) if rng.random() < 0.25 else None
    if rng.random() < 0.5:
        path, body = "/v1/chat/completions", {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Why?"}]}
        if rng.random() < 0.25:  # a conversation that called a tool and has its result
            call = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"q": "why"}'}}
            body["messages"] += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Because."},
            ]
        if logprobs is not None:
            options.update(logprobs=True, top_logprobs=logprobs)
        elif rng.random() < 0.25 and len(body["messages"]) == 2:
            options["response_format"] = {"type": "json_object"}
    else:
        path, body = "/v1/completions", {"prompt": system + "Why?"}
        if rng.random() < 0.25:
            body["prompt"] = [system + "Why?", system + "Why not?"]
            choices = 2 * n
        if logprobs is not None:
            options.update(logprobs=logprobs, echo=rng.random() < 0.5)
    stream = rng.random() < 0.5
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        try:
            if stream:
                async with http.stream("POST", path, json={**body, **options, "stream": True}) as response:
                    text = "".join([line async for line in response.aiter_lines()])
                ends = text.count('"finish_reason":"stop"') + text.count('"finish_reason":"length"')
                ok = response.status_code == 200 and "[DONE]" in text and '"error"' not in text and ends == choices
            else:
                response = await http.post(path, json={**body, **options})
                ok = response.status_code == 200 and len(response.json()["choices"]) == choices
                if ok and logprobs is not None:
                    answer = response.json()
                    entries = sum(len(_entries(c["logprobs"])) for c in answer["choices"])
                    echoed = answer["usage"]["prompt_tokens"] * n if options.get("echo") else 0
                    ok = entries == answer["usage"]["completion_tokens"] + echoed
        except httpx.HTTPError as error:
            ok, response = False, None
            failures.append(f"{path}: {error!r}")
    if ok:
        served[path] += 1
    elif response is not None:
        failures.append(f"{path}: {response.status_code}")


async def stress(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    served: collections.Counter = collections.Counter()
    failures: list[str] = []
    answers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    attacks = Attacks(url, random.Random(args.seed + 1)).all()
    # Warm the server (every path once) before memory is read.
    for _ in range(4):
        await well_formed(url, rng, collections.Counter(), failures)
    before = server_rss(pid)
    deadline = time.monotonic() + args.duration

    async def client(seed: int) -> None:
        own = random.Random(seed)
        while time.monotonic() < deadline:
            await well_formed(url, own, served, failures)

    async def attacker(seed: int) -> None:
        own = random.Random(seed)
        names = list(attacks)
        while time.monotonic() < deadline:
            name = own.choice(names)
            try:
                status = await attacks[name]()
            except Exception as error:  # an attack's own failure is counted, not fatal
                status = type(error).__name__
            answers[name][str(status)] += 1

    async with anyio.create_task_group() as tg:
        for i in range(args.clients):
            tg.start_soon(client, args.seed + 100 + i)
        for i in range(args.attackers):
            tg.start_soon(attacker, args.seed + 200 + i)
    peak_after = server_rss(pid)
    settled = await settle(url)
    after = server_rss(pid)
    return {
        "served": dict(served),
        "failures": failures,
        "attacks": {name: dict(counts) for name, counts in sorted(answers.items())},
        "rss_before_mib": round(before / MiB, 1),
        "rss_end_of_load_mib": round(peak_after / MiB, 1),
        "rss_after_mib": round(after / MiB, 1),
        **settled,
    }


async def settle(url: str) -> dict[str, Any]:
    """Wait (up to 30 s) until no slot and no block is held; what was seen last."""
    headers = {"Authorization": f"Bearer {KEY}"}
    held: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        for _ in range(300):
            health = (await http.get("/health")).json()
            metrics = (await http.get("/metrics")).text
            held = {}
            for line in metrics.splitlines():
                name, _, value = line.rpartition(" ")
                if name in ('mlxkv_kv_blocks{state="held"}', "mlxkv_requests_running", "mlxkv_requests_waiting", "mlxkv_compute_live_requests"):
                    held[name] = float(value)
            if health.get("running") == 0 and not any(held.values()):
                break
            await anyio.sleep(0.1)
    return {"health": health, "held": held}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load (30)")
    parser.add_argument("--clients", type=int, default=4, help="well-formed clients (4)")
    parser.add_argument("--attackers", type=int, default=4, help="hostile clients (4)")
    parser.add_argument("--model", help="a model directory (default: the built-in model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    from mlxkv.default_model import DEFAULT_MODEL, ensure_model

    model = args.model or str(ensure_model(DEFAULT_MODEL))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="stress-serve-", suffix=".log", delete=False)
    command = [
        sys.executable, "-m", "mlxkv.cli", "serve", "--model", model, "--port", str(port),
        "--api-key", KEY, "--max-concurrent", "8", "--max-queue", "16", "--body-timeout", "2",
        "--max-body", "8MiB", "--block-size", "16",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_ready(url, process, timeout=180)
        report = anyio.run(stress, url, process.pid, args)
        report["alive"] = process.poll() is None
    finally:
        stop(process)
    report["server_log"] = log.name
    print(f"well-formed requests served  {sum(report['served'].values())} {report['served']}")
    print(f"well-formed requests failed  {len(report['failures'])} {report['failures'][:5]}")
    for name, counts in report["attacks"].items():
        print(f"attack {name:<22}{counts}")
    print(
        f"server RSS                   {report['rss_before_mib']} MiB before,"
        f" {report['rss_end_of_load_mib']} MiB at the end of the load, {report['rss_after_mib']} MiB settled"
    )
    print(f"/health                      {report['health']}")
    print(f"held at the end              {report['held']}")
    print(f"server log                   {log.name}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    ok = report["alive"] and not report["failures"] and not any(report["held"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
