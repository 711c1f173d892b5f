"""KV events on the wire, as vLLM publishes them, for prefix-aware routers.

``mlxkv serve --kv-events tcp://*:5557`` publishes the runtime's KV events
(:mod:`mlxkv.cache.kv_events`) on a ZMQ PUB socket in vLLM's format, so a
router written for vLLM (NVIDIA Dynamo's KV router, llm-d's KV-cache
indexer, ...) consumes an mlxkv worker unchanged. The format is vLLM
0.26's, where each event is a msgpack map tagged by ``type``
(vllm-project/vllm#42892) inside a positional batch:

* frames: ``topic`` (bytes), ``seq`` (8 bytes, big-endian, from 0, one per
  batch), ``payload``;
* payload: msgpack ``[timestamp, [event, ...], data_parallel_rank]``;
* ``{"type": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name",
  "extra_keys", "group_idx", "kv_cache_spec_kind"}`` -- one event per
  stored block;
* ``{"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}``;
* ``{"type": "AllBlocksCleared"}`` -- the first batch (seq 0) of every
  start: whatever a router knew of this worker's earlier run is gone.

Hashes are 64-bit unsigned integers: the low 64 bits of the chain hash
(its last 8 bytes, big-endian), as vLLM turns its hashes into integers.
``medium`` says where the block is: ``GPU`` for the block pool (vLLM's
name for the engine's own cache, what the model reads from, whatever the
device), ``DISK`` for a ``file://`` tier, ``REDIS`` for a ``redis://``
tier. ``extra_keys`` has one entry per block: None for a block of tokens
alone, else the keys that entered its hash beside its tokens (a prompt's
images: ``["images", KEY]``), never a tenant's salt.

Tenants. A router ignores salts, and a subscriber learns every announced
block's tokens: the prompts themselves. So blocks of salted chains (a
request with ``cache_salt``, or any request of a server with API keys,
whose tenants are salts) are not announced unless the server is told to
(``--kv-events-salted announce``); a removal is announced only for a block
whose store was.

Replay (``--kv-events-replay tcp://*:5558``, a ROUTER socket): a client
sends ``[identity, b"", start_seq as 8 bytes big-endian]`` and receives
``[identity, b"", seq, payload]`` for every batch still buffered from
``start_seq`` on, then ``[identity, b"", -1 as 8 signed bytes, b""]``.

Endpoints follow vLLM's rule: an address with ``*``, ``::``, ``ipc://`` or
``inproc://`` is bound, any other is connected to (a router that binds
its own SUB socket). The sockets live on a thread of their own; the event
loop hands it encoded batches and never waits.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal, Optional

import anyio
import attrs
import msgpack
import zmq

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_events import POOL, BlockRemoved, BlockStored, KVEvent, KVEventSubscription
from mlxkv.cache.validators import int_at_least

__all__ = [
    "END_OF_REPLAY",
    "WIRE_FORMAT",
    "KVEventPublisher",
    "KVWireConfig",
    "WireEvents",
    "medium_of",
    "wire_hash",
]

logger = logging.getLogger(__name__)

#: The vLLM release whose wire format this is.
WIRE_FORMAT = "vLLM 0.26 (map-encoded events, vllm-project/vllm#42892)"
#: The sequence number that ends a replay.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_MEDIA = {"file": "DISK", "redis": "REDIS", "rediss": "REDIS"}
_SALTED = ("omit", "announce")


_OPTION = {"endpoint": "kv_events", "replay_endpoint": "kv_events_replay"}


def _endpoint(instance: Any, attribute: attrs.Attribute, value: Optional[str]) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise InvalidInput(
            _OPTION[attribute.name], value, "must be a ZMQ address: tcp://HOST:PORT, ipc://PATH"
        )


@attrs.frozen(kw_only=True)
class KVWireConfig:
    """Where and how the KV events go on the wire (see the module docstring).

    Attributes:
        endpoint: the PUB socket's address.
        replay_endpoint: the replay ROUTER socket's address, or None.
        topic: the first frame of every message.
        salted: ``"omit"`` (the default) keeps tenants' blocks off the wire;
            ``"announce"`` announces them like any other (without their salt).
        buffer_batches: batches kept for replay.
        data_parallel_rank: the third field of every payload.
    """

    endpoint: str = attrs.field(validator=_endpoint)
    replay_endpoint: Optional[str] = attrs.field(default=None, validator=_endpoint)
    topic: str = ""
    salted: Literal["omit", "announce"] = attrs.field(default="omit")
    buffer_batches: int = attrs.field(default=10_000, validator=int_at_least(1))
    data_parallel_rank: int = 0

    @salted.validator
    def _check_salted(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in _SALTED:
            raise InvalidInput("kv_events_salted", value, f"must be one of {', '.join(_SALTED)}")


def wire_hash(block_hash: bytes) -> int:
    """A chain hash as the wire carries it: its low 64 bits, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


def medium_of(tier: str) -> str:
    """The wire's ``medium`` of a block held by ``tier`` (:data:`POOL` or a tier's name)."""
    if tier == POOL:
        return "GPU"
    scheme = tier.partition("://")[0].lower()
    return _MEDIA.get(scheme, scheme.upper())


class WireEvents:
    """Turns the runtime's KV events into vLLM's wire events.

    Owns: the blocks announced stored and not yet removed, per medium (a
    tier's removal names only its storage key; the pool's only hashes that
    it once stored), bounded by ``max_announced``: past it the oldest are
    forgotten, and their removal is then not announced (a router keeps a
    stale belief: one missed reuse, never a wrong block).

    Invariants:
        - a removal is announced only for a block whose store was;
        - a salted block's store is announced only when ``salted`` is
          ``"announce"``.
    """

    def __init__(self, *, salted: str = "omit", max_announced: int = 1 << 20) -> None:
        self._salted = salted == "announce"
        self._max_announced = max_announced
        #: (medium, key or hash) -> wire hash, oldest first.
        self._announced: dict[tuple[str, bytes], int] = {}
        self.num_omitted = 0

    def convert(self, event: KVEvent) -> Optional[dict[str, Any]]:
        """The wire event of ``event``, or None if it is not announced."""
        medium = medium_of(event.tier)
        if isinstance(event, BlockStored):
            if event.salted and not self._salted:
                self.num_omitted += 1
                return None
            if event.token_ids is None:  # a writer that did not know them: of no use to a router
                self.num_omitted += 1
                return None
            number = wire_hash(event.block_hash)
            self._remember((medium, event.key or event.block_hash), number)
            return {
                "type": "BlockStored",
                "block_hashes": [number],
                "parent_block_hash": None if event.parent_hash is None else wire_hash(event.parent_hash),
                "token_ids": list(event.token_ids),
                "block_size": event.block_size,
                "lora_id": None,
                "medium": medium,
                "lora_name": None,
                "extra_keys": [_unsalted(event.extra_keys)],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        assert isinstance(event, BlockRemoved), f"not a KV event: {event!r}"
        found = event.key or event.block_hash
        number = None if found is None else self._announced.pop((medium, found), None)
        if number is None:
            return None
        return {"type": "BlockRemoved", "block_hashes": [number], "medium": medium, "group_idx": 0}

    def _remember(self, where: tuple[str, bytes], number: int) -> None:
        announced = self._announced
        announced.pop(where, None)
        announced[where] = number
        if len(announced) > self._max_announced:
            del announced[next(iter(announced))]


def _unsalted(keys: Optional[tuple[Any, ...]]) -> Optional[list[Any]]:
    """A block's extra keys as the wire shows them: lists, and never a salt."""
    if not keys:
        return None
    shown = [list(key) if isinstance(key, tuple) else key for key in keys if not _is_salt(key)]
    return shown or None


def _is_salt(key: Any) -> bool:
    return type(key) is tuple and key[:1] == ("salt",)


def encode_batch(events: list[Mapping[str, Any]], *, rank: int, timestamp: Optional[float] = None) -> bytes:
    """One batch's payload: msgpack ``[timestamp, events, data_parallel_rank]``."""
    return msgpack.packb([time.time() if timestamp is None else timestamp, events, rank])


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The ZMQ sockets and the thread that owns them.

    Use as ``with KVEventPublisher(config) as publisher:`` (binds or
    connects on entry, so a bad address fails there), then
    ``await publisher.forward(subscription)`` on the event loop.

    Owns: a ZMQ context; on its thread (from :meth:`__enter__` on), the PUB
    socket, the replay socket, the pipe's PULL end, the sequence counter
    and the replay buffer; on the caller's thread, the PUSH end of the pipe
    and the counters.

    Invariants:
        - sequence numbers go 0, 1, 2, ... one per batch, in the order
          :meth:`publish` was called;
        - :meth:`publish` never waits: a batch that finds the pipe full is
          dropped and counted (``num_dropped``), leaving a gap nobody fills.
    """

    def __init__(self, config: KVWireConfig) -> None:
        self.config = config
        self._context = zmq.Context()
        self._pipe_address = f"inproc://mlxkv-kv-events-{id(self)}"
        self._push: Optional[zmq.Socket] = None
        self._thread: Optional[threading.Thread] = None
        #: The PUB socket's address once open (a bound ``:*`` port resolved).
        self.endpoint: Optional[str] = None
        #: The replay socket's address once open.
        self.replay_endpoint: Optional[str] = None
        self.num_published = 0
        self.num_dropped = 0
        self.wire = WireEvents(salted=config.salted)

    def __enter__(self) -> KVEventPublisher:
        """Open the sockets here, so a bad address fails in the caller; then
        hand them to the publisher thread (starting a thread is the memory
        barrier ZMQ asks for when a socket changes threads)."""
        sockets: list[zmq.Socket] = []
        try:
            pull = self._context.socket(zmq.PULL)
            sockets.append(pull)
            pull.bind(self._pipe_address)
            pub = self._context.socket(zmq.PUB)
            sockets.append(pub)
            pub.setsockopt(zmq.SNDHWM, 100_000)
            pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _open(pub, self.config.endpoint)
            replay = None
            if self.config.replay_endpoint is not None:
                replay = self._context.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.setsockopt(zmq.LINGER, 0)
                # A ROUTER drops what passes a peer's limit: room for a whole replay.
                replay.setsockopt(zmq.SNDHWM, self.config.buffer_batches + 1)
                replay.bind(self.config.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            push = self._context.socket(zmq.PUSH)
            sockets.append(push)
            push.setsockopt(zmq.SNDHWM, 100_000)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self._pipe_address)
        except zmq.ZMQError as error:
            for sock in sockets:
                sock.close(linger=0)
            self._context.term()
            raise InvalidInput(
                "kv_events", self.config.endpoint, f"cannot open its sockets: {error}"
            ) from error
        self._push = push
        self._thread = threading.Thread(
            target=self._run, args=(pull, pub, replay), name="mlxkv-kv-events", daemon=True
        )
        self._thread.start()
        self.publish([{"type": "AllBlocksCleared"}])
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets; idempotent."""
        push, self._push = self._push, None
        if push is not None:
            push.setsockopt(zmq.SNDTIMEO, 2000)
            try:
                push.send(b"")  # the end: the thread publishes what came before it
            except zmq.Again:
                logger.warning("kv events: the publisher thread did not take the end in 2 s")
            push.close()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
            if thread.is_alive():  # a daemon: it ends with the process
                logger.warning("kv events: the publisher thread did not stop in 5 s")
            else:
                self._context.term()

    def publish(self, events: list[Mapping[str, Any]]) -> None:
        """Queue one batch for the PUB socket (never waits; see ``num_dropped``)."""
        if self._push is None or not events:
            return
        payload = encode_batch(events, rank=self.config.data_parallel_rank)
        try:
            self._push.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1
            return
        self.num_published += 1

    async def forward(self, subscription: KVEventSubscription) -> None:
        """Publish ``subscription``'s events until it ends: what has arrived by
        the time a batch is made (one store's blocks, a step's evictions) is
        one batch."""
        with subscription:
            async for event in subscription:
                events = [event]
                while True:
                    try:
                        events.append(subscription.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                wire = [found for found in map(self.wire.convert, events) if found is not None]
                self.publish(wire)

    # -- the publisher thread ------------------------------------------------------

    def _run(self, pull: zmq.Socket, pub: zmq.Socket, replay: Optional[zmq.Socket]) -> None:
        try:
            self._serve(pull, pub, replay)
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in (pull, pub, replay):
                if sock is not None:
                    sock.close(linger=0)

    def _serve(self, pull: zmq.Socket, pub: zmq.Socket, replay: Optional[zmq.Socket]) -> None:
        topic = self.config.topic.encode()
        numbers = itertools.count()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_batches)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock is replay:
                    _serve_replay(replay, buffer)
                    continue
                payload = pull.recv()
                if not payload:
                    return
                seq = next(numbers)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                buffer.append((seq, payload))


def _open(sock: zmq.Socket, endpoint: str) -> str:
    if _binds(endpoint):
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.connect(endpoint)
    return endpoint


def _serve_replay(replay: zmq.Socket, buffer: deque[tuple[int, bytes]]) -> None:
    """Answer one replay request; a malformed one is logged and ignored."""
    frames = replay.recv_multipart()
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        logger.warning("kv events: ignored a replay request of %d frames", len(frames))
        return
    identity, _, start = frames
    first = int.from_bytes(start, "big")
    for seq, payload in list(buffer):
        if seq >= first:
            replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
    replay.send_multipart((identity, b"", END_OF_REPLAY, b""))
