"""Image hashing and the multimodal prefix cache (seed API).

:class:`MLLMPrefixCacheManager` keeps, per (images, prompt) pair, the vision
encoder's output, the language model's KV cache and the token ids they cover,
in an LRU bounded by entry count and by bytes. A repeated request skips the
vision encoder and as much prefill as its token ids share with the entry.

Image identity. An image may be given as

- a readable file's path (``str`` or ``os.PathLike``): its bytes are hashed;
- a ``data:`` URL: its *decoded* bytes are hashed, so it keys like the same
  image given as a file or as ``bytes``;
- any other string -- a URL (``scheme://...``, never fetched; a ``file://``
  URL too), a ``video:<path>:fps<f>:max<n>`` source, a path that cannot be
  read, any identifier, a malformed data URL -- is keyed by the string
  itself, as in the seed;
- ``bytes``/``bytearray``/``memoryview``: hashed as they are;
- a numpy or MLX array: dtype, shape and element bytes are hashed.

Keying is all this module does: it never needs the pixels. Code that must
load them (generation) is the one to reject an image it cannot read.

Two strengths. :func:`compute_image_hash` and :func:`compute_images_hash` keep
the seed's 16-hex-character (64-bit) output; for a file or a string the former
gives the seed's exact value. The caches never key on those: they use the
full SHA-256 keys of :func:`image_digest`/:func:`images_digest`, which also
separate the input kinds (a string keyed as such and a file or bytes that
happen to hold the same characters are different images), so no crafted
64-bit collision can be served another user's state. The combined key keeps
the image order: ``[A, B]`` and ``[B, A]`` are different requests.

The runtime (:mod:`mlxkv.images`) builds its keys from the same records
(:func:`image_key`, :func:`combine_image_keys`), but keys a picture by its
decoded pixels (kind ``pixels``), so that a file and the same picture as a
PIL image agree; its keys equal :func:`images_digest`'s for sources that are
not pictures and differ for pictures.
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import hashlib
import logging
import os
import re
import sys
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from mlxkv.cache.block_hash import ChainKeys
from mlxkv.cache.errors import InvalidInput, InvariantViolation
from mlxkv.cache.token_ids import check_token_ids

__all__ = [
    "ImageSource",
    "MLLMCacheManager",
    "MLLMCacheStats",
    "MLLMPrefixCacheEntry",
    "MLLMPrefixCacheManager",
    "VLMCacheEntry",
    "VLMCacheManager",
    "VLMCacheStats",
    "VLMPrefixCacheEntry",
    "VLMPrefixCacheManager",
    "combine_image_keys",
    "compute_image_hash",
    "compute_images_hash",
    "data_url_bytes",
    "image_digest",
    "image_key",
    "images_digest",
]

logger = logging.getLogger(__name__)

#: What :func:`compute_image_hash` accepts (arrays are numpy or MLX arrays).
ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Any]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_READ_CHUNK = 1 << 20
_MIB = 1024 * 1024


class _Fingerprint(NamedTuple):
    """An image's kind and the SHA-256 of its payload (bytes, URL, array)."""

    kind: bytes
    payload_digest: bytes

    @property
    def short(self) -> str:
        return self.payload_digest.hex()[:16]

    @property
    def key(self) -> bytes:
        return image_key(self.kind, self.payload_digest)


def image_key(kind: bytes, payload_digest: bytes) -> bytes:
    """Return the full-strength key (32 bytes) of one image of ``kind``.

    The kind enters the key, so payloads of different kinds never meet:
    ``b"content"`` (the SHA-256 of a file's or a data URL's bytes),
    ``b"string"``, ``b"array"`` here, and ``b"pixels"`` for the runtime's
    decoded pictures (:mod:`mlxkv.images`).

    Args:
        kind: what the payload is, without NUL bytes.
        payload_digest: the SHA-256 of the payload.
    """
    assert b"\0" not in kind, "an image kind holds no NUL byte"
    return hashlib.sha256(b"mlxkv.image\0" + kind + b"\0" + payload_digest).digest()


def _hash_file(path: Union[str, "os.PathLike[str]"]) -> Optional[bytes]:
    """The SHA-256 of the file's bytes, or None if it cannot be read as a file."""
    hasher = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(_READ_CHUNK), b""):
                hasher.update(chunk)
    except (OSError, ValueError):
        # ValueError: a path with an embedded NUL byte.
        return None
    return hasher.digest()


def _string_fingerprint(text: str) -> _Fingerprint:
    return _Fingerprint(b"string", hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())


def data_url_bytes(url: str) -> Optional[bytes]:
    """Return the bytes a ``data:`` URL carries (base64 or percent-encoded), or None if it is malformed."""
    header, sep, data = url[len("data:") :].partition(",")
    if not sep:
        return None
    if header.lower().endswith(";base64"):
        try:
            return base64.b64decode("".join(data.split()), validate=True)
        except binascii.Error:
            return None
    return urllib.parse.unquote_to_bytes(data)


def _array_fingerprint(obj: Any) -> Optional[_Fingerprint]:
    # An array type can only be met if its library is already imported, so
    # looking in sys.modules recognises arrays without importing anything.
    mx = sys.modules.get("mlx.core")
    if mx is not None and isinstance(obj, mx.array):
        dtype = str(obj.dtype).rsplit(".", 1)[-1]
        view = memoryview(obj)
        data: Any = view if view.c_contiguous else view.tobytes()
        return _Fingerprint(b"array", _array_digest(dtype, obj.shape, data))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise InvalidInput("image", obj, "array of Python objects has no stable bytes")
        if obj.dtype.byteorder == ">":
            # Same values, same key: big-endian input is normalised first.
            obj = obj.astype(obj.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(obj)
        return _Fingerprint(b"array", _array_digest(obj.dtype.name, obj.shape, data))
    return None


def _array_digest(dtype: str, shape: Sequence[int], data: Any) -> bytes:
    # dtype names hold no '|' and the shape only digits and commas, so the
    # header cannot run into the data.
    header = f"{dtype}|{','.join(str(d) for d in shape)}|".encode()
    hasher = hashlib.sha256(header)
    hasher.update(data)
    return hasher.digest()


def _fingerprint(image: Any) -> _Fingerprint:
    if isinstance(image, os.PathLike):
        image = os.fsdecode(image)
    if isinstance(image, str):
        if image[:5].lower() == "data:":
            data = data_url_bytes(image)
            if data is None:
                return _string_fingerprint(image)
            return _Fingerprint(b"content", hashlib.sha256(data).digest())
        if _URL.match(image):
            return _string_fingerprint(image)
        digest = _hash_file(image)
        if digest is None:
            return _string_fingerprint(image)
        return _Fingerprint(b"content", digest)
    if isinstance(image, memoryview) and not image.c_contiguous:
        image = image.tobytes()
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _Fingerprint(b"content", hashlib.sha256(image).digest())
    fingerprint = _array_fingerprint(image)
    if fingerprint is None:
        raise InvalidInput(
            "image", image,
            "expected a path, URL, data URL, bytes, or a numpy/MLX array",
        )
    return fingerprint


def _fingerprints(images: Any) -> List[_Fingerprint]:
    if images is None:
        return []
    if isinstance(images, (str, bytes, bytearray, memoryview, os.PathLike)):
        raise InvalidInput("images", images, "must be a list of images, not a single image")
    try:
        items = list(images)
    except TypeError as exc:
        raise InvalidInput("images", images, "must be a list of images") from exc
    return [_fingerprint(image) for image in items]


def combine_image_keys(keys: Sequence[bytes]) -> str:
    """Return the order-sensitive key (64 hex) of a list of images, each given
    by its :func:`image_key`: ``[A, B]``, ``[B, A]`` and ``[A]`` all differ."""
    # Fixed-width records in the given order.
    hasher = hashlib.sha256(b"mlxkv.images\0")
    hasher.update(len(keys).to_bytes(8, "little"))
    for key in keys:
        assert len(key) == 32, "an image key is a 32-byte image_key"
        hasher.update(key)
    return hasher.hexdigest()


def compute_image_hash(image_path: ImageSource) -> str:
    """Return the short (seed-format) hash of one image.

    Args:
        image_path: a file path, URL, data URL, bytes, or numpy/MLX array
            (see the module docstring for how each is read).

    Returns:
        16 hex characters: the first 64 bits of the SHA-256 of the image's
        payload (file bytes, decoded data-URL bytes, the string itself,
        array header and bytes): the seed's value for a file and for a
        string. For display and seed compatibility only; caches key on
        :func:`image_digest`.

    Raises:
        InvalidInput: an unsupported type (not a path, string, bytes or
            array), or an array of Python objects.
    """
    return _fingerprint(image_path).short


def compute_images_hash(images: Sequence[ImageSource]) -> str:
    """Return the short (seed-format) hash of an ordered list of images.

    Args:
        images: the request's images, in order.

    Returns:
        ``"no_images"`` for an empty list or ``None``; otherwise 16 hex
        characters of the SHA-256 of the per-image short hashes joined with
        ``"_"`` in the given order (the seed sorted them first).

    Raises:
        InvalidInput: as :func:`compute_image_hash`, or ``images`` is a single
            image rather than a list.
    """
    fingerprints = _fingerprints(images)
    if not fingerprints:
        return "no_images"
    combined = "_".join(f.short for f in fingerprints)
    return hashlib.sha256(combined.encode()).hexdigest()[:16]


def image_digest(image: ImageSource) -> str:
    """Return the full-strength key of one image: 64 hex characters.

    Unlike :func:`compute_image_hash`, the key also covers the input kind,
    so a string keyed as such (a URL, an identifier, a path that cannot be
    read) and a file or bytes holding its text differ.

    Raises:
        InvalidInput: as :func:`compute_image_hash`.
    """
    return _fingerprint(image).key.hex()


def images_digest(images: Sequence[ImageSource]) -> str:
    """Return the full-strength, order-sensitive key of a list of images (64 hex).

    Raises:
        InvalidInput: as :func:`compute_images_hash`.
    """
    return combine_image_keys([f.key for f in _fingerprints(images)])


@dataclass
class MLLMCacheStats:
    """Counters of an :class:`MLLMPrefixCacheManager`.

    Attributes:
        hits: fetches that found their exact (images, prompt) entry.
        misses: fetches that found nothing usable.
        partial_hits: exact hits whose token ids diverge from the entry's,
            plus image-only hits (vision embeddings reused, no KV).
        tokens_saved: matched token counts returned by exact hits.
        image_cache_hits: exact hits on requests with images.
        vision_encoder_skips: returned entries that carry vision embeddings.
        total_queries: all fetches.
        evictions: entries dropped for count or memory.
    """

    hits: int = 0
    misses: int = 0
    partial_hits: int = 0
    tokens_saved: int = 0
    image_cache_hits: int = 0
    vision_encoder_skips: int = 0
    total_queries: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / total_queries``; ``0.0`` before the first query."""
        if self.total_queries == 0:
            return 0.0
        return self.hits / self.total_queries

    def to_dict(self) -> dict:
        """Return the counters and the hit rate under the seed's keys."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "partial_hits": self.partial_hits,
            "hit_rate": self.hit_rate,
            "tokens_saved": self.tokens_saved,
            "image_cache_hits": self.image_cache_hits,
            "vision_encoder_skips": self.vision_encoder_skips,
            "total_queries": self.total_queries,
            "evictions": self.evictions,
        }


def _array_bytes(value: Any) -> int:
    """Bytes held by the arrays in ``value`` (arrays, caches, nested lists,
    records with an int ``nbytes``)."""
    if value is None or isinstance(value, (int, float, str, bytes)):
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_array_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(_array_bytes(item) for item in value.values())
    if hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(getattr(value, "nbytes", None), int):
        return value.nbytes  # a record that counts its own arrays
    if hasattr(value, "state"):
        # mlx-lm cache layers expose their arrays through ``state``.
        return _array_bytes(value.state)
    return 0


@dataclass
class MLLMPrefixCacheEntry:
    """What is kept for one (images, prompt) pair.

    Attributes:
        image_hash: full-strength key of the ordered images (64 hex; see
            :func:`images_digest`).
        prompt_hash: SHA-256 of the prompt text (64 hex).
        vision_embeddings: the vision encoder's output, or ``None``.
        kv_cache: the language model's per-layer caches.
        token_ids: the token ids ``kv_cache`` covers.
        num_image_tokens: how many of them stand for images.
        num_text_tokens: the others.
        prompt_tokens: ``len(token_ids)`` at store time.
        created_at: logical time of the store (the manager's store counter);
            no wall clock is read.
        hit_count: exact hits served from this entry.
        model_name: free-form label given at store time.
    """

    image_hash: str
    prompt_hash: str
    vision_embeddings: Any = None
    kv_cache: List[Any] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    num_image_tokens: int = 0
    num_text_tokens: int = 0
    prompt_tokens: int = 0
    created_at: float = 0
    hit_count: int = 0
    model_name: str = ""

    @property
    def total_tokens(self) -> int:
        """The number of token ids this entry covers."""
        return len(self.token_ids)

    @property
    def memory_size(self) -> int:
        """Bytes of the arrays held: vision embeddings plus every KV layer's state."""
        return _array_bytes(self.vision_embeddings) + _array_bytes(self.kv_cache)

    def get_prefix_match_length(self, new_token_ids: List[int]) -> int:
        """Return how many leading token ids ``new_token_ids`` shares with this entry."""
        match_length = 0
        for cached, new in zip(self.token_ids, new_token_ids):
            if cached != new:
                break
            match_length += 1
        return match_length

    def _detached(self) -> MLLMPrefixCacheEntry:
        # A copy whose caches, arrays and lists the caller may change freely;
        # the arrays' buffers are shared, not copied.
        return dataclasses.replace(
            self,
            vision_embeddings=copy.deepcopy(self.vision_embeddings),
            kv_cache=copy.deepcopy(self.kv_cache),
            token_ids=list(self.token_ids),
        )


class _Keys(NamedTuple):
    entry: str  # salt + images + prompt
    images_scope: str  # salt + images
    images: str
    prompt: str
    has_images: bool


class _Slot(NamedTuple):
    entry: MLLMPrefixCacheEntry
    nbytes: int
    images_scope: Optional[str]  # set iff the entry is in the image index


class _Found(NamedTuple):
    slot: Optional[_Slot]
    match_length: int
    exact: bool


def _namespace(cache_salt: Optional[str], images_key: str) -> bytes:
    """The (salt, ordered images) namespace, derived as block chains derive
    theirs (:class:`~mlxkv.cache.block_hash.ChainKeys`)."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidInput("cache_salt", cache_salt, "must be a str or None")
    return ChainKeys.derive(cache_salt=cache_salt, images_key=images_key).namespace()


def _positive(argument: str, value: Any, kinds: tuple) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or not 0 < value < float("inf")
    ):
        raise InvalidInput(argument, value, "must be a positive, finite number")


class MLLMPrefixCacheManager:
    """LRU cache of multimodal prefix states, bounded by count and bytes.

    Owns the entries (each a private snapshot of what was stored), their LRU
    order, an index from (salt, ordered images) to the entries that carry
    vision embeddings for them, the byte count and the statistics.

    Entries are keyed by SHA-256 over the namespace of the optional
    ``cache_salt`` and the ordered images' full-strength keys (derived by
    :class:`~mlxkv.cache.block_hash.ChainKeys`, as block chains are) and the
    prompt: tenants with different salts never share an entry, not even
    vision embeddings.

    Invariants:
        - ``len(self) <= max_size`` and ``_current_memory <= max_memory``.
        - ``_current_memory`` is the sum of the byte counts recorded for the
          stored entries (each computed once, at store time).
        - An entry key is in the image index iff its entry has images and
          vision embeddings, under its own salt-scoped images key.
        - No stored entry, KV layer or array handle is reachable from
          outside: stores snapshot, fetches return detached copies.

    Args:
        max_entries: the most entries kept.
        max_memory_mb: the most MiB of arrays kept (vision embeddings plus KV
            state, counted from the arrays' ``nbytes``).

    Raises:
        InvalidInput: a bound that is not a positive, finite number.
    """

    def __init__(self, max_entries: int = 50, max_memory_mb: int = 2048) -> None:
        _positive("max_entries", max_entries, (int,))
        _positive("max_memory_mb", max_memory_mb, (int, float))
        self.max_size = max_entries
        self.max_memory = int(max_memory_mb * _MIB)
        self.stats = MLLMCacheStats()
        self._cache: OrderedDict[str, _Slot] = OrderedDict()
        self._by_images: Dict[str, Dict[str, None]] = {}
        self._current_memory = 0
        self._tick = 0

    @staticmethod
    def _keys(images: Any, prompt: Any, cache_salt: Optional[str]) -> _Keys:
        if not isinstance(prompt, str):
            raise InvalidInput("prompt", prompt, "must be a str")
        fingerprints = _fingerprints(images)
        images_key = combine_image_keys([f.key for f in fingerprints])
        namespace = _namespace(cache_salt, images_key)
        prompt_key = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest()
        # The namespace is length-prefixed and the prompt key fixed-size: no
        # two (namespace, prompt) pairs give the same bytes.
        entry = hashlib.sha256(b"mlxkv.mllm-entry\0" + namespace + prompt_key)
        scope = hashlib.sha256(b"mlxkv.mllm-images\0" + namespace)
        return _Keys(
            entry.hexdigest(), scope.hexdigest(), images_key, prompt_key.hex(),
            bool(fingerprints),
        )

    def _make_cache_key(
        self, images: List[Any], prompt: str, *, cache_salt: Optional[str] = None
    ) -> str:
        """Return the full-strength entry key of (salt, images, prompt): 64 hex.

        Raises:
            InvalidInput: bad images, prompt or salt.
        """
        return self._keys(images, prompt, cache_salt).entry

    def _make_image_only_key(
        self, images: List[Any], *, cache_salt: Optional[str] = None
    ) -> str:
        """Return the salt-scoped key of the ordered images alone: 64 hex.

        Raises:
            InvalidInput: bad images or salt.
        """
        return self._keys(images, "", cache_salt).images_scope

    def fetch(
        self,
        images: List[Any],
        prompt: str,
        token_ids: Optional[List[int]] = None,
        *,
        cache_salt: Optional[str] = None,
    ) -> Tuple[Optional[MLLMPrefixCacheEntry], int]:
        """Look up the state stored for these images and this prompt.

        On an exact (salt, images, prompt) hit the match length is the
        entry's token count, or, if ``token_ids`` is given, how many leading
        ids it shares with the entry's. Otherwise, an entry with the same
        salt and the same images *in the same order* that holds vision
        embeddings is returned with match length 0, for its embeddings only.

        Args:
            images: the request's images, in order (may be empty).
            prompt: the request's prompt text.
            token_ids: the request's token ids, for prefix matching.
            cache_salt: tenant namespace; only entries stored with the same
                salt are seen.

        Returns:
            ``(entry, match_length)``; ``(None, 0)`` on a miss. The entry is a
            detached copy: changing it or its caches changes nothing here.

        Raises:
            InvalidInput: bad images, prompt, token ids or salt; nothing is
                counted then.
        """
        keys = self._keys(images, prompt, cache_salt)
        wanted = None if token_ids is None else list(check_token_ids(token_ids, argument="token_ids"))
        found = self._lookup(keys, wanted)
        if found.slot is None:
            return None, 0
        return found.slot.entry._detached(), found.match_length

    def _lookup(self, keys: _Keys, wanted: Optional[List[int]]) -> _Found:
        self.stats.total_queries += 1

        slot = self._cache.get(keys.entry)
        if slot is not None:
            self._cache.move_to_end(keys.entry)
            entry = slot.entry
            entry.hit_count += 1
            self.stats.hits += 1
            if keys.has_images:
                self.stats.image_cache_hits += 1
            if entry.vision_embeddings is not None:
                self.stats.vision_encoder_skips += 1
            match_length = entry.total_tokens
            if wanted:
                match_length = entry.get_prefix_match_length(wanted)
                if match_length < entry.total_tokens:
                    self.stats.partial_hits += 1
            self.stats.tokens_saved += match_length
            logger.debug("mllm cache hit: key=%s match=%d", keys.entry[:16], match_length)
            return _Found(slot, match_length, True)

        holders = self._by_images.get(keys.images_scope) if keys.has_images else None
        if holders:
            key = next(iter(holders))
            self._cache.move_to_end(key)
            self.stats.partial_hits += 1
            self.stats.vision_encoder_skips += 1
            logger.debug("mllm cache image-only hit: images=%s", keys.images[:16])
            return _Found(self._cache[key], 0, False)

        self.stats.misses += 1
        logger.debug("mllm cache miss: key=%s", keys.entry[:16])
        return _Found(None, 0, False)

    def fetch_cache(
        self, images: List[Any], prompt: str, *, cache_salt: Optional[str] = None
    ) -> Tuple[Optional[List[Any]], bool]:
        """Legacy lookup: the KV cache stored for exactly these images and prompt.

        Counted like :meth:`fetch`. An image-only match is *not* a hit here:
        its KV cache belongs to another prompt.

        Returns:
            ``(kv_cache, True)`` (a detached copy) on an exact hit whose entry
            has KV layers, else ``(None, False)``.

        Raises:
            InvalidInput: bad images, prompt or salt.
        """
        found = self._lookup(self._keys(images, prompt, cache_salt), None)
        if not found.exact or not found.slot.entry.kv_cache:
            return None, False
        return copy.deepcopy(found.slot.entry.kv_cache), True

    def store(
        self,
        images: List[Any],
        prompt: str,
        vision_embeddings: Any,
        kv_cache: List[Any],
        token_ids: List[int],
        num_image_tokens: int = 0,
        model_name: str = "",
        *,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Store a snapshot of a request's prefix state.

        Replaces any entry of the same (salt, images, prompt). Evicts least
        recently used entries until both the count and the memory bound hold.
        An entry larger than the whole memory budget is refused (logged,
        nothing evicted, any previous entry kept).

        Args:
            images: the request's images, in order.
            prompt: the request's prompt text.
            vision_embeddings: the vision encoder's output, or ``None``.
            kv_cache: the language model's per-layer caches (``None`` means
                none); the caller keeps its own, which may go on changing.
            token_ids: the token ids ``kv_cache`` covers.
            num_image_tokens: how many of ``token_ids`` stand for images.
            model_name: a label kept on the entry.
            cache_salt: tenant namespace of the entry.

        Raises:
            InvalidInput: bad images, prompt, salt, token ids, ``kv_cache``
                that is not a list, or ``num_image_tokens`` outside
                ``[0, len(token_ids)]``.
        """
        keys = self._keys(images, prompt, cache_salt)
        tokens = list(check_token_ids(token_ids, argument="token_ids"))
        if kv_cache is None:
            kv_cache = []
        if not isinstance(kv_cache, (list, tuple)):
            raise InvalidInput("kv_cache", kv_cache, "must be a list of per-layer caches")
        if (
            isinstance(num_image_tokens, bool)
            or not isinstance(num_image_tokens, int)
            or not 0 <= num_image_tokens <= len(tokens)
        ):
            raise InvalidInput(
                "num_image_tokens", num_image_tokens, f"must be an int in [0, {len(tokens)}]"
            )

        nbytes = _array_bytes(vision_embeddings) + _array_bytes(kv_cache)
        if nbytes > self.max_memory:
            logger.warning(
                "mllm cache refused an entry of %d bytes: budget is %d bytes",
                nbytes, self.max_memory,
            )
            return

        self._tick += 1
        entry = MLLMPrefixCacheEntry(
            image_hash=keys.images,
            prompt_hash=keys.prompt,
            vision_embeddings=copy.deepcopy(vision_embeddings),
            kv_cache=copy.deepcopy(list(kv_cache)),
            token_ids=tokens,
            num_image_tokens=num_image_tokens,
            num_text_tokens=len(tokens) - num_image_tokens,
            prompt_tokens=len(tokens),
            created_at=self._tick,
            model_name=model_name,
        )
        if keys.entry in self._cache:
            self._remove(keys.entry)
        self._evict_by_memory(nbytes)
        self._evict_by_count()

        indexed = keys.has_images and vision_embeddings is not None
        scope = keys.images_scope if indexed else None
        self._cache[keys.entry] = _Slot(entry, nbytes, scope)
        self._current_memory += nbytes
        if scope is not None:
            self._by_images.setdefault(scope, {})[keys.entry] = None
        logger.debug(
            "mllm cache stored: key=%s tokens=%d bytes=%d", keys.entry[:16], len(tokens), nbytes
        )

    def store_cache(
        self,
        images: List[Any],
        prompt: str,
        cache: Optional[List[Any]],
        num_tokens: int = 0,
        *,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Legacy store: a KV cache without token ids or vision embeddings.

        ``None`` or an empty list stores nothing. The entry's token ids are
        ``num_tokens`` placeholder zeros, as in the seed.

        Raises:
            InvalidInput: as :meth:`store`, or a negative ``num_tokens``.
        """
        if cache is None or (isinstance(cache, (list, tuple)) and len(cache) == 0):
            return
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidInput("num_tokens", num_tokens, "must be a non-negative int")
        self.store(
            images, prompt, None, cache, [0] * num_tokens, cache_salt=cache_salt,
        )

    def _remove(self, key: str) -> _Slot:
        slot = self._cache.pop(key)
        self._current_memory -= slot.nbytes
        if slot.images_scope is not None:
            holders = self._by_images[slot.images_scope]
            del holders[key]
            if not holders:
                del self._by_images[slot.images_scope]
        return slot

    def _evict_oldest(self) -> None:
        key = next(iter(self._cache))
        self._remove(key)
        self.stats.evictions += 1
        logger.debug("mllm cache evicted: key=%s", key[:16])

    def _evict_by_memory(self, required_size: int) -> None:
        """Evict LRU entries until ``required_size`` more bytes fit (or none is left)."""
        while self._cache and self._current_memory + required_size > self.max_memory:
            self._evict_oldest()

    def _evict_by_count(self) -> None:
        """Evict LRU entries until one more entry fits under ``max_size``."""
        while self._cache and len(self._cache) >= self.max_size:
            self._evict_oldest()

    def get_stats(self) -> Dict[str, Any]:
        """Return the statistics (seed keys) plus occupancy.

        Returns:
            :meth:`MLLMCacheStats.to_dict` plus ``entries``, ``max_entries``,
            ``memory_used_mb`` and ``max_memory_mb``.
        """
        stats = self.stats.to_dict()
        stats["entries"] = len(self._cache)
        stats["max_entries"] = self.max_size
        stats["memory_used_mb"] = self._current_memory / _MIB
        stats["max_memory_mb"] = self.max_memory / _MIB
        return stats

    def reset_stats(self) -> None:
        """Zero every counter."""
        self.stats = MLLMCacheStats()

    def clear(self) -> None:
        """Drop every entry and zero the statistics."""
        self._cache.clear()
        self._by_images.clear()
        self._current_memory = 0
        self.reset_stats()

    def __len__(self) -> int:
        """Return the number of entries."""
        return len(self._cache)

    def __repr__(self) -> str:
        mem_mb = self._current_memory / _MIB
        return f"<MLLMPrefixCacheManager entries={len(self)} memory={mem_mb:.1f}MB>"

    def check_invariants(self) -> None:
        """Verify the class invariants.

        The checks are explicit raises, not ``assert``: they also run under
        ``python -O``.

        Raises:
            InvariantViolation: naming the first broken invariant.
        """
        if len(self._cache) > self.max_size:
            raise InvariantViolation(f"{len(self._cache)} entries, max_size is {self.max_size}")
        if self._current_memory > self.max_memory:
            raise InvariantViolation(
                f"{self._current_memory} bytes held, the budget is {self.max_memory}"
            )
        recorded = sum(slot.nbytes for slot in self._cache.values())
        if self._current_memory != recorded:
            raise InvariantViolation(
                f"byte count {self._current_memory} drifted from the entries' {recorded}"
            )
        indexed = {(scope, key) for scope, keys in self._by_images.items() for key in keys}
        expected = {
            (slot.images_scope, key)
            for key, slot in self._cache.items()
            if slot.images_scope is not None
        }
        if indexed != expected:
            raise InvariantViolation("image index out of step with the entries")
        if not all(self._by_images.values()):
            raise InvariantViolation("empty holder set left in the image index")


#: Short alias of :class:`MLLMPrefixCacheManager`.
MLLMCacheManager = MLLMPrefixCacheManager
VLMCacheStats = MLLMCacheStats
VLMPrefixCacheEntry = MLLMPrefixCacheEntry
VLMCacheEntry = MLLMPrefixCacheEntry
VLMPrefixCacheManager = MLLMPrefixCacheManager
VLMCacheManager = MLLMPrefixCacheManager
