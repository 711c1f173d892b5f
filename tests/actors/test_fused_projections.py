"""Sibling projections as one product: the same outputs, one launch a set,
nothing held twice, and sets whose siblings take other inputs left apart."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from mlxkv.actors.fused_projections import fuse_projections, fused_linear
from mlxkv.actors.weight_layout import transpose_linear_weights
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, TINY_SLIDING_LLAMA, ensure_model

from device_arithmetic import EXACT_FLOAT32, LOGITS_ATOL
from graph_ops import primitives
from model_weights import parameter_bytes, prefill_and_decode_logits


def _same(got, want):
    for a, b in zip(got, want):
        if EXACT_FLOAT32:
            assert mx.array_equal(a, b).item()
        else:  # another product's kernel on a GPU
            assert mx.allclose(a, b, atol=LOGITS_ATOL, rtol=0).item()


class TestFuseProjections:
    @pytest.mark.parametrize("transposed", [False, True], ids=["layout", "transposed"])
    @pytest.mark.parametrize("spec", [TINY_LLAMA, TINY_SLIDING_LLAMA, TINY_HYBRID], ids=lambda s: s.name)
    def test_a_model_computes_the_sameprefill_and_decode_logits(self, spec, model_dir, transposed):
        """Every attention's k/v and every MLP's gate/up of an mlx-lm model
        become one product a set, the model's parameters take the same bytes,
        and its prefill and decode logits equal the untouched model's (bit
        for bit on the CPU), with the rest of its linear layers transposed
        too or not."""
        path = str(ensure_model(spec, model_dir))
        model, _ = load(path)
        plain, _ = load(path)
        prompt = list(range(3, 40))
        want = prefill_and_decode_logits(plain, prompt, 4)
        before = parameter_bytes(model)
        sets = fuse_projections(model, transposed=transposed)
        if transposed:
            transpose_linear_weights(model)
        assert sets >= len(model.layers)  # at least each layer's MLP
        assert parameter_bytes(model) == before
        assert fuse_projections(model) == 0  # once
        _same(prefill_and_decode_logits(model, prompt, 4), want)

    def test_one_product_a_set(self, tiny_llama_fresh):
        """A layer's key and value projections put one product in the graph
        where they put two, its gate and up one where two; the queries keep
        theirs."""
        model = tiny_llama_fresh
        layer = model.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        x = mx.random.normal((2, 3, model.args.hidden_size))
        before = primitives(attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)).count("Matmul")
        fuse_projections(model)
        outs = [attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)]
        assert before == 4 and primitives(*outs).count("Matmul") == 2
        assert type(attn.q_proj) is nn.Linear
        assert attn.k_proj._ref.product.last is None  # nothing held past the set's calls

    def test_siblings_on_other_inputs_go_apart(self, tiny_llama_fresh):
        """Keys and values of another input (cross-attention), or a sibling
        never called (a layer reusing another's keys): each then multiplies
        by its own columns, and gives the original layer's output."""
        model = tiny_llama_fresh
        attn = model.model.layers[0].self_attn
        mlp = model.model.layers[0].mlp
        originals = {name: (getattr(attn, name).weight) for name in ("k_proj", "v_proj")}
        gate_up = {name: getattr(mlp, name).weight for name in ("gate_proj", "up_proj")}
        fuse_projections(model)
        x, y = (mx.random.normal((1, 2, model.args.hidden_size)) for _ in range(2))
        _same([attn.k_proj(x)], [x @ originals["k_proj"].T])  # the joint product's columns
        assert mx.array_equal(attn.v_proj(y), y @ originals["v_proj"].T).item()  # another input
        assert attn.k_proj._ref.product.apart
        assert mx.array_equal(attn.k_proj(y), y @ originals["k_proj"].T).item()
        assert primitives(attn.k_proj(x)).count("Matmul") == 1
        mlp.gate_proj(x)
        assert mx.array_equal(mlp.gate_proj(y), y @ gate_up["gate_proj"].T).item()  # up never called for x
        assert mlp.gate_proj._ref.product.apart

    def test_an_update_of_the_parameters_reaches_the_product(self, tiny_llama_fresh):
        """The joint weight is the first sibling's parameter: a model's
        ``update`` of it (zeroed here) is what the set multiplies by."""
        from mlx.utils import tree_map

        model = tiny_llama_fresh
        fuse_projections(model)
        attn = model.model.layers[0].self_attn
        attn.k_proj.update(tree_map(mx.zeros_like, attn.k_proj.parameters()))
        x = mx.random.normal((1, 2, model.args.hidden_size))
        assert not mx.any(attn.k_proj(x)).item() and not mx.any(attn.v_proj(x)).item()

    def test_weights_read_as_before(self, tiny_llama_fresh):
        """A fused layer's ``weight`` is its original ``(out, in)`` weight."""
        model = tiny_llama_fresh
        attn = model.model.layers[0].self_attn
        want = {name: getattr(attn, name).weight for name in ("k_proj", "v_proj")}
        fuse_projections(model, transposed=True)
        for name, weight in want.items():
            assert isinstance(getattr(attn, name), fused_linear())
            assert mx.array_equal(getattr(attn, name).weight, weight).item()

    def test_only_plain_float_sets_of_one_input_fuse(self):
        """Biases on some siblings only, another input size, a quantized
        sibling: left as they are; biases on all: fused with them."""

        class Block(nn.Module):
            def __init__(self, biases, sizes=(8, 8)):
                super().__init__()
                self.k_proj = nn.Linear(sizes[0], 4, bias=biases[0])
                self.v_proj = nn.Linear(sizes[1], 2, bias=biases[1])

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = [Block((True, True)), Block((True, False)), Block((False, False), (8, 6))]
                self.quantized = Block((False, False))
                self.quantized.v_proj = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=8)

        net = Net()
        x = mx.random.normal((3, 8))
        want = [net.blocks[0].k_proj(x), net.blocks[0].v_proj(x)]
        assert fuse_projections(net) == 1
        assert isinstance(net.blocks[0].k_proj, fused_linear())
        assert type(net.blocks[1].k_proj) is nn.Linear and type(net.blocks[2].k_proj) is nn.Linear
        assert type(net.quantized.k_proj) is nn.Linear
        _same([net.blocks[0].k_proj(x), net.blocks[0].v_proj(x)], want)


@pytest.fixture
def tiny_llama_fresh(model_dir):
    """A tiny Llama of its own (fusing changes the model)."""
    model, _ = load(str(ensure_model(TINY_LLAMA, model_dir)))
    return model


class TestRunner:
    def test_a_model_it_loads_is_fused_and_the_rest_laid_out_for_the_device(self, model_dir):
        """``TextRunner.load`` fuses by default: each layer's keys and values,
        and its MLP's gate and up; the other linear layers (queries, output
        and down projections, the output layer) transposed where MLX runs on
        the CPU."""
        from mlxkv.actors.compute_config import RunnerConfig
        from mlxkv.actors.model_runner import TextRunner
        from mlxkv.actors.weight_layout import wanted

        runner = TextRunner.load(str(ensure_model(TINY_LLAMA, model_dir)), RunnerConfig())
        assert runner.info.fused_projections == 2 * 2
        assert runner.info.transposed_layers == (2 * 3 + 1 if wanted(None) else 0)
        off = TextRunner.load(str(ensure_model(TINY_LLAMA, model_dir)), RunnerConfig(fuse_projections=False))
        assert off.info.fused_projections == 0

    @pytest.mark.parametrize("choice", [None, False, True])
    def test_a_model_handed_in_is_fused_only_when_told(self, choice, tiny_llama_fresh, model_dir):
        from mlx_lm import load as load_model

        from mlxkv.actors.compute_config import RunnerConfig
        from mlxkv.actors.model_runner import TextRunner

        _, tokenizer = load_model(str(ensure_model(TINY_LLAMA, model_dir)))
        runner = TextRunner(tiny_llama_fresh, tokenizer, RunnerConfig(fuse_projections=choice))
        assert (runner.info.fused_projections > 0) is (choice is True)
        assert (fused_linear() in {type(m) for _, m in tiny_llama_fresh.named_modules()}) is (choice is True)
