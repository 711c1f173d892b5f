"""Images end to end on the built-in tiny Qwen2-VL: parity, reuse of embeddings and KV, bad images.

Parity is exact here (the recipe measured max abs differences of 0 on this
model); the tests keep the generation tests' tolerance, ``ATOL = 1e-4``. A
"cold" run is the same request under a fresh ``cache_salt``: no block and no
cached image features are shared with it.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Callable

import anyio
import mlx.core as mx
import numpy as np
import pytest

from mlxkv import CacheRuntime, GenerationReport, InvalidInput
from mlxkv.default_model import TINY_LLAMA, ensure_model
from mlxkv.default_vlm import DEFAULT_VLM
from parity import ATOL, assert_clean, run
from image_checks import blank_png, on_this_thread, spy_on_pixel_work

pytest.importorskip("mlx_vlm")
from PIL import Image  # noqa: E402  (pillow comes with the vlm extra)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three noise PNGs: 64x64, 64x64 and 80x48."""
    folder = tmp_path_factory.mktemp("pictures")
    out = []
    for seed, (width, height) in enumerate([(64, 64), (64, 64), (80, 48)]):
        rng = np.random.default_rng(seed)
        path = folder / f"p{seed}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        out.append(str(path))
    return out


def _logits(report: GenerationReport) -> np.ndarray:
    return np.array(report.prompt_logits)


def _same(warm: tuple[list[int], GenerationReport], cold: tuple[list[int], GenerationReport]) -> None:
    assert warm[0] == cold[0]
    np.testing.assert_allclose(_logits(warm[1]), _logits(cold[1]), atol=ATOL, rtol=0)


class TestVisionGeneration:
    async def test_a_cold_request_equals_mlx_vlm(self, vlm_path, tiny_vlm, pictures):
        """A request with an image gives mlx-vlm's own greedy tokens and first logits."""
        import mlx.core as mx
        from mlx_vlm.generate import stream_generate

        model, processor = tiny_vlm
        prompt = "<|vision_start|><|image_pad|><|vision_end|>Describe this image."
        captured: list[Any] = []

        def capture(_tokens: Any, logits: Any) -> Any:
            captured.append(np.array(logits.astype(mx.float32)).reshape(-1))
            return logits

        reference = [
            r.token
            for r in stream_generate(
                model, processor, prompt, image=[pictures[0]], max_tokens=6, logits_processors=[capture]
            )
        ]
        model.language_model._position_ids = model.language_model._rope_deltas = None
        async with CacheRuntime(model=str(vlm_path), block_size=16) as rt:
            tokens, report = await run(rt, prompt, images=[pictures[0]], max_tokens=6)
            await assert_clean(rt)
        assert tokens == reference[: len(tokens)]
        np.testing.assert_allclose(_logits(report), captured[0], atol=ATOL, rtol=0)

    async def test_cached_embeddings_skip_the_encoder_exactly(self, vlm_path, pictures):
        """A second request about the same image feeds its cached embeddings (no encoder
        run) and equals the same request computed cold."""
        # Blocks of 64: the prompts share no full block, so only embeddings are
        # reused (the last cache, which holds the shared image tokens, is off).
        async with CacheRuntime(model=str(vlm_path), block_size=64, keep_caches=False) as rt:
            await run(rt, "What is this?", images=[pictures[0]])
            warm = await run(rt, "Describe the colours.", images=[pictures[0]])
            stats = await rt.stats()
            cold = await run(rt, "Describe the colours.", images=[pictures[0]], cache_salt="cold")
            await assert_clean(rt)
        assert warm[1].cached_tokens == 0
        assert stats.compute is not None
        assert (stats.compute.num_vision_encoder_runs, stats.compute.num_vision_encoder_skips) == (1, 1)
        assert stats.images.num_hits == 1
        _same(warm, cold)

    @pytest.mark.parametrize("keep_caches", [False, True])
    async def test_a_second_turn_reuses_the_first(self, vlm_path, pictures, keep_caches):
        """Turn 2 (turn 1's prompt + answer + new text, same image) reuses turn 1's
        image+prompt KV, needs no encoder, and equals turn 2 computed cold: from
        the blocks (full blocks only), or from the last cache (all of turn 1)."""
        async with CacheRuntime(model=str(vlm_path), block_size=16, keep_caches=keep_caches) as rt:
            preparer_tokens = await rt.tokenize(" And the shapes?")
            first = await run(rt, "Describe this image.", images=[pictures[0]], max_tokens=8)
            turn1 = await _prompt_tokens(rt, "Describe this image.", [pictures[0]])
            turn2 = turn1 + first[0] + list(preparer_tokens)
            warm = await run(rt, turn2, images=[pictures[0]], max_tokens=8)
            stats = await rt.stats()
            cold = await run(rt, turn2, images=[pictures[0]], max_tokens=8, cache_salt="cold")
            await assert_clean(rt)
        turn1_tokens = len(turn1) + len(first[0])
        assert warm[1].cached_tokens == (turn1_tokens if keep_caches else turn1_tokens // 16 * 16)
        assert stats.compute is not None and stats.compute.num_vision_encoder_runs == 1
        assert stats.compute.num_kept_cache_reuses == int(keep_caches)
        _same(warm, cold)

    async def test_image_order_is_part_of_the_key(self, vlm_path, pictures):
        """[A, B] and [B, A] share nothing and answer differently."""
        async with CacheRuntime(model=str(vlm_path), block_size=16) as rt:
            ab = await run(rt, "Compare them.", images=[pictures[0], pictures[2]])
            ba = await run(rt, "Compare them.", images=[pictures[2], pictures[0]])
            stats = await rt.stats()
        assert ba[1].cached_tokens == 0
        assert stats.images.num_hits == 0
        assert np.abs(_logits(ab[1]) - _logits(ba[1])).max() > 1e-3

    async def test_text_before_the_images_is_shared_across_images(self, vlm_path, pictures):
        """Images key the blocks from the one holding their first token on: a
        system prompt before the image is computed once for requests about
        different images (and for text alone), each exact; the image blocks
        are never shared."""
        system = "<|im_start|>system\nYou look at pictures and say what you see in them.<|im_end|>\n"
        ask = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        async with CacheRuntime(model=str(vlm_path), block_size=16, keep_caches=False) as rt:
            system_tokens = len(await rt.tokenize(system + "<|im_start|>user\n"))
            shared = system_tokens // 16 * 16  # full blocks before the image
            assert shared >= 32
            first = await run(rt, system + ask, images=[pictures[0]], max_tokens=6)
            other = await run(rt, system + ask, images=[pictures[1]], max_tokens=6)
            text = await run(rt, system + "<|im_start|>user\nNo picture today.<|im_end|>\n", max_tokens=6)
            same = await run(rt, system + ask, images=[pictures[1]], max_tokens=6)
            cold = await run(rt, system + ask, images=[pictures[1]], max_tokens=6, cache_salt="cold")
            await assert_clean(rt)
        assert first[1].cached_tokens == 0
        assert other[1].cached_tokens == shared  # the system prompt, not the other image
        assert text[1].cached_tokens == shared
        assert same[1].cached_tokens > shared  # its own image's blocks too
        _same(other, cold)
        _same(same, cold)
        assert first[0] != other[0] or np.abs(_logits(first[1]) - _logits(other[1])).max() > 1e-3

    async def test_an_answer_completing_the_block_of_the_image_is_reused(self, vlm_path, tmp_path):
        """An image whose tokens all sit in the prompt's last, partial block: the
        answer completes that block, which the images key too (stored as an
        extension); turn 2 finds it and every later one, exactly."""
        small = _write(tmp_path / "small.png", _png_bytes(32, 32))  # 4 image tokens
        lead = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        async with CacheRuntime(model=str(vlm_path), block_size=16, keep_caches=False) as rt:
            lead_tokens = len(await rt.tokenize(lead))
            # <|vision_start|> at offset 7 of a block: the 4 image tokens, the
            # end token and "?" fill offsets 8-13, and the prompt ends there.
            pad = (7 - lead_tokens) % 16 + 16
            text = lead + "x" * pad + "<|vision_start|><|image_pad|><|vision_end|>?"
            prompt = await _prompt_tokens(rt, text, [small])
            pad_id = DEFAULT_VLM.image_token_id
            assert len(prompt) % 16 == 14 and prompt.index(pad_id) == len(prompt) - 6
            assert prompt.count(pad_id) == 4
            first = await run(rt, text, images=[small], max_tokens=24)
            turn2 = prompt + first[0] + list(await rt.tokenize(" More?"))
            warm = await run(rt, turn2, images=[small], max_tokens=4)
            cold = await run(rt, turn2, images=[small], max_tokens=4, cache_salt="cold")
            await assert_clean(rt)
        assert warm[1].cached_tokens == (len(prompt) + len(first[0])) // 16 * 16 > len(prompt)
        _same(warm, cold)

    async def test_a_text_only_request_on_the_vision_model(self, vlm_path, pictures):
        """Without images the vision model generates as a text model, and reuses text prefixes."""
        prompt = "A plain question without any image, long enough to fill a block or two."
        async with CacheRuntime(model=str(vlm_path), block_size=16) as rt:
            first = await run(rt, prompt)
            again = await run(rt, prompt)
            cold = await run(rt, prompt, cache_salt="cold")
            stats = await rt.stats()
        assert again[1].cached_tokens > 0
        _same(again, cold)
        assert first[0] == cold[0]
        assert stats.compute is not None and stats.compute.num_vision_encoder_runs == 0
        assert stats.compute.num_kept_cache_reuses == 1  # "again" took "first"'s cache

    async def test_image_requests_decode_together_exactly(self, vlm_path, pictures):
        """Concurrent requests with different images (and one without) decode in one batch,
        each as it would alone."""
        requests = [("Describe it.", [pictures[0]]), ("Which one?", [pictures[2]]), ("No picture here.", None)]
        async with CacheRuntime(model=str(vlm_path), block_size=16) as rt:
            alone = [await run(rt, p, images=i, max_tokens=10, cache_salt="alone") for p, i in requests]
            together: list[Any] = [None] * len(requests)

            async def one(k: int) -> None:
                prompt, images = requests[k]
                together[k] = await run(rt, prompt, images=images, max_tokens=10, cache_salt="together")

            async with anyio.create_task_group() as tg:
                for k in range(len(requests)):
                    tg.start_soon(one, k)
            stats = await rt.stats()
        for mine, theirs in zip(together, alone):
            _same(mine, theirs)
        assert stats.compute is not None and stats.compute.mean_batch_size > 1


class TestBadImages:
    @pytest.mark.parametrize(
        "make_bad, reason",
        [
            (lambda tmp: str(tmp / "missing.png"), "cannot be read"),
            (lambda tmp: b"these bytes are not a picture", "cannot be read"),
            (lambda tmp: _write(tmp / "truncated.png", _png_bytes()[:200]), "cannot be read"),
            (lambda tmp: Image.open(_write(tmp / "truncated.png", _png_bytes()[:200])), "cannot be read"),
            (lambda tmp: np.zeros((1, 400, 3), dtype=np.uint8), "elongated"),
            (lambda tmp: _write(tmp / "huge.png", blank_png(12000, 12000)), "144000000 pixels, more than"),
            (lambda tmp: "https://example.com/cat.png", "URLs are not fetched"),
            (lambda tmp: np.zeros((8, 8, 3), dtype=np.float32), "uint8"),
        ],
        ids=["missing", "not-an-image", "truncated", "truncated-PIL", "too-elongated", "too-large", "url", "float-array"],
    )
    async def test_refused_before_anything_is_computed(self, vlm_path, pictures, tmp_path, make_bad, reason):
        """A bad image is InvalidInput naming it (images[1]); nothing is computed, cached or held."""
        bad = make_bad(tmp_path)
        async with CacheRuntime(model=str(vlm_path), block_size=16) as rt:
            with pytest.raises(InvalidInput, match=reason) as info:
                await run(rt, "Look at these.", images=[pictures[0], bad])
            assert info.value.argument == "images[1]"
            stats = await rt.stats()
            assert stats.compute is not None and stats.compute.num_prefill_tokens == 0
            assert stats.index.num_lookups == 0 and stats.images.num_entries == 0
            await assert_clean(rt)
        if isinstance(bad, Image.Image):
            bad.close()  # PIL keeps the file of a failed load open

    async def test_placeholders_must_match_the_images(self, vlm_path, pictures):
        """A prompt with more image placeholders than images, or image tokens without
        images, is refused."""
        async with CacheRuntime(model=str(vlm_path), block_size=16) as rt:
            with pytest.raises(InvalidInput, match="has 2 image placeholders for 1 image$"):
                await run(rt, "<|image_pad|><|image_pad|>two?", images=[pictures[0]])
            with pytest.raises(InvalidInput, match="image tokens"):
                await run(rt, [1, 2, 261, 3])  # 261: the image-pad token
            await assert_clean(rt)

    async def test_a_text_model_refuses_images(self, model_dir, pictures):
        """Images given to a text model are refused up front."""
        async with CacheRuntime(model=str(ensure_model(TINY_LLAMA, model_dir))) as rt:
            with pytest.raises(InvalidInput, match=r"^invalid images=<1 image>: this model does not take images"):
                rt.generate("hi", images=[pictures[0]], max_tokens=2)


#: Every form generate and fetch take of the picture at a path (made when called).
FORMS: dict[str, Callable[[str], Any]] = {
    "path": lambda path: path,
    "Path": Path,
    "bytes": lambda path: Path(path).read_bytes(),
    "data URL": lambda path: "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode(),
    "PIL opened": Image.open,
    "PIL decoded": lambda path: Image.open(path).convert("RGB"),
    "PIL RGBA": lambda path: Image.open(path).convert("RGBA"),
    "uint8 array": lambda path: np.asarray(Image.open(path).convert("RGB")),
    "MLX array": lambda path: mx.array(np.asarray(Image.open(path).convert("RGB"))),
}


class TestImageForms:
    async def test_generate_hits_the_same_picture_in_every_form(self, vlm_path, pictures):
        """After a request about a PNG file, the same request with the picture as a path,
        bytes, data URL, PIL image (opened, decoded, with an alpha channel) or array
        reuses the cached blocks and features (the encoder runs once) and answers alike."""
        async with CacheRuntime(model=str(vlm_path), block_size=16, keep_caches=False) as rt:
            first = await run(rt, "Hi?", images=[pictures[0]])  # 21 tokens: 16 + 1 image token, 4 more
            for name, form in FORMS.items():
                tokens, report = await run(rt, "Hi?", images=[form(pictures[0])])
                assert report.cached_tokens == 16, name
                _same((tokens, report), first)
            stats = await rt.stats()
            await assert_clean(rt)
        assert stats.compute is not None
        assert (stats.compute.num_vision_encoder_runs, stats.compute.num_vision_encoder_skips) == (1, len(FORMS))
        assert stats.images.num_hits == len(FORMS)

    async def test_fetch_finds_what_generate_cached_in_every_form(self, vlm_path, pictures):
        """rt.fetch (and rt.request) with the picture in any form, keyed from its first
        image token as generate keys it, gets generate's blocks and the cached features."""
        async with CacheRuntime(model=str(vlm_path), block_size=16) as rt:
            _, report = await run(rt, "Hi?", images=[pictures[0]])
            prompt = list(report.prompt_ids)
            start = prompt.index(DEFAULT_VLM.image_token_id)
            for k, (name, form) in enumerate(FORMS.items()):
                async with rt.request(f"r{k}", prompt, images=[form(pictures[0])], images_start=start) as request:
                    assert request.result is not None
                    assert request.result.num_cached_tokens == 16, name
                    assert request.result.vision_embeddings is not None, name
            await assert_clean(rt)

    @pytest.mark.parametrize("form", ["path", "bytes", "PIL opened", "PIL decoded", "uint8 array"])
    async def test_no_pixels_are_touched_on_the_loop(self, vlm_path, tmp_path, monkeypatch, form):
        """While generate (a miss, then a hit) and fetch take a 512x512 picture, no PIL
        decode, conversion, serialization, pixel hash or freeing of decoded pictures
        runs on the event loop's thread."""
        path = _write(tmp_path / "big.png", _png_bytes(512, 512))
        async with CacheRuntime(model=str(vlm_path), block_size=16) as rt:
            for_generate, again, for_fetch = FORMS[form](path), FORMS[form](path), FORMS[form](path)
            seen = spy_on_pixel_work(monkeypatch)
            await run(rt, "Hi?", images=[for_generate], max_tokens=2)
            await run(rt, "Hi?", images=[again], max_tokens=2)
            await rt.fetch("low", [1, 2, 3], images=[for_fetch], cache_salt="other")
            await rt.release("low")
        assert "_pixel_key" in seen and "take_pictures" in seen
        assert ("release" in seen) == form.startswith(("PIL", "uint8"))  # decoded, then not needed
        assert not on_this_thread(seen)


class TestImageBudget:
    async def test_embeddings_are_bounded_by_bytes(self, vlm_path, pictures):
        """The image cache keeps embeddings within memory_budget, evicting the least recent."""
        async with CacheRuntime(model=str(vlm_path), block_size=64, memory_budget=6000) as rt:
            for picture in pictures:
                await run(rt, "What is it?", images=[picture], max_tokens=2)
            stats = await rt.stats()
        # One 64x64 image's features: 16 tokens x 64 floats x 4 bytes = 4 KiB.
        assert stats.images.num_bytes <= 6000 and stats.images.num_evictions >= 1
        assert stats.images.num_entries == 1


async def _prompt_tokens(rt: CacheRuntime, text: str, images: list[str]) -> list[int]:
    """The token ids generate made of ``text`` and ``images`` (image pads included)."""
    loaded = [Image.open(path).convert("RGB") for path in images]
    assert rt.preparer is not None
    return list(rt.preparer.prepare(text, loaded).tokens)


def _png_bytes(width: int = 64, height: int = 64) -> bytes:
    import io

    buffer = io.BytesIO()
    noise = np.random.default_rng(5).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


class TestPositions:
    @pytest.mark.parametrize(
        "prompt",
        [
            "Two pictures, then some text after them.",
            "A bare <|image_pad|> and another <|image_pad|>, then some text after them.",
            (*b"bare pads: ", DEFAULT_VLM.image_token_id, *b", ", DEFAULT_VLM.image_token_id, *b" text"),
        ],
        ids=["placed", "bare-text", "bare-ids"],
    )
    def test_text_after_images_sits_at_index_plus_delta(self, tiny_vlm, pictures, prompt):
        """The position of text after the images, computed from their grids alone,
        equals what mlx-vlm's get_rope_index gives for the whole prompt, also
        for bare (unframed) placeholders, which the preparer frames."""
        import mlx.core as mx

        from mlxkv.actors.vision_runner import VisionRunner

        model, processor = tiny_vlm
        runner = VisionRunner(model, processor)
        loaded = [Image.open(path).convert("RGB") for path in (pictures[0], pictures[2])]
        prepared = runner.preparer().prepare(prompt, loaded)
        positions, deltas = model.language_model.get_rope_index(
            mx.array(prepared.tokens)[None], prepared.inputs.grid
        )
        delta = runner._image_delta(prepared.inputs.grid)
        assert delta == int(deltas.reshape(-1)[0].item()) < 0
        last = len(prepared.tokens) - 1
        assert np.array(positions[:, 0, last]).tolist() == [last + delta] * 3
