"""A request's images, read, checked and keyed the same way at every entry point.

:func:`key_images` is the runtime's one keying path: ``generate``,
``fetch``/``request`` and ``store_images`` all call it, and it returns the
ordered, full-strength key of the images (:class:`KeyedImages`) or raises
:class:`~mlxkv.errors.InvalidInput` naming the image (``images[1]``) and
what is wrong with it.

Accepted: a path (``str`` or ``os.PathLike``) of a readable image file, a
``data:`` URL, the encoded bytes of an image file, a ``PIL.Image``, or a
``uint8`` numpy or MLX array of shape ``(height, width)`` or
``(height, width, 3|4)``. Refused: an unreadable, truncated or unknown file,
and images with no pixels or more than :data:`MAX_PIXELS`; for the model
(``generate``) also a URL (nothing is fetched over the network), bytes that
are not an image, another array, and images more elongated than 200:1.

Identity. A picture keys by its decoded pixels: width, height and RGB bytes,
which is what the vision model is given (every picture is converted to RGB,
an alpha channel dropped). So the same picture hits whatever form it comes
in. Keying pixels costs far more than hashing the file (two orders of
magnitude for a large JPEG: ``scripts/bench_image_keys.py``), so each runtime remembers the pixel key of the encoded images it
has decoded, by the SHA-256 of their bytes (:class:`PixelMemo`, a bounded
LRU): a repeated file costs its byte hash only. The low-level calls, which may key a scheduler's
own sources, key what is not a picture as :func:`mlxkv.cache.mllm.image_digest`
does -- a URL or other string by itself, bytes that are not an image by
their content, another array by dtype, shape and bytes -- each kind apart
from pixels. Keys are 256-bit and keep the order of the images.

Threads. Nothing heavy runs on the event loop: files are read, bytes hashed
and pixels decoded, converted and hashed on worker threads; only encoded
images of at most :data:`INLINE_BYTES` in all are read and hashed on the
loop (faster than the hop to a thread). Two things stay on the loop: an MLX
array is evaluated there, because an unevaluated one can only be evaluated
on the thread that built it (evaluated, it can be read anywhere); and an
encoded image's header is parsed there (no pixels: 30-60 us), so that
PIL's ``DecompressionBombWarning`` for a huge picture is silenced without
touching the process's warning filters from a second thread -- a picture
over :data:`MAX_PIXELS` is refused before anything is decoded, and mlxkv
prints nothing. Decoded pictures are freed on worker threads too (freeing
a large one takes milliseconds). A PIL image handed in is read on a worker
thread: do not use it elsewhere until the call returns.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Optional

import anyio
import anyio.to_thread
import attrs

from mlxkv.cache.errors import InvalidInput, Shown, plural
from mlxkv.cache.mllm import combine_image_keys, data_url_bytes, image_digest, image_key
from mlxkv.freed_memory import TRIM_AFTER_BYTES, return_freed_memory

__all__ = [
    "INLINE_BYTES",
    "MAX_PIXELS",
    "ImageBudget",
    "KeyedImages",
    "PixelMemo",
    "describe",
    "freed_pictures",
    "key_images",
]

#: The most pixels an image may have (64 megapixels): beyond it decoding
#: alone costs seconds and hundreds of MB. Below PIL's own warning limit
#: (``PIL.Image.MAX_IMAGE_PIXELS``, about 89 megapixels).
MAX_PIXELS = 8192 * 8192
#: Encoded images up to this many bytes in all are read and hashed on the event loop.
INLINE_BYTES = 256 * 1024
#: Encoded images whose pixel keys a runtime remembers (about 150 bytes each).
MEMO_ENTRIES = 4096
_MAX_ASPECT = 200
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_ACCEPTED = "must be a path, data URL, image bytes, PIL image or uint8 array"


@attrs.frozen(kw_only=True)
class ImageBudget:
    """What one request's images may cost, checked before any picture is decoded
    (decoded, a picture takes 3 bytes a pixel, and more while it is converted).

    Attributes:
        max_images: the most images of one request.
        max_pixels: the most pixels of one request's pictures together.
    """

    max_images: int = 16
    max_pixels: int = MAX_PIXELS

    def check_count(self, count: int) -> None:
        """Raises: InvalidInput: more than ``max_images`` images."""
        if count > self.max_images:
            raise InvalidInput(
                "images",
                Shown(f"<{plural(count, 'image')}>"),
                f"a request takes at most {self.max_images} (max_request_images)",
            )

    def check_pixels(self, sizes: Sequence[Optional[tuple[int, int]]]) -> None:
        """Raises: InvalidInput: the pictures have more than ``max_pixels`` pixels together."""
        total = sum(width * height for width, height in filter(None, sizes))
        if total > self.max_pixels:
            raise InvalidInput(
                "images",
                Shown(f"<{plural(len(sizes), 'image')} of {total} pixels>"),
                f"a request's images take at most {self.max_pixels} pixels together (max_request_pixels)",
            )


@attrs.frozen
class _Pixels:
    """What decoding an encoded image gave: its pixel key and size."""

    key: bytes
    size: tuple[int, int]


class PixelMemo:
    """The pixel keys of encoded images a runtime has decoded, by the SHA-256 of their bytes.

    An LRU of at most ``max_entries``. One runtime owns it and only its event
    loop's thread touches it (:func:`key_images` reads and fills it between
    its hops to worker threads), so it needs no lock.

    Invariants:
        ``len(entries) <= max_entries``.
    """

    def __init__(self, max_entries: int = MEMO_ENTRIES) -> None:
        assert max_entries >= 1, "a memo holds at least one entry"
        self.max_entries = max_entries
        self.num_hits = 0
        self.num_misses = 0
        self._entries: OrderedDict[bytes, _Pixels] = OrderedDict()

    @property
    def num_entries(self) -> int:
        """Encoded images remembered."""
        return len(self._entries)

    def get(self, content: bytes) -> Optional[_Pixels]:
        """The pixels of the encoded image whose bytes hash to ``content``, if remembered."""
        pixels = self._entries.get(content)
        if pixels is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(content)
        self.num_hits += 1
        return pixels

    def put(self, content: bytes, pixels: _Pixels) -> None:
        """Remember ``pixels`` for ``content``, forgetting the least recent beyond the bound."""
        self._entries[content] = pixels
        self._entries.move_to_end(content)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


@attrs.frozen(kw_only=True)
class KeyedImages:
    """A request's images, keyed, in order.

    For the model (``for_model``), it also holds what the processor will need
    on an image-cache miss: each picture decoded while keying, or the encoded
    bytes of one keyed from memory. Handing them over and freeing them are
    one-time steps for a worker thread: freeing a large picture alone takes
    milliseconds.

    Attributes:
        digest: the order-sensitive key of them all (64 hex).
        keys: each image's 32-byte :func:`~mlxkv.cache.mllm.image_key`, in order.
        sizes: each image's ``(width, height)``; None for a low-level source
            that is not a picture (a URL, an identifier, other bytes or arrays).

    Invariants:
        ``len(keys) == len(sizes) == len(held)``, and ``held`` empties once
        (:meth:`take_pictures` or :meth:`release`).
    """

    digest: str
    keys: tuple[bytes, ...]
    sizes: tuple[Optional[tuple[int, int]], ...]
    #: per image: its decoded RGB picture, its encoded bytes, or None
    _held: list[Any] = attrs.field(alias="held", eq=False, repr=False)

    @property
    def num_decoded(self) -> int:
        """Pictures held decoded (the others need decoding by :meth:`take_pictures`)."""
        return sum(1 for item in self._held if item is not None and not isinstance(item, bytes))

    def take_pictures(self) -> list[Any]:
        """Hand over every image as a decoded RGB ``PIL.Image``, in order (for the
        processor), decoding those keyed from memory; nothing is held after.

        Run it on a worker thread: it decodes, and the pictures are freed
        where the caller drops them.

        Raises:
            InvalidInput: an image that is not a picture or was released (a
                bug of the caller), or one that no longer decodes.
        """
        held, self._held[:] = list(self._held), [None] * len(self._held)
        out = []
        for index, item in enumerate(held):
            name = f"images[{index}]"
            if isinstance(item, bytes):
                from PIL import Image

                item = _decode(Image, _open(Image, item, name), name, item)
            elif item is None:
                raise InvalidInput(name, None, "holds no picture")
            out.append(item)
        return out

    def release(self) -> None:
        """Free what is held (on the calling thread: a worker's, for large
        pictures), and hand memory that large pictures took back to the system."""
        decoded = self.num_decoded_pixels
        self._held[:] = [None] * len(self._held)
        if decoded:
            freed_pictures(decoded)

    @property
    def num_decoded_pixels(self) -> int:
        """Pixels of the pictures held decoded."""
        return sum(
            size[0] * size[1]
            for size, item in zip(self.sizes, self._held)
            if size is not None and item is not None and not isinstance(item, bytes)
        )

    @property
    def num_pixels(self) -> int:
        """Pixels of every picture, decoded or not."""
        return sum(width * height for width, height in filter(None, self.sizes))


async def key_images(
    images: Any, memo: PixelMemo, *, for_model: bool, budget: Optional[ImageBudget] = None
) -> Optional[KeyedImages]:
    """Read, check and key ``images`` (see the module docstring).

    Args:
        images: a list of images, or None.
        memo: the runtime's remembered pixel keys (read and filled here).
        for_model: True for images the model will see (``generate``): each
            must be a picture it can use, and what its processor will need
            is kept (:meth:`KeyedImages.take_pictures`). False for the
            low-level calls: a source that is not a picture is keyed as it
            is, and nothing is kept.
        budget: what the images may cost together (the count checked before
            anything is read, the pixels before anything is decoded); None:
            no bound but each picture's :data:`MAX_PIXELS`.

    Returns:
        The keyed images, or None for None or no images.

    Raises:
        InvalidInput: ``images`` is not a list, or an image cannot be used
            (the error names it: ``images[i]``). Nothing else is raised for
            bad input.
    """
    if images is None:
        return None
    if isinstance(images, (str, bytes, bytearray, memoryview, os.PathLike)) or not isinstance(
        images, Sequence
    ):
        raise InvalidInput("images", describe(images), "must be a list of images (put one image in a list)")
    if not images:
        return None
    if budget is not None:
        budget.check_count(len(images))
    pending = [_classify(image, f"images[{i}]", for_model) for i, image in enumerate(images)]
    # 1. Encoded images are read and hashed, other sources fingerprinted.
    if sum(p.read_cost for p in pending) > INLINE_BYTES:
        await anyio.to_thread.run_sync(_read_all, pending, for_model)
    else:
        _read_all(pending, for_model)
    # 2. A remembered encoded image needs nothing more; the others' sizes are
    # checked before anything is decoded.
    for p in pending:
        if p.content is not None:
            known = memo.get(p.content)
            if known is not None:
                _check_size(p.name, known.size, for_model)
                p.key, p.size = known.key, known.size
    Image = None
    if any(p.key is None for p in pending):
        Image = await _pil(required=for_model)
    for p in pending:
        if p.key is not None or Image is None:  # None: low level without pillow (step 3)
            continue
        if p.form == "encoded":
            p.opened = _open_header(Image, p, for_model)
        if p.key is None:
            p.size = p.opened.size if p.opened is not None else p.size
            _check_size(p.name, p.size, for_model)
    if budget is not None:
        budget.check_pixels([p.size for p in pending])
    # 3. Pictures not remembered are decoded, converted and hashed.
    if any(p.key is None for p in pending):
        await anyio.to_thread.run_sync(_decode_all, Image, pending, for_model)
    for p in pending:
        if p.content is not None and p.decoded:
            memo.put(p.content, _Pixels(p.key, p.size))
    keys = tuple(p.key for p in pending)
    return KeyedImages(
        digest=combine_image_keys(keys),
        keys=keys,
        sizes=tuple(p.size for p in pending),
        held=[(p.picture if p.picture is not None else p.encoded) if for_model else None for p in pending],
    )


def describe(value: Any) -> Any:
    """``value`` as an error message shows it: itself if short and plain, else a readable summary."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value if len(value) <= 200 else Shown(f"<{len(value)} characters: {value[:40]!r}...>")
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Shown(f"<{memoryview(value).nbytes} bytes>")
    if _is_pil(value):
        return Shown(f"<PIL image {value.size[0]}x{value.size[1]} {value.mode}>")
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        dtype = str(value.dtype).rsplit(".", 1)[-1]
        return Shown(f"<{dtype} array of shape {tuple(value.shape)}>")
    if isinstance(value, (list, tuple)):
        return Shown(f"<{type(value).__name__} of {plural(len(value), 'image')}>")
    return Shown(f"<{type(value).__name__}>")


@attrs.define
class _Pending:
    """One image on its way through :func:`key_images` (local to one call)."""

    name: str
    source: Any
    #: what it is: "encoded" (a path, data URL or bytes), "picture" (a PIL
    #: image), "array" (a uint8 image array), "opaque" (keyed as it is)
    form: str
    read_cost: int = 0
    encoded: Optional[bytes] = None
    content: Optional[bytes] = None  # the SHA-256 of ``encoded``
    opened: Any = None  # a PIL image, its pixels maybe not yet decoded
    key: Optional[bytes] = None
    size: Optional[tuple[int, int]] = None
    decoded: bool = False  # its pixels were decoded and keyed
    picture: Any = None  # decoded RGB, if kept


def _classify(image: Any, name: str, for_model: bool) -> _Pending:
    """On the loop: what ``image`` is, refusing a type no entry point takes."""
    if _is_pil(image):
        if getattr(image, "tile", None) and getattr(image, "fp", False) is None:
            raise InvalidInput(name, describe(image), "cannot be read as an image: its file was closed before it was decoded")
        return _Pending(name, image, "picture", opened=image)
    # An array type can only be met if its library is imported already.
    mx, np = sys.modules.get("mlx.core"), sys.modules.get("numpy")
    is_mlx = mx is not None and isinstance(image, mx.array)
    if is_mlx or (np is not None and isinstance(image, np.ndarray)):
        if is_mlx:
            mx.eval(image)  # here: an unevaluated array belongs to this thread's stream
        if _is_image_array(image):
            return _Pending(name, image, "array", size=(image.shape[1], image.shape[0]))
        if for_model:
            raise InvalidInput(name, describe(image), "must be uint8 of shape (h, w) or (h, w, 3|4)")
        return _Pending(name, image, "opaque", read_cost=image.nbytes)
    if isinstance(image, os.PathLike):
        image = os.fsdecode(image)
    if isinstance(image, str):
        if image[:5].lower() == "data:":
            return _Pending(name, image, "encoded", read_cost=len(image))
        if _URL.match(image):
            if for_model:
                raise InvalidInput(name, image, "URLs are not fetched: pass the file, its bytes or a data URL")
            return _Pending(name, image, "opaque")
        try:
            size = os.stat(image).st_size
        except (OSError, ValueError):
            size = 0  # reported (or keyed by its string) when read
        return _Pending(name, image, "encoded", read_cost=size)
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _Pending(name, image, "encoded", read_cost=memoryview(image).nbytes)
    hint = ": pass its bytes (read() or getvalue())" if hasattr(image, "read") else ""
    raise InvalidInput(name, describe(image), _ACCEPTED + hint)


def _read_all(pending: list[_Pending], for_model: bool) -> None:
    """Read and hash every encoded image; fingerprint every opaque source."""
    for p in pending:
        if p.form == "encoded":
            p.encoded = _read(p, for_model)
            if p.encoded is None:  # a low-level source that is not a readable file
                p.key = bytes.fromhex(image_digest(p.source))
            else:
                p.content = hashlib.sha256(p.encoded).digest()
        elif p.form == "opaque":
            p.key = bytes.fromhex(image_digest(p.source))


def _read(p: _Pending, for_model: bool) -> Optional[bytes]:
    source = p.source
    if isinstance(source, str):
        if source[:5].lower() == "data:":
            data = data_url_bytes(source)
            if data is None and for_model:
                raise InvalidInput(p.name, describe(source), "is not a valid data URL")
            return data
        try:
            with open(source, "rb") as fh:
                return fh.read()
        except (OSError, ValueError) as error:  # ValueError: an embedded NUL
            if for_model:
                reason = getattr(error, "strerror", None) or str(error)
                raise InvalidInput(p.name, source, f"cannot be read: {reason}") from None
            return None
    return bytes(source)  # one snapshot: what is hashed is what is decoded


async def _pil(*, required: bool) -> Any:
    """PIL's Image module with its format plugins loaded (imports that would
    stall the loop: done on a worker thread, once), or None if pillow is not
    installed and not ``required``.

    Raises:
        InvalidInput: pillow is not installed and ``required``.
    """
    global _plugins_loaded
    if _plugins_loaded is False:
        _plugins_loaded = await anyio.to_thread.run_sync(_load_pil)
    if _plugins_loaded is None:
        if required:
            raise InvalidInput("images", None, "reading images needs pillow: pip install 'mlxkv[vlm]'")
        return None
    from PIL import Image

    return Image


#: Whether PIL's plugins are loaded: False not yet, None if pillow is missing.
_plugins_loaded: Optional[bool] = False


def _load_pil() -> Optional[bool]:
    try:
        from PIL import Image
    except ImportError:
        return None
    Image.init()
    return True


def _open_header(Image: Any, p: _Pending, for_model: bool) -> Any:
    """On the loop: open an encoded image (its header only), or, at the low
    level, key it by its bytes if it is not one. PIL's
    decompression-bomb warning is silenced here, on the loop's thread, because
    :func:`_check_size` refuses such a picture before it is decoded."""
    assert p.encoded is not None and p.content is not None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return _open(Image, p.encoded, p.name)
    except InvalidInput as error:
        if for_model or not isinstance(error.__cause__, Image.UnidentifiedImageError):
            raise
        p.key = image_key(b"content", p.content)  # not an image: keyed by its bytes
        return None


def _open(Image: Any, encoded: bytes, name: str) -> Any:
    try:
        return Image.open(io.BytesIO(encoded))
    except Image.UnidentifiedImageError as error:
        raise InvalidInput(name, describe(encoded), "cannot be read as an image: not a format PIL reads") from error
    except Image.DecompressionBombError as error:
        raise InvalidInput(name, describe(encoded), f"has more than {MAX_PIXELS} pixels: {error}") from error
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        raise InvalidInput(name, describe(encoded), f"cannot be read as an image: {error}") from error


def _check_size(name: str, size: tuple[int, int], for_model: bool) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise InvalidInput(name, Shown(f"<{width}x{height} image>"), "has no pixels")
    if width * height > MAX_PIXELS:
        raise InvalidInput(
            name, Shown(f"<{width}x{height} image>"), f"has {width * height} pixels, more than {MAX_PIXELS}"
        )
    if for_model and max(width, height) / min(width, height) > _MAX_ASPECT:
        raise InvalidInput(name, Shown(f"<{width}x{height} image>"), f"is more elongated than {_MAX_ASPECT}:1")


def freed_pictures(num_pixels: int) -> None:
    """Pictures of ``num_pixels`` in all were just freed (on this worker thread):
    if that was a lot, hand the memory back to the system (:mod:`mlxkv.freed_memory`)."""
    if num_pixels * 3 >= TRIM_AFTER_BYTES:
        return_freed_memory()


def _decode_all(Image: Any, pending: list[_Pending], keep: bool) -> None:
    """On a worker thread: decode, convert and key every picture not keyed yet,
    keeping the RGB pictures if ``keep``, else freeing them here (without
    pillow, at the low level: key each as its source)."""
    try:
        _decode_each(Image, pending, keep)
    finally:
        if not keep:
            freed_pictures(sum(p.size[0] * p.size[1] for p in pending if p.decoded and p.size))


def _decode_each(Image: Any, pending: list[_Pending], keep: bool) -> None:
    for p in pending:
        if p.key is not None:
            continue
        if Image is None:
            p.key = image_key(b"content", p.content) if p.content is not None else bytes.fromhex(image_digest(p.source))
            continue
        if p.form == "array":
            import numpy as np

            p.opened = Image.fromarray(np.asarray(p.source))  # a copy
        picture = _decode(Image, p.opened, p.name, p.source)
        if p.opened is not p.source:
            p.opened.close()  # ours; the picture is a copy
        p.opened = None
        p.size, p.key, p.decoded = picture.size, _pixel_key(picture), True
        if keep:
            p.picture = picture


def _decode(Image: Any, opened: Any, name: str, source: Any) -> Any:
    """The RGB copy of ``opened``, decoding it (a truncated file fails here)."""
    try:
        if opened.mode == "P" and "transparency" in opened.info:
            # Through RGBA: the same RGB values, without PIL's warning about
            # a palette's transparency.
            opened = opened.convert("RGBA")
        return opened.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as error:
        raise InvalidInput(name, describe(source), f"cannot be read as an image: {error}") from error


def _pixel_key(picture: Any) -> bytes:
    """The key of an RGB picture: its width, height and pixel bytes."""
    width, height = picture.size
    hasher = hashlib.sha256(b"mlxkv.pixels\0RGB\0")
    hasher.update(width.to_bytes(8, "little") + height.to_bytes(8, "little"))
    hasher.update(picture.tobytes())
    return image_key(b"pixels", hasher.digest())


def _is_pil(value: Any) -> bool:
    Image = sys.modules.get("PIL.Image")
    return Image is not None and isinstance(value, Image.Image)


def _is_image_array(array: Any) -> bool:
    dtype = str(array.dtype).rsplit(".", 1)[-1]
    shape = tuple(array.shape)
    return dtype == "uint8" and (len(shape) == 2 or (len(shape) == 3 and shape[2] in (3, 4)))
