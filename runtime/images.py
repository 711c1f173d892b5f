"""Reading a request's images before anything is computed or cached.

:func:`load_images` turns each image a caller gives ``generate`` into a
decoded RGB picture, or raises :class:`~mlxkv.errors.InvalidInput` naming the
image (``images[1]``) and what is wrong with it. It runs on a worker thread
(files are read and pixels decoded), never on the event loop.

Accepted: a path (``str`` or ``os.PathLike``) of a readable image file, a
``data:`` URL, the encoded bytes of an image file, a ``PIL.Image``, or a
``uint8`` array of shape ``(height, width)`` or ``(height, width, 3|4)``.
Refused: a URL (nothing is fetched over the network), an unreadable or
truncated file, bytes that are not an image, and images too small, too
large (more than ``MAX_PIXELS`` pixels) or too elongated (aspect ratio above
200) for the vision model's processor.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import anyio
import anyio.to_thread

from mlxkv.cache.errors import CacheError, InvalidInput
from mlxkv.cache.mllm import images_digest

__all__ = ["MAX_PIXELS", "digest_images", "image_key_source", "load_images"]

#: The most pixels an image may have (64 megapixels): beyond it decoding
#: alone costs seconds and hundreds of MB, and PIL warns of a decompression bomb.
MAX_PIXELS = 8192 * 8192
#: Image files up to this many bytes in all are hashed on the event loop.
INLINE_FILE_BYTES = 256 * 1024
_MAX_ASPECT = 200
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def load_images(images: Sequence[Any]) -> list[Any]:
    """Decode every image, in order.

    Returns:
        One RGB ``PIL.Image`` per image.

    Raises:
        InvalidInput: pillow is not installed, or an image cannot be used
            (the error names it: ``images[i]``).
    """
    try:
        from PIL import Image
    except ImportError:
        raise InvalidInput(
            "images", len(images), "reading images needs pillow: pip install 'mlxkv[vlm]'"
        ) from None
    return [_load(Image, image, f"images[{index}]") for index, image in enumerate(images)]


def image_key_source(image: Any) -> Any:
    """What keys ``image`` in the caches: itself, or a PIL image's pixels as an array."""
    if type(image).__module__.startswith("PIL."):
        import numpy as np

        return np.asarray(image.convert("RGB"))
    return image


def _load(Image: Any, image: Any, name: str) -> Any:
    picture = None
    try:
        picture = _open(Image, image, name)
        width, height = picture.size
        if width < 1 or height < 1:
            raise InvalidInput(name, (width, height), "has no pixels")
        if width * height > MAX_PIXELS:
            raise InvalidInput(name, (width, height), f"has more than {MAX_PIXELS} pixels")
        if max(width, height) / min(width, height) > _MAX_ASPECT:
            raise InvalidInput(name, (width, height), f"is more elongated than {_MAX_ASPECT}:1")
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return picture.convert("RGB")  # decodes now: a truncated file fails here
    except InvalidInput:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise InvalidInput(name, _describe(image), f"cannot be read as an image: {error}") from error
    finally:
        if picture is not None and picture is not image:
            picture.close()  # the file we opened; convert() made a copy


def _open(Image: Any, image: Any, name: str) -> Any:
    if type(image).__module__.startswith("PIL.") and hasattr(image, "convert"):
        return image
    if isinstance(image, os.PathLike):
        image = os.fspath(image)
    if isinstance(image, str):
        if image[:5].lower() == "data:":
            return Image.open(io.BytesIO(_data_url_bytes(image, name)))
        if _URL.match(image):
            raise InvalidInput(name, image, "URLs are not fetched: pass the file, its bytes or a data URL")
        return Image.open(image)
    if isinstance(image, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(bytes(image)))
    import numpy as np

    if isinstance(image, np.ndarray) or type(image).__module__.startswith("mlx."):
        array = np.asarray(image)
        if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
            raise InvalidInput(name, f"array {array.dtype} {array.shape}", "must be uint8 of shape (h, w) or (h, w, 3|4)")
        return Image.fromarray(array)
    raise InvalidInput(name, type(image).__name__, "must be a path, data URL, image bytes, PIL image or uint8 array")


def _data_url_bytes(url: str, name: str) -> bytes:
    header, _, data = url[5:].partition(",")
    if not header.lower().endswith(";base64"):
        raise InvalidInput(name, url[:40], "a data URL must be base64")
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except binascii.Error as error:
        raise InvalidInput(name, url[:40], f"is not valid base64: {error}") from None


def _describe(image: Any) -> Any:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return f"<{len(image)} bytes>"
    if isinstance(image, str) and len(image) > 200:
        return image[:200] + "..."
    return image


def _file_bytes(images: Sequence[Any]) -> float:
    """Bytes of the image files among ``images`` (infinite if one cannot be sized)."""
    total = 0.0
    for image in images:
        if isinstance(image, (str, os.PathLike)) and not _URL.match(str(image)):
            try:
                total += os.stat(image).st_size
            except OSError:
                return float("inf")  # the hasher reports it, off the loop
    return total


async def digest_images(images: Any) -> Optional[str]:
    """The order-sensitive digest of ``images``, or None for no images.

    Paths to files of more than :data:`INLINE_FILE_BYTES` in all are hashed
    on a worker thread: reading them must not block the event loop (a small
    file is read and hashed here, faster than the hop to a thread). Anything
    else (bytes, URLs, arrays) is hashed here, because an unevaluated MLX
    array can only be evaluated on the thread that built it.
    """
    if images is None:
        return None
    if isinstance(images, (str, bytes, bytearray, os.PathLike)) or not isinstance(
        images, Sequence
    ):
        raise InvalidInput("images", images, "must be a list of images")
    if not images:
        return None
    try:
        if _file_bytes(images) > INLINE_FILE_BYTES:
            return await anyio.to_thread.run_sync(images_digest, list(images))
        return images_digest(list(images))
    except CacheError:
        raise
    except Exception as error:  # an image type the hasher cannot read
        raise InvalidInput("images", images, f"cannot be hashed: {error}") from error
