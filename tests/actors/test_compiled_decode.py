"""Decode steps through compiled decoder layers: the layers' own logits (bit
for bit on the CPU), each part traced once a batch size, prefills and lone
requests left to the layers' own code, and only layers whose code mlxkv
knows replaced."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import make_prompt_cache
from structlog.testing import capture_logs

from mlxkv.actors import compiled_decode
from mlxkv.actors.compiled_decode import (
    compile_checked,
    compile_decode_layers,
    compiled_layer,
    known,
    restore_layers,
    self_check,
)
from mlxkv.actors.compute_config import RunnerConfig
from mlxkv.actors.decode_batch import DecodeBatch
from mlxkv.actors.model_runner import TextRunner
from mlxkv.actors.request import RequestSpec
from mlxkv.actors.sequence import SequenceState
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, TINY_SLIDING_LLAMA, ensure_model

from device_arithmetic import EXACT_FLOAT32, LOGITS_ATOL, ON_CPU
from model_blocks import block_payloads

BS = 16
PREFIX = [(i * 37 + 5) % 250 for i in range(3 * BS)]


def _small_args(module, **more):
    return module.ModelArgs(
        model_type=module.__name__.rsplit(".", 1)[-1], hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64, **more,
    )  # fmt: skip


class TestKnown:
    def test_the_llama_and_qwen2_layers_are_known(self):
        """mlx-lm's Llama and Qwen2 decoder layers are known; a Qwen3 layer
        (norms on its queries and keys), a subclass of a known layer, and a
        known layer given another part are not."""
        assert all(known(layer) for layer in llama.Model(_small_args(llama)).layers)
        assert all(known(layer) for layer in qwen2.Model(_small_args(qwen2)).layers)
        args = _small_args(qwen3, head_dim=8, tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=64)
        assert not any(known(layer) for layer in qwen3.Model(args).layers)

        class Block(llama.TransformerBlock):
            pass

        assert not known(Block(_small_args(llama)))
        layer = llama.TransformerBlock(_small_args(llama))
        layer.extra = nn.Linear(2, 2)
        assert not known(layer)

    def test_a_hybrid_models_layers_stay(self, model_dir):
        """An LFM2 hybrid's layers are none of the known ones: nothing is replaced."""
        model, _ = load(str(ensure_model(TINY_HYBRID, model_dir)))
        assert compile_decode_layers(model) == 0


class TestCompileDecodeLayers:
    def test_each_layer_is_replaced_once_with_its_parameters_where_they_were(self, model_dir):
        """Every layer of a Llama gets a stand-in, once; the model's parameters
        are the same arrays under the same names, and what a model reads off a
        layer (``use_sliding``) still reads."""
        model, _ = load(str(ensure_model(TINY_SLIDING_LLAMA, model_dir)))
        before = {name: id(a) for name, a in tree_flatten(model.parameters())}
        sliding = [layer.use_sliding for layer in model.layers]
        assert compile_decode_layers(model) == len(model.layers)
        assert compile_decode_layers(model) == 0
        assert all(type(layer) is compiled_layer() for layer in model.layers)
        assert {name: id(a) for name, a in tree_flatten(model.parameters())} == before
        assert [layer.use_sliding for layer in model.layers] == sliding

    def test_a_lone_requests_cache_runs_the_layers_own_code(self, tiny_llama, model_dir):
        """A single request's cache (an int offset) and a prefill go to the
        layer's own code: the logits of a prefill and decode steps are the
        plain model's, and nothing is traced."""
        model, _ = tiny_llama
        fresh, _ = load(str(ensure_model(TINY_LLAMA, model_dir)))
        traced = []
        fresh.model.layers[:] = [_counting(compiled_layer()(layer), traced) for layer in fresh.layers]
        prompt = list(range(3, 30))
        for want, got in zip(_logits(model, prompt), _logits(fresh, prompt)):
            _same(got, want)
        assert traced == []


def _counting(stand_in, traced: list):
    """``stand_in`` whose compiled first part notes each trace."""
    layer = stand_in.layer

    def before(x, offset):
        traced.append(x.shape[0])
        return compiled_decode._before_attention(layer, x, offset)

    stand_in._before = mx.compile(before)
    return stand_in


def _logits(model, prompt: list[int], steps: int = 3) -> list:
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
    mx.eval(out)
    return out


def _same(got, want):
    if EXACT_FLOAT32:
        assert mx.array_equal(got, want).item()
    else:
        assert mx.allclose(got, want, atol=LOGITS_ATOL, rtol=0).item()


def _runner(spec, directory, compiled: bool, dtype, traced: list | None = None) -> TextRunner:
    runner = TextRunner.load(str(ensure_model(spec, directory)), RunnerConfig(compile_decode=compiled))
    runner._model.set_dtype(dtype)
    if traced is not None:
        runner._model.model.layers[:] = [_counting(layer, traced) for layer in runner._model.layers]
    assert (runner.info.compiled_layers > 0) is compiled
    return runner


def _row(runner, index: int, payloads: tuple) -> SequenceState:
    own = [(i * 11 + index * 29) % 250 for i in range(5 + 3 * index)]
    spec = RequestSpec(
        request_id=f"r{index}", prompt=PREFIX + own, prefix=payloads, max_tokens=64, block_size=BS,
        stop_tokens=frozenset(), keep_logits=True,
    )  # fmt: skip
    sequence = SequenceState(spec)
    runner.start(sequence)
    logits = runner.prefill(sequence, len(spec.prompt))
    sequence.emitted(int(mx.argmax(logits).item()))
    return sequence


def _steps(runner, shared: bool) -> list:
    """Each emitted token's log-probabilities over a batch of three rows, then
    two (one left), then three (another joined): batch sizes 3, 2 and 3."""
    payloads = block_payloads(runner._model, PREFIX, BS) if shared else ()
    batch = DecodeBatch(runner)
    rows = [_row(runner, i, payloads) for i in range(3)]
    batch.join(rows)
    out = []
    for step in range(7):
        if step == 3:
            batch.leave([rows[1]])
        if step == 5:
            batch.join([_row(runner, 3, payloads)])
        emitted, failed, _ = batch.advance(1)
        assert not failed
        out.extend(item.logprobs for item in emitted)
    mx.eval(out)
    return out


class TestParity:
    @pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
    @pytest.mark.parametrize("shared", [True, False], ids=["shared-prefix", "copies"])
    @pytest.mark.parametrize("spec", [TINY_LLAMA, TINY_SLIDING_LLAMA], ids=lambda s: s.name)
    def test_batched_decode_steps_give_the_layers_own_logits(self, spec, shared, dtype, model_dir):
        """Rows decoding together, leaving and joining, over a shared prefix or
        their own copies: every step's log-probabilities through the compiled
        layers are those of the layers' own code (bit for bit on the CPU)."""
        want = _steps(_runner(spec, model_dir, False, dtype), shared)
        got = _steps(_runner(spec, model_dir, True, dtype), shared)
        assert len(got) == len(want) > 10
        for a, b in zip(got, want):
            _same(a, b)

    def test_each_part_is_traced_once_a_batch_size(self, model_dir):
        """The compiled first part of each layer is traced once for each batch
        size the steps run at (3, then 2, then 3 again: two traces a layer),
        not once a step; prefills trace nothing."""
        traced: list = []
        runner = _runner(TINY_LLAMA, model_dir, True, mx.float32, traced)
        _steps(runner, shared=True)
        layers = len(runner._model.layers)
        assert sorted(traced) == sorted([3] * layers + [2] * layers)


def _wrong_after(layer, x, attended):
    """The layer's code after attention with its second residual dropped."""
    rows, length, _ = x.shape
    h = x + layer.self_attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(rows, length, -1))
    return layer.mlp(layer.post_attention_layernorm(h))


def _raising_before(layer, x, offset):
    raise RuntimeError("no kernel for this fusion")


class TestSelfCheck:
    @pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
    def test_a_compiled_model_passes(self, dtype, model_dir):
        model, _ = load(str(ensure_model(TINY_SLIDING_LLAMA, model_dir)))
        model.set_dtype(dtype)
        assert self_check(model) is None  # nothing compiled: nothing to check
        compile_decode_layers(model)
        assert self_check(model) is None

    @pytest.mark.parametrize(
        "part, broken, says",
        [("_after_attention", _wrong_after, "max difference"), ("_before_attention", _raising_before, "RuntimeError")],
        ids=["wrong", "raising"],
    )
    def test_a_broken_part_fails_and_the_layers_are_put_back(self, part, broken, says, monkeypatch, model_dir):
        """A compiled part that disagrees with the layer's code, or raises, fails
        the check: ``compile_checked`` puts every layer back (the model's own
        classes, the same parameters) and the model decodes as written."""
        model, _ = load(str(ensure_model(TINY_LLAMA, model_dir)))
        layers = list(model.layers)
        monkeypatch.setattr(compiled_decode, part, broken)
        compile_decode_layers(model)
        assert says in self_check(model)
        restore_layers(model)
        with capture_logs() as logs:
            assert compile_checked(model, check=True) == 0
        assert [id(layer) for layer in model.layers] == [id(layer) for layer in layers]
        [event] = [log for log in logs if log["event"] == "compiled_decode_unusable"]
        assert event["log_level"] == "warning" and says in event["reason"] and event["layers"] == len(layers)

    def test_a_passing_check_keeps_the_layers(self, model_dir):
        model, _ = load(str(ensure_model(TINY_LLAMA, model_dir)))
        with capture_logs() as logs:
            assert compile_checked(model, check=True) == len(model.layers)
        assert all(type(layer) is compiled_layer() for layer in model.layers)
        assert [log["event"] for log in logs] == ["compiled_decode_checked"]

    def test_the_cpu_is_not_checked(self, monkeypatch, model_dir):
        """On the CPU (where the parity tests hold the compiled layers to their
        own bit for bit) loading a model runs no check."""
        if not ON_CPU:
            pytest.skip("the CPU's default")
        model, _ = load(str(ensure_model(TINY_LLAMA, model_dir)))
        monkeypatch.setattr(compiled_decode, "self_check", lambda model: pytest.fail("checked on the CPU"))
        assert compile_checked(model) == len(model.layers)

    def test_restoring_puts_every_layer_back(self, model_dir):
        model, _ = load(str(ensure_model(TINY_LLAMA, model_dir)))
        layers = [id(layer) for layer in model.layers]
        compile_decode_layers(model)
        assert restore_layers(model) == len(layers)
        assert [id(layer) for layer in model.layers] == layers
        assert restore_layers(model) == 0

