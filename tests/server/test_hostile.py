"""``mlxkv serve`` against a hostile client (issue 32), on asyncio and trio.

Each attack goes to a real server on a free loopback port, through raw
sockets where a client library would not misbehave. After each: the server
still answers a well-formed request, nothing stays held (pool blocks,
computations, admission slots), errors are the stated 4xx bodies, and where
memory is at stake the process's resident set returns within a stated margin.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gc
import io
import json
import os
import threading
from typing import Any, Optional
from urllib.parse import urlsplit

import anyio
import pytest

pytest.importorskip("starlette")
pytest.importorskip("hypercorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402
import structlog  # noqa: E402

from test_app import GREEDY, chat, nothing_held  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2?|httpcore2?)\.:ResourceWarning"
)

MiB = 1 << 20


def rss() -> int:
    """This process's resident set, in bytes (the server runs in it)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def request_bytes(path: str, body: bytes, *, length: Optional[int] = None, headers: str = "") -> bytes:
    """An HTTP/1.1 POST of ``body`` (declaring ``length`` bytes, default its own)."""
    declared = len(body) if length is None else length
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n{headers}\r\n"
    )
    return head.encode() + body


async def connect(url: str) -> Any:
    parts = urlsplit(url)
    return await anyio.connect_tcp(parts.hostname, parts.port)


async def read_response(stream: Any) -> tuple[int, dict[str, str], bytes]:
    """Read one response until the connection closes (or a whole content-length)."""
    data = b""
    with anyio.fail_after(30):
        while b"\r\n\r\n" not in data:
            data += await stream.receive()
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "-1"))
        while length < 0 or len(body) < length:
            try:
                body += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                break
    return status, headers, body


async def raw_post(url: str, path: str, body: bytes, **kwargs: Any) -> tuple[int, dict[str, str], Any]:
    """POST raw bytes on a fresh connection; (status, headers, decoded JSON body)."""
    async with await connect(url) as stream:
        await stream.send(request_bytes(path, body, **kwargs))
        status, headers, data = await read_response(stream)
    return status, headers, json.loads(data) if data else None


async def still_serving(s: Any) -> None:
    """A well-formed request is answered, and then nothing is held."""
    reply = await s.client.completions.create(model="tiny", prompt="still there?", max_tokens=3, **GREEDY)
    assert reply.usage.completion_tokens >= 1
    await slots_free(s)
    await nothing_held(s.runtime)


async def slots_free(s: Any) -> None:
    with anyio.fail_after(10):
        while True:
            stats = s.server.admission.statistics()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return
            await anyio.sleep(0.01)


def error_events(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in logs if event.get("log_level") in ("error", "critical")]


class TestSlotsAndSampling:
    """Down for everyone, items 1 and 2."""

    async def test_clients_that_close_at_once_leak_no_slot(self, serve):
        """Four requests sent and closed at once (with four slots and four places
        in the queue) leave every slot free: /health says "ok", and a request is
        answered (once, each leaked a slot for good)."""
        async with serve(server_options={"max_concurrent": 4, "max_queue": 4}) as s:
            body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 64}).encode()
            for _ in range(3):
                for _ in range(4):
                    async with await connect(s.url) as stream:
                        await stream.send(request_bytes("/v1/completions", body))
                await slots_free(s)
            async with httpx.AsyncClient(base_url=s.url) as http:
                health = (await http.get("/health")).json()
            assert health["status"] == "ok" and health["running"] == 0
            await still_serving(s)

    async def test_a_top_k_past_the_vocabulary_breaks_nothing(self, serve):
        """top_k of a million is answered (it keeps every token), and unseeded
        sampling requests after it, default, top_p and min_p, are answered too."""
        async with serve() as s:
            wide = await s.client.completions.create(
                model="tiny", prompt="hello", max_tokens=4, temperature=1.0, extra_body={"top_k": 10**6}
            )
            # Unseeded draws may pick the end-of-sequence token: a stop, not a failure.
            assert wide.usage.completion_tokens == 4 or wide.choices[0].finish_reason == "stop"
            for extra in ({}, {"top_p": 0.9}, {"min_p": 0.1}):
                options = {k: v for k, v in extra.items() if k == "top_p"}
                reply = await s.client.completions.create(
                    model="tiny", prompt="hello", max_tokens=4, temperature=1.0,
                    extra_body={k: v for k, v in extra.items() if k != "top_p"}, **options,
                )  # fmt: skip
                assert reply.usage.completion_tokens == 4 or reply.choices[0].finish_reason == "stop"
            await still_serving(s)


class TestLargePrompts:
    """Down for everyone, item 3: a prompt that cannot fit is refused untokenized;
    tokenizing happens off the event loop."""

    @pytest.mark.parametrize("endpoint", ["completions", "chat"])
    async def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(self, serve, endpoint):
        """5 MB of text, more characters than the context's tokens can stand for,
        is a 400 naming the prompt (``messages`` for chat) without a call to the
        tokenizer; memory stays within 64 MiB of where it was."""
        async with serve() as s:
            limit = s.server.max_prompt_chars
            assert limit == 32768 * len("<|begin_of_text|>")
            calls: list[int] = []
            preparer, template = s.runtime.preparer, s.server.chat
            encode, chat_encode = preparer.encode, template.encode
            preparer.encode = lambda text: calls.append(len(text)) or encode(text)
            template.encode = lambda text: calls.append(len(text)) or chat_encode(text)
            try:
                await still_serving(s)
                calls.clear()
                gc.collect()
                before = rss()
                text = "x" * (5 * MiB)
                if endpoint == "chat":
                    path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
                else:
                    path, body = "/v1/completions", {"prompt": text}
                status, _, error = await raw_post(s.url, path, json.dumps({"model": "tiny", **body}).encode())
                del text, body
                assert status == 400
                assert error["error"]["param"] == ("messages" if endpoint == "chat" else "prompt")
                assert "cannot fit the model's context" in error["error"]["message"]
                assert calls == []
                gc.collect()
                assert rss() - before < 64 * MiB
            finally:
                preparer.encode, template.encode = encode, chat_encode
            await still_serving(s)

    async def test_prompts_are_tokenized_off_the_event_loop(self, serve):
        """Completion text and chat prompts are tokenized on worker threads, so a
        long one never stalls the loop."""
        async with serve() as s:
            loop_thread = threading.get_ident()
            threads: list[int] = []
            preparer, template = s.runtime.preparer, s.server.chat
            encode, chat_encode = preparer.encode, template.encode
            preparer.encode = lambda text: threads.append(threading.get_ident()) or encode(text)
            template.encode = lambda text: threads.append(threading.get_ident()) or chat_encode(text)
            try:
                await s.client.completions.create(model="tiny", prompt="a b c", max_tokens=1)
                await s.client.chat.completions.create(model="tiny", messages=chat("Hi."), max_tokens=1)
            finally:
                preparer.encode, template.encode = encode, chat_encode
            assert len(threads) == 2 and loop_thread not in threads
            await still_serving(s)


class TestLargeBodies:
    """Large bodies are parsed off the event loop, one at a time."""

    async def test_large_bodies_are_parsed_one_at_a_time(self, serve):
        """Three 400 KB bodies sent together are each parsed on a worker
        thread, never two at once (parsed, a body of many small values holds
        many times its bytes; one at a time, the process holds one's), and
        each is answered."""
        async with serve() as s:
            parse, inside, most = s.server.parse, [0], [0]

            def counted(*args: Any) -> Any:  # the server's own parse, its overlaps counted
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                try:
                    threading.Event().wait(0.2)
                    return parse(*args)
                finally:
                    inside[0] -= 1

            s.server.parse = counted
            create = functools.partial(
                s.client.completions.create, model="tiny", prompt="Hi", max_tokens=1, user="u" * 400_000
            )  # 400 KB (an OpenAI field the server takes and ignores): past what is parsed on the loop
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(create)
            assert most[0] == 1
            await still_serving(s)


class TestWhatAnyoneSees:
    """Leaks, item 5: with API keys, what a caller without one may see."""

    async def test_health_and_metrics_without_a_key(self, serve, tmp_path):
        """Without a key, /health gives its admission state only and /metrics is
        401, unless ``public_metrics``; no path (the disk tier's, the model's)
        is in either."""
        tier = tmp_path / "kv"
        options = {"api_keys": ("alice",)}
        async with serve(api_key="alice", server_options=options, kv_tiers=(f"file://{tier}",)) as s:
            await s.client.completions.create(model="tiny", prompt="hello " * 40, max_tokens=2)
            async with httpx.AsyncClient(base_url=s.url) as anyone:
                health = await anyone.get("/health")
                metrics = await anyone.get("/metrics")
            async with httpx.AsyncClient(base_url=s.url, headers={"Authorization": "Bearer alice"}) as alice:
                keyed_health = (await alice.get("/health")).json()
                keyed_metrics = await alice.get("/metrics")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            assert metrics.status_code == 401 and metrics.json()["error"]["code"] == "invalid_api_key"
            assert keyed_health["model"] == "tiny" and keyed_health["running"] == 0
            assert keyed_metrics.status_code == 200 and "mlxkv_kv_tier_blocks" in keyed_metrics.text
            for text in (health.text, keyed_metrics.text, json.dumps(keyed_health)):
                assert str(tmp_path) not in text and s.runtime.config.model not in text
            await still_serving(s)
        options["public_metrics"] = True
        async with serve(api_key="alice", server_options=options) as s:
            async with httpx.AsyncClient(base_url=s.url) as anyone:
                assert (await anyone.get("/metrics")).status_code == 200


class TestBodies:
    """Leaks, item 7: bodies are read only once admitted, within a time bound."""

    async def test_withheld_bodies_are_read_only_once_admitted_and_time_out(self, serve):
        """Sixteen connections each send 8 MiB of a 9 MiB body and withhold the
        rest: only the two admitted ones take more than 64 KiB; each admitted one
        gets 408 ``body_timeout`` and its connection closed; then the queued ones
        are admitted and time out in turn. Memory returns within 32 MiB of where
        it was; the server serves throughout."""
        options = {"max_concurrent": 2, "max_queue": 16, "body_timeout": 1.0}
        async with serve(server_options=options) as s:
            await still_serving(s)
            gc.collect()
            before = rss()
            answers: list[int] = []
            chunk = b" " * MiB

            async def withhold() -> None:
                async with await connect(s.url) as stream:
                    await stream.send(request_bytes("/v1/completions", b"", length=9 * MiB))
                    try:
                        for _ in range(8):
                            await stream.send(chunk)
                    except (anyio.BrokenResourceError, OSError):
                        pass  # refused and closed while sending: the answer is read below
                    status, headers, _ = await read_response(stream)
                    answers.append(status)
                    assert headers.get("connection") == "close"

            async with anyio.create_task_group() as tg:
                for _ in range(16):
                    tg.start_soon(withhold)
                with anyio.fail_after(10):
                    while s.server.admission.statistics().num_waiting < 14:
                        await anyio.sleep(0.02)
                peak = rss() - before
                assert peak < 2 * 9 * MiB + 32 * MiB  # two bodies, not sixteen
            assert answers == [408] * 16
            await slots_free(s)
            with anyio.fail_after(10):  # each answer ends by handing its memory back
                while s.server._answering:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.2)
            gc.collect()
            assert rss() - before < 32 * MiB
            await still_serving(s)

    async def test_a_trickled_body_is_cut_off(self, serve):
        """A body sent a byte at a time past ``body_timeout`` gets 408 and a closed
        connection, instead of holding its slot for as long as it trickles."""
        async with serve(server_options={"body_timeout": 0.5, "max_concurrent": 1}) as s:
            body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
            async with await connect(s.url) as stream:
                await stream.send(request_bytes("/v1/completions", b"", length=len(body)))

                async def trickle() -> None:
                    with contextlib.suppress(anyio.BrokenResourceError, OSError):
                        for byte in body:
                            await stream.send(bytes([byte]))
                            await anyio.sleep(0.1)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(trickle)
                    status, headers, data = await read_response(stream)
                    tg.cancel_scope.cancel()
            assert headers.get("connection") == "close"
            assert status == 408 and json.loads(data)["error"]["code"] == "body_timeout"
            await still_serving(s)

    async def test_slow_or_no_headers_are_cut_off(self, serve):
        """A connection that sends nothing, or its headers a byte at a time past
        ``header_timeout``, is closed without an answer (slowloris); a request
        whose headers came in time keeps its connection while its body is
        withheld past it (the body has its own timeout) and is answered."""
        async with serve(server_options={"header_timeout": 0.5, "body_timeout": 10.0}) as s:

            async def closed_unanswered(stream: Any, trickle: bytes) -> None:
                received = b""

                async def send_slowly() -> None:
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        for byte in trickle:
                            await stream.send(bytes([byte]))
                            await anyio.sleep(0.1)

                # Well within Hypercorn's own default (5 s): the option is what closed it.
                with anyio.fail_after(3):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(send_slowly)
                        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                            while True:
                                received += await stream.receive()
                        tg.cancel_scope.cancel()
                assert received == b""

            body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, **GREEDY}).encode()
            async with await connect(s.url) as stream:
                await closed_unanswered(stream, b"")
            async with await connect(s.url) as stream:
                await closed_unanswered(stream, request_bytes("/v1/completions", body))
            async with await connect(s.url) as stream:
                await stream.send(request_bytes("/v1/completions", b"", length=len(body)))
                await anyio.sleep(1.0)  # twice the header timeout: the headers are whole
                await stream.send(body)
                status, _, data = await read_response(stream)
            assert status == 200 and json.loads(data)["usage"]["completion_tokens"] >= 1
            await still_serving(s)

    async def test_the_body_limit_is_an_option(self, serve):
        """``max_body_bytes`` refuses a larger body with 413, by its declared length
        before reading it, and by its bytes when it declares less (chunked)."""
        async with serve(server_options={"max_body_bytes": 4096}) as s:
            status, headers, error = await raw_post(s.url, "/v1/completions", b"{}", length=10**9)
            assert status == 413 and error["error"]["code"] == "body_too_large"
            async with httpx.AsyncClient(base_url=s.url) as http:

                async def chunks() -> Any:
                    for _ in range(8):
                        yield b" " * 1024

                chunked = await http.post("/v1/completions", content=chunks())
            assert chunked.status_code == 413
            await still_serving(s)


class TestBadBodies:
    """Item 10 and 11: OpenAI-shaped 400s naming the field, nothing logged as an error."""

    @pytest.mark.parametrize(
        "raw, param, words",
        [
            (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", "body", "nested more than"),
            (b'{"prompt": "hi", "metadata": ' + b"[" * 100 + b"]" * 100 + b"}", "metadata", "nested more than"),
            (b'{"prompt": "hi", "\\ud800": 1}', "\\ud800", "lone surrogate"),
            (b'{"prompt": "hi \\udc00 there"}', "prompt", "lone surrogate"),
            (b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}", "seed", "must be an integer"),
            ('{"prompt": "hi"}'.encode("utf-16"), "body", "is not UTF-8"),
            (b'{"prompt": "hi"', "body", "is not JSON"),
        ],
        ids=["deep", "deep field", "surrogate name", "surrogate prompt", "5000 digits", "utf-16", "truncated"],
    )
    async def test_completions(self, serve, raw, param, words):
        """Each is a 400 whose param names the field and whose message says what is wrong."""
        async with serve() as s:
            with structlog.testing.capture_logs() as logs:
                status, _, error = await raw_post(s.url, "/v1/completions", raw)
            assert status == 400 and error["error"]["type"] == "invalid_request_error"
            assert error["error"]["param"] == param and words in error["error"]["message"]
            assert "set_int_max_str_digits" not in error["error"]["message"]
            assert "codec" not in error["error"]["message"]
            assert not error_events(logs)
            await still_serving(s)

    @pytest.mark.parametrize("role", [[], {}, 7, None])
    async def test_a_role_that_is_not_a_string(self, serve, role):
        """``"role": []`` (or ``{}``) is a 400 naming ``messages[0].role``."""
        async with serve() as s:
            body = {"model": "tiny", "messages": [{"role": role, "content": "hi"}]}
            with structlog.testing.capture_logs() as logs:
                status, _, error = await raw_post(s.url, "/v1/chat/completions", json.dumps(body).encode())
            assert status == 400 and error["error"]["param"] == "messages[0].role"
            assert not error_events(logs)
            await still_serving(s)

    async def test_an_over_long_chat_prompt_names_messages(self, serve):
        """A chat whose tokens fill the context is the fault of ``messages``, not of a ``prompt`` it has none of."""
        async with serve() as s:
            text = "x" * 33000  # fits the character bound; its byte tokens do not fit 32768
            for extra in ({}, {"max_tokens": 5}):
                with pytest.raises(openai.BadRequestError) as caught:
                    await s.client.chat.completions.create(model="tiny", messages=chat(text), **extra)
                assert caught.value.body["param"] == "messages"
                assert "context" in caught.value.body["message"]
            await still_serving(s)

    async def test_a_failed_computation_does_not_show_its_internals(self, serve, monkeypatch):
        """A computation that raises is a 500 naming the request, not the exception;
        the exception is in the server's log, at error level."""
        from mlxkv.actors.sampling import Sampling

        class Internal(RuntimeError):
            pass

        def failing(self: Sampling) -> Any:
            def draw(logprobs: Any) -> Any:
                raise Internal("[metal::Device] secret internals at 0xdeadbeef")

            return draw

        async with serve() as s:
            monkeypatch.setattr(Sampling, "make_sampler", failing)
            with structlog.testing.capture_logs() as logs:
                with pytest.raises(openai.InternalServerError) as caught:
                    await s.client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=1.0)
            message = caught.value.body["message"]
            assert caught.value.body["code"] == "compute_failed"
            assert "secret" not in message and "Internal" not in message and "cmpl-" in message
            assert any("secret internals" in str(event.get("error")) for event in error_events(logs))
            monkeypatch.undo()
            await still_serving(s)


class TestHealth:
    """Item 12: /health reports the admission state."""

    async def test_ok_busy_full(self, serve):
        """ok while a slot is free, busy while a request would wait, full while it
        would be refused; ok again once they are done."""
        async with serve(server_options={"max_concurrent": 1, "max_queue": 1}) as s:

            async def status() -> str:
                async with httpx.AsyncClient(base_url=s.url) as http:
                    response = await http.get("/health")
                assert response.status_code == 200
                return response.json()["status"]

            assert await status() == "ok"
            holding = await s.client.chat.completions.create(
                model="tiny", messages=chat("Go on."), max_tokens=20000, stream=True, **GREEDY
            )
            await holding.__anext__()
            assert await status() == "busy"
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: s.client.completions.create(model="tiny", prompt="hi", max_tokens=1)
                )
                with anyio.fail_after(10):
                    while s.server.admission.statistics().num_waiting < 1:
                        await anyio.sleep(0.01)
                assert await status() == "full"
                await holding.close()
            await slots_free(s)
            assert await status() == "ok"
            await still_serving(s)


def _png(width: int, height: int, seed: int = 0) -> str:
    """A data URL of a ``width`` x ``height`` PNG: a few colours, so it compresses
    to little (200 KB for 7000x7000) and decodes to 3 bytes a pixel."""
    import numpy as np
    from PIL import Image

    colours = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    picture = Image.fromarray(colours).resize((width, height), Image.NEAREST)
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _ask(*urls: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": "What are these?"}]}]


class TestImages:
    """Leaks, item 6: what one request's images may cost is bounded, and checked
    from their headers before anything is decoded."""

    @pytest.fixture
    async def vlm_server(self, serve, vlm_path):
        from mlxkv.server.chat import ChatTemplate

        template = await anyio.to_thread.run_sync(ChatTemplate.load, str(vlm_path))
        return lambda **options: serve(path=str(vlm_path), chat=template, **options)

    async def test_too_many_images_or_pixels_are_400_naming_the_budget(self, vlm_server):
        """Three images past ``max_request_images=2``, or 2.2 megapixels past
        ``max_request_pixels=2_000_000``, are 400s naming ``messages`` and the
        setting; nothing was decoded (the pixel memo is empty); within budget
        the same images are answered."""
        async with vlm_server(max_request_images=2, max_request_pixels=2_000_000) as s:
            for urls, setting in (
                ([_png(32, 32, seed) for seed in range(3)], "max_request_images"),
                ([_png(1100, 1000, seed) for seed in range(2)], "max_request_pixels"),
            ):
                with pytest.raises(openai.BadRequestError) as caught:
                    await s.client.chat.completions.create(model="tiny", messages=_ask(*urls), max_tokens=2)
                assert caught.value.body["param"] == "messages"
                assert setting in caught.value.body["message"]
            assert s.runtime.client.pixel_memo.num_entries == 0
            reply = await s.client.chat.completions.create(
                model="tiny", messages=_ask(_png(1000, 1000), _png(900, 900, 1)), max_tokens=2, **GREEDY
            )
            assert reply.usage.prompt_tokens > 20
            await still_serving(s)

    async def test_eight_huge_pictures_cost_nothing_and_one_is_freed_after_use(self, vlm_server):
        """Eight 7000x7000 PNGs (a 1.6 MB body that once peaked at 3 GB) are refused
        from their headers: memory stays within 64 MiB. One of them, within the
        default budget, is answered, and afterwards memory is back within 64 MiB
        of where it was (147 MB of pixels were decoded)."""
        async with vlm_server() as s:
            huge = _png(7000, 7000)
            await s.client.chat.completions.create(model="tiny", messages=_ask(_png(64, 64)), max_tokens=1)
            gc.collect()
            before = rss()
            with pytest.raises(openai.BadRequestError) as caught:
                await s.client.chat.completions.create(model="tiny", messages=_ask(*[huge] * 8), max_tokens=1)
            assert "max_request_pixels" in caught.value.body["message"]
            assert rss() - before < 64 * MiB
            reply = await s.client.chat.completions.create(model="tiny", messages=_ask(huge), max_tokens=1)
            assert reply.usage.completion_tokens == 1
            await nothing_held(s.runtime)
            gc.collect()
            assert rss() - before < 64 * MiB
            await still_serving(s)


class TestTiers:
    """Items 8 and 13 through the server: what is planted in a disk tier's
    directory costs counted misses, never a hung request or a wrong answer."""

    async def test_fifos_planted_under_every_block_name(self, serve, tmp_path):
        """A second server over a disk tier whose every block file was replaced by
        a FIFO answers the same prompt with the same greedy text, promptly, with
        nothing reused; /metrics counts the planted files corrupt; and it keeps
        serving."""
        directory = tmp_path / "kv"
        prompt = "The same long prompt, written once and read back. " * 8
        async with serve(kv_tiers=(f"file://{directory}",)) as s:
            first = await s.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
            await s.runtime.flush_tiers()
        blocks = [path for path in directory.iterdir() if len(path.name) == 64]
        assert blocks
        for path in blocks:
            path.unlink()
            os.mkfifo(path)
        with anyio.fail_after(60):
            async with serve(kv_tiers=(f"file://{directory}",)) as s:
                again = await s.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
                async with httpx.AsyncClient(base_url=s.url) as http:
                    metrics = (await http.get("/metrics")).text
                await still_serving(s)
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        corrupt = next(
            float(line.rpartition(" ")[2])
            for line in metrics.splitlines()
            if line.startswith('mlxkv_kv_tier_blocks_total{event="corrupt",tier="file"}')
        )
        assert corrupt >= 1
