"""The parity checks have teeth: the built-in models' greedy tokens depend on
the KV they attend to, so a wrong cached prefix changes them.

With tied embeddings and small random weights a model repeats the prompt's
last token forever, and "the warm run gives the cold run's greedy tokens"
then holds whatever the cache holds. These tests pin down that the built-in
models do not (different prompts continue differently, and each continuation
varies), and that serving a request from a deliberately broken cached prefix
-- block 0's KV replaced by block 1's, a chain bug that serves the wrong
block -- changes its greedy tokens within a few steps, on every cache kind
and on both ways a warm prefix is served (rebuilt from blocks, or the kept
last cache). The same requests without the fault equal their cold runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlxkv import CacheRuntime
from mlxkv.actors import kept_caches
from mlxkv.default_model import (
    DEFAULT_MODEL,
    TINY_HYBRID,
    TINY_LLAMA,
    TINY_SLIDING_LLAMA,
    ensure_model,
)

from device_arithmetic import LOGITS_ATOL_ON_GPU
from model_weights import with_twin_tokens
from parity import BS, assert_clean, assert_matches_cold, assert_parted_at_a_tie, break_prefix_rebuild, run

TEXT_SPECS = {
    "default": DEFAULT_MODEL,
    "llama": TINY_LLAMA,
    "sliding": TINY_SLIDING_LLAMA,
    "hybrid": TINY_HYBRID,
}

#: Greedy steps within which a wrong prefix must show.
STEPS = 8


def _prompt(length: int, seed: int) -> list[int]:
    return [(i * 37 + seed * 101 + (i // 7) ** 2 + seed * i) % 250 for i in range(length)]


def _greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    return [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=steps)]


def _break_reconstruction(monkeypatch: pytest.MonkeyPatch) -> None:
    break_prefix_rebuild(monkeypatch, BS)


def _scramble_tail(cache: list[Any], count: int = 4) -> None:
    """The fault for a kept cache: its last ``count`` tokens get its first
    ones' KV (the tail is what the kept cache gives beyond the cached blocks,
    which a shared prefix takes from the pool instead)."""
    for layer in cache:
        layer = getattr(layer, "suffix", layer)
        end = layer.offset
        if isinstance(getattr(layer, "keys", None), mx.array) and end >= 2 * count:
            layer.keys[..., end - count : end, :] = layer.keys[..., :count, :]
            layer.values[..., end - count : end, :] = layer.values[..., :count, :]


def _break_kept_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    honest = kept_caches.KeptCaches.keep

    def broken(self: Any, sequence: Any, cache: list[Any], num_tokens: int, **options: Any) -> None:
        honest(self, sequence, cache, num_tokens, **options)
        _scramble_tail(self.entries[-1].cache)

    monkeypatch.setattr(kept_caches.KeptCaches, "keep", broken)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class TestBuiltInModelsContinue:
    @pytest.mark.parametrize("name", sorted(TEXT_SPECS))
    def test_continuations_depend_on_the_prompt(self, name, model_dir):
        """Eight prompts give eight different greedy continuations, none of
        them stuck: each has at least 4 distinct tokens in 16."""
        model, _ = load(str(ensure_model(TEXT_SPECS[name], model_dir)))
        continuations = [_greedy(model, _prompt(48, seed), 16) for seed in range(8)]
        assert len({tuple(c) for c in continuations}) == 8
        assert min(len(set(c)) for c in continuations) >= 4, continuations

    def test_the_prompts_last_token_is_not_echoed(self, model_dir):
        """The default model does not repeat the prompt's last token (the old echo)."""
        model, _ = load(str(ensure_model(DEFAULT_MODEL, model_dir)))
        for seed in range(4):
            prompt = _prompt(48, seed)
            assert _greedy(model, prompt, 8) != [prompt[-1]] * 8


async def _caught(
    path: str,
    break_it: Callable[[pytest.MonkeyPatch], None],
    monkeypatch: pytest.MonkeyPatch,
    *,
    keep_caches: bool,
    first: Any = None,
    shared_prefix: bool = True,
    **kwargs: Any,
) -> None:
    """Turn 2 of a conversation equals its cold run, and diverges from it
    within :data:`STEPS` tokens once its cached prefix is broken."""
    first = _prompt(80, 1) if first is None else first
    options = dict(block_size=BS, keep_caches=keep_caches, shared_prefix=shared_prefix)
    async with CacheRuntime(model=path, **options) as rt:
        answer, report = await run(rt, first, max_tokens=4, **kwargs)
        second = list(report.prompt_ids) + answer + _prompt(20, 2)
        honest = await run(rt, second, max_tokens=STEPS, **kwargs)
        assert honest[1].cached_tokens >= 2 * BS
        await assert_matches_cold(rt, second, honest, "cold", **kwargs)

        break_it(monkeypatch)
        await run(rt, first, max_tokens=4, cache_salt="broken", **kwargs)
        tokens, report = await run(rt, second, max_tokens=STEPS, cache_salt="broken", **kwargs)
        monkeypatch.undo()
        assert report.cached_tokens >= 2 * BS
        assert _first_difference(tokens, honest[0]) < STEPS, (tokens, honest[0])
        # The GPU's looser logit tolerance would catch it too, with room to
        # spare (the least a broken prefix moved them here: 0.017, hybrid).
        moved = mx.abs(mx.array(report.prompt_logits) - mx.array(honest[1].prompt_logits)).max().item()
        assert moved > 2 * LOGITS_ATOL_ON_GPU, moved
        await assert_clean(rt)


class TestParityClearsOnlyTies:
    async def test_a_token_the_model_ranks_far_below_its_choice_is_no_tie(self, model_dir):
        """Greedy runs that part are cleared only at a tie within float noise:
        a run whose first token is the one the model ranks last is not, and
        neither is one that parts nowhere, nor a request with images."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        async with CacheRuntime(model=path, block_size=BS) as rt:
            tokens, report = await run(rt, _prompt(40, 3), max_tokens=4)
            worst = int(mx.argmin(mx.array(report.prompt_logits).reshape(-1)).item())
            with pytest.raises(AssertionError):
                assert_parted_at_a_tie(rt, report.prompt_ids, tokens, [worst, *tokens[1:]], images=False)
            with pytest.raises(AssertionError):
                assert_parted_at_a_tie(rt, report.prompt_ids, tokens, tokens, images=False)
            with pytest.raises(AssertionError):
                assert_parted_at_a_tie(rt, report.prompt_ids, tokens, [worst, *tokens[1:]], images=True)
            await assert_clean(rt)

    async def test_two_tokens_the_model_cannot_tell_apart_are_a_tie(self, model_dir, tmp_path):
        """With a token's output weights made its greedy first choice's, a run
        that takes the twin instead parts at a tie (gap 0) and is cleared."""
        path, prompt = tmp_path / "twins", _prompt(40, 3)
        first, twin = with_twin_tokens(ensure_model(TINY_LLAMA, model_dir), path, prompt)
        async with CacheRuntime(model=str(path), block_size=BS) as rt:
            tokens, report = await run(rt, prompt, max_tokens=4)
            assert tokens[0] in (first, twin)
            other = twin if tokens[0] == first else first
            assert_parted_at_a_tie(rt, report.prompt_ids, tokens, [other, *tokens[1:]], images=False)


class TestAWrongPrefixChangesTheTokens:
    @pytest.mark.parametrize("name", ["llama", "llama-copies", "sliding", "hybrid"])
    async def test_rebuilt_from_blocks(self, name, model_dir, monkeypatch):
        """A prefix rebuilt from blocks with block 0 wrong gives other greedy
        tokens, on each text cache kind (KVCache held once in a shared
        prefix, or copied per request; RotatingKVCache; ArraysCache)."""
        spec = TEXT_SPECS[name.removesuffix("-copies")]
        path = str(ensure_model(spec, model_dir))
        await _caught(
            path, _break_reconstruction, monkeypatch, keep_caches=False, shared_prefix=not name.endswith("-copies")
        )

    async def test_from_the_last_cache(self, model_dir, monkeypatch):
        """The kept last cache with its tail wrong gives other greedy tokens."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        await _caught(path, _break_kept_cache, monkeypatch, keep_caches=True)

    async def test_rebuilt_with_an_image(self, vlm_path, tmp_path, monkeypatch):
        """A vision-language prefix (text, then an image) rebuilt with block 0
        wrong gives other greedy tokens."""
        pytest.importorskip("mlx_vlm")
        first = "A system prompt of some length. <|image_pad|> What is in it, in detail?"
        await _caught(
            str(vlm_path),
            _break_reconstruction,
            monkeypatch,
            keep_caches=False,
            first=first,
            images=[_picture(tmp_path, seed=0)],
        )


def _picture(folder: Any, seed: int) -> str:
    import numpy as np
    from PIL import Image

    path = folder / f"p{seed}.png"
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return str(path)


class TestTheVisionModelSeesTheImage:
    async def test_different_images_continue_differently(self, vlm_path, tmp_path):
        """The same text about three different images gives three different
        greedy continuations, each of at least 4 distinct tokens."""
        pytest.importorskip("mlx_vlm")
        prompt = "<|vision_start|><|image_pad|><|vision_end|>Describe this image."
        async with CacheRuntime(model=str(vlm_path), block_size=BS) as rt:
            outs = [
                (await run(rt, prompt, images=[_picture(tmp_path, seed)], max_tokens=16))[0]
                for seed in range(3)
            ]
            await assert_clean(rt)
        assert len({tuple(o) for o in outs}) == 3
        assert min(len(set(o)) for o in outs) >= 4, outs

