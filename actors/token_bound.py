"""How many characters of text one token can stand for, read off a tokenizer.

A text of ``n`` characters has at least ``n / max_chars_per_token(tokenizer)``
tokens, so a text longer than ``context * max_chars_per_token`` cannot fit a
model's context, and can be refused before it is tokenized (tokenizing
megabytes takes seconds and hundreds of MB).

The bound is sound only for a tokenizer that never drops text: every
character it is given ends up inside some token's span. That holds for what
modern LLM tokenizers are made of (byte-level BPE, as GPT-2, Llama 3 and
Qwen use; SentencePiece-style BPE with byte fallback, as Llama 2, Mistral and
Gemma use), and not for others: a pre-tokenizer that splits on whitespace
and drops it, WordPiece's one ``[UNK]`` for a whole over-long word, a
normalizer that strips accents or control characters, an added token that
swallows the whitespace beside it. :func:`max_chars_per_token` reads the
tokenizer's own description (its ``tokenizer.json``) and answers None for
anything it does not know to keep every character: then no characters bound
is sound, and a caller has only the text's size to go by.

How a part counts:
- a token stands for at most as many characters as its vocabulary string
  has (byte-level: one string character per byte, and a character is at
  least one byte; SentencePiece: ``▁`` for a space; byte fallback
  ``<0xE3>``: one byte), and an added token for its content;
- a normalizer that composes characters (NFC, NFKC) turns at most 4 into one
  (the longest canonical decomposition of a Unicode character has 4 code
  points); ``Replace`` of a string by a shorter non-empty one shrinks the
  text by at most their ratio; the others named below never shrink it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["max_chars_per_token"]

#: Normalizers that never make a text shorter.
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
#: Normalizers that compose characters: at most this many become one.
_COMPOSING_NORMALIZERS = {"NFC": 4, "NFKC": 4}
#: Pre-tokenizers that split or map text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
#: Split behaviours that keep the delimiter (only "Removed" drops it).
_KEEPING_SPLITS = {"Isolated", "Contiguous", "MergedWithPrevious", "MergedWithNext"}


def max_chars_per_token(tokenizer: Any) -> Optional[int]:
    """The most characters of input text one of ``tokenizer``'s tokens can stand
    for, or None if the tokenizer may drop text (then no such bound exists).

    Args:
        tokenizer: a Hugging Face fast tokenizer, or anything that forwards to
            one (mlx-lm's ``TokenizerWrapper``); anything without a
            ``backend_tokenizer`` gives None.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    longest = _longest_token(spec.get("model"), spec.get("pre_tokenizer"))
    added = _longest_added(spec.get("added_tokens") or ())
    if shrink is None or longest is None or added is None:
        return None
    return math.ceil(max(longest, added) * shrink)


def _normalizer_shrink(normalizer: Optional[Mapping[str, Any]]) -> Optional[float]:
    """How many input characters at most become one normalized character."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in normalizer.get("normalizers", ()):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind in _KEEPING_NORMALIZERS:
        return 1.0
    if kind in _COMPOSING_NORMALIZERS:
        return float(_COMPOSING_NORMALIZERS[kind])
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content")
        string = pattern.get("String") if isinstance(pattern, Mapping) else None
        if not isinstance(string, str) or not string or not isinstance(content, str) or not content:
            return None  # a regex, or a deletion: no bound
        return max(1.0, len(string) / len(content))
    return None  # strips, cleans, precompiled maps: may delete


def _keeps_text(pre_tokenizer: Optional[Mapping[str, Any]]) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(part) for part in pre_tokenizer.get("pretokenizers", ()))
    if kind == "Split":
        return pre_tokenizer.get("behavior") in _KEEPING_SPLITS
    return kind in _KEEPING_PRE_TOKENIZERS


def _longest_token(
    model: Optional[Mapping[str, Any]], pre_tokenizer: Optional[Mapping[str, Any]]
) -> Optional[int]:
    """The longest vocabulary string, if every character of a pre-tokenized
    text lands in a token whose string is at least as long as its span."""
    if model is None or not _keeps_text(pre_tokenizer):
        return None
    kind = model.get("type")
    vocab = model.get("vocab")
    if kind == "BPE" and isinstance(vocab, Mapping):
        # Unknown characters fused into one token would stand for any number.
        if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
            return None
        strings = list(vocab)
    elif kind == "Unigram" and isinstance(vocab, list) and model.get("byte_fallback"):
        strings = [entry[0] for entry in vocab]
    else:
        return None  # WordPiece, WordLevel, Unigram without byte fallback: an unknown span is one token
    return max((len(string) for string in strings), default=None)


def _longest_added(added: Any) -> Optional[int]:
    """The longest added token's content; None if one strips the whitespace beside it."""
    longest = 1
    for token in added:
        if token.get("lstrip") or token.get("rstrip"):
            return None
        longest = max(longest, len(token.get("content", "")))
    return longest
