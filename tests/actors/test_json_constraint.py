"""Which tokens a JSON constraint allows: the walk against reading every token.

Real tokenizers (byte-level BPE with merges learned on JSON, a
SentencePiece-style one with byte fallback, the built-in model's), real
mlx-lm tokenizer wrappers; the allowed set of each state reached is compared
with the plain definition (the tokens whose every byte the grammar reads),
and random generations over the allowed tokens end in JSON the schema allows.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, NaiveStreamingDetokenizer, SPMStreamingDetokenizer
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mlxkv.actors.json_constraint import ConstrainedRow, ConstraintBroken, JsonConstraint, NoTokenAllowed, TokenBytes
from mlxkv.actors.json_constraint import masked
from mlxkv.actors.json_constraint import token_pieces
from mlxkv.actors.json_grammar import JsonGrammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "count": {"type": "integer"},
        "ok": {"type": "boolean"},
        "items": {"type": "array", "items": {"anyOf": [{"type": "number"}, {"enum": ["x", "yz"]}]}, "maxItems": 3},
        "extra": {"type": "object"},
    },
    "required": ["name", "count"],
}
#: Strings and numbers held to patterns, lengths, a format and bounds.
RULED = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[a-z]{2}\\d*$"},
        "name": {"type": "string", "maxLength": 4},
        "score": {"type": "number", "minimum": -1, "maximum": 2.5},
        "day": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True},
    },
    "required": ["code", "name", "score"],
}
CORPUS = [
    json.dumps({"name": "Zoë", "count": 12, "ok": True, "items": [1.5, "x", -3e2], "extra": {"k": None}}),
    json.dumps({"name": "東京 \\ \"quoted\"", "count": 0}, indent=2, ensure_ascii=False),
    '{"a": [true, false, null], "b": "\\u00e9\\n"}',
    "Plain words, more words and the words again. ",
    "<think>Let me think: </th is not </think>\n\n",
]
#: A reasoning model's markers.
THINK = (b"<think>", b"</think>")


def byte_level() -> TokenizerWrapper:
    """A byte-level BPE with merges learned on JSON (tokens such as ``{"``,
    ``":`` and multi-byte characters), a special end token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s+|\w+|[^\s\w]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"],
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")
    return TokenizerWrapper(fast, BPEStreamingDetokenizer)


def sentencepiece_like() -> TokenizerWrapper:
    """Spaces as ``▁``, byte fallback (``<0xNN>`` tokens), a few merged pieces."""
    vocab = {"<s>": 0, "</s>": 1}
    vocab.update({f"<0x{b:02X}>": b + 2 for b in range(256)})
    for piece in ("▁", '▁"', '":', "▁{", "}", "name", "▁true", "é", "▁▁"):
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=True, unk_token=None))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    return TokenizerWrapper(fast, SPMStreamingDetokenizer)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, TokenizerWrapper]:
    return {"byte-level": byte_level(), "sentencepiece-like": sentencepiece_like()}


def object_constraint(tokenizer: TokenizerWrapper, width: int) -> JsonConstraint:
    """JSON mode over ``tokenizer``'s tokens, logits ``width`` wide."""
    return JsonConstraint(JsonGrammar({"type": "object"}), TokenBytes.of(tokenizer, width), tokenizer.eos_token_ids)


def brute_force(constraint: JsonConstraint, state) -> np.ndarray:
    """The definition: each token whose every byte the grammar reads from ``state``."""
    grammar, tokens = constraint.grammar, constraint.tokens
    mask = np.zeros(tokens.width, dtype=bool)
    for token, piece in enumerate(tokens.pieces):
        if piece is not None and grammar.read(state, piece):
            mask[token] = True
    if grammar.complete(state):
        mask[constraint.end_tokens] = True
    return mask


def random_generation(constraint: JsonConstraint, rng: random.Random, check, steps: int = 200) -> bytes | None:
    """Tokens drawn among the allowed ones (``check`` run on each state) until
    an end token; the text, or None if it ran out of steps. In a reasoning
    block, tokens that write its end marker are drawn half the time (so that
    walks leave it)."""
    row = ConstrainedRow(constraint)
    text = b""
    end = THINK[1]
    for _ in range(steps):
        check(row.state)
        allowed = np.flatnonzero(row.allowed())
        assert len(allowed), text
        ends = [t for t in allowed if t in constraint.end_tokens]
        pieces = constraint.tokens.pieces
        written = max(m for m in range(len(end)) if text.endswith(end[:m]))  # of the marker, so far
        closing = [t for t in allowed if pieces[t] and (end[written:].startswith(pieces[t]) or end in pieces[t])]
        if closing and end not in text and rng.random() < 0.5:
            token = int(rng.choice(closing))
        else:
            token = int(rng.choice(ends)) if ends and rng.random() < 0.4 else int(rng.choice(list(allowed)))
        row.fed(token)
        if token in constraint.end_tokens:
            return text
        text += constraint.tokens.pieces[token]
    return None


class TestTokenPieces:
    @pytest.mark.parametrize("name", ["byte-level", "sentencepiece-like"])
    def test_pieces_joined_are_the_text(self, tokenizers, name):
        """A text's tokens' pieces, joined, are its bytes (SentencePiece's
        prepended ``▁``: a space before); special tokens add none."""
        tokenizer = tokenizers[name]
        pieces = token_pieces(tokenizer)
        for text in CORPUS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            joined = b"".join(pieces[i] for i in ids)
            assert joined == (b" " if name == "sentencepiece-like" else b"") + text.encode()
        for special in tokenizer.all_special_ids:
            assert pieces[special] is None
        assert any(piece and len(piece) > 2 for piece in pieces)

    def test_a_token_decoded_alone_when_no_streaming_detokenizer_says(self, tokenizers):
        """The naive path: each token decoded alone; one that decodes to part
        of a character adds nothing."""
        inner = tokenizers["byte-level"]._tokenizer
        naive = TokenizerWrapper(inner, NaiveStreamingDetokenizer)
        pieces, exact = token_pieces(naive), token_pieces(tokenizers["byte-level"])
        assert pieces[inner.convert_tokens_to_ids("a")] == b"a"
        for piece, truth in zip(pieces, exact):
            if piece is not None:
                assert piece == truth
        assert any(truth is not None and piece is None for piece, truth in zip(pieces, exact))  # half characters

    def test_the_built_in_models_bytes(self, model_dir):
        from mlx_lm.utils import load_tokenizer

        from mlxkv.default_model import DEFAULT_MODEL, ensure_model

        pieces = token_pieces(load_tokenizer(ensure_model(DEFAULT_MODEL, model_dir)))
        assert pieces[:256] == [bytes([b]) for b in range(256)]
        assert all(piece is None for piece in pieces[256:])


class TestAllowed:
    @pytest.mark.parametrize("name", ["byte-level", "sentencepiece-like"])
    @pytest.mark.parametrize(
        ("schema", "around"),
        [
            ({"type": "object"}, {}),
            (SCHEMA, {}),
            (SCHEMA, {"before": b"<tool_call>\n", "after": b"\n</tool_call>"}),
            ({"type": "object"}, {"reasoning": THINK}),
            ({"type": "object"}, {"reasoning": THINK, "reasoning_opened": True}),
            (RULED, {}),
        ],
        ids=["json_object", "schema", "markers", "reasoning", "inside reasoning", "ruled"],
    )
    def test_the_walk_finds_exactly_the_tokens_the_grammar_reads(self, tokenizers, name, schema, around):
        """On every state random generations reach, the tokens allowed are
        the definition's (the walk's skips and the shortcuts inside strings
        and reasoning lose and add none), and every finished generation is
        JSON the schema allows."""
        tokenizer = tokenizers[name]
        grammar = JsonGrammar(schema, **around)
        tokens = TokenBytes(token_pieces(tokenizer), len(tokenizer) + 5)  # a padded vocabulary
        constraint = JsonConstraint(grammar, tokens, tokenizer.eos_token_ids)
        checked = set()

        def check(state):
            if state not in checked:
                checked.add(state)
                assert np.array_equal(constraint.allowed(state), brute_force(constraint, state))

        rng = random.Random(7)
        finished = 0
        for _ in range(40):
            text = random_generation(constraint, rng, check, steps=400)
            if text is not None:
                finished += 1
                value = text
                if around.get("reasoning_opened") or ("reasoning" in around and value.startswith(b"<think>")):
                    value = value.split(b"</think>", 1)[1]  # the block (any bytes) ends at its first end marker
                value = value.decode("utf-8").removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
                json.loads(value)
                assert grammar.accepts(text)
        assert finished >= 10 and len(checked) >= 30

    @pytest.mark.parametrize(
        ("reasoning", "schema"),
        [(False, SCHEMA), (True, SCHEMA), (False, RULED)],
        ids=["schema", "after reasoning", "ruled"],
    )
    def test_a_random_vocabulary(self, reasoning, schema):
        """Thousands of random multi-byte tokens (quotes, escapes, digits,
        partial UTF-8, pieces of the reasoning markers mixed in, some longer
        than a ruled string reads a column at a time), against the definition."""
        rng = random.Random(3)
        alphabet = list(b'{}[]":, \n\t0123456789-+.eEtrufalsnbxyz\\/<>hik') + [0xC3, 0xA9, 0xE6, 0x9D, 0xB1, 0x1F]
        pieces = [bytes([b]) for b in range(256)] + [None]
        pieces += [bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 6))) for _ in range(4000)]
        pieces += [THINK[1][:cut] + tail for cut in range(1, 8) for tail in (b"", b"x", b"\n{", b">{}")]
        pieces += [THINK[1][cut:] + tail for cut in range(1, 8) for tail in (b"", b"x", b"\n{", b"{}")]
        pieces += [bytes(rng.choice(b"abcxyz0123-") for _ in range(rng.randint(17, 24))) for _ in range(50)]
        grammar = JsonGrammar(schema, reasoning=THINK, reasoning_opened=True) if reasoning else JsonGrammar(schema)
        constraint = JsonConstraint(grammar, TokenBytes(pieces, len(pieces)), [256])
        checked = set()

        def check(state):
            if state not in checked and len(checked) < 150:
                checked.add(state)
                assert np.array_equal(constraint.allowed(state), brute_force(constraint, state))

        finished = [random_generation(constraint, rng, check, steps=300) for _ in range(30)]
        assert sum(text is not None for text in finished) >= 10
        if schema is RULED:  # ruled strings were met, patterned and held to lengths alone
            rules = {ruled[0] for state in checked if (ruled := grammar.in_ruled_string(state))}
            assert {rule.pattern is None for rule in rules} == {False, True}
        if reasoning:  # the places in the end marker were met
            assert {grammar.in_free_text(state) for state in checked} >= {(THINK[1], 0), (THINK[1], 2)}
        for text in finished:
            if text is not None:
                assert constraint.grammar.accepts(text)

    def test_a_token_not_allowed_breaks_the_row(self, tokenizers):
        tokenizer = tokenizers["byte-level"]
        constraint = object_constraint(tokenizer, len(tokenizer))
        row = ConstrainedRow(constraint)
        with pytest.raises(ConstraintBroken):
            row.fed(ord("x"))
        with pytest.raises(ConstraintBroken):
            row.fed(next(iter(tokenizer.eos_token_ids)))  # not whole yet
        row.fed(tokenizer.encode("{}", add_special_tokens=False)[0])
        assert row.state == constraint.grammar.read(constraint.grammar.start, tokenizer.decode(
            tokenizer.encode("{}", add_special_tokens=False)[:1]).encode())

    def test_the_masks_kept_stay_within_their_budget(self):
        """One budget for every constraint's masks: the least recently used go."""
        from mlxkv.actors.json_constraint import MaskCache

        cache = MaskCache(budget=3000)
        masks = [np.zeros(1000, dtype=bool) for _ in range(4)]
        for key, mask in enumerate(masks[:3]):
            cache.put(key, mask)
        assert cache.get(0) is masks[0] and len(cache) == 3  # 0 is now the most recent
        cache.put(3, masks[3])
        assert cache.bytes == 3000 and cache.get(1) is None and cache.get(0) is masks[0]

    def test_an_ambiguous_row_fails_alone(self, tokenizers):
        """A row whose allowed tokens read too many ways at once is named by
        ``masked`` (its logits as they were); the other rows are masked."""
        import mlx.core as mx

        tokenizer = tokenizers["byte-level"]
        tokens = TokenBytes.of(tokenizer, len(tokenizer))
        one_key = [{"type": "object", "properties": {"a": {"const": i}}, "required": ["a"]} for i in range(300)]
        alike = JsonConstraint(JsonGrammar({"anyOf": one_key}), tokens, tokenizer.eos_token_ids)
        fine = object_constraint(tokenizer, len(tokenizer))
        logits = mx.random.normal((2, len(tokenizer)))
        out, failed = masked(logits, [ConstrainedRow(alike), ConstrainedRow(fine)])
        assert [row for row, _ in failed] == [0] and mx.array_equal(out[0], logits[0]).item()
        assert np.array_equal(np.isfinite(np.array(out[1])), fine.allowed(fine.grammar.start))

    def test_a_row_no_token_can_continue_fails_alone(self, tokenizers):
        """A vocabulary without the byte a schema needs next (here ``"``,
        for a required key): the state is live, no token is; ``allowed``
        says so (and keeps nothing), ``masked`` names the row, and the
        other rows are masked."""
        import mlx.core as mx

        tokens = TokenBytes([b"{", b"}", b"a", b":", b"1", None], 6)
        keyed = JsonConstraint(JsonGrammar({"properties": {"a": {}}, "required": ["a"]}), tokens, [5])
        row = ConstrainedRow(keyed)
        assert np.array(row.allowed()).tolist() == [True, False, False, False, False, False]
        row.fed(0)
        with pytest.raises(NoTokenAllowed):
            row.allowed()
        assert len(keyed.masks) == 1  # the start's mask alone
        fine = ConstrainedRow(JsonConstraint(JsonGrammar({"type": "object"}), tokens, [5]))
        logits = mx.random.normal((2, 6))
        out, failed = masked(logits, [row, fine])
        assert [index for index, _ in failed] == [0] and isinstance(failed[0][1], NoTokenAllowed)
        assert np.isfinite(np.array(out[1])).tolist() == [True, False, False, False, False, False]

    def test_masked_leaves_free_rows_alone(self, tokenizers):
        import mlx.core as mx

        tokenizer = tokenizers["byte-level"]
        width = len(tokenizer) + 3
        constraint = object_constraint(tokenizer, width)
        logits = mx.random.normal((2, width))
        out, failed = masked(logits, [None, ConstrainedRow(constraint)])
        assert failed == []
        assert mx.array_equal(out[0], logits[0]).item()
        allowed = constraint.allowed(constraint.grammar.start)
        finite = np.isfinite(np.array(out[1]))
        assert np.array_equal(finite, allowed)
        assert masked(logits, [None, None])[0] is logits
