"""The hook: install routes a model's attention for shared-prefix caches only,
with the way its thread chose."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.actors import attention_hook
from mlxkv.actors.attention_hook import install
from mlxkv.actors.prefix_attention import PrefixAttention
from mlxkv.cache.shared_prefix import PrefixGroup, SharedPrefixCache, suffix_cache

from device_arithmetic import LOGITS_ATOL
from model_blocks import block_payloads


@pytest.fixture(autouse=True)
def device_way_after():
    """Each test leaves this thread attending the device's way, passed or failed."""
    yield
    attention_hook.use(PrefixAttention.for_device())


class TestInstall:
    def test_routes_a_model_and_leaves_other_caches_alone(self, tiny_llama):
        """After install, the model's attention module name is the dispatcher;
        the same model with ordinary caches computes exactly as before."""
        import mlx_lm.models.llama as llama

        model, _ = tiny_llama
        x = mx.array([[1, 2, 3, 4]])
        before = model(x, cache=make_prompt_cache(model))
        assert install(model)
        assert install(model)  # once per module, whatever the calls
        assert hasattr(llama.scaled_dot_product_attention, "__wrapped__")
        assert not hasattr(llama.scaled_dot_product_attention.__wrapped__, "__wrapped__")
        after = model(x, cache=make_prompt_cache(model))
        assert mx.array_equal(before, after).item()

    def test_the_last_layer_leaves_its_prefix_slices_lazy(self, tiny_llama, monkeypatch):
        """Every layer but the last evaluates a long prefix's scores slice by
        slice; the last leaves them to MLX, so a prefill body's last-layer
        attention, which nothing reads, is never computed."""
        import mlxkv.actors.attention_hook as module

        model, _ = tiny_llama
        assert install(model)
        group = PrefixGroup.build(block_payloads(model, list(range(64)), 16))
        layers = len(group.keys)
        assert layers > 1
        caches = [SharedPrefixCache(group, i, 64, suffix) for i, suffix in enumerate(suffix_cache((), 8, layers))]
        assert [c.last_layer for c in caches] == [False] * (layers - 1) + [True]
        batch = [SharedPrefixCache.merge([c, SharedPrefixCache(group, c.layer, 32, suffix_cache((), 8, 1)[0])]) for c in caches]
        assert [b.last_layer for b in batch] == [False] * (layers - 1) + [True]
        flags: list[bool] = []
        from mlxkv.actors.prefix_attention import cascade_attention as real

        def recording(*args: Any, evaluate_slices: bool = True) -> Any:
            flags.append(evaluate_slices)
            return real(*args, evaluate_slices=evaluate_slices)

        attention_hook.use(PrefixAttention.CASCADE)
        monkeypatch.setattr(module._CHOSEN, "attend", recording)
        model(mx.array([[1, 2, 3, 4], [5, 6, 7, 8]]), cache=batch)
        assert flags == [True] * (layers - 1) + [False]

    @pytest.mark.parametrize("way", list(PrefixAttention), ids=lambda way: way.value)
    def test_each_way_gives_the_logits_of_plain_caches(self, tiny_llama, way):
        """A batch of three rows over one group (two seeing all of its prefix,
        one only its first block), prefilling a chunk and then decoding a
        step, gives the logits of plain per-row caches holding the same
        tokens, whichever way the thread attends."""
        model, _ = tiny_llama
        assert install(model)
        attention_hook.use(way)
        assert attention_hook.way_in_use() is way
        prompt = list(range(3, 67))
        group = PrefixGroup.build(block_payloads(model, prompt, 16))
        layers = len(group.keys)
        seen = [64, 64, 16]
        rows = []
        for n in seen:
            rows.append([SharedPrefixCache(group, i, n, s) for i, s in enumerate(suffix_cache((), 8, layers))])
        batch = [SharedPrefixCache.merge([row[i] for row in rows]) for i in range(layers)]
        chunk = mx.array([[70, 71, 72], [80, 81, 82], [90, 91, 92]])
        shared = [model(chunk, cache=batch)[:, -1]]
        shared.append(model(mx.array([[5], [6], [7]]), cache=batch)[:, -1])
        for r, n in enumerate(seen):
            plain = make_prompt_cache(model)
            model(mx.array(prompt[:n])[None], cache=plain)
            first = model(chunk[r : r + 1], cache=plain)[:, -1]
            second = model(mx.array([[5 + r]]), cache=plain)[:, -1]
            for got, want in zip(shared, (first, second)):
                assert mx.allclose(got[r : r + 1], want, atol=LOGITS_ATOL, rtol=0).item(), (way, r)

    def test_the_way_is_the_threads_own(self):
        """A way chosen on one thread is not another thread's."""
        import threading

        attention_hook.use(PrefixAttention.STACKED)
        seen: list[Any] = []
        other = threading.Thread(target=lambda: seen.append(attention_hook.way_in_use()))
        other.start()
        other.join()
        assert attention_hook.way_in_use() is PrefixAttention.STACKED
        assert seen == [PrefixAttention.for_device()]

    def test_a_model_without_the_name_is_not_served(self):
        """A model whose attention does not call a module-level
        scaled_dot_product_attention is refused, and nothing changes."""
        import mlx.nn as nn

        class Attention(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q_proj = self.k_proj = self.v_proj = nn.Linear(2, 2)

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = [Attention()]

        assert not install(Model())

    @pytest.mark.parametrize("name", ["sliding_llama", "hybrid_model"])
    def test_only_plain_kv_models_share(self, name, request):
        """A sliding window or recurrent layers keep copies: the runner says so."""
        from mlxkv.actors.model_runner import TextRunner

        model, tokenizer = request.getfixturevalue(name)
        assert not TextRunner(model, tokenizer).info.shared_prefix
        plain = request.getfixturevalue("tiny_llama")
        assert TextRunner(*plain).info.shared_prefix
