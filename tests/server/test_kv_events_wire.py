"""KV events on the wire (``--kv-events``) and the render endpoints, as a
vLLM consumer sees them.

A real server on a free loopback port, a real ZMQ SUB socket (pyzmq) and
replay DEALER socket, and payloads decoded the way a vLLM 0.26 consumer
decodes them: ``msgspec.msgpack.Decoder`` over types declared from vLLM's
wire format (a positional batch of events tagged by ``type``). ZMQ calls
block, so they run on worker threads while the server serves on the loop.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import anyio
import pytest

pytest.importorskip("starlette")
pytest.importorskip("hypercorn")
openai = pytest.importorskip("openai")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
import httpx  # noqa: E402

from mlxkv.cache.errors import InvalidInput  # noqa: E402
from mlxkv.cache.kv_events import POOL, KVEventHub  # noqa: E402
from mlxkv.server.kv_wire import (  # noqa: E402
    END_OF_REPLAY,
    KVEventPublisher,
    KVWireConfig,
    WireEvents,
    medium_of,
    wire_hash,
)

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2?|httpcore2?)\.:ResourceWarning"
)

BS = 16
LOOPBACK = "tcp://127.0.0.1:*"


# -- vLLM 0.26's consumer-side types (declared from the wire format) --------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


# -- a consumer --------------------------------------------------------------------


class Consumer:
    """A SUB socket and a replay DEALER socket, used from worker threads."""

    def __init__(self, publisher: KVEventPublisher, topic: bytes = b"") -> None:
        self._context = zmq.Context()
        self.sub = self._context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(publisher.endpoint)
        self.replayer = self._context.socket(zmq.DEALER)
        if publisher.replay_endpoint is not None:
            self.replayer.connect(publisher.replay_endpoint)
        self.received: list[tuple[int, bytes]] = []
        self.topics: set[bytes] = set()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replayer.close(linger=0)
        self._context.term()

    def take(self, until: Any, timeout: float = 20.0) -> None:
        """Receive batches until ``until(self)`` holds (or fail after ``timeout``)."""
        deadline = timeout * 1000
        while not until(self):
            assert self.sub.poll(deadline), "no KV event batch came"
            topic, seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            self.received.append((int.from_bytes(seq, "big"), payload))

    def events(self) -> list[Any]:
        return [event for _, payload in self.received for event in DECODER.decode(payload).events]

    def stored(self) -> list[BlockStored]:
        return [event for event in self.events() if isinstance(event, BlockStored)]

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        self.replayer.send_multipart([b"", start.to_bytes(8, "big")])
        answered = []
        while True:
            assert self.replayer.poll(10_000), "the replay did not end"
            empty, seq, payload = self.replayer.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert payload == b""
                return answered
            answered.append((int.from_bytes(seq, "big"), payload))


async def _publisher(served: Any) -> KVEventPublisher:
    with anyio.fail_after(10):
        while served.server.kv_publisher is None:
            await anyio.sleep(0.01)
    return served.server.kv_publisher


async def _consumer(served: Any, topic: bytes = b"") -> Consumer:
    consumer = Consumer(await _publisher(served), topic)
    await anyio.sleep(0.3)  # ZMQ's subscription reaches the PUB socket
    return consumer


def _wire(**options: Any) -> dict[str, Any]:
    return {"kv_events": KVWireConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, **options)}


def _messages(system: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": "What next?"}]


async def _render(url: str, path: str, body: dict[str, Any], **headers: str) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


# -- the tests ---------------------------------------------------------------------


@pytest.mark.anyio
class TestOnTheWire:
    async def test_a_chat_requests_blocks_as_a_vllm_consumer_reads_them(self, serve):
        """Every full block of the rendered prompt is announced once, in chain
        order, with its tokens; an eviction is announced as a removal of a
        block announced before; sequence numbers have no gaps; a replay
        gives the very batches the SUB socket got."""
        first, second = "You keep answers short. " * 24, "Answer in French, always. " * 24
        async with serve(server_options=_wire(topic="kv"), max_blocks=48) as served:
            consumer = await _consumer(served, b"kv")
            try:
                body = {"model": "tiny", "messages": _messages(first), "max_tokens": 3}
                rendered = await _render(served.url, "/v1/chat/completions/render", body)
                tokens = rendered["token_ids"]
                blocks = [tokens[i : i + BS] for i in range(0, len(tokens) // BS * BS, BS)]
                answer = await served.client.chat.completions.create(
                    model="tiny", messages=_messages(first), max_tokens=3, temperature=0
                )
                assert answer.usage.prompt_tokens == len(tokens)
                await anyio.to_thread.run_sync(
                    consumer.take, lambda c: len(c.stored()) >= len(blocks)
                )
                stored = consumer.stored()[: len(blocks)]
                assert [event.token_ids for event in stored] == blocks
                assert stored[0].parent_block_hash is None
                for parent, child in zip(stored, stored[1:]):
                    assert child.parent_block_hash == parent.block_hashes[0]
                for event in stored:
                    assert (event.block_size, event.medium, event.lora_id, event.lora_name) == (BS, "GPU", None, None)
                    assert (event.extra_keys, event.group_idx) == ([None], 0)
                    assert len(event.block_hashes) == 1 and 0 <= event.block_hashes[0] < 1 << 64

                await served.client.chat.completions.create(
                    model="tiny", messages=_messages(second), max_tokens=3, temperature=0
                )
                await anyio.to_thread.run_sync(
                    consumer.take,
                    lambda c: any(isinstance(event, BlockRemoved) for event in c.events()),
                )
                announced = set()
                for event in consumer.events():
                    if isinstance(event, BlockStored):
                        announced.update(event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        assert event.medium == "GPU"
                        assert set(event.block_hashes) <= announced, "a removal of a block never announced"
                        announced.difference_update(event.block_hashes)
                removed = {h for e in consumer.events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
                assert removed & {event.block_hashes[0] for event in stored}

                numbers = [seq for seq, _ in consumer.received]
                assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
                assert consumer.topics == {b"kv"}
                replayed = await anyio.to_thread.run_sync(consumer.replay, 0)
                assert [seq for seq, _ in replayed] == list(range(len(replayed)))
                assert DECODER.decode(replayed[0][1]).events == [AllBlocksCleared()]
                assert replayed[numbers[0] :][: len(numbers)] == consumer.received
                later = await anyio.to_thread.run_sync(consumer.replay, numbers[-1])
                assert later[0] == consumer.received[-1]
                assert [seq for seq, _ in later] == list(range(numbers[-1], numbers[-1] + len(later)))
                batch = DECODER.decode(replayed[-1][1])
                assert batch.data_parallel_rank == 0 and batch.ts > 0
            finally:
                consumer.close()

    async def test_tenants_blocks_stay_off_the_wire_unless_announced(self, serve):
        """With API keys every request is a tenant's (salted): by default none
        of its blocks is announced; with ``salted="announce"`` they are, and
        the salt is not on the wire."""
        system = "Tenants' prompts are theirs. " * 12
        for salted, announced in (("omit", False), ("announce", True)):
            options = {**_wire(salted=salted), "api_keys": ("secret-key",)}
            async with serve(server_options=options, api_key="secret-key") as served:
                consumer = await _consumer(served)
                try:
                    await served.client.chat.completions.create(
                        model="tiny", messages=_messages(system), max_tokens=2
                    )
                    publisher = served.server.kv_publisher
                    with anyio.fail_after(10):
                        while publisher.wire.num_omitted == 0 and publisher.num_published < 2:
                            await anyio.sleep(0.02)
                    if announced:
                        await anyio.to_thread.run_sync(consumer.take, lambda c: len(c.stored()) > 0)
                        first = consumer.stored()[0]
                        assert first.extra_keys == [None]  # the salt entered its hash; it is not shown
                    else:
                        await anyio.sleep(0.3)
                        assert consumer.sub.poll(0) == 0
                        assert publisher.wire.num_omitted > 0
                finally:
                    consumer.close()


@pytest.mark.anyio
class TestRender:
    async def test_completions_render_is_the_prompts_tokens(self, serve):
        async with serve() as served:
            body = {"model": "tiny", "prompt": "Hello, router.", "max_tokens": 5, "temperature": 0}
            (rendered,) = await _render(served.url, "/v1/completions/render", body)
            assert rendered["token_ids"] == list(await served.runtime.tokenize("Hello, router."))
            assert rendered["sampling_params"]["max_tokens"] == 5
            assert rendered["request_id"].startswith("cmpl-") and rendered["model"] == "tiny"
            (by_ids,) = await _render(served.url, "/v1/completions/render", {"prompt": [5, 6, 7]})
            assert by_ids["token_ids"] == [5, 6, 7]

    async def test_chat_render_follows_the_conversation_memory(self, serve):
        """A later turn renders to the tokens the server will run (the kept
        answer's own tokens, not the text tokenized again), and rendering
        counts no conversation turn."""
        async with serve() as served:
            messages = _messages("Be brief. " * 8)
            answer = await served.client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, temperature=0
            )
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": "And then?"},
            ]
            before = served.server.memory.statistics()
            rendered = await _render(served.url, "/v1/chat/completions/render", {"messages": messages})
            assert served.server.memory.statistics() == before
            second = await served.client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=1, temperature=0
            )
            assert second.usage.prompt_tokens == len(rendered["token_ids"])
            assert second.usage.prompt_tokens_details.cached_tokens > 0
            assert rendered["features"] is None and rendered["request_id"].startswith("chatcmpl-")

    async def test_render_refuses_what_generation_refuses(self, serve):
        async with serve(server_options={"api_keys": ("k",)}, api_key="k") as served:
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
                unkeyed = await client.post("/v1/completions/render", json={"prompt": "x"})
                assert unkeyed.status_code == 401
                headers = {"Authorization": "Bearer k"}
                bad = await client.post("/v1/chat/completions/render", json={"messages": []}, headers=headers)
                assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
                unknown = await client.post(
                    "/v1/completions/render", json={"model": "other", "prompt": "x"}, headers=headers
                )
                assert unknown.status_code == 404


class TestWireEvents:
    """The conversion alone, on events from a real hub."""

    def _events(self, **fields: Any) -> list[Any]:
        hub = KVEventHub(block_size=4)
        with hub.subscribe() as subscription:
            hub.stored(tier=POOL, block_hash=b"\x01" * 32, parent_hash=None, token_ids=(1, 2, 3, 4), **fields)
            hub.removed(tier=POOL, reason="evicted", block_hash=b"\x01" * 32)
            hub.removed(tier=POOL, reason="evicted", block_hash=b"\x02" * 32)
            hub.close()
            return [subscription.receive_nowait() for _ in range(3)]

    def test_a_store_and_its_removal(self):
        wire = WireEvents()
        stored, removed, unknown = map(wire.convert, self._events())
        assert stored["block_hashes"] == [wire_hash(b"\x01" * 32)] == [int.from_bytes(b"\x01" * 8, "big")]
        assert stored["token_ids"] == [1, 2, 3, 4] and stored["medium"] == "GPU"
        assert removed == {"type": "BlockRemoved", "block_hashes": stored["block_hashes"], "medium": "GPU", "group_idx": 0}
        assert unknown is None  # never announced: nothing to take back

    def test_salted_blocks_are_omitted_by_default(self):
        events = self._events(salted=True, extra_keys=(("salt", "t"), ("images", "ab")))
        assert [WireEvents().convert(event) for event in events] == [None, None, None]
        stored = WireEvents(salted="announce").convert(events[0])
        assert stored["extra_keys"] == [[["images", "ab"]]]

    def test_media(self):
        assert medium_of(POOL) == "GPU"
        assert medium_of("file:///var/kv") == "DISK"
        assert medium_of("redis://host:6379/0") == "REDIS"

    def test_bad_settings(self):
        with pytest.raises(InvalidInput, match="kv_events"):
            KVWireConfig(endpoint="http://x:1")
        with pytest.raises(InvalidInput, match="kv_events_salted"):
            KVWireConfig(endpoint=LOOPBACK, salted="all")


class TestPublisher:
    def test_replay_ignores_a_malformed_request_and_answers_the_next(self):
        with KVEventPublisher(KVWireConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)) as publisher:
            publisher.publish([{"type": "AllBlocksCleared"}])
            consumer = Consumer(publisher)
            try:
                consumer.replayer.send_multipart([b"", b"\x00"])  # not 8 bytes
                consumer.replayer.send_multipart([b"", b"x", b"y"])
                replayed = consumer.replay(1)
                assert [seq for seq, _ in replayed] == [1]
                assert consumer.replay(5) == []
            finally:
                consumer.close()

    def test_an_address_in_use_is_refused_at_once(self):
        with KVEventPublisher(KVWireConfig(endpoint=LOOPBACK)) as publisher:
            taken = publisher.endpoint.replace("127.0.0.1", "*")
            with pytest.raises(InvalidInput, match="cannot open"):
                KVEventPublisher(KVWireConfig(endpoint=taken)).__enter__()
