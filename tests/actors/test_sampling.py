"""A request's sampler: top_k past the vocabulary, and failing draws that leave MLX's generator as it was."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.actors.sampling import Sampling


def _logprobs(width: int, seed: int = 0) -> mx.array:
    logits = mx.array(np.random.default_rng(seed).normal(size=(1, width)).astype(np.float32))
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _key() -> np.ndarray:
    return np.array(mx.random.state[0])


class TestDraw:
    """``Sampling.make_sampler()``'s draws."""

    @pytest.mark.parametrize("top_k", [10, 11, 2**40])
    def test_top_k_at_or_past_the_width_is_off(self, top_k):
        """top_k >= the logits' width draws what top_k=0 draws, from the same key."""
        logprobs = _logprobs(10)
        wide = Sampling(temperature=1.0, top_k=top_k, seed=4).make_sampler()
        free = Sampling(temperature=1.0, seed=4).make_sampler()
        assert wide is not None and free is not None
        assert [wide(logprobs).item() for _ in range(8)] == [free(logprobs).item() for _ in range(8)]

    @pytest.mark.parametrize("seed", [None, 3])
    def test_a_failing_draw_leaves_the_key_as_it_was(self, seed):
        """A draw that raises inside mlx-lm's compiled sampler (top_k=5 met with
        logits 3 wide: its own range check) leaves MLX's key unchanged, and every
        kind of unseeded draw after it works (once, they all failed with "eval an
        array without a primitive" until something reseeded)."""
        sampler = Sampling(temperature=1.0, top_k=5, seed=seed).make_sampler()
        assert sampler is not None
        mx.eval(sampler(_logprobs(10)))  # built for 10 wide
        before = _key()
        with pytest.raises(ValueError, match="top_k"):
            sampler(_logprobs(3))
        assert (_key() == before).all()
        for options in ({}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 2}):
            draw = Sampling(temperature=1.0, **options).make_sampler()
            assert draw is not None
            token = draw(_logprobs(10, seed=1))
            mx.eval(token)
            assert 0 <= token.item() < 10

    def test_an_unseeded_draw_moves_the_key_and_a_seeded_one_reseeds(self):
        """Draws use the generator: an unseeded one advances its key; a seeded one
        leaves an unpredictable key behind (not the one its seed gave)."""
        before = _key()
        unseeded = Sampling(temperature=1.0).make_sampler()
        assert unseeded is not None
        mx.eval(unseeded(_logprobs(10)))
        after = _key()
        assert not (after == before).all()
        seeded = Sampling(temperature=1.0, seed=7).make_sampler()
        assert seeded is not None
        mx.eval(seeded(_logprobs(10)))
        first = _key()
        seeded_again = Sampling(temperature=1.0, seed=7).make_sampler()
        assert seeded_again is not None
        mx.eval(seeded_again(_logprobs(10)))
        assert not (_key() == first).all()

    def test_greedy_has_no_sampler(self):
        """temperature=0 takes the argmax: no sampler, whatever the filters."""
        assert Sampling(top_k=3).make_sampler() is None
