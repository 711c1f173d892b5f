"""``max_chars_per_token``: a bound that holds for the tokenizers it accepts, and None for those that drop text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mlxkv.actors.token_bound import max_chars_per_token
from mlxkv.default_model import DEFAULT_MODEL, ensure_model

from budget import examples

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. ",
    "東京特許許可局 許可局長 きゃりーぱみゅぱみゅ 한국어 텍스트 ",
    "def f(x):\n    return x ** 2  # 12345 67890\n\t\t",
]
#: Texts that stress the bound: long runs, combining marks, Hangul jamo (NFC
#: composes three into one), special tokens' strings, whitespace, bytes
#: outside the corpus.
TEXT = st.lists(
    st.one_of(
        st.sampled_from(list("aeo ̣́̈\u1100\u1161\u11a8\n\t ") + ["<|end|>", "the ", "    ", "quick"]),
        st.characters(codec="utf-8"),
    ),
    min_size=1,
    max_size=300,
).map("".join)


def _fast(tokenizer: Tokenizer) -> Any:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def _byte_level(normalizer: Any = None) -> Any:
    """A byte-level BPE with merges learned on the corpus (tokens up to many
    bytes long), a Qwen-style split and an added special token."""
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s+|\w+|[^\s\w]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|end|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 8, trainer)
    return _fast(tokenizer)


def _sentencepiece_like() -> Any:
    """A Llama-2-style BPE: spaces as ``▁``, a prepended ``▁``, byte fallback."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("▁", "▁the", "▁quick", "the", "e", "o", "a", "▁▁▁▁"):
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=True, unk_token=None))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return _fast(tokenizer)


ACCEPTED = {
    "byte-level": lambda: _byte_level(),
    "byte-level NFC": lambda: _byte_level(normalizers.NFC()),
    "byte-level NFKC + lowercase": lambda: _byte_level(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])),
    "sentencepiece-like": _sentencepiece_like,
}


@pytest.fixture(scope="module")
def accepted() -> dict[str, Any]:
    return {name: make() for name, make in ACCEPTED.items()}


class TestMaxCharsPerToken:
    """``max_chars_per_token(tokenizer)``."""

    @pytest.mark.parametrize("name", list(ACCEPTED))
    @settings(max_examples=examples(150), deadline=None)
    @given(text=TEXT)
    def test_a_text_has_at_least_its_length_over_the_bound_in_tokens(self, accepted, name, text):
        """For every tokenizer given a bound: len(text) <= bound * number of tokens."""
        tokenizer = accepted[name]
        bound = max_chars_per_token(tokenizer)
        assert bound is not None
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(text) <= bound * len(ids), (bound, len(ids))

    def test_the_built_in_models_have_a_bound(self, model_dir):
        """The built-in tokenizer (bytes and three special tokens) stands for at most 17 characters a token."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(DEFAULT_MODEL, model_dir)))
        assert max_chars_per_token(tokenizer) == len("<|begin_of_text|>")

    def test_composition_and_replacement_widen_the_bound(self, accepted):
        """NFC multiplies the longest token by 4; a prepend or a same-length replace does not."""
        plain = max_chars_per_token(accepted["byte-level"])
        assert max_chars_per_token(accepted["byte-level NFC"]) == 4 * plain
        assert max_chars_per_token(accepted["sentencepiece-like"]) == len("<0x00>")

    @pytest.mark.parametrize(
        "kind",
        ["whitespace split", "removed split", "strip accents", "replace by nothing", "wordpiece", "fused unknowns", "lstrip added"],
    )
    def test_tokenizers_that_drop_text_have_none(self, kind):
        """A part that can drop characters (or make one token of any length) gives no bound,
        and each such tokenizer really does fit a long text in few tokens."""
        vocab = {"a": 0, "b": 1, "[UNK]": 2, " ": 3}
        model = models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100) if kind == "wordpiece" else (
            models.BPE(vocab=vocab, merges=[], unk_token="[UNK]", fuse_unk=kind == "fused unknowns")
        )
        tokenizer = Tokenizer(model)
        text = "a" + " " * 500 + "b"
        if kind == "whitespace split":
            tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        elif kind == "removed split":
            tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
        elif kind == "strip accents":
            tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
            text = "a" + "\u0301" * 500
        elif kind == "replace by nothing":
            tokenizer.normalizer = normalizers.Replace(" ", "")
        elif kind == "wordpiece":
            tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            text = "ab" * 300
        elif kind == "fused unknowns":
            text = "a" + "z" * 500
        elif kind == "lstrip added":
            from tokenizers import AddedToken

            tokenizer.add_special_tokens([AddedToken("[X]", lstrip=True)])
            text = "a" + " " * 500 + "[X]"
        fast = _fast(tokenizer)
        assert len(fast.encode(text, add_special_tokens=False)) <= 3
        assert max_chars_per_token(fast) is None

    def test_no_backend_no_bound(self):
        """Something that is not a fast tokenizer gives None."""
        assert max_chars_per_token(object()) is None
