"""The built-in models are written deterministically and load through mlx_lm."""

from __future__ import annotations

import hashlib

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from mlxkv.default_model import TINY_LLAMA, ensure_model

from graph_ops import primitives


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


class TestEnsureModel:
    def test_same_spec_writes_same_bytes(self, tmp_path):
        """Two directories written from one spec hold identical weights."""
        a = ensure_model(TINY_LLAMA, tmp_path / "a")
        b = ensure_model(TINY_LLAMA, tmp_path / "b")
        assert _digest(a) == _digest(b)

    def test_second_call_reuses_directory(self, tmp_path):
        """A written model is reused, not rewritten."""
        first = ensure_model(TINY_LLAMA, tmp_path)
        mtime = (first / "model.safetensors").stat().st_mtime_ns
        again = ensure_model(TINY_LLAMA, tmp_path)
        assert again == first
        assert (again / "model.safetensors").stat().st_mtime_ns == mtime
        assert [p.name for p in tmp_path.iterdir()] == [first.name]


class TestLoadedModels:
    def test_tokenizer_round_trips_bytes(self, tiny_llama):
        """The byte-level tokenizer maps text to one id per UTF-8 byte and back."""
        _, tokenizer = tiny_llama
        text = "Hello, wörld!\n\tok"
        ids = tokenizer.encode(text)
        assert ids == list(text.encode())
        assert tokenizer.decode(ids) == text

    def test_cache_kinds(self, tiny_llama, sliding_llama, hybrid_model):
        """Each test model produces the cache kinds it is meant to exercise."""
        assert {type(c) for c in make_prompt_cache(tiny_llama[0])} == {KVCache}
        assert {type(c) for c in make_prompt_cache(sliding_llama[0])} == {KVCache, RotatingKVCache}
        assert {type(c) for c in make_prompt_cache(hybrid_model[0])} == {KVCache, ArraysCache}

    def test_forward_is_deterministic(self, tiny_llama):
        """The same prompt gives the same logits twice."""
        model, _ = tiny_llama
        x = mx.array([[1, 2, 3, 4, 5]])
        a = model(x, cache=make_prompt_cache(model))
        b = model(x, cache=make_prompt_cache(model))
        assert mx.array_equal(a, b).item()


class TestSpecs:
    def test_weights_in_another_dtype(self, tmp_path):
        """A spec's ``dtype`` is the weights' type on disk, as mlx_lm.load gives them
        back; it names another directory than the float32 spec's, which keeps its name."""
        import attrs
        from mlx_lm import load

        from mlxkv.default_model import DEFAULT_MODEL

        half = attrs.evolve(TINY_LLAMA, dtype="bfloat16")
        assert half.digest() != TINY_LLAMA.digest()
        assert DEFAULT_MODEL.digest() == "41f477a228a5"  # float32 names did not move
        model, _ = load(str(ensure_model(half, tmp_path)))
        assert model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
        logits = model(mx.array([[1, 2, 3]]))
        assert logits.dtype == mx.bfloat16 and mx.isfinite(logits.astype(mx.float32)).all()

    def test_a_built_in_model_by_name(self, tmp_path):
        """``model_path`` writes a built-in model named by its spec's name, takes
        None for the default one and leaves any other value as it is."""
        from mlxkv.default_model import BENCH_LLAMA_722M, BUILT_IN_MODELS, DEFAULT_MODEL, model_path

        assert model_path("tiny-llama", tmp_path) == str(ensure_model(TINY_LLAMA, tmp_path))
        assert model_path(None, tmp_path) == str(ensure_model(DEFAULT_MODEL, tmp_path))
        assert model_path("/some/dir", tmp_path) == "/some/dir"
        assert BUILT_IN_MODELS[BENCH_LLAMA_722M.name] is BENCH_LLAMA_722M
        config = BENCH_LLAMA_722M.full_config()
        per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632
        assert (config["hidden_size"], config["num_hidden_layers"], BENCH_LLAMA_722M.dtype) == (2048, 16, "bfloat16")
        assert 720e6 < 16 * per_layer < 725e6

    def test_the_graph_proxy_has_the_gpu_models_layers_and_heads(self, tmp_path):
        """``bench-llama-722m-graph`` stands for the 722M model's graph on a CPU:
        its configuration is the 722M model's but for two widths (mlx-lm's
        Llama builds its graph from the rest), in the same dtype, and a step
        of it runs every layer."""
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        from mlxkv.default_model import BENCH_LLAMA_722M, BENCH_LLAMA_722M_GRAPH, BUILT_IN_MODELS

        assert BUILT_IN_MODELS[BENCH_LLAMA_722M_GRAPH.name] is BENCH_LLAMA_722M_GRAPH
        big, proxy = BENCH_LLAMA_722M.full_config(), BENCH_LLAMA_722M_GRAPH.full_config()
        widths = {"hidden_size", "intermediate_size"}
        assert {k: v for k, v in proxy.items() if k not in widths} == {k: v for k, v in big.items() if k not in widths}
        assert BENCH_LLAMA_722M_GRAPH.dtype == BENCH_LLAMA_722M.dtype
        assert proxy["hidden_size"] * proxy["intermediate_size"] * 64 <= big["hidden_size"] * big["intermediate_size"]
        model, _ = load(str(ensure_model(BENCH_LLAMA_722M_GRAPH, tmp_path)))
        cache = make_prompt_cache(model)
        model(mx.array([[1, 2, 3]]), cache=cache)
        assert len(primitives(model(mx.array([[4]]), cache=cache))) > 16 * 10  # every layer's operations, not a stub

    def test_the_memory_proxy_keeps_the_gpu_models_proportions(self):
        """``bench-llama-722m-proportions`` holds, per token and layer, the
        722M model's hidden state, MLP activations and attention scores in the
        same ratios to its KV, and has its layers."""
        from mlxkv.default_model import BENCH_LLAMA_722M, BENCH_LLAMA_722M_PROPORTIONS, BUILT_IN_MODELS

        def per_token(spec):
            config, size = spec.full_config(), {"bfloat16": 2, "float32": 4}[spec.dtype]
            head = config["hidden_size"] // config["num_attention_heads"]
            kv = 2 * config["num_key_value_heads"] * head * size
            hidden, mlp = config["hidden_size"] * size, config["intermediate_size"] * size
            scores = config["num_attention_heads"] * 4  # a key's float32 score in every query head
            return kv, (hidden / kv, mlp / kv, scores / kv), config["num_hidden_layers"]

        assert BUILT_IN_MODELS[BENCH_LLAMA_722M_PROPORTIONS.name] is BENCH_LLAMA_722M_PROPORTIONS
        big_kv, big_ratios, big_layers = per_token(BENCH_LLAMA_722M)
        kv, ratios, layers = per_token(BENCH_LLAMA_722M_PROPORTIONS)
        assert ratios == big_ratios and layers == big_layers
        assert kv * 2 == big_kv

