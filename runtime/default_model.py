"""The built-in model: small mlx-lm models with deterministic random weights.

No weights can be downloaded where mlxkv is built and tested, so the project
writes its own models: a ``config.json``, a ``model.safetensors`` with weights
drawn from a seeded generator, and a byte-level ``tokenizer.json``, all in the
mlx-lm directory format. They are then loaded with ``mlx_lm.load`` -- the same
code path as any real model -- so everything downstream is exercised for real.

A written model directory is immutable: :func:`ensure_model` writes it once,
atomically (to a temporary sibling, then ``rename``), and later calls reuse it.
The directory name includes a digest of the spec, so a changed spec never reads
a stale directory. :func:`ensure_written`, :func:`spec_digest` and
:func:`write_byte_tokenizer` are shared with the built-in vision-language model
(:mod:`mlxkv.default_vlm`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import attrs

from mlxkv.cache.tiers import cache_dir

__all__ = [
    "BENCH_LLAMA_722M",
    "BENCH_LLAMA_722M_GRAPH",
    "BUILT_IN_MODELS",
    "BYTE_VOCAB",
    "DEFAULT_MODEL",
    "MATRIX_SCALE",
    "ModelSpec",
    "TINY_HYBRID",
    "TINY_LLAMA",
    "TINY_SLIDING_LLAMA",
    "UNTIED_SHARP",
    "default_cache_dir",
    "ensure_model",
    "ensure_written",
    "model_path",
    "shape_weights",
    "spec_digest",
    "write_byte_tokenizer",
    "write_model",
]

#: Special tokens appended after the 256 byte tokens.
_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
#: Byte-level tokenizers give token id ``b`` to byte ``b``; specials follow.
BYTE_VOCAB = 256
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: "
    "{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|begin_of_text|>assistant: {% endif %}"
)


@attrs.frozen(kw_only=True)
class ModelSpec:
    """What to write: an mlx-lm ``model_type`` and its architecture fields.

    ``config`` holds the fields of the model's ``ModelArgs`` except
    ``model_type`` and ``vocab_size`` (the vocabulary is always the byte-level
    tokenizer's). ``weight_scales`` shapes the random weights (see
    :func:`shape_weights`). ``seed`` makes the weights deterministic.
    ``dtype`` is the weights' type on disk (an ``mlx.core`` dtype's name):
    drawn in float32, then cast.
    """

    name: str
    model_type: str
    config: Mapping[str, Any] = attrs.field(converter=lambda c: dict(sorted(c.items())))
    weight_scales: Mapping[str, float] = attrs.field(
        factory=dict, converter=lambda c: dict(sorted(c.items()))
    )
    seed: int = 0
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(("float32", "bfloat16", "float16")))

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB + len(_SPECIAL_TOKENS)

    def full_config(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "bos_token_id": BYTE_VOCAB,
            "eos_token_id": BYTE_VOCAB + 1,
            **self.config,
        }

    def digest(self) -> str:
        payload = {
            "config": self.full_config(),
            "weight_scales": self.weight_scales,
            "seed": self.seed,
            "format": 1,
        }
        if self.dtype != "float32":  # float32 specs keep the names they always had
            payload["dtype"] = self.dtype
        return spec_digest(payload)


def spec_digest(payload: Mapping[str, Any]) -> str:
    """12 hex characters of SHA-256 over ``payload`` as canonical JSON.

    Everything that decides a written directory's bytes goes into ``payload``,
    so a changed spec gets a new directory name instead of a stale directory.
    """
    blob = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


#: Every weight matrix is its initialiser's draw times this, unless a
#: ``weight_scales`` pattern says otherwise: activations stay in a sane range.
MATRIX_SCALE = 0.5

#: Random weights that continue a prompt in an input-dependent way. With a
#: tied output head and the plain initialisers, the residual stream is
#: dominated by the input token's embedding, so greedy decoding repeats the
#: prompt's last token whatever the KV holds, and a check of "the same greedy
#: tokens" can never fail. So: an untied head where the architecture has
#: one, sharper attention (queries and keys x2, so a query picks out a few
#: positions rather than averaging them all), and where the head must stay
#: tied, embeddings 10x smaller than the layers' outputs. Measured on 300-token
#: prompts (``tests/runtime/test_teeth.py`` keeps it so): replacing one cached
#: 64-token block with another prompt's changes the greedy tokens within a
#: few steps on every built-in model.
UNTIED_SHARP = {"q_proj": 2 * MATRIX_SCALE, "k_proj": 2 * MATRIX_SCALE}


def shape_weights(weights: Mapping[str, Any], scales: Mapping[str, float]) -> dict[str, Any]:
    """``weights`` scaled and cast to float32, ready to save.

    A weight whose name contains a key of ``scales`` is multiplied by its
    factor (the first matching key in sorted order); any other matrix by
    :data:`MATRIX_SCALE`; any other vector (norms, biases) is left as drawn.
    """
    import mlx.core as mx

    shaped = {}
    for name, value in weights.items():
        factor = next((f for key, f in sorted(scales.items()) if key in name), None)
        if factor is None:
            factor = MATRIX_SCALE if value.ndim > 1 else 1.0
        shaped[name] = (value * factor).astype(mx.float32)
    return shaped


def _llama(**overrides: Any) -> dict[str, Any]:
    base = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    base.update(overrides)
    return base


#: The smallest useful model: fast enough for property and parity tests.
TINY_LLAMA = ModelSpec(
    name="tiny-llama", model_type="llama", config=_llama(), weight_scales=UNTIED_SHARP
)

#: Llama whose odd layers use sliding-window attention (``RotatingKVCache``).
TINY_SLIDING_LLAMA = ModelSpec(
    name="tiny-sliding-llama",
    model_type="llama",
    config=_llama(
        num_hidden_layers=2,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=512,
    ),
    weight_scales=UNTIED_SHARP,
)

#: A hybrid model: attention layers (``KVCache``) next to short-convolution
#: layers whose recurrent state lives in an ``ArraysCache``.
TINY_HYBRID = ModelSpec(
    name="tiny-hybrid-lfm2",
    model_type="lfm2",
    config={
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1],
        "rope_theta": 10000.0,
        "tie_embedding": True,  # lfm2 has no untied head
    },
    # Its q/k norms set the attention's sharpness; attention values and
    # output x2, embeddings (which are also its output head) x0.1.
    weight_scales={
        "embed_tokens": 0.1 * MATRIX_SCALE,
        "q_layernorm": 3.0,
        "k_layernorm": 3.0,
        "self_attn.v_proj": 2 * MATRIX_SCALE,
        "self_attn.out_proj": 2 * MATRIX_SCALE,
    },
)

#: The model ``mlxkv run`` uses unless given ``--model``: Llama geometry with
#: grouped-query attention (2 query heads share 1 KV head, head_dim 48).
#: Sized on the 2-core build CPU (mlx 0.32.4, reference BLAS), where a long
#: prefill is mostly attention, whose cost grows with query heads x layers, so
#: that a 2048-token prefill takes under a second there (the figures, and
#: those of the geometries tried before: docs/benchmarks.md).
DEFAULT_MODEL = ModelSpec(
    name="mlxkv-default-llama",
    model_type="llama",
    config=_llama(
        hidden_size=96,
        num_hidden_layers=2,
        intermediate_size=192,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    weight_scales=UNTIED_SHARP,
)


#: The model of the GPU measurements (docs/benchmarks.md; issue 31): a Llama
#: of 722M parameters in bfloat16 -- hidden 2048, 16 layers, intermediate
#: 5632, 32 query and 8 KV heads of 64 -- written like the others (random
#: weights, the byte-level tokenizer). About 1.4 GB on disk; writing it takes
#: a few GB of memory and tens of seconds. Not for the CPU's tests.
BENCH_LLAMA_722M = ModelSpec(
    name="bench-llama-722m-bf16",
    model_type="llama",
    config=_llama(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=5632,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    weight_scales=UNTIED_SHARP,
    dtype="bfloat16",
)

#: :data:`BENCH_LLAMA_722M`'s graph at a CPU's cost: its 16 layers and its 32
#: query / 8 KV heads, of 8 dimensions (hidden 256, intermediate 512), in
#: bfloat16. A step of it puts the same operations in MLX's graph as a step
#: of the 722M model, and its host (Python) time is the same, so the CPU can
#: measure what a GPU's host pays per step (``scripts/bench_step.py``).
BENCH_LLAMA_722M_GRAPH = attrs.evolve(
    BENCH_LLAMA_722M,
    name="bench-llama-722m-graph",
    config={**BENCH_LLAMA_722M.config, "hidden_size": 256, "intermediate_size": 512},
)

#: :data:`BENCH_LLAMA_722M`'s memory at a CPU's cost: per token and layer,
#: its hidden state, its MLP's activations and a query's attention scores
#: (float32, 16 query heads) are the same multiples of its KV (2 and 5.5
#: times; scores 1/16 per key) as the 722M model's in bfloat16, each half its
#: bytes -- hidden 512, intermediate 1,408, 16 query / 4 KV heads of 32, in
#: float32 -- so peak memory over the floor (the KV the work needs) comes
#: out in the 722M model's ratio (``scripts/bench_memory.py``, with
#: ``--fused-attention-stand-in`` for a GPU's fused attention).
BENCH_LLAMA_722M_PROPORTIONS = attrs.evolve(
    BENCH_LLAMA_722M,
    name="bench-llama-722m-proportions",
    config={
        **BENCH_LLAMA_722M.config,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    dtype="float32",
)

#: The built-in models by name: what ``--model NAME`` names in the scripts.
BUILT_IN_MODELS = {
    spec.name: spec
    for spec in (
        DEFAULT_MODEL,
        TINY_LLAMA,
        TINY_SLIDING_LLAMA,
        TINY_HYBRID,
        BENCH_LLAMA_722M,
        BENCH_LLAMA_722M_GRAPH,
        BENCH_LLAMA_722M_PROPORTIONS,
    )
}


def model_path(model: Optional[str], cache_dir: Path | None = None) -> str:
    """The model directory a ``--model`` value names: the built-in model for
    None, a built-in model's directory (written if missing) for one of
    :data:`BUILT_IN_MODELS`' names, else the value itself (a path or Hub id)."""
    if model is None:
        return str(ensure_model(DEFAULT_MODEL, cache_dir))
    spec = BUILT_IN_MODELS.get(model)
    return model if spec is None else str(ensure_model(spec, cache_dir))


def default_cache_dir() -> Path:
    """Where models are written: ``$MLXKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/mlxkv``, else ``~/.cache/mlxkv`` (the one rule, in
    :func:`mlxkv.cache.tiers.cache_dir.default_cache_dir`)."""
    return cache_dir.default_cache_dir()


def ensure_model(spec: ModelSpec = DEFAULT_MODEL, cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model, writing it first if missing.

    Args:
        spec: the model to write.
        cache_dir: parent directory; defaults to :func:`default_cache_dir`.

    Returns:
        A directory that ``mlx_lm.load`` accepts.
    """
    return ensure_written(
        f"{spec.name}-{spec.digest()}", lambda d: write_model(spec, d), cache_dir
    )


def ensure_written(
    name: str, write: Callable[[Path], None], cache_dir: Path | None = None
) -> Path:
    """Return ``cache_dir / name``, calling ``write`` to fill it first if missing.

    The directory is immutable once written: ``write`` fills a temporary
    sibling, which is then renamed into place, so readers never see a partial
    directory, and a concurrent writer of the same name loses the race
    harmlessly. A directory counts as written when it holds ``config.json``.

    Args:
        name: the directory name; it should carry a digest of what is written
            (see :func:`spec_digest`).
        write: fills the (existing, empty) directory it is given.
        cache_dir: parent directory; defaults to :func:`default_cache_dir`.

    Returns:
        The written directory.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / name
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process won the race and wrote the same immutable model.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_model(spec: ModelSpec, directory: Path) -> None:
    """Write ``spec`` in the mlx-lm format into ``directory`` (which must exist).

    The weights come from the model's own initialisers under a seeded MLX
    generator, shaped by :func:`shape_weights`, so the same spec always
    writes the same bytes.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    directory = Path(directory)
    config = spec.full_config()
    model_class, args_class = _get_classes(config)
    mx.random.seed(spec.seed)
    model = model_class(args_class.from_dict(config))
    weights = shape_weights(dict(tree_flatten(model.parameters())), spec.weight_scales)
    del model
    if spec.dtype != "float32":
        dtype = getattr(mx, spec.dtype)
        weights = {name: value.astype(dtype) for name, value in weights.items()}
        config["torch_dtype"] = spec.dtype
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _write_tokenizer(directory)


def _write_tokenizer(directory: Path) -> None:
    bos, eos, pad = _SPECIAL_TOKENS
    write_byte_tokenizer(
        directory, _SPECIAL_TOKENS, bos=bos, eos=eos, pad=pad, chat_template=_CHAT_TEMPLATE
    )


def write_byte_tokenizer(
    directory: Path,
    special_tokens: Sequence[str],
    *,
    bos: Optional[str],
    eos: str,
    pad: str,
    chat_template: str,
) -> None:
    """Write a byte-level tokenizer: one token per byte, no merges, then specials.

    Byte ``b`` gets token id ``b``; ``special_tokens[i]`` gets ``256 + i`` and
    is never split. Writes ``tokenizer.json`` (with the ``tokenizers``
    package), ``tokenizer_config.json`` and ``special_tokens_map.json``.

    Args:
        directory: an existing directory.
        special_tokens: the special tokens, in id order.
        bos: the beginning-of-sequence token, or None for a tokenizer without
            one; never added automatically.
        eos: the end-of-sequence token.
        pad: the padding token.
        chat_template: a Jinja chat template for ``apply_chat_template``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = Path(directory)
    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()
    # ``alphabet()`` is unordered; give every byte a stable id equal to its value.
    mapping = _bytes_to_unicode()
    assert set(mapping.values()) == set(byte_to_unicode), "byte alphabet mismatch"
    vocab = {mapping[b]: b for b in range(BYTE_VOCAB)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(special_tokens))
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": False,
        "model_max_length": 32768,
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    (directory / "special_tokens_map.json").write_text(
        json.dumps({k: v for k, v in special_map.items() if v is not None}, indent=2)
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table (ByteLevel's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(BYTE_VOCAB):
        if b not in table:
            table[b] = chr(BYTE_VOCAB + extra)
            extra += 1
    return table
