"""Images read, checked and keyed once for every entry point (``mlxkv.images``).

Real PIL images and real files throughout: every form of a picture keys
alike, nothing heavy runs on the event loop's thread, the pixel limit is
checked before anything is decoded, PIL's warnings stay silent, a repeated
file is keyed from memory, and every refusal names its image readably.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import CacheRuntime, InvalidInput
from mlxkv import images as images_module
from mlxkv.cache.mllm import compute_image_hash, image_digest, image_key, images_digest
from mlxkv.images import MAX_PIXELS, KeyedImages, PixelMemo, key_images
from image_checks import blank_png, on_this_thread, spy_on_pixel_work

Image = pytest.importorskip("PIL.Image")

PROMPT = list(range(1, 49))


def _noise(width: int, height: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


def _encoded(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


class Picture:
    """One 48x32 noise picture: its pixels, its PNG bytes and file, and an alpha channel."""

    def __init__(self, folder: Path, seed: int = 0) -> None:
        self.array = _noise(48, 32, seed)
        self.png = _encoded(self.array)
        self.path = folder / f"picture-{seed}.png"
        self.path.write_bytes(self.png)
        alpha = np.random.default_rng(seed + 100).integers(0, 256, (32, 48, 1), dtype=np.uint8)
        self.rgba = np.concatenate([self.array, alpha], axis=2)


@pytest.fixture
def picture(tmp_path: Path) -> Picture:
    return Picture(tmp_path)


#: Every accepted form of the same picture.
FORMS: dict[str, Callable[[Picture], Any]] = {
    "path": lambda p: str(p.path),
    "PathLike": lambda p: p.path,
    "bytes": lambda p: p.png,
    "bytearray": lambda p: bytearray(p.png),
    "memoryview": lambda p: memoryview(p.png),
    "data URL": lambda p: "data:image/png;base64," + base64.b64encode(p.png).decode(),
    "PIL opened": lambda p: Image.open(p.path),  # nothing decoded yet
    "PIL decoded": lambda p: Image.fromarray(p.array),
    "PIL RGBA": lambda p: Image.fromarray(p.rgba),  # the alpha channel never reaches the model
    "PIL palette": lambda p: Image.fromarray(p.array[:, :, :1].repeat(3, axis=2)).convert("P"),
    "uint8 array": lambda p: p.array,
    "uint8 RGBA array": lambda p: p.rgba,
    "MLX array": lambda p: mx.array(p.array),
    "MLX array, unevaluated": lambda p: mx.array(p.array)[:, ::-1][:, ::-1],
}


async def _key(images: Any, memo: PixelMemo | None = None, *, for_model: bool = True) -> KeyedImages:
    keyed = await key_images(images, memo if memo is not None else PixelMemo(), for_model=for_model)
    assert keyed is not None
    return keyed


class TestKeys:
    @pytest.mark.parametrize("form", list(FORMS))
    async def test_every_form_of_a_picture_keys_alike(self, picture, form):
        """Each accepted form of one picture keys as its file does (decoded RGB pixels)."""
        if form == "PIL palette":  # another picture: its file is the palette image saved
            image = FORMS[form](picture)
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            expected = await _key([buffer.getvalue()])
        else:
            expected = await _key([str(picture.path)])
            image = FORMS[form](picture)
        keyed = await _key([image])
        assert keyed.digest == expected.digest
        assert keyed.sizes == ((48, 32),)

    async def test_a_jpeg_keys_as_its_decoded_pixels(self, tmp_path, picture):
        """A lossy file keys as the pixels it decodes to, not as the picture it was saved from."""
        jpeg = tmp_path / "picture.jpg"
        jpeg.write_bytes(_encoded(picture.array, "JPEG"))
        decoded = np.asarray(Image.open(jpeg).convert("RGB"))
        assert not np.array_equal(decoded, picture.array)
        assert (await _key([jpeg])).digest == (await _key([decoded])).digest
        assert (await _key([jpeg])).digest != (await _key([picture.array])).digest

    async def test_other_pixels_sizes_and_orders_key_apart(self, picture):
        """One pixel changed, the same bytes in another shape, another order, a repeat: all differ."""
        changed = picture.array.copy()
        changed[0, 0, 0] ^= 1
        reshaped = picture.array.reshape(48, 32, 3)  # same bytes, 32x48
        other = _noise(48, 32, seed=1)
        digests = [
            (await _key(images)).digest
            for images in (
                [picture.array],
                [changed],
                [reshaped],
                [picture.array, other],
                [other, picture.array],
                [picture.array, picture.array],
            )
        ]
        assert len(set(digests)) == len(digests)

    async def test_keys_are_full_strength_and_kinds_apart(self, picture):
        """A 64-hex order-sensitive digest of 32-byte keys; a picture's pixel key is
        neither its file's content key nor its path's string key."""
        keyed = await _key([picture.path, picture.array])
        assert len(keyed.digest) == 64 and all(len(key) == 32 for key in keyed.keys)
        content = image_key(b"content", hashlib.sha256(picture.png).digest())
        assert keyed.keys[0] not in (content, bytes.fromhex(image_digest("/not/a/file.png")))

    async def test_runtime_and_seed_keys_agree_except_on_pictures(self, picture):
        """What is not a picture (a URL, an identifier, a missing file, bytes that are no
        image, a float array) keys at the low level exactly as the seed-compatible
        images_digest does; a picture keys by its pixels, unlike there, and the seed's
        16-hex compute_image_hash still hashes the file."""
        sources = [
            "https://images.invalid/a.png",
            "video:/v.mp4:fps1.0:max8",
            "/no/such/file.png",
            b"not a picture",
            np.zeros((2, 2), dtype=np.float32),
        ]
        assert (await _key(sources, for_model=False)).digest == images_digest(sources)
        assert (await _key([picture.path])).digest != images_digest([picture.path])
        assert compute_image_hash(str(picture.path)) == hashlib.sha256(picture.png).hexdigest()[:16]

    async def test_without_pillow_the_low_level_keys_sources(self, picture, monkeypatch):
        """With no pillow installed the low-level calls still key images, as the seed's full
        keys do (bytes by their content); the model's calls refuse."""
        monkeypatch.setattr(images_module, "_plugins_loaded", None)
        sources = [picture.png, picture.array]
        assert (await _key(sources, for_model=False)).digest == images_digest(sources)
        with pytest.raises(InvalidInput, match="needs pillow"):
            await _key([picture.png])

    async def test_inline_and_worker_thread_routes_agree(self, picture, monkeypatch):
        """Small encoded images read on the loop and large ones on a worker thread key alike."""
        sources = [str(picture.path), picture.png, Image.fromarray(picture.array)]
        digests = []
        for limit in (0, 10**9):  # everything off the loop, then everything inline
            monkeypatch.setattr(images_module, "INLINE_BYTES", limit)
            digests.append((await _key(sources)).digest)
        assert digests[0] == digests[1]


class TestThreads:
    @pytest.fixture
    def threads(self, monkeypatch) -> dict[str, set[int]]:
        """The threads that touch pixels, by operation (see image_checks.spy_on_pixel_work)."""
        return spy_on_pixel_work(monkeypatch)

    @pytest.mark.parametrize("form", ["path", "bytes", "data URL", "PIL opened", "PIL decoded", "uint8 array"])
    @pytest.mark.parametrize("for_model", [True, False], ids=["generate", "low-level"])
    async def test_no_pixels_are_touched_on_the_loop(self, tmp_path, threads, form, for_model):
        """Decoding, converting, serializing and hashing a picture (here 512x512, more
        than INLINE_BYTES encoded) all happen off the event loop's thread."""
        big = Picture(tmp_path)
        big.array = _noise(512, 512)
        big.png = _encoded(big.array)
        big.path.write_bytes(big.png)
        assert len(big.png) > images_module.INLINE_BYTES
        image = FORMS[form](big)
        threads.clear()  # only what keying does
        keyed = await _key([image], for_model=for_model)
        assert keyed.sizes == ((512, 512),)
        assert "_pixel_key" in threads, "the spies saw nothing"
        assert not on_this_thread(threads), f"{form}: {sorted(on_this_thread(threads))} ran on the event loop"

    async def test_the_pixel_limit_is_checked_before_decoding(self, tmp_path, threads):
        """A picture over MAX_PIXELS (9000x9000) is refused, as a file, as bytes and as a
        PIL image, without decoding a pixel."""
        data = blank_png(9000, 9000)
        path = tmp_path / "big.png"
        path.write_bytes(data)
        with Image.open(path) as opened:
            for form in (str(path), data, opened):
                with pytest.raises(InvalidInput, match=f"81000000 pixels, more than {MAX_PIXELS}") as info:
                    await _key([form])
                assert info.value.argument == "images[0]"
        assert "load" not in threads and "convert" not in threads

    @pytest.mark.parametrize("for_model", [True, False], ids=["generate", "low-level"])
    async def test_decompression_bomb_warning_stays_silent(self, tmp_path, for_model):
        """A 12000x12000 PNG (over PIL's warning limit) is refused with InvalidInput, not a
        warning (this suite turns warnings into errors), and no warning filter is left behind."""
        data = blank_png(12000, 12000)
        path = tmp_path / "bomb.png"
        path.write_bytes(data)
        filters = list(warnings.filters)
        for form in (str(path), data, "data:image/png;base64," + base64.b64encode(data).decode()):
            with pytest.raises(InvalidInput, match="144000000 pixels"):
                await _key([form], for_model=for_model)
        assert warnings.filters == filters

    def test_mlxkv_prints_nothing_for_a_bomb(self, tmp_path):
        """In a fresh interpreter with Python's default warning filters, fetch and
        store_images refuse a 12000x12000 PNG and print nothing to stderr, on asyncio
        and on trio."""
        path = tmp_path / "bomb.png"
        path.write_bytes(blank_png(12000, 12000))
        script = (
            "import anyio, mlx.core as mx, sys\n"
            "from mlxkv import CacheRuntime, InvalidInput\n"
            "async def main():\n"
            "    async with CacheRuntime(block_size=16, max_blocks=8) as rt:\n"
            "        for call in (lambda: rt.fetch('r', [1, 2, 3], images=[sys.argv[1]]),\n"
            "                     lambda: rt.store_images([open(sys.argv[1], 'rb').read()], mx.ones((2,)))):\n"
            "            try:\n"
            "                await call()\n"
            "            except InvalidInput as error:\n"
            "                print(error.argument)\n"
            "for backend in ('asyncio', 'trio'):\n"
            "    anyio.run(main, backend=backend)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60, check=True
        )
        assert done.stdout.split() == ["images[0]"] * 4
        assert done.stderr == ""


class TestMemo:
    async def test_a_repeated_file_costs_its_byte_hash_only(self, picture, monkeypatch):
        """Once decoded, the same encoded bytes -- as the path, the bytes or a data URL --
        key from memory: nothing is opened or decoded again."""
        memo = PixelMemo()
        first = await _key([picture.path], memo)
        assert (memo.num_entries, memo.num_hits) == (1, 0)

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("decoded again")

        monkeypatch.setattr(Image, "open", refuse)
        monkeypatch.setattr(images_module, "_decode_all", refuse)
        for form in ("path", "bytes", "data URL"):
            again = await _key([FORMS[form](picture)], memo)
            assert again.digest == first.digest
            assert again.sizes == ((48, 32),) and again.num_decoded == 0
        assert memo.num_hits == 3

    async def test_a_remembered_picture_still_decodes_for_the_model(self, picture):
        """A picture keyed from memory keeps its bytes, and take_pictures() decodes them
        (on the caller's thread: generation runs it on a worker) to the same RGB pixels;
        a picture decoded while keying is handed over as it is, and nothing stays held."""
        memo = PixelMemo()
        await _key([picture.png], memo)
        again = await _key([picture.png], memo)
        assert again.num_decoded == 0
        (decoded,) = again.take_pictures()
        assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), picture.array)
        fresh = await _key([picture.array, picture.png], memo)
        assert fresh.num_decoded == 1  # the array; the PNG is remembered
        pictures = fresh.take_pictures()
        assert [np.array_equal(np.asarray(p), picture.array) for p in pictures] == [True, True]
        with pytest.raises(InvalidInput, match="holds no picture"):
            fresh.take_pictures()

    async def test_the_low_level_keeps_no_pixels(self, picture):
        """fetch and store_images need keys only: no decoded picture or bytes outlive keying."""
        keyed = await _key([picture.png, picture.array], for_model=False)
        assert keyed.num_decoded == 0
        with pytest.raises(InvalidInput, match="holds no picture"):
            keyed.take_pictures()

    async def test_a_changed_file_is_another_picture(self, tmp_path, picture):
        """The memo goes by the bytes read, not the path: a file rewritten with another
        picture keys as that picture."""
        memo = PixelMemo()
        before = await _key([picture.path], memo)
        picture.path.write_bytes(_encoded(_noise(48, 32, seed=7)))
        after = await _key([picture.path], memo)
        assert after.digest != before.digest
        assert after.digest == (await _key([_noise(48, 32, seed=7)])).digest

    def test_the_memo_is_a_bounded_lru(self):
        """Beyond max_entries the least recently used entry is forgotten."""
        memo = PixelMemo(max_entries=2)
        values = {name: images_module._Pixels(bytes(32), (1, 1)) for name in (b"a", b"b", b"c")}
        memo.put(b"a", values[b"a"])
        memo.put(b"b", values[b"b"])
        assert memo.get(b"a") is values[b"a"]  # a is now the most recent
        memo.put(b"c", values[b"c"])
        assert memo.num_entries == 2
        assert memo.get(b"b") is None and memo.get(b"a") is values[b"a"] and memo.get(b"c") is values[b"c"]
        assert (memo.num_hits, memo.num_misses) == (3, 1)


def _truncated(picture: Picture) -> bytes:
    return picture.png[: len(picture.png) // 2]


class TestRefusals:
    @pytest.mark.parametrize("form", ["path", "bytes", "data URL", "PIL opened"])
    @pytest.mark.parametrize("for_model", [True, False], ids=["generate", "low-level"])
    async def test_a_truncated_picture_fails_alike_in_every_form(self, tmp_path, picture, form, for_model):
        """Half a PNG, as a file, bytes, a data URL or an opened PIL image, is the same
        InvalidInput naming its image."""
        broken = Picture(tmp_path, seed=3)
        broken.png = _truncated(broken)
        broken.path.write_bytes(broken.png)
        image = FORMS[form](broken)
        with pytest.raises(InvalidInput, match="cannot be read as an image: image file is truncated") as info:
            await _key([picture.png, image], for_model=for_model)
        assert info.value.argument == "images[1]"
        if form == "PIL opened":
            image.close()  # the caller's: PIL keeps its file open after a failed load

    @pytest.mark.parametrize(
        "bad, argument, shown, reason",
        [
            (lambda p: io.BytesIO(p.png), "images[1]", "<BytesIO>", "pass its bytes"),
            (lambda p: None, "images[1]", "=None", "must be a path"),
            (lambda p: object(), "images[1]", "<object>", "must be a path"),
            (lambda p: b"these bytes are not a picture", "images[1]", "<29 bytes>", "not a format PIL reads"),
            (lambda p: "/no/such/picture.png", "images[1]", "picture.png", "No such file"),
            (lambda p: "data:image/png;base64,%%%", "images[1]", "data:", "not a valid data URL"),
            (lambda p: np.zeros((8, 8, 3), dtype=np.float32), "images[1]", "<float32 array of shape (8, 8, 3)>", "uint8"),
            (lambda p: np.zeros((0, 8, 3), dtype=np.uint8), "images[1]", "<8x0 image>", "no pixels"),
            (lambda p: np.zeros((1, 300, 3), dtype=np.uint8), "images[1]", "<300x1 image>", "elongated"),
        ],
        ids=["BytesIO", "None", "object", "not-an-image", "missing", "bad-data-url", "float", "empty", "elongated"],
    )
    async def test_each_refusal_names_its_image_readably(self, picture, bad, argument, shown, reason):
        """A refused image is named by its index and shown as a reader would describe it:
        no object address, no stream repr."""
        with pytest.raises(InvalidInput) as info:
            await _key([picture.png, bad(picture)])
        message = str(info.value)
        assert info.value.argument == argument
        assert shown in message and reason in message
        assert not re.search("0x[0-9a-f]{6}", message) and "_io." not in message

    @pytest.mark.parametrize(
        "images, shown",
        [("cat.png", "'cat.png'"), (b"\x89PNG", "<4 bytes>"), (np.zeros((4, 4, 3), np.uint8), "<uint8 array of shape")],
        ids=["str", "bytes", "array"],
    )
    async def test_one_image_instead_of_a_list(self, images, shown):
        """A single image where a list belongs is refused as ``images``, described, with the fix."""
        with pytest.raises(InvalidInput, match="put one image in a list") as info:
            await _key(images)
        assert info.value.argument == "images" and shown in str(info.value)

    async def test_one_pil_image_instead_of_a_list(self, picture):
        """A PIL image where a list belongs is shown by size and mode, not by its repr."""
        with pytest.raises(InvalidInput, match=r"images=<PIL image 48x32 RGB>: must be a list") as info:
            await _key(Image.fromarray(picture.array))
        assert not re.search("0x[0-9a-f]{6}", str(info.value))

    async def test_the_low_level_keys_what_is_not_a_picture(self, picture):
        """fetch and store_images key a URL, a missing file, bytes that are no picture and
        other arrays (their own sources), where generate refuses them; broken pictures,
        other types and oversized pictures they refuse alike."""
        for source in ("https://images.invalid/a.png", "/no/such/file", b"opaque", np.ones((3,), np.float64)):
            await _key([source], for_model=False)
            with pytest.raises(InvalidInput):
                await _key([source], for_model=True)
        for bad in (None, io.BytesIO(picture.png), _truncated(picture), np.zeros((0, 4), np.uint8)):
            with pytest.raises(InvalidInput):
                await _key([bad], for_model=False)


class TestEntryPoints:
    async def test_fetch_and_store_images_take_every_form(self, picture):
        """On a runtime without a model, store_images with a PIL image and fetch with any
        other form of the picture find the same embeddings and blocks."""
        embeddings = mx.ones((4, 8))
        async with CacheRuntime(block_size=16, max_blocks=16) as rt:
            await rt.store_images([Image.open(picture.path)], embeddings, num_image_tokens=4)
            await rt.fetch("first", PROMPT, images=[picture.array])
            await rt.store("first", PROMPT, [mx.full((2, 16), float(i)) for i in range(3)])
            await rt.release("first")
            for k, form in enumerate(FORMS):
                if form == "PIL palette":
                    continue  # another picture
                async with rt.request(f"r{k}", PROMPT, images=[FORMS[form](picture)]) as request:
                    assert request.result.vision_embeddings is not None, form
                    assert request.result.num_cached_tokens == 48, form
            assert rt.client.pixel_memo.num_hits > 0
            assert await rt.check_invariants()
