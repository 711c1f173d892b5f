"""The OpenAI API of ``mlxkv serve``, through the real ``openai`` client, on asyncio and trio.

Each test starts a fresh runtime on the built-in model and a server on a free
loopback port (``serve`` in conftest.py), and talks to it over HTTP as any
client would; it checks the runtime object in the same process for what the
client cannot see (blocks held, live computations).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
from typing import Any, Optional

import anyio
import attrs
import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("hypercorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from mlxkv import GeneratedToken  # noqa: E402
from mlxkv.actors.prompt_preparer import encode_text  # noqa: E402
from mlxkv.server.request import ChatMessage, ToolCall  # noqa: E402

from device_arithmetic import LOGITS_ATOL  # noqa: E402
from greedy import CLEAR_GAP, least_gap, reference_load  # noqa: E402
from tool_cases import WEATHER  # noqa: E402

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

# The openai client (and its httpx2/httpcore2) leave their own stream generators
# unfinished after "[DONE]"; trio's finalizer warns about them. The server's
# generators are all closed: a warning about one of them stays an error.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2?|httpcore2?)\.:ResourceWarning"
)

SYSTEM = "You are a terse assistant who answers in one line. " * 6
GREEDY: dict[str, Any] = {"temperature": 0}
# Answers compared as text across paths (cold and cached, alone and batched)
# come from prompts clear of ties (TestPrompts): the tokens are not on the
# wire, so a parting at a tie (another device's rounding) could not be told
# from a wrong cache. "Question number {i}?" parted so, on the GPU's
# emulated arithmetic, where its two best tokens were 1e-5 apart.
ASK = SYSTEM + "Say something."
ASK_TOO = SYSTEM + "Who wrote Hamlet?"
QUESTIONS = (
    "Tell me a joke.", "Say hello.", "Who wrote Hamlet?", "Spell cat.", "Pick a number.", "Sing a song.",
    "Define love.", "Greet me.",
)  # fmt: skip


def chat(*turns: str) -> list[dict[str, str]]:
    """A conversation: the system prompt, then user and assistant turns alternating."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": SYSTEM}] + [
        {"role": roles[i % 2], "content": text} for i, text in enumerate(turns)
    ]


async def streamed_chat(client: Any, **kwargs: Any) -> tuple[str, Any, list[Any]]:
    """A streamed chat completion: its text, its usage chunk's usage and every chunk."""
    chunks = [
        c async for c in await client.chat.completions.create(model="tiny", stream=True, **kwargs)
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage, chunks


async def nothing_held(rt: Any) -> Any:
    """Wait (at most 10 s) until no request holds a block or a computation; the stats."""
    with anyio.fail_after(10):
        while True:
            stats = await rt.stats()
            if (
                stats.allocator.num_referenced == 0
                and stats.compute.num_live == 0
                and stats.index.num_active_requests == 0
            ):
                await rt.check_invariants()
                return stats
            await anyio.sleep(0.02)


class TestPrompts:
    def test_the_prompts_compared_as_text_are_clear_of_ties(self, default_model_path, chat_template):
        """Every greedy step of the prompts whose answers are compared as text
        has its two best choices at least ``CLEAR_GAP`` apart (the model in
        hand, mlx-lm's own run): no device's rounding parts two exact paths."""
        model, tokenizer = reference_load(default_model_path)
        prompts = {ASK: (encode_text(tokenizer, ASK), 24), ASK_TOO: (encode_text(tokenizer, ASK_TOO), 8)}
        for question in ("Hello!", *QUESTIONS):
            messages = [ChatMessage(**m) for m in chat(question)]
            prompts[question] = (chat_template.encode(chat_template.render(messages)), 12)
        gaps = {name: least_gap(model, ids, steps) for name, (ids, steps) in prompts.items()}
        assert min(gaps.values()) > CLEAR_GAP, {name: gap for name, gap in gaps.items() if gap <= CLEAR_GAP}


class TestCompletions:
    """``POST /v1/completions``: text and token-id prompts, streamed and not."""

    async def test_text_and_token_ids_match_the_runtime(self, serve):
        """A text prompt and its token ids give the runtime's own greedy tokens, and
        the usage counts the prompt, the answer and the tokens reused."""
        async with serve() as s:
            prompt = ASK
            ids = list(await s.runtime.tokenize(prompt))
            direct = []
            async with s.runtime.generate(ids, max_tokens=12, cache_salt="direct") as stream:
                async for record in stream:
                    if isinstance(record, GeneratedToken):
                        direct.append(record.text)
            by_text = await s.client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, **GREEDY
            )
            assert by_text.object == "text_completion"
            assert by_text.choices[0].text == "".join(direct)
            assert by_text.choices[0].finish_reason == stream.report.finish_reason
            assert by_text.usage.prompt_tokens == len(ids)
            assert by_text.usage.completion_tokens == stream.report.generated_tokens
            assert by_text.usage.prompt_tokens_details.cached_tokens == 0  # another salt
            by_ids = await s.client.completions.create(
                model="tiny", prompt=ids, max_tokens=12, **GREEDY
            )
            assert by_ids.choices[0].text == by_text.choices[0].text
            # The same prompt again: all but its last token from the last cache.
            assert by_ids.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
            await nothing_held(s.runtime)

    async def test_streamed_with_usage(self, serve):
        """Streamed pieces add up to the non-streamed text; ``include_usage`` ends the
        stream with a chunk of no choices and the usage; without it, no usage."""
        async with serve() as s:
            whole = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=10, **GREEDY
            )
            chunks = [
                c
                async for c in await s.client.completions.create(
                    model="tiny", prompt=ASK, max_tokens=10, stream=True,
                    stream_options={"include_usage": True}, **GREEDY,
                )
            ]  # fmt: skip
            assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
            assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
            assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
            usage = chunks[-1].usage
            assert usage.prompt_tokens == whole.usage.prompt_tokens
            assert usage.completion_tokens == whole.usage.completion_tokens
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
            plain = [
                c
                async for c in await s.client.completions.create(
                    model="tiny", prompt=ASK, max_tokens=3, stream=True
                )
            ]
            assert all(c.usage is None for c in plain)

    async def test_stop_strings(self, serve):
        """A stop string ends the answer before it, streamed or not, with
        finish_reason "stop" and the usage of the tokens generated up to it."""
        async with serve() as s:
            full = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=24, **GREEDY
            )
            text = full.choices[0].text
            stop = text[6:8]
            assert len(stop) == 2 and text.index(stop) >= 1, (
                f"the greedy answer {text!r} is too short"
            )
            expected = text[: text.index(stop)]
            cut = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=24, stop=[stop, "\x00\x00"], **GREEDY
            )
            assert cut.choices[0].text == expected
            assert cut.choices[0].finish_reason == "stop"
            assert 0 < cut.usage.completion_tokens < full.usage.completion_tokens
            assert cut.usage.prompt_tokens_details.cached_tokens > 0  # known without a report
            chunks = [
                c async for c in await s.client.completions.create(
                    model="tiny", prompt=ASK, max_tokens=24, stop=stop, stream=True, **GREEDY
                )
            ]  # fmt: skip
            assert "".join(c.choices[0].text for c in chunks) == expected
            assert chunks[-1].choices[0].finish_reason == "stop"
            await nothing_held(s.runtime)


class TestChat:
    """``POST /v1/chat/completions``: the chat template, streaming, earlier turns reused."""

    async def test_streamed_and_not_agree(self, serve):
        """The streamed answer is the whole answer; the stream opens with the
        assistant role and ends with the finish reason, then the usage."""
        async with serve() as s:
            whole = await s.client.chat.completions.create(
                model="tiny", messages=chat("Hello!"), max_tokens=10, **GREEDY
            )
            assert whole.object == "chat.completion"
            assert whole.choices[0].message.role == "assistant"
            text, usage, chunks = await streamed_chat(
                s.client,
                messages=chat("Hello!"),
                max_tokens=10,
                stream_options={"include_usage": True},
                **GREEDY,
            )
            assert text == whole.choices[0].message.content
            assert chunks[0].object == "chat.completion.chunk"
            assert chunks[0].choices[0].delta.role == "assistant"
            assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
            assert usage.prompt_tokens == whole.usage.prompt_tokens
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1

    async def test_second_turn_reuses_the_first_exactly(self, serve):
        """Turn 2 (turn 1's messages, its answer, a new question) is built on turn
        1's exact tokens: it reuses all of turn 1's prompt and answer, though the
        answer's text tokenizes differently; an edited answer is tokenized afresh."""
        async with serve(keep_caches=False) as s:
            first = await s.client.chat.completions.create(
                model="tiny", messages=chat("Hello!"), max_tokens=32, **GREEDY
            )
            answer = first.choices[0].message.content
            earlier = first.usage.prompt_tokens + first.usage.completion_tokens
            second = await s.client.chat.completions.create(
                model="tiny", messages=chat("Hello!", answer, "And then?"), max_tokens=8, **GREEDY
            )
            # Every full block of turn 1's prompt and answer (blocks of 16).
            assert second.usage.prompt_tokens_details.cached_tokens == earlier // 16 * 16
            assert second.usage.prompt_tokens > earlier
            assert s.server.memory.statistics().num_continued == 1
            # Tokenized afresh, the answer's text is not the tokens generated: the
            # prompt diverges inside it (random weights emit bytes that are not UTF-8).
            fresh = s.server.chat.encode(
                s.server.chat.render(_messages(chat("Hello!", answer, "And then?")))
            )
            assert len(fresh) != second.usage.prompt_tokens
            edited = await s.client.chat.completions.create(
                model="tiny",
                messages=chat("Hello!", answer + "!", "And then?"),
                max_tokens=8,
                **GREEDY,
            )
            assert edited.usage.prompt_tokens_details.cached_tokens < earlier // 16 * 16
            assert s.server.memory.statistics().num_fresh == 2  # turn 1 and the edited turn

    async def test_concurrent_clients(self, serve):
        """Eight clients at once (streamed and not) get the answers each gets alone,
        decoded together, and reuse the shared system prompt."""
        questions = QUESTIONS
        async with serve() as s:
            alone = [
                (
                    await s.client.chat.completions.create(
                        model="tiny", messages=chat(q), max_tokens=12, **GREEDY
                    )
                )
                .choices[0]
                .message.content
                for q in questions
            ]
            together: dict[int, str] = {}
            cached: dict[int, int] = {}

            async def ask(i: int) -> None:
                if i % 2:
                    text, usage, _ = await streamed_chat(
                        s.client, messages=chat(questions[i]), max_tokens=12,
                        stream_options={"include_usage": True}, extra_body={"cache_salt": "together"}, **GREEDY,
                    )  # fmt: skip
                else:
                    reply = await s.client.chat.completions.create(
                        model="tiny", messages=chat(questions[i]), max_tokens=12,
                        extra_body={"cache_salt": "together"}, **GREEDY,
                    )  # fmt: skip
                    text, usage = reply.choices[0].message.content, reply.usage
                together[i], cached[i] = text, usage.prompt_tokens_details.cached_tokens

            stats = await s.runtime.stats()
            steps, rows = stats.compute.num_decode_steps, stats.compute.num_decode_rows
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(ask, i)
            assert [together[i] for i in range(8)] == alone
            assert sum(1 for n in cached.values() if n > 0) >= 4
            stats = await nothing_held(s.runtime)
            batch = (stats.compute.num_decode_rows - rows) / (
                stats.compute.num_decode_steps - steps
            )
            assert batch > 2, f"decoded {batch:.1f} requests per step"

    async def test_disconnect_mid_stream_releases_everything(self, serve):
        """A client that leaves mid-stream cancels its generation: nothing stays held,
        the computation stops, and the request counts as disconnected."""
        async with serve() as s:
            probe = await s.client.chat.completions.create(
                model="tiny", messages=chat("Tell me all."), max_tokens=48, **GREEDY
            )
            assert probe.choices[0].finish_reason == "length", (
                "the greedy answer ends too soon to leave mid-way"
            )
            stream = await s.client.chat.completions.create(
                model="tiny", messages=chat("Tell me all."), max_tokens=20000, stream=True, **GREEDY
            )
            received = 0
            async for _ in stream:
                received += 1
                if received == 4:
                    break
            before = await s.runtime.stats()
            assert before.compute.num_live == 1 and before.allocator.num_referenced > 0
            await stream.close()
            stats = await nothing_held(s.runtime)
            assert stats.generation.num_stopped == 1
            assert stats.compute.num_decode_steps < 1000
            metrics = await _metrics(s.url)
            assert metrics['mlxkv_requests_total{endpoint="chat",outcome="disconnected"}'] == 1


class TestErrors:
    """Every refusal is an OpenAI-shaped error with its status."""

    async def test_bad_requests_are_400(self, serve):
        """Bad JSON, an unknown field, a field of the wrong type and a prompt past
        the context: 400 with the InvalidInput message and the field at fault."""
        async with serve() as s:
            async with httpx.AsyncClient(base_url=s.url) as http:
                raw = await http.post(
                    "/v1/completions",
                    content=b"{not json",
                    headers={"content-type": "application/json"},
                )
            assert raw.status_code == 400
            assert (
                raw.json()["error"]["param"] == "body"
                and "is not JSON" in raw.json()["error"]["message"]
            )
            cases = [
                ({"prompt": "hi", "extra_body": {"frobnicate": 1}}, "frobnicate"),
                ({"prompt": "hi", "temperature": "hot"}, "temperature"),
                ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                ({"prompt": "hi", "n": 17}, "n"),  # past --max-choices (16)
                ({"prompt": "hi", "n": 0}, "n"),
                ({"prompt": [1, 2, 100_000]}, "prompt"),
                ({"prompt": "hi", "max_tokens": 40_000}, "max_tokens"),  # past the 32k context
            ]
            for kwargs, param in cases:
                with pytest.raises(openai.BadRequestError) as caught:
                    await s.client.completions.create(model="tiny", **kwargs)
                error = caught.value.body
                assert caught.value.status_code == 400, kwargs
                assert error["param"] == param, (kwargs, error)
                assert error["type"] == "invalid_request_error" and error["message"].startswith(
                    "invalid "
                )
            with pytest.raises(openai.BadRequestError) as caught:
                await s.client.chat.completions.create(
                    model="tiny", messages=[{"role": "robot", "content": "x"}]
                )
            assert caught.value.body["param"] == "messages[0].role"
            with pytest.raises(openai.BadRequestError) as caught:
                await s.client.chat.completions.create(
                    model="tiny",
                    messages=[
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                        }
                    ],
                )
            assert "does not take images" in caught.value.body["message"]
            await nothing_held(s.runtime)

    async def test_unknown_model_and_path_are_404(self, serve):
        """A model the server does not serve and a path it does not have: 404."""
        async with serve() as s:
            with pytest.raises(openai.NotFoundError) as caught:
                await s.client.completions.create(model="gpt-5", prompt="hi")
            assert (
                caught.value.body["code"] == "model_not_found"
                and caught.value.body["param"] == "model"
            )
            with pytest.raises(openai.NotFoundError):
                await s.client.models.retrieve("gpt-5")
            assert (await s.client.models.retrieve("tiny")).id == "tiny"
            assert [m.id for m in (await s.client.models.list()).data] == ["tiny"]
            async with httpx.AsyncClient(base_url=s.url) as http:
                missing = await http.get("/v1/embeddings")
                wrong_method = await http.get("/v1/completions")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
            assert wrong_method.status_code == 405 and "error" in wrong_method.json()

    async def test_admission_limit_is_503_with_a_bounded_queue(self, serve):
        """With one slot and a queue of one, a third request is refused at once with
        503 "overloaded"; the queued one runs once the slot is free; one that gives
        up while queued leaves the queue."""
        async with serve(server_options={"max_concurrent": 1, "max_queue": 1}) as s:
            holding = await s.client.chat.completions.create(
                model="tiny", messages=chat("Go on."), max_tokens=20000, stream=True, **GREEDY
            )
            await holding.__anext__()  # admitted and generating
            with anyio.move_on_after(0.5):  # queued behind it, then the client leaves
                await s.client.completions.create(model="tiny", prompt="hi", max_tokens=2)
                pytest.fail("admitted beyond the limit")
            with anyio.fail_after(5):
                while s.server.admission.statistics().num_waiting:
                    await anyio.sleep(0.01)
            queued: list[Any] = []

            async def wait_in_queue() -> None:
                queued.append(
                    await s.client.completions.create(
                        model="tiny", prompt="hi", max_tokens=2, **GREEDY
                    )
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_in_queue)
                with anyio.fail_after(10):
                    while s.server.admission.statistics().num_waiting < 1:
                        await anyio.sleep(0.01)
                with pytest.raises(openai.InternalServerError) as caught:
                    await s.client.completions.create(model="tiny", prompt="hi", max_tokens=2)
                assert caught.value.status_code == 503
                assert caught.value.body["code"] == "overloaded"
                assert caught.value.response.headers["retry-after"] == "1"
                assert not queued
                await holding.close()
            assert queued[0].usage.completion_tokens >= 1
            await nothing_held(s.runtime)
            with anyio.fail_after(5):  # the last answer's task leaves its slot after sending
                while s.server.admission.statistics().num_running:
                    await anyio.sleep(0.01)
            stats = s.server.admission.statistics()
            assert (stats.num_refused, stats.num_waiting, stats.num_admitted) == (1, 0, 2)
            metrics = await _metrics(s.url)
            assert (
                metrics['mlxkv_requests_total{endpoint="completions",outcome="disconnected"}'] == 1
            )
            assert metrics['mlxkv_requests_total{endpoint="completions",outcome="overloaded"}'] == 1

    async def test_body_over_the_limit_is_413(self, serve):
        """A body larger than ``max_body_bytes`` is refused before it is parsed."""
        async with serve(server_options={"max_body_bytes": 1000}) as s:
            with pytest.raises(openai.APIStatusError) as caught:
                await s.client.completions.create(model="tiny", prompt="x" * 2000, max_tokens=1)
            assert caught.value.status_code == 413 and caught.value.body["code"] == "body_too_large"
            small = await s.client.completions.create(model="tiny", prompt="x" * 500, max_tokens=1)
            assert small.usage.prompt_tokens == 500

    async def test_closed_runtime_is_503(self, serve):
        """Once the runtime is closed, generation requests and /health answer 503."""
        from mlxkv.server import running

        async with serve() as s:
            pass  # the runtime is closed now
        async with running(s.server, graceful_timeout=0.5) as url:
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="-", max_retries=0
            ) as client:
                with pytest.raises(openai.InternalServerError) as caught:
                    await client.completions.create(model="tiny", prompt="hi")
            async with httpx.AsyncClient(base_url=url) as http:
                health = await http.get("/health")
                metrics = await http.get("/metrics")
        assert caught.value.status_code == 503 and caught.value.body["code"] == "runtime_closed"
        assert health.status_code == 503 and metrics.status_code == 503


class TestTenants:
    """With API keys, each key is its own cache namespace."""

    async def test_keys_are_required_and_isolate_prefixes(self, serve):
        """No key or a wrong one is 401; a prefix one key cached is not reused by
        another key (whose time to first token it would otherwise shorten), and a
        request's own cache_salt divides its key's namespace further."""
        async with serve(api_key="alice", server_options={"api_keys": ("alice", "bob")}) as s:

            async def cached(key: str, **extra: Any) -> int:
                async with openai.AsyncOpenAI(
                    base_url=s.url + "/v1", api_key=key, max_retries=0
                ) as client:
                    reply = await client.completions.create(
                        model="tiny", prompt=SYSTEM, max_tokens=2, extra_body=extra
                    )
                return reply.usage.prompt_tokens_details.cached_tokens

            assert await cached("alice") == 0
            assert await cached("bob") == 0
            assert await cached("alice") > 0
            assert await cached("alice", cache_salt="project") == 0
            assert await cached("alice", cache_salt="project") > 0
            for key in ("mallory", "alic"):
                with pytest.raises(openai.AuthenticationError) as caught:
                    await cached(key)
                assert (
                    caught.value.status_code == 401
                    and caught.value.body["code"] == "invalid_api_key"
                )
            async with httpx.AsyncClient(base_url=s.url) as http:
                keyless = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert (
                    keyless.status_code == 401
                    and keyless.json()["error"]["code"] == "invalid_api_key"
                )
                assert (await http.get("/v1/models")).status_code == 401
                assert (await http.get("/health")).status_code == 200


class TestChoices:
    """``n``: several answers to one prompt, each a generation of its own, over
    the prompt's KV computed once."""

    async def test_greedy_choices_are_the_lone_answer_and_share_the_prompt(self, serve):
        """Three greedy choices are each the answer of ``n=1``, indexed 0-2; the
        usage counts the prompt once and every choice's tokens; the prompt's
        full blocks were computed once for the three (in-flight sharing)."""
        async with serve() as s:
            lone = await s.client.completions.create(model="tiny", prompt=ASK, max_tokens=12, **GREEDY)
            before = (await s.runtime.stats()).compute.num_prefill_tokens
            three = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=12, n=3, extra_body={"cache_salt": "cold"}, **GREEDY
            )
            computed = (await nothing_held(s.runtime)).compute.num_prefill_tokens - before
            prompt = lone.usage.prompt_tokens
            assert [c.index for c in three.choices] == [0, 1, 2]
            assert [c.text for c in three.choices] == [lone.choices[0].text] * 3
            assert {c.finish_reason for c in three.choices} == {lone.choices[0].finish_reason}
            assert three.usage.prompt_tokens == prompt
            assert three.usage.completion_tokens == 3 * lone.usage.completion_tokens
            assert three.usage.total_tokens == prompt + 3 * lone.usage.completion_tokens
            assert three.usage.prompt_tokens_details.cached_tokens == 0  # a new salt: one choice computed it
            # One choice computes the prompt; the others wait for its full blocks
            # and compute what no full block holds (block size 16).
            assert prompt <= computed <= prompt + 2 * 16, (computed, prompt)

    async def test_a_batch_of_prompts_is_answered_prompt_by_prompt(self, serve):
        """Two prompts of two choices each: choices 0-1 are the first prompt's
        lone answer, 2-3 the second's; usage counts each prompt once; a batch
        past the bound on generations is refused, naming the prompt; as
        lm-eval-harness scores a batch (token ids, ``echo``, ``logprobs: 1``,
        one token), each choice's entries begin with its own prompt's."""
        prompts = [ASK, ASK_TOO]
        async with serve() as s:
            lone = [
                await s.client.completions.create(model="tiny", prompt=p, max_tokens=8, **GREEDY) for p in prompts
            ]
            batch = await s.client.completions.create(model="tiny", prompt=prompts, max_tokens=8, n=2, **GREEDY)
            with pytest.raises(openai.BadRequestError) as info:
                await s.client.completions.create(model="tiny", prompt=[ASK] * 9, max_tokens=1, n=2)
            ids = [list(await s.runtime.tokenize(p)) for p in prompts]
            scored = await s.client.completions.create(
                model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1, seed=1234, **GREEDY
            )
            await nothing_held(s.runtime)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert [c.text for c in batch.choices] == [lone[0].choices[0].text] * 2 + [lone[1].choices[0].text] * 2
        assert batch.usage.prompt_tokens == sum(answer.usage.prompt_tokens for answer in lone)
        assert batch.usage.completion_tokens == 2 * sum(answer.usage.completion_tokens for answer in lone)
        assert info.value.body["param"] == "prompt" and "9 x n=2" in info.value.body["message"]
        for choice, prompt in zip(scored.choices, ids):
            assert len(choice.logprobs.token_logprobs) == len(prompt) + 1
            assert choice.logprobs.token_logprobs[0] is None
            assert all(value <= 0 for value in choice.logprobs.token_logprobs[1:])

    async def test_streamed_choices_interleave_and_each_ends_once(self, serve):
        """A streamed chat of two choices: each choice opens with the role, its
        pieces join to the unstreamed choice's text, it ends with one finish
        chunk, and the usage chunk comes last with both choices' tokens."""
        async with serve() as s:
            whole = await s.client.chat.completions.create(
                model="tiny", messages=chat("Hello!"), max_tokens=10, n=2, **GREEDY
            )
            stream = await s.client.chat.completions.create(
                model="tiny", messages=chat("Hello!"), max_tokens=10, n=2, stream=True,
                stream_options={"include_usage": True}, **GREEDY,
            )  # fmt: skip
            chunks = [chunk async for chunk in stream]
            await nothing_held(s.runtime)
        texts, roles, ends = {0: "", 1: ""}, {0: 0, 1: 0}, {0: [], 1: []}
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.finish_reason is not None:
                ends[choice.index].append(choice.finish_reason)
        assert roles == {0: 1, 1: 1}
        assert texts == {c.index: c.message.content for c in whole.choices}
        assert ends == {c.index: [c.finish_reason] for c in whole.choices}
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    async def test_seeded_choices_differ(self, serve):
        """Sampled choices with a seed are not copies of one another: each draws
        with its own seed (``seed + index``; one seed for all gives three equal
        answers here). Whether a seeded answer is the same again is the
        runtime's to test: which choice computes the prompt and which reuses it
        varies with scheduling, and the two paths' logits may part in the last
        bits."""
        async with serve() as s:
            three = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=12, n=3, temperature=1.0, seed=7
            )
        assert len({c.text for c in three.choices}) == 3

    async def test_disconnect_releases_every_choice(self, serve):
        """A client that leaves a stream of three choices stops all three: nothing
        stays held, and the request counts once, as disconnected."""
        async with serve() as s:
            stream = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=20000, n=3, stream=True, **GREEDY
            )
            received = 0
            async for _ in stream:
                received += 1
                if received == 6:
                    break
            assert (await s.runtime.stats()).compute.num_live == 3
            await stream.close()
            stats = await nothing_held(s.runtime)
            assert stats.generation.num_stopped == 3
            metrics = await _metrics(s.url)
        assert metrics['mlxkv_requests_total{endpoint="completions",outcome="disconnected"}'] == 1

    async def test_each_choice_holds_an_admission_slot(self, serve):
        """With two slots, a request of two choices holds both while it
        generates (a one-choice request waits meanwhile, then is served), and
        one of three choices is refused (it could never run)."""
        async with serve(server_options={"max_concurrent": 2, "max_queue": 4}) as s:
            with pytest.raises(openai.BadRequestError) as caught:
                await s.client.completions.create(model="tiny", prompt=ASK, max_tokens=2, n=3)
            assert caught.value.body["param"] == "n" and "--max-concurrent" in caught.value.body["message"]
            stream = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=20000, n=2, stream=True, **GREEDY
            )
            await anext(aiter(stream))
            assert s.server.admission.statistics().num_running == 2
            async with anyio.create_task_group() as tg:
                lone: list[Any] = []

                async def one() -> None:
                    lone.append(await s.client.completions.create(model="tiny", prompt=ASK, max_tokens=2))

                tg.start_soon(one)
                with anyio.fail_after(10):
                    while s.server.admission.statistics().num_waiting == 0:
                        await anyio.sleep(0.01)
                assert not lone
                await stream.close()
            assert lone[0].choices[0].finish_reason == "length"
            await nothing_held(s.runtime)
            assert s.server.admission.statistics().num_running == 0

    async def test_a_failure_is_found_past_cancellations(self):
        """What a failed task group of choices is answered as: its first failure,
        nested groups opened and the cancellations it caused passed over;
        nothing where it holds only cancellations (then the group goes on)."""
        from mlxkv.errors import ComputeFailed
        from mlxkv.server.answer import first_failure

        async def cancelled() -> BaseException:
            """A real cancellation of this backend (trio's has no public constructor)."""
            with anyio.CancelScope() as scope:
                scope.cancel()
                try:
                    await anyio.sleep(1)
                except anyio.get_cancelled_exc_class() as error:
                    caught = error
            return caught

        failure = ComputeFailed("x-1", RuntimeError("injected"))
        nested = BaseExceptionGroup("", [await cancelled(), BaseExceptionGroup("", [await cancelled(), failure])])
        assert first_failure(nested) is failure
        assert first_failure(BaseExceptionGroup("", [await cancelled(), await cancelled()])) is None

    @pytest.mark.parametrize("stream", [False, True])
    async def test_a_failing_choice_fails_the_request_as_itself(self, serve, monkeypatch, stream):
        """One choice's computation failing ends the request with that failure
        (500, ``compute_failed``, naming the choice's request; in a stream, its
        last event), not as an unknown error; the other choices are stopped
        and release everything. The fault is injected where the server reads
        the choice's tokens (a real compute fault is the runtime's tests')."""
        from mlxkv.errors import ComputeFailed
        from mlxkv.generation import Generation

        honest = Generation.__anext__

        async def failing(self: Generation) -> Any:
            record = await honest(self)
            if self.request.request_id.endswith("-1") and isinstance(record, GeneratedToken) and record.index == 2:
                raise ComputeFailed(self.request.request_id, RuntimeError("injected"))
            return record

        monkeypatch.setattr(Generation, "__anext__", failing)
        async with serve() as s:
            if stream:
                async with httpx.AsyncClient(base_url=s.url, timeout=30) as http:
                    body = {"prompt": ASK, "max_tokens": 8, "n": 3, "temperature": 0, "stream": True}
                    response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200
                events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
                error = json.loads(events[-1])["error"]
            else:
                with pytest.raises(openai.InternalServerError) as caught:
                    await s.client.completions.create(model="tiny", prompt=ASK, max_tokens=8, n=3, **GREEDY)
                error = caught.value.body
            stats = await nothing_held(s.runtime)
        assert error["code"] == "compute_failed" and error["message"].endswith("-1 failed"), error
        assert stats.generation.num_stopped >= 2


class TestLogprobs:
    """Tokens' log-probabilities, in the two endpoints' shapes: one entry for
    every token the usage counts, each the runtime's own record."""

    async def test_completions_give_the_runtimes_records(self, serve):
        """``logprobs: 3`` on ``/v1/completions``: each counted token's text,
        log-probability and three likeliest alternatives -- the runtime's own
        (``generate(logprobs=3)`` on the same ids) -- and where its text
        starts in the answer."""
        async with serve() as s:
            ids = list(await s.runtime.tokenize(ASK))
            direct = []
            async with s.runtime.generate(ids, max_tokens=12, logprobs=3, cache_salt="direct") as stream:
                async for record in stream:
                    if isinstance(record, GeneratedToken):
                        direct.append(record)
            answer = await s.client.completions.create(model="tiny", prompt=ASK, max_tokens=12, logprobs=3, **GREEDY)
            plain = await s.client.completions.create(model="tiny", prompt=ASK, max_tokens=12, **GREEDY)
            decode = s.runtime.preparer.decode
        assert plain.choices[0].logprobs is None
        (choice,) = answer.choices
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == answer.usage.completion_tokens == len(direct)
        assert logprobs.tokens == [decode([record.token]) for record in direct]
        np.testing.assert_allclose(logprobs.token_logprobs, [r.logprob.logprob for r in direct], atol=LOGITS_ATOL)
        for alternatives, record in zip(logprobs.top_logprobs, direct):
            expected = {decode([token]): value for token, value in reversed(record.logprob.top)}
            assert alternatives.keys() == expected.keys()
            np.testing.assert_allclose(
                list(alternatives.values()), [expected[k] for k in alternatives], atol=LOGITS_ATOL
            )
        offsets = [sum(len(r.text) for r in direct[:i]) for i in range(len(direct))]
        assert logprobs.text_offset == offsets
        assert choice.text == "".join(r.text for r in direct)

    async def test_a_streamed_chat_gives_every_counted_token_once(self, serve):
        """``logprobs: true, top_logprobs: 2`` on a streamed chat: the chunks'
        entries, joined, are the unstreamed answer's, one for each counted
        token, the likeliest alternative first (greedy: the token itself);
        a stop string cuts the text, not the entries of the tokens counted."""
        kwargs: dict[str, Any] = {"messages": chat("Hello!"), "max_tokens": 10, **GREEDY}
        async with serve() as s:
            create = functools.partial(s.client.chat.completions.create, model="tiny")
            whole = await create(logprobs=True, top_logprobs=2, **kwargs)
            _, usage, chunks = await streamed_chat(
                s.client, logprobs=True, top_logprobs=2, stream_options={"include_usage": True}, **kwargs
            )
            text = whole.choices[0].message.content
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            stopped = await create(logprobs=True, stop=[stop], **kwargs)
            await nothing_held(s.runtime)
        entries = whole.choices[0].logprobs.content
        assert len(entries) == whole.usage.completion_tokens == usage.completion_tokens
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in entries]
        np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in entries], atol=LOGITS_ATOL)
        for entry in entries:
            assert entry.bytes == list(entry.token.encode("utf-8"))
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.top_logprobs[0].token == entry.token
            assert entry.logprob == entry.top_logprobs[0].logprob
        assert stopped.choices[0].finish_reason == "stop"
        assert len(stopped.choices[0].logprobs.content) == stopped.usage.completion_tokens
        assert all(e.top_logprobs == [] for e in stopped.choices[0].logprobs.content)

    async def test_echo_gives_the_prompts_records_as_lm_eval_reads_them(self, serve):
        """``echo`` with ``logprobs: 1``, as lm-eval-harness scores a
        continuation: the answer begins with the prompt, and so do the
        entries -- the first token's null, then each prompt token's
        log-probability and likeliest alternative, the model's over the
        whole prompt (its prefix cached and reused by none of it) -- then the
        answer's, as without ``echo``; streamed, the same entries."""
        from mlx_lm import load

        async with serve() as s:
            ids = list(await s.runtime.tokenize(ASK))
            await s.client.completions.create(model="tiny", prompt=ids, max_tokens=2, **GREEDY)  # cached now
            kwargs: dict[str, Any] = {"model": "tiny", "prompt": ids, "max_tokens": 4, "logprobs": 1, **GREEDY}
            plain = await s.client.completions.create(**kwargs)
            echoed = await s.client.completions.create(echo=True, **kwargs)
            chunks = [c async for c in await s.client.completions.create(echo=True, stream=True, **kwargs)]
            echo_only = await s.client.completions.create(model="tiny", prompt=ASK, max_tokens=3, echo=True, **GREEDY)
            await nothing_held(s.runtime)
            path = s.runtime.config.model
        model, _ = load(path)
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        (choice,) = echoed.choices
        answer = plain.choices[0]
        prompt_text = s.runtime.preparer.decode(ids)
        assert choice.text == prompt_text + answer.text
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(ids) + len(answer.logprobs.tokens)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        np.testing.assert_allclose(
            logprobs.token_logprobs[1 : len(ids)], [reference[i, t] for i, t in enumerate(ids[1:])], atol=LOGITS_ATOL
        )
        assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
        assert logprobs.tokens[len(ids) :] == answer.logprobs.tokens
        np.testing.assert_allclose(
            logprobs.token_logprobs[len(ids) :], answer.logprobs.token_logprobs, atol=LOGITS_ATOL
        )
        assert logprobs.text_offset[len(ids) :] == [len(prompt_text) + o for o in answer.logprobs.text_offset]
        streamed = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in streamed) == choice.text
        entries = [t for c in streamed if c.logprobs for t in c.logprobs.token_logprobs]
        assert entries[0] is None and len(entries) == len(logprobs.token_logprobs)
        np.testing.assert_allclose(entries[1:], logprobs.token_logprobs[1:], atol=LOGITS_ATOL)
        assert echo_only.choices[0].text.startswith(ASK) and echo_only.choices[0].logprobs is None

    async def test_each_choice_has_its_own(self, serve):
        """Two sampled choices: each its own entries, as many as its tokens."""
        async with serve() as s:
            answer = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=8, n=2, logprobs=1, temperature=1.0, seed=5
            )
        assert answer.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in answer.choices)
        for choice in answer.choices:
            assert all(len(top) == 1 for top in choice.logprobs.top_logprobs)
            assert all(value <= 0 for value in choice.logprobs.token_logprobs)


class TestPenalties:
    """Penalties and a bias reach the decoding."""

    async def test_a_bias_bans_and_forces_tokens(self, serve):
        """``logit_bias`` -100 on the greedy answer's first token: another
        answer; +100 on one token: every token is it (the log-probabilities
        say so); a token past the vocabulary: 400 naming the field."""
        async with serve() as s:
            kwargs: dict[str, Any] = {"model": "tiny", "prompt": ASK, "max_tokens": 6, "logprobs": 0, **GREEDY}
            async with s.runtime.generate(list(await s.runtime.tokenize(ASK)), max_tokens=1) as stream:
                first = [record.token async for record in stream if isinstance(record, GeneratedToken)][0]
            banned = await s.client.completions.create(**kwargs, logit_bias={str(first): -100})
            forced = await s.client.completions.create(**kwargs, logit_bias={"42": 100})
            with pytest.raises(openai.BadRequestError) as info:
                await s.client.completions.create(**kwargs, logit_bias={"100000": 1})
            await nothing_held(s.runtime)
        assert banned.choices[0].logprobs.tokens[0] != s.runtime.preparer.decode([first])
        assert set(forced.choices[0].logprobs.tokens) == {s.runtime.preparer.decode([42])}
        assert info.value.body["param"] == "logit_bias"


#: A schema a random model's answer ends quickly in (closed, short values).
VERDICT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "tense"]}, "score": {"enum": [1, 2, 3]}},
    "required": ["ok", "mood", "score"],
}


class TestJsonOutput:
    """``response_format``: the answer is JSON the schema (or JSON mode) allows."""

    async def test_a_schema_holds_streamed_and_whole_answers_and_every_choice(self, serve):
        """Chat, streamed and not, ``n`` 3 sampled: every answer is whole JSON
        of the schema (finish ``stop``); the streamed answer is the whole one."""
        response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
        kwargs: dict[str, Any] = {
            "model": "tiny", "messages": chat("Judge this."), "max_tokens": 400, "response_format": response_format,
        }  # fmt: skip
        async with serve() as s:
            whole = await s.client.chat.completions.create(**kwargs, **GREEDY)
            stream = await s.client.chat.completions.create(**kwargs, **GREEDY, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            sampled = await s.client.chat.completions.create(**kwargs, n=3, temperature=1.0, seed=5)
            await nothing_held(s.runtime)
        assert streamed == whole.choices[0].message.content
        for choice in [whole.choices[0], *sampled.choices]:
            assert choice.finish_reason == "stop", choice.message.content
            value = json.loads(choice.message.content)
            assert list(value) == ["ok", "mood", "score"] and isinstance(value["ok"], bool)
            assert value["mood"] in ("calm", "tense") and value["score"] in (1, 2, 3)

    async def test_the_openai_clients_parse_reads_a_pydantic_model(self, serve):
        """The real ``openai`` client's ``chat.completions.parse``: the schema
        it writes for a Pydantic model (strict: every key required, no others)
        holds the answer, and the client reads it back into the model."""
        import datetime
        import uuid
        from typing import Annotated, Literal

        from pydantic import BaseModel, Field, StringConstraints

        class Verdict(BaseModel):
            ok: bool
            mood: Literal["calm", "tense"]
            score: Literal[1, 2, 3]
            note: Optional[Literal["a", "b"]]

        class Booking(BaseModel):  # constrained fields: patterns, lengths, bounds, formats
            code: Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}$")]
            label: Annotated[str, Field(min_length=1, max_length=4)]
            seats: Annotated[int, Field(ge=1, le=5)]
            day: datetime.date
            ref: uuid.UUID
            extras: set[Literal["wifi", "meal", "bag"]]

        async with serve() as s:
            answer = await s.client.chat.completions.parse(
                model="tiny", messages=chat("Judge this."), max_tokens=400, response_format=Verdict, **GREEDY
            )
            booked = await s.client.chat.completions.parse(
                model="tiny", messages=chat("Book."), max_tokens=1500, response_format=Booking, **GREEDY
            )
            await nothing_held(s.runtime)
        parsed = answer.choices[0].message.parsed
        assert isinstance(parsed, Verdict) and parsed.mood in ("calm", "tense")
        assert Verdict.model_validate_json(answer.choices[0].message.content) == parsed
        booking = booked.choices[0].message.parsed
        assert isinstance(booking, Booking) and 1 <= booking.seats <= 5 and 1 <= len(booking.label) <= 4
        extras = json.loads(booked.choices[0].message.content)["extras"]
        assert len(extras) == len(set(extras))  # each once: a set's items

    async def test_json_mode_and_completions(self, serve):
        """``json_object``: an object (or, cut by ``max_tokens``, the start of
        one); completions take the field too, and a free answer of the same
        prompt is not JSON."""
        async with serve() as s:
            chat_answer = await s.client.chat.completions.create(
                model="tiny", messages=chat("JSON please."), max_tokens=40, response_format={"type": "json_object"},
                **GREEDY,
            )  # fmt: skip
            completion = await s.client.completions.create(
                model="tiny", prompt=ASK, max_tokens=40, extra_body={"response_format": {"type": "json_object"}},
                **GREEDY,
            )  # fmt: skip
            free = await s.client.completions.create(model="tiny", prompt=ASK, max_tokens=40, **GREEDY)
            grammar = s.runtime._generation.json_outputs.grammar({"type": "object"})
        for text, finish in (
            (chat_answer.choices[0].message.content, chat_answer.choices[0].finish_reason),
            (completion.choices[0].text, completion.choices[0].finish_reason),
        ):
            state = grammar.read(grammar.start, text.encode())
            assert text.startswith("{") and state
            assert grammar.complete(state) == (finish == "stop")
        assert not free.choices[0].text.startswith("{")

    async def test_a_reasoning_model_reasons_first(self, serve):
        """Where the model reasons and the prompt opened a block, the answer
        is the model's own free reasoning up to the end marker, then JSON:
        the reasoning apart, the content an object. The markers: the start the
        prompt's last two characters (so the prompt opens a block), the end
        two characters of the free greedy answer (random weights write no
        ``</think>``)."""
        from mlxkv.actors.json_grammar import JsonGrammar
        from mlxkv.server.reasoning import ReasoningSyntax

        ask = {"model": "tiny", "messages": chat("Think, then JSON."), "max_tokens": 80, **GREEDY}
        async with serve() as s:
            free = (await s.client.chat.completions.create(**ask, extra_body={"cache_salt": "free"})).choices[0]
            text = free.message.content
            prompt = s.server.chat.render(_messages(ask["messages"]))
            end_at = next(i for i in range(4, len(text) - 2) if text.find(text[i : i + 2]) == i)
            start, end = prompt[-2:], text[end_at : end_at + 2]
            assert start != end and prompt.rfind(end) < len(prompt) - 2
            template = copy.copy(s.server.chat)
            template.reasoning_syntax = ReasoningSyntax(start=start, end=end)
            s.server.chat = template
            held = await s.client.chat.completions.create(
                **ask, response_format={"type": "json_object"}, extra_body={"cache_salt": "held"}
            )
            await nothing_held(s.runtime)
        message = held.choices[0].message
        assert message.reasoning == text[:end_at]  # free text: the model's own greedy run
        grammar = JsonGrammar({"type": "object"})
        state = grammar.read(grammar.start, message.content.lstrip().encode())
        assert message.content.lstrip().startswith("{") and state
        assert grammar.complete(state) == (held.choices[0].finish_reason == "stop")

    async def test_what_cannot_be_held_is_400_naming_response_format(self, serve):
        async with serve() as s:
            with pytest.raises(openai.BadRequestError) as info:
                await s.client.chat.completions.create(
                    model="tiny", messages=chat("x"), max_tokens=4,
                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
                )  # fmt: skip
            assert info.value.body["param"] == "response_format" and "'not'" in info.value.body["message"]
            # Alternatives too alike fail as the text is read: a 400 too.
            ambiguous = {"anyOf": [{"type": "object", "properties": {"a": {"const": i}}} for i in range(300)]}
            with pytest.raises(openai.BadRequestError) as info:
                await s.client.chat.completions.create(
                    model="tiny", messages=chat("x"), max_tokens=4,
                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ambiguous}},
                )  # fmt: skip
            assert info.value.body["param"] == "response_format" and "ways" in info.value.body["message"]
            for response_format in (
                {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
                {"type": "json_schema"},
                {"type": "yaml"},
            ):
                with pytest.raises(openai.BadRequestError) as info:
                    await s.client.chat.completions.create(
                        model="tiny", messages=chat("x"), max_tokens=4, response_format=response_format
                    )
                assert info.value.body["param"].startswith("response_format"), response_format
            await nothing_held(s.runtime)


#: A conversation that called the weather tool and has its result.
CALLED = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
]  # fmt: skip


class TestTools:
    """Tools offered, calls read out of the answer, a tool's result sent back:
    on the built-in model with a chat template that takes tools
    (``TOOL_TEMPLATE`` in conftest.py, in mlx-lm's ``json_tools`` syntax)."""

    async def test_the_prompt_is_mlx_lms_render(self, serve, tool_model_path, tool_chat_template):
        """A conversation with tools, an assistant's call and the tool's result
        runs on exactly the tokens ``mlx_lm.server`` renders for it (mlx-lm's
        tokenizer, arguments given to the template as an object); with
        ``tool_choice: none`` the tools are still offered: the same tokens."""
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(tool_model_path)
        as_mlx_lm = json.loads(json.dumps(CALLED))
        as_mlx_lm[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
        expected = tokenizer.apply_chat_template(as_mlx_lm, tools=[WEATHER], add_generation_prompt=True)
        async with serve(path=tool_model_path, chat=tool_chat_template) as s:
            async with httpx.AsyncClient(base_url=s.url) as http:
                body = {"messages": CALLED, "tools": [WEATHER]}
                rendered = [
                    (await http.post("/v1/chat/completions/render", json={**body, **extra})).json()
                    for extra in ({}, {"tool_choice": "none"})
                ]
            assert rendered[0]["token_ids"] == list(expected) == rendered[1]["token_ids"]
            assert b'"name": "get_weather"' in bytes(t for t in expected if t < 256)

    async def test_a_tool_loop_reuses_the_conversation(self, serve, tool_model_path, tool_chat_template):
        """Turn 1 offers a tool; turn 2 sends back a call and its result: it is
        answered, on all of turn 1's prompt from the cache (its full blocks
        shared, its tail in the conversation's kept cache), as a cold run of
        it answers: the same tokens (its greedy run clear of ties) with the
        same log-probabilities (a reused KV that were wrong would move them)."""
        async with serve(path=tool_model_path, chat=tool_chat_template) as s:
            first = await s.client.chat.completions.create(
                model="tiny", messages=CALLED[:2], tools=[WEATHER], max_tokens=8, **GREEDY
            )
            assert first.choices[0].message.tool_calls is None  # random weights write no call
            again = {"model": "tiny", "messages": CALLED, "tools": [WEATHER], "max_tokens": 8, "logprobs": True, **GREEDY}
            second = await s.client.chat.completions.create(**again)
            assert second.usage.completion_tokens == 8 and second.choices[0].message.content
            assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
            cold = await s.client.chat.completions.create(**again, extra_body={"cache_salt": "cold"})
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            async with httpx.AsyncClient(base_url=s.url) as http:
                ids = (await http.post("/tokenize", json={"messages": CALLED, "tools": [WEATHER]})).json()["tokens"]
            assert least_gap(reference_load(tool_model_path)[0], ids, 8) > CLEAR_GAP
            assert second.choices[0].message.content == cold.choices[0].message.content
            # Each token's log-probability too (a reused KV that were wrong moves them, the tokens or not).
            warm_lp = [entry.logprob for entry in second.choices[0].logprobs.content]
            cold_lp = [entry.logprob for entry in cold.choices[0].logprobs.content]
            assert np.allclose(warm_lp, cold_lp, rtol=0, atol=LOGITS_ATOL), (warm_lp, cold_lp)
            await nothing_held(s.runtime)

    async def test_a_forced_call_is_the_answer(self, serve, tool_model_path, tool_chat_template):
        """``tool_choice`` naming a function, or ``required``: the answer is
        one call of it (of one of them), arguments of its schema, streamed or
        not; a schema outside the subset is a 400 naming the tools."""
        mode = {
            "type": "function",
            "function": {
                "name": "set_mode",
                "parameters": {
                    "type": "object", "properties": {"mode": {"enum": ["fast", "safe"]}, "level": {"enum": [1, 2]}},
                    "required": ["mode", "level"],
                },
            },
        }  # fmt: skip
        ask = {"model": "tiny", "messages": CALLED[:2], "tools": [WEATHER, mode], "max_tokens": 600, **GREEDY}
        async with serve(path=tool_model_path, chat=tool_chat_template) as s:
            assert s.server.chat.tool_syntax.json_body
            named = {"type": "function", "function": {"name": "set_mode"}}
            whole = await s.client.chat.completions.create(**ask, tool_choice=named)
            chunks = [c async for c in await s.client.chat.completions.create(**ask, tool_choice=named, stream=True)]
            sampled = await s.client.chat.completions.create(
                **{**ask, "temperature": 1.0, "seed": 3, "n": 3, "tools": [mode]}, tool_choice="required"
            )
            strict = {**mode, "function": {**mode["function"], "parameters": {"type": "string", "pattern": "(?=x)"}}}
            with pytest.raises(openai.BadRequestError) as info:
                await s.client.chat.completions.create(**{**ask, "tools": [strict]}, tool_choice="required")
            await nothing_held(s.runtime)
        assert info.value.body["param"] == "tools" and "lookaround" in info.value.body["message"]
        for choice in [whole.choices[0], *sampled.choices]:
            assert choice.finish_reason == "tool_calls" and not choice.message.content, choice.message
            (call,) = choice.message.tool_calls
            arguments = json.loads(call.function.arguments)
            assert call.function.name == "set_mode"
            assert arguments["mode"] in ("fast", "safe") and arguments["level"] in (1, 2)
        streamed = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
        assert [(c.function.name, c.function.arguments) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
        ]

    async def test_calls_are_read_from_a_real_answer(self, serve, tool_model_path, tool_chat_template):
        """The answer's calls come out of the model's own text, streamed or
        not: the server reads them in a syntax this test picks from what the
        model writes (its markers two-character pieces of a greedy answer; the
        parser a plain function), since random weights write no real call.
        Text outside the calls is the content, each call's text its
        arguments, and the stop string after a call ends it as ``tool_calls``."""
        from mlxkv.server.tools import ToolSyntax

        ask = {"model": "tiny", "messages": CALLED[:2], "tools": [WEATHER], "max_tokens": 48, **GREEDY}
        async with serve(path=tool_model_path, chat=tool_chat_template) as s:
            probe = await s.client.chat.completions.create(
                **ask, tool_choice="none", extra_body={"cache_salt": "probe"}
            )  # each request computes the prompt cold, alone: the same greedy text
            text = probe.choices[0].message.content
            start, end, stop = _markers(text)
            assert stop is not None, text
            template = copy.copy(s.server.chat)
            template.tool_syntax = ToolSyntax(
                start=start, end=end, parse=lambda call, tools: {"name": "echo", "arguments": {"text": call}}
            )
            s.server.chat = template
            expected_text, expected_calls = _reference_split(text[: text.index(stop)], start, end)
            assert expected_calls, (text, start, end)
            whole = await s.client.chat.completions.create(**ask, stop=[stop], extra_body={"cache_salt": "whole"})
            message = whole.choices[0].message
            assert message.content == (expected_text or None)
            assert [json.loads(c.function.arguments)["text"] for c in message.tool_calls] == expected_calls
            assert {c.function.name for c in message.tool_calls} == {"echo"}
            assert len({c.id for c in message.tool_calls}) == len(expected_calls)
            assert whole.choices[0].finish_reason == "tool_calls"
            chunks = [
                c async for c in await s.client.chat.completions.create(
                    **ask, stop=[stop], stream=True, extra_body={"cache_salt": "streamed"}
                )
            ]  # fmt: skip
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(d.content or "" for d in deltas) == expected_text
            streamed = [call for d in deltas for call in d.tool_calls or ()]
            assert [c.index for c in streamed] == list(range(len(expected_calls)))
            assert [json.loads(c.function.arguments)["text"] for c in streamed] == expected_calls
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            # parallel_tool_calls: false -- the answer ends with its first call.
            one = await s.client.chat.completions.create(
                **ask, parallel_tool_calls=False, extra_body={"cache_salt": "one"}
            )
            first_end = text.index(end, text.index(start) + len(start)) + len(end)
            first_text, first_calls = _reference_split(text[:first_end], start, end)
            assert [json.loads(c.function.arguments)["text"] for c in one.choices[0].message.tool_calls] == first_calls
            assert one.choices[0].message.content == (first_text or None)
            assert one.choices[0].finish_reason == "tool_calls" and one.usage.completion_tokens < 48
            # Ended by max_tokens (not cut by a stop string), the answer is kept for the
            # next turn: found by an assistant message of its text and calls, as a client
            # sends them back (ids its own, arguments spaced otherwise).
            kept = await s.client.chat.completions.create(**ask, extra_body={"cache_salt": "kept"})
            assert kept.choices[0].finish_reason == "length" and kept.choices[0].message.tool_calls
            sent_back = ChatMessage(
                role="assistant", content=kept.choices[0].message.content or "",
                tool_calls=tuple(
                    ToolCall(
                        id=f"mine-{i}", name=c.function.name,
                        arguments=json.dumps(json.loads(c.function.arguments), indent=1),
                    )
                    for i, c in enumerate(kept.choices[0].message.tool_calls)
                ),
            )  # fmt: skip
            rendered = template.render(_messages(CALLED[:2]), [WEATHER]) + text  # the prompt, the answer as written
            turn = s.server.memory.continued("kept", [*_messages(CALLED[:2]), sent_back], rendered + "...", count=False)
            assert turn is not None and turn.text == rendered
            assert len(turn.tokens) == kept.usage.prompt_tokens + 48
            assert s.server.memory.continued("kept", [*_messages(CALLED[:2]), attrs.evolve(sent_back, tool_calls=())],
                                             rendered + "...", count=False) is None  # fmt: skip
            await nothing_held(s.runtime)

    async def test_template_variables_reach_the_template(self, serve, default_model_path):
        """``chat_template_kwargs`` sets the template's variables (Qwen3's
        ``enable_thinking``, here over a template that reads it; mlx-lm's own
        default for it, the model's, yields to the request's); the template's
        own arguments cannot be set so."""
        from mlx_lm.utils import load_tokenizer

        from mlxkv.server.chat import ChatTemplate

        tokenizer = load_tokenizer(default_model_path)
        tokenizer.chat_template = "{{ messages[0]['content'] }}{% if enable_thinking %} <think>{% endif %}"
        async with serve(chat=ChatTemplate(tokenizer)) as s:
            async with httpx.AsyncClient(base_url=s.url) as http:

                async def rendered(**extra: Any) -> Any:
                    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
                    return await http.post("/v1/chat/completions/render", json=body)

                plain = (await rendered()).json()["token_ids"]
                thinking = (await rendered(chat_template_kwargs={"enable_thinking": True})).json()["token_ids"]
                assert bytes(plain) == b"Hi" and bytes(thinking) == b"Hi <think>"
                refused = await rendered(chat_template_kwargs={"add_generation_prompt": False})
                assert refused.status_code == 400
                assert refused.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"
        # The server's defaults (--chat-template-args), under the request's own.
        defaults = {"chat_template_args": {"enable_thinking": True}}
        async with serve(chat=ChatTemplate(tokenizer), server_options=defaults) as s:
            async with httpx.AsyncClient(base_url=s.url) as http:
                assert bytes((await rendered()).json()["token_ids"]) == b"Hi <think>"
                off = await rendered(chat_template_kwargs={"enable_thinking": False})
                assert bytes(off.json()["token_ids"]) == b"Hi"

    async def test_reasoning_sent_back_is_rendered(self, serve, default_model_path):
        """A template that renders earlier turns' reasoning (interleaved
        thinking) gets it from the assistant message a client sends back."""
        from mlx_lm.utils import load_tokenizer

        from mlxkv.server.chat import ChatTemplate

        tokenizer = load_tokenizer(default_model_path)
        tokenizer.chat_template = "{% for m in messages %}[{{ m.reasoning_content or '' }}]{{ m.content }}{% endfor %}"
        turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "hm"}]
        async with serve(chat=ChatTemplate(tokenizer)) as s:
            async with httpx.AsyncClient(base_url=s.url) as http:
                rendered = await http.post("/v1/chat/completions/render", json={"messages": turns})
            assert bytes(rendered.json()["token_ids"]) == b"[]q[hm]a"

    async def test_tools_on_a_model_that_calls_none_are_refused(self, serve):
        async with serve() as s:
            with pytest.raises(openai.BadRequestError) as caught:
                await s.client.chat.completions.create(model="tiny", messages=chat("Hi"), tools=[WEATHER], max_tokens=2)
            assert caught.value.body["param"] == "tools" and "does not call tools" in caught.value.body["message"]


def _markers(text: str, *, longest: bool = False) -> tuple[str, str, Optional[str]]:
    """A block's start and end markers and a stop string, each two characters
    of ``text`` found first where they are picked: a block opens early, ends
    later (at the first end it can, or the last: the ``longest`` first
    block), and the stop string comes after it (None if none can)."""

    def first_at(at: int, since: int = 0) -> bool:
        return text.find(text[at : at + 2], since) == at

    assert len(text) >= 16, f"the greedy answer is too short to pick markers from: {text!r}"
    a = next(i for i in range(1, len(text) - 8) if first_at(i))
    ends = [i for i in range(a + 3, len(text) - 4) if first_at(i, a + 2)]
    b = ends[-1] if longest else ends[0]
    c = next((i for i in range(b + 2, len(text) - 1) if first_at(i)), None)
    return text[a : a + 2], text[b : b + 2], None if c is None else text[c : c + 2]


def _reference_split(text: str, start: str, end: str, *, open_runs_to_end: bool = False) -> tuple[str, list[str]]:
    """The text outside blocks and each block's text, read from the whole
    text at once; a block left open is text (a call cut short), or, with
    ``open_runs_to_end``, a block to the end (reasoning)."""
    closing = f"(?:{re.escape(end)}|\\Z)" if open_runs_to_end else re.escape(end)
    parts = re.split(f"{re.escape(start)}(.*?){closing}", text, flags=re.DOTALL)
    return "".join(parts[0::2]), parts[1::2]


class TestReasoning:
    """A reasoning model's reasoning, sent apart from its answer."""

    async def test_reasoning_is_read_apart_from_a_real_answer(self, serve):
        """The reasoning comes out of the model's own text, apart from the
        content: in the message's ``reasoning``, streamed in ``reasoning``
        deltas as it is written (or, with ``stream_reasoning: false``, one
        delta a block), left out on ``include_reasoning: false``, and kept in
        the content on ``separate_reasoning: false``. The markers are two-character
        pieces of a greedy answer this test picks (random weights write no
        ``<think>``); every request computes the prompt cold, alone: the same text."""
        from mlxkv.server.reasoning import ReasoningSyntax

        ask = {"model": "tiny", "messages": chat("Think first."), "max_tokens": 48, **GREEDY}

        async def asked(salt: str, **extra: Any) -> Any:
            return await s.client.chat.completions.create(**ask, extra_body={"cache_salt": salt, **extra})

        async def deltas(salt: str, **extra: Any) -> list[Any]:
            stream = await s.client.chat.completions.create(**ask, stream=True, extra_body={"cache_salt": salt, **extra})
            return [c.choices[0].delta async for c in stream if c.choices]

        async with serve() as s:
            text = (await asked("probe")).choices[0].message.content
            start, end, _ = _markers(text, longest=True)
            template = copy.copy(s.server.chat)
            template.reasoning_syntax = ReasoningSyntax(start=start, end=end)
            s.server.chat = template
            content, blocks = _reference_split(text, start, end, open_runs_to_end=True)
            assert len(blocks) >= 2 and len(blocks[0]) >= 4, (text, start, end)
            whole = await asked("whole")
            message = whole.choices[0].message
            assert message.content == content and message.reasoning == "".join(blocks)
            # Counted exactly in test_answer_pieces.py (a scripted generation).
            reasoned = whole.usage.completion_tokens_details.reasoning_tokens
            assert sum(len(block) for block in blocks) <= reasoned < whole.usage.completion_tokens
            streamed = await deltas("streamed")
            thoughts = [d.reasoning for d in streamed if getattr(d, "reasoning", None)]
            assert "".join(thoughts) == "".join(blocks) and len(thoughts) > len(blocks)  # as written
            assert "".join(d.content or "" for d in streamed) == content
            held = await deltas("held", stream_reasoning=False)
            assert [d.reasoning for d in held if getattr(d, "reasoning", None)] == [b for b in blocks if b]
            assert "".join(d.content or "" for d in held) == content
            left_out = await asked("left-out", include_reasoning=False)
            assert left_out.choices[0].message.content == content
            assert getattr(left_out.choices[0].message, "reasoning", None) is None
            assert left_out.usage.completion_tokens_details.reasoning_tokens == reasoned  # read, not sent
            kept_in = await asked("kept-in", separate_reasoning=False)
            assert kept_in.choices[0].message.content == text
            assert getattr(kept_in.choices[0].message, "reasoning", None) is None
            assert kept_in.usage.completion_tokens_details.reasoning_tokens == 0
            await nothing_held(s.runtime)


class TestTokenize:
    """vLLM's ``/tokenize`` and ``/detokenize``: what a prompt costs, and the text of tokens."""

    async def test_tokens_are_what_the_server_runs(self, serve):
        """A prompt's tokens are those a completion of it runs on, a chat's
        those its generation runs on (its usage counts them); their count and
        the model's context come with them. Detokenized, the prompt's tokens
        are its text again."""
        async with serve() as s:
            async with httpx.AsyncClient(base_url=s.url) as http:
                prompt = await http.post("/tokenize", json={"model": "tiny", "prompt": ASK})
                conversation = await http.post("/tokenize", json={"messages": chat("Hello!")})
                back = await http.post("/detokenize", json={"tokens": prompt.json()["tokens"]})
            assert prompt.status_code == conversation.status_code == back.status_code == 200
            assert prompt.json()["tokens"] == list(await s.runtime.tokenize(ASK))
            assert prompt.json()["count"] == len(prompt.json()["tokens"])
            assert prompt.json()["max_model_len"] == s.runtime.model_info.max_context
            answered = await s.client.chat.completions.create(
                model="tiny", messages=chat("Hello!"), max_tokens=2, **GREEDY
            )
            assert conversation.json()["count"] == answered.usage.prompt_tokens
            assert back.json() == {"prompt": ASK}
            metrics = await _metrics(s.url)
            assert metrics['mlxkv_requests_total{endpoint="tokenize",outcome="rendered"}'] == 2
            await nothing_held(s.runtime)

    async def test_bad_bodies_are_named(self, serve):
        async with serve() as s:
            async with httpx.AsyncClient(base_url=s.url) as http:
                for path, body, param in (
                    ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
                    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
                    ("/tokenize", {"messages": chat("x"), "return_token_strs": True}, "return_token_strs"),
                    ("/tokenize", {"messages": chat("x"), "add_generation_prompt": False}, "add_generation_prompt"),
                    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),  # 404
                    ("/detokenize", {"tokens": [1, 100_000]}, "tokens"),
                    ("/detokenize", {"tokens": "abc"}, "tokens"),
                    ("/detokenize", {}, "tokens"),
                ):
                    answer = await http.post(path, json=body)
                    assert answer.status_code == (404 if body.get("model") else 400), (path, body, answer.text)
                    assert answer.json()["error"]["param"] == param, (path, body)
            assert "index 1" in (await http_post(s.url, "/detokenize", {"tokens": [1, 100_000]}))["error"]["message"]


async def http_post(url: str, path: str, body: dict[str, Any]) -> Any:
    async with httpx.AsyncClient(base_url=url) as http:
        return (await http.post(path, json=body)).json()


class TestHealthAndMetrics:
    """``GET /health`` and ``GET /metrics``."""

    async def test_metrics_count_requests_reuse_and_ttft(self, serve):
        """The Prometheus text has requests by outcome, the time-to-first-token
        histogram, prefix-cache queries and hits, tokens reused and blocks."""
        async with serve() as s:
            for _ in range(2):
                await s.client.completions.create(
                    model="tiny", prompt=SYSTEM, max_tokens=3, **GREEDY
                )
            with pytest.raises(openai.BadRequestError):
                await s.client.completions.create(model="tiny", prompt="hi", top_p=7)
            metrics = await _metrics(s.url)
            stats = await s.runtime.stats()
            assert metrics['mlxkv_requests_total{endpoint="completions",outcome="length"}'] == 2
            assert metrics['mlxkv_requests_total{endpoint="completions",outcome="invalid"}'] == 1
            assert metrics["mlxkv_time_to_first_token_seconds_count"] == 2
            assert metrics["mlxkv_prefix_cache_queries_total"] == stats.index.num_lookups >= 2
            assert metrics["mlxkv_prefix_cache_hits_total"] == stats.index.num_hits
            assert (
                metrics["mlxkv_prompt_tokens_reused_total"] == stats.compute.num_cached_tokens > 0
            )
            assert metrics["mlxkv_request_cached_tokens_total"] == stats.compute.num_cached_tokens
            assert metrics['mlxkv_kv_blocks{state="cached"}'] == stats.allocator.num_cached > 0
            assert metrics['mlxkv_kv_blocks{state="held"}'] == 0
            assert metrics["mlxkv_decode_steps_total"] == stats.compute.num_decode_steps
            info = s.runtime.model_info
            compute = (
                f'mlxkv_compute_info{{compiled_layers="{info.compiled_layers}",device="{info.device}",'
                f'fused_projections="{info.fused_projections}",layers="{len(info.cache_layers)}",'
                f'prefix_attention="{info.prefix_attention}",transposed_layers="{info.transposed_layers}"}}'
            )
            assert metrics[compute] == 1
            async with httpx.AsyncClient(base_url=s.url) as http:
                health = (await http.get("/health")).json()
            assert health == {
                "status": "ok", "model": "tiny", "compute": s.runtime.model_info.summary(), "running": 0, "waiting": 0,
                "max_running": 32, "max_waiting": 128,
            }  # fmt: skip
            assert health["compute"].startswith(f"{s.runtime.model_info.device}, shared-prefix attention ")

    async def test_metrics_count_each_kv_tiers_blocks(self, serve, tmp_path):
        """With a disk tier, /metrics has its blocks by event and whether it
        answers (labelled by the tier's kind, not its path); a second server
        over the same directory loads the prompt."""
        tier = f"file://{tmp_path}"
        async with serve(kv_tiers=[tier]) as s:
            await s.client.completions.create(model="tiny", prompt=SYSTEM, max_tokens=3, **GREEDY)
            await s.runtime.flush_tiers()
            metrics = await _metrics(s.url)
        assert metrics['mlxkv_kv_tier_blocks_total{event="written",tier="file"}'] > 0
        assert metrics['mlxkv_kv_tier_available{tier="file"}'] == 1
        assert metrics["mlxkv_kv_tier_queue_dropped_total"] == 0
        async with serve(kv_tiers=[tier]) as s:
            await s.client.completions.create(model="tiny", prompt=SYSTEM, max_tokens=3, **GREEDY)
            metrics = await _metrics(s.url)
        assert metrics['mlxkv_kv_tier_blocks_total{event="loaded",tier="file"}'] > 0
        assert metrics["mlxkv_kv_tier_lookup_seconds_total"] > 0


class TestImages:
    """Image parts on the built-in vision-language model."""

    async def test_data_urls_are_seen_and_urls_refused(self, serve, vlm_path):
        """A data: URL image is part of the prompt (the answer differs with another
        image, a second turn about it reuses it); any other URL is refused unfetched."""
        import base64
        import io

        import numpy as np
        from PIL import Image

        from mlxkv.server.chat import ChatTemplate

        def data_url(seed: int) -> str:
            pixels = np.random.default_rng(seed).integers(0, 256, (48, 48, 3), dtype=np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="PNG")
            return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()

        def ask(url: str) -> list[dict[str, Any]]:
            return [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "What is it?"},
                    ],
                }
            ]

        template = await anyio.to_thread.run_sync(ChatTemplate.load, str(vlm_path))
        async with serve(path=str(vlm_path), chat=template) as s:
            one = await s.client.chat.completions.create(
                model="tiny", messages=ask(data_url(1)), max_tokens=8, **GREEDY
            )
            other = await s.client.chat.completions.create(
                model="tiny", messages=ask(data_url(2)), max_tokens=8, **GREEDY
            )
            assert one.usage.prompt_tokens > 20  # the image's tokens
            assert one.choices[0].message.content != other.choices[0].message.content
            again = await s.client.chat.completions.create(
                model="tiny",
                messages=ask(data_url(1)) + [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": "More?"}],
                max_tokens=4, **GREEDY,
            )  # fmt: skip
            assert (
                again.usage.prompt_tokens_details.cached_tokens
                >= (one.usage.prompt_tokens + one.usage.completion_tokens) // 16 * 16
            )
            for url in ("https://example.com/cat.png", "file:///etc/passwd", "/etc/passwd"):
                with pytest.raises(openai.BadRequestError) as caught:
                    await s.client.chat.completions.create(
                        model="tiny", messages=ask(url), max_tokens=2
                    )
                assert "URLs are not fetched" in caught.value.body["message"]
            await nothing_held(s.runtime)


def _messages(conversation: list[dict[str, str]]) -> list[Any]:
    from mlxkv.server.request import ChatMessage

    return [ChatMessage(role=m["role"], content=m["content"]) for m in conversation]


async def _metrics(url: str) -> dict[str, float]:
    """The server's /metrics samples, by name with labels."""
    async with httpx.AsyncClient(base_url=url) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
