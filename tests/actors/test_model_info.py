"""ModelInfo: what a runner says of its model, made from mlx-lm's model arguments."""

from __future__ import annotations

import pytest
from mlx_lm.models.llama import ModelArgs

from mlxkv.actors.model_info import ModelInfo, context_unit


def _args(**changes: object) -> ModelArgs:
    options = dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100,
        max_position_embeddings=2048,
    )  # fmt: skip
    options.update(changes)
    return ModelArgs(**options)


class TestFromArgs:
    """``ModelInfo.from_args``: the fields both runners read off a model's arguments."""

    def test_reads_vocabulary_context_and_stop_tokens(self):
        """Vocabulary and context come from the config; stop tokens become a
        frozenset of ints; the runner's own fields pass through."""
        info = ModelInfo.from_args(
            _args(), [2, 7, 2], cache_layers=("KVCache", "KVCache"), has_recurrent=False, compiled_layers=2
        )
        assert info.vocab_size == 100
        assert info.max_context == 2048
        assert info.eos_token_ids == frozenset({2, 7})
        assert info.cache_layers == ("KVCache", "KVCache") and info.compiled_layers == 2

    @pytest.mark.parametrize("bad", [0, -1, None, "2048"])
    def test_a_context_that_is_not_a_positive_int_is_unknown(self, bad):
        """A missing, zero, negative or non-int ``max_position_embeddings`` says
        nothing: the context is None (generation then checks no bound)."""
        info = ModelInfo.from_args(_args(max_position_embeddings=bad), (), cache_layers=(), has_recurrent=False)
        assert info.max_context is None

    def test_context_unit_weighs_a_tokens_work_against_its_attention(self):
        """Projections and MLP of one token (2*64*64 + 2*64*32 + 3*64*128 = 36,864
        multiply-adds) over its attention to one context token (2*4*16 = 128): 288."""
        assert context_unit(_args()) == 288
        assert ModelInfo.from_args(_args(), (), cache_layers=(), has_recurrent=False).context_unit == 288

    def test_context_unit_without_sizes_is_the_default(self):
        """Arguments that do not say the sizes (no args at all, say) weigh as 512."""
        assert context_unit(None) == 512
        assert ModelInfo.from_args(None, (), cache_layers=(), has_recurrent=False).context_unit == 512


class TestSummary:
    """``ModelInfo.summary`` and ``block_bytes``."""

    def test_summary_names_only_what_there_is(self):
        """Fused and transposed layers appear only where there are any; no
        shared prefixes show as ``-``."""
        plain = ModelInfo(vocab_size=1, eos_token_ids=frozenset(), cache_layers=("KVCache",) * 2, has_recurrent=False)
        assert plain.summary() == "cpu, shared-prefix attention -; decode compiled in 0 of 2 layers"
        chosen = ModelInfo(
            vocab_size=1, eos_token_ids=frozenset(), cache_layers=("KVCache",) * 2, has_recurrent=False,
            prefix_attention="kernel", compiled_layers=2, fused_projections=4, transposed_layers=7, device="gpu (CUDA)",
        )  # fmt: skip
        assert chosen.summary() == (
            "gpu (CUDA), shared-prefix attention kernel; decode compiled in 2 of 2 layers,"
            " 4 projection sets fused, 7 linear layers transposed"
        )

    def test_block_bytes_count_the_snapshot(self):
        """A block's bytes are its tokens' KV and one recurrent snapshot."""
        info = ModelInfo(
            vocab_size=1, eos_token_ids=frozenset(), cache_layers=(), has_recurrent=True,
            kv_bytes_per_token=256, state_bytes=1000,
        )  # fmt: skip
        assert info.block_bytes(16) == 16 * 256 + 1000
