"""Linear weights held transposed: the same outputs bit for bit, nothing held twice."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from mlxkv.actors.compute_config import RunnerConfig
from mlxkv.actors.compute import ComputeActor, ComputeHandle
from mlxkv.actors.model_runner import TextRunner
from mlxkv.actors.weight_layout import transpose_linear_weights, transposed_linear, wanted
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, TINY_SLIDING_LLAMA, ensure_model

from device_arithmetic import EXACT_FLOAT32, LOGITS_ATOL, ON_CPU
from model_weights import parameter_bytes, prefill_and_decode_logits


def _load(spec, model_dir):
    return load(str(ensure_model(spec, model_dir)))


class _Net(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.first = nn.Linear(24, 40, bias=bias)
        self.layers = [nn.Linear(40, 40, bias=bias), nn.Sequential(nn.Linear(40, 8, bias=bias))]
        self.table = {"head": nn.Linear(8, 5, bias=bias)}

    def __call__(self, x):
        x = self.layers[1](self.layers[0](self.first(x)))
        return self.table["head"](x)


class _MyLinear(nn.Linear):
    pass


class TestTransposeLinearWeights:
    @pytest.mark.parametrize("spec", [TINY_LLAMA, TINY_SLIDING_LLAMA, TINY_HYBRID], ids=lambda s: s.name)
    def test_a_model_computes_the_same_logits_bit_for_bit(self, spec, model_dir):
        """Every linear layer of an mlx-lm model is replaced, and its prefill
        and decode logits equal the untouched model's exactly on the CPU
        (on a GPU, ``x @ w.T`` and ``x @ w`` are other kernels: within float
        noise); its parameters take the same bytes."""
        plain, _ = _load(spec, model_dir)
        model, _ = _load(spec, model_dir)
        prompt = [3 + (i * 7) % 200 for i in range(150)]
        expected = prefill_and_decode_logits(plain, prompt, 4)
        before = parameter_bytes(model)
        linears = sum(type(m) is nn.Linear for _, m in model.named_modules())
        assert transpose_linear_weights(model) == linears > 0
        assert not any(type(m) is nn.Linear for _, m in model.named_modules())
        assert parameter_bytes(model) == before
        if ON_CPU:
            assert mx.get_cache_memory() == 0  # the originals' buffers were given back
        for got, want in zip(prefill_and_decode_logits(model, prompt, 4), expected):
            if EXACT_FLOAT32:
                assert mx.array_equal(got, want).item()
            else:
                assert mx.allclose(got, want, atol=LOGITS_ATOL, rtol=0).item()
        assert transpose_linear_weights(model) == 0

    @pytest.mark.parametrize("bias", [False, True])
    def test_nested_layers_biases_and_the_weight_view(self, bias):
        """Layers in lists, dicts and nested modules are replaced; with a bias
        the output is still bit-identical (on the CPU); ``weight`` reads the
        ``(out, in)`` view of the same values."""
        net = _Net(bias)
        mx.eval(net.parameters())
        weights = {name: mx.array(m.weight) for name, m in net.named_modules() if type(m) is nn.Linear}
        x = mx.random.normal((3, 17, 24), key=mx.random.key(1))
        expected = net(x)
        mx.eval(expected)
        assert transpose_linear_weights(net) == 4
        if EXACT_FLOAT32:
            assert mx.array_equal(net(x), expected).item()
        else:  # another product's kernel
            assert mx.allclose(net(x), expected, atol=LOGITS_ATOL, rtol=0).item()
        for name, module in net.named_modules():
            if name in weights:
                assert isinstance(module, transposed_linear())
                assert module.weight_t.shape == weights[name].shape[::-1]
                assert mx.array_equal(module.weight, weights[name]).item()
                assert ("bias" in module) is bias

    def test_quantized_and_subclassed_layers_are_left_alone(self):
        """A quantized layer and a subclass of ``nn.Linear`` (which may
        compute something else) keep their own class."""
        net = nn.Sequential(_MyLinear(64, 64), nn.QuantizedLinear(64, 64, bits=8), nn.Linear(64, 64))
        mx.eval(net.parameters())
        assert transpose_linear_weights(net) == 1
        kinds = [type(layer) for layer in net.layers]
        assert kinds[:2] == [_MyLinear, nn.QuantizedLinear]
        assert kinds[2] is transposed_linear()


class TestWanted:
    def test_a_choice_is_kept_and_none_means_the_cpu(self):
        """True and False are taken as given; None transposes exactly where
        MLX's default device is the CPU (these tests run on it)."""
        assert wanted(True) is True
        assert wanted(False) is False
        assert wanted(None) is (mx.default_device().type == mx.DeviceType.cpu)


class TestRunner:
    @pytest.mark.parametrize("choice", [False, True])
    def test_a_model_handed_in_changes_only_when_told(self, choice, model_dir):
        """A runner over a model it was handed transposes it only when told
        True: the model is the caller's."""
        model, tokenizer = _load(TINY_LLAMA, model_dir)
        runner = TextRunner(model, tokenizer, RunnerConfig(transpose_weights=choice))
        kinds = {type(m) for _, m in model.named_modules()}
        assert (transposed_linear() in kinds) is choice
        assert (nn.Linear in kinds) is not choice
        assert (runner.info.transposed_layers > 0) is choice

    @pytest.mark.parametrize("choice", [None, False, True])
    async def test_the_actor_changes_a_model_handed_in_only_when_told(self, choice, model_dir, running):
        """``ComputeActor.with_model`` leaves the caller's model as it is
        unless given True; None (auto) is for the models it loads."""
        model, tokenizer = _load(TINY_LLAMA, model_dir)
        actor = ComputeActor.with_model(model, tokenizer, runner_config=RunnerConfig(transpose_weights=choice))
        async with running(actor) as ref:
            info = await ComputeHandle(ref).describe()
        assert (info.transposed_layers > 0) is (choice is True)
        assert (transposed_linear() in {type(m) for _, m in model.named_modules()}) is (choice is True)

    @pytest.mark.parametrize("choice", [None, False, True])
    def test_a_model_it_loads_follows_the_device_by_default(self, choice, model_dir):
        """``TextRunner.load`` decides for the model it loads: None
        transposes where MLX runs on the CPU."""
        config = RunnerConfig(transpose_weights=choice, fuse_projections=False)
        runner = TextRunner.load(str(ensure_model(TINY_LLAMA, model_dir)), config)
        kinds = {type(m) for _, m in runner._model.named_modules()}
        assert (transposed_linear() in kinds) is wanted(choice)
        # 2 layers x (4 attention + 3 MLP projections) + the output layer (none fused)
        assert runner.info.transposed_layers == (15 if wanted(choice) else 0)
