"""A generation held to a JSON grammar: which of the model's tokens may come next.

:class:`TokenBytes` is a tokenizer's vocabulary as the bytes each token adds
to the text (special tokens add none: they are never allowed inside the
text). :class:`JsonConstraint` joins it with a
:class:`~mlxkv.actors.json_grammar.JsonGrammar`: for a grammar state, the
tokens whose every byte the grammar takes (the state stays live through the
whole token), and the end-of-sequence tokens once the text is a whole
value. :class:`ConstrainedRow` is one generation's place in it.

Finding the tokens walks the vocabulary in byte order, each shared prefix
read once, and skips every token under a prefix the grammar refuses (most
of them, outside strings). Inside a string, between characters, whether a
token stays in the string (validly) does not depend on what holds the
string: those tokens are a vector read once a vocabulary, and only the
tokens that end the string are walked, from their closing quote on (and
the same in a reasoning block: tokens without its end marker stay in it).
Inside a string held to a rule, the short tokens of plain characters go
through the rule's states a byte column at a time, all at once
(``_plain_taken``); the others are walked. What a state allows is cached
(a runtime's bounded LRU), so a schema's repeated places cost one walk.

Ownership: a constraint is made on the event loop; from then on its caches
are read and written on the MLX thread only (every generation's rows
step there). A :class:`ConstrainedRow` belongs to its
:class:`~mlxkv.actors.sequence.SequenceState`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from mlxkv.actors.json_grammar import (
    CLOSED, MAX_LENGTH, GrammarTooAmbiguous, JsonGrammar, State, past_prefix, string_step,
)  # fmt: skip

__all__ = [
    "ConstrainedRow", "ConstraintBroken", "JsonConstraint", "MaskCache", "NoTokenAllowed", "TokenBytes", "masked",
    "token_pieces",
]  # fmt: skip

#: Bytes of allowed-token vectors a runtime's constraints keep together (one
#: byte a token a state: about 440 states over 150,000 tokens).
MASK_BYTES = 64 << 20
#: Places in reasoning end markers whose tokens a vocabulary keeps read.
MARKERS_KEPT = 32
#: The longest piece read a column at a time inside a ruled string (longer ones are walked).
PLAIN_BYTES = 16
#: UTF-8 continuation bytes (a character's count is its other bytes').
_CONTINUATION = bytes(range(0x80, 0xC0))


class ConstraintBroken(RuntimeError):
    """A row's token was not one its constraint allowed (a bug, not bad input)."""


class NoTokenAllowed(ValueError):
    """A state the text may go on from where no token of the vocabulary can
    (the schema asks for bytes the vocabulary has no token for, such as a
    vocabulary without single-byte tokens)."""


class MaskCache:
    """The tokens grammar states allow, kept for every constraint of a
    runtime together: the most recently used, up to ``budget`` bytes.

    Owned by the MLX thread once constraints use it (they read and write it
    only there). Invariant: ``bytes`` is the size of the vectors kept, at
    most ``budget`` after every :meth:`put`.
    """

    def __init__(self, budget: int = MASK_BYTES) -> None:
        self.budget = budget
        self.bytes = 0
        self._kept: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any) -> Any:
        found = self._kept.get(key)
        if found is not None:
            self._kept.move_to_end(key)
        return found

    def put(self, key: Any, mask: Any) -> None:
        if key in self._kept:
            return
        self._kept[key] = mask
        self.bytes += mask.nbytes
        while self.bytes > self.budget and len(self._kept) > 1:
            _, dropped = self._kept.popitem(last=False)
            self.bytes -= dropped.nbytes

    def __len__(self) -> int:
        return len(self._kept)


class TokenBytes:
    """A vocabulary as the bytes each token adds to the text.

    Attributes:
        width: the logits' width (the model's vocabulary; ids past the
            tokenizer's add nothing).
        pieces: each id's bytes, None for a token that adds none (special
            tokens, padding past the tokenizer, tokens that decode to nothing).

    Invariants: ``sorted_pieces`` is every piece, in byte order, beside
    its id. Read inside a string between characters (whatever holds the
    string): ``in_string`` marks the pieces that stay inside it, valid;
    ``closing_pieces`` are, for the pieces whose valid text ends the string,
    the rest of each from its closing quote on, sorted, beside their ids;
    any other piece cannot come there.
    """

    def __init__(self, pieces: Sequence[Optional[bytes]], width: int) -> None:
        import numpy as np

        self.width = width
        self.pieces = list(pieces)[:width] + [None] * max(0, width - len(pieces))
        texts = sorted((piece, token) for token, piece in enumerate(self.pieces) if piece)
        self.sorted_pieces = [piece for piece, _ in texts]
        self.sorted_ids = [token for _, token in texts]
        self.in_string = np.zeros(width, dtype=bool)
        closing = []
        for piece, token in texts:
            rest = _read_in_string(piece)
            if rest == b"":
                self.in_string[token] = True
            elif rest is not None:
                closing.append((rest, token))
        closing.sort()
        self.closing_pieces = [piece for piece, _ in closing]
        self.closing_ids = [token for _, token in closing]
        # For a string held to a rule: the pieces of plain characters (in the
        # string, no escape, short), whose every byte goes to the rule, as a
        # byte matrix (zero-padded) beside their lengths and ids; the other
        # pieces that may come there (escapes, a quote ending it, long ones,
        # the rest of a character), read through the grammar, sorted.
        plain = [(piece, token) for piece, token in texts
                 if self.in_string[token] and b"\\" not in piece and len(piece) <= PLAIN_BYTES]  # fmt: skip
        self.plain_bytes = np.frombuffer(
            b"".join(piece.ljust(PLAIN_BYTES, b"\0") for piece, _ in plain), dtype=np.uint8
        ).reshape(len(plain), PLAIN_BYTES)
        self.plain_lengths = np.array([len(piece) for piece, _ in plain], dtype=np.int64)
        self.plain_ids = np.array([token for _, token in plain], dtype=np.int64)
        #: Each plain piece's characters (its bytes but UTF-8 continuation bytes).
        self.plain_chars = np.array([len(piece.translate(None, _CONTINUATION)) for piece, _ in plain], dtype=np.int64)
        plain_set = {token for _, token in plain}
        others = [
            (piece, token) for piece, token in texts
            if token not in plain_set and (0x80 <= piece[0] <= 0xBF or _read_in_string(piece) is not None)
        ]  # fmt: skip
        self.other_pieces = [piece for piece, _ in others]
        self.other_ids = [token for _, token in others]
        self._free_text: OrderedDict[tuple[bytes, int], tuple[Any, list[bytes], list[int]]] = OrderedDict()

    def free_text(self, end: bytes, written: int) -> tuple[Any, list[bytes], list[int]]:
        """Read in free text that ends at ``end`` (a reasoning block), where
        the text ends with ``written`` bytes of it: the tokens that stay in it
        (a vector), and the rest of each token that ends it, after ``end``,
        sorted, beside their ids. Made once a place in a marker (on the MLX
        thread: one pass of ``bytes.find``)."""
        key = (end, written)
        found = self._free_text.get(key)
        if found is not None:
            self._free_text.move_to_end(key)
        else:
            import numpy as np

            stays = np.zeros(self.width, dtype=bool)
            ending = []
            before = end[:written]
            for piece, token in zip(self.sorted_pieces, self.sorted_ids):
                text = before + piece
                at = text.find(end)
                if at < 0:
                    stays[token] = True
                else:
                    ending.append((text[at + len(end) :], token))
            ending.sort()
            found = self._free_text[key] = (stays, [piece for piece, _ in ending], [token for _, token in ending])
            if len(self._free_text) > MARKERS_KEPT:
                self._free_text.popitem(last=False)
        return found

    @classmethod
    def of(cls, tokenizer: Any, width: int) -> TokenBytes:
        """An mlx-lm tokenizer's vocabulary as bytes (byte-level BPE,
        SentencePiece, or each token decoded alone; see :func:`token_pieces`)."""
        return cls(token_pieces(tokenizer), width)


def token_pieces(tokenizer: Any) -> list[Optional[bytes]]:
    """Each token's bytes in the text, as ``tokenizer``'s own streaming
    detokenizer reads them: a byte-level BPE token's characters map back to
    bytes, a SentencePiece token's ``▁`` is a space and ``<0xNN>`` a byte;
    otherwise a token decoded alone (one that decodes to a part of a
    character adds nothing: it is never allowed). Special tokens add none."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

    detokenizer = getattr(tokenizer, "_detokenizer", None)
    size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special.update(
        token for token, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if getattr(added, "special", True)
    )  # fmt: skip
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        decoder = _byte_decoder()
        pieces: list[Optional[bytes]] = []
        for name in detokenizer.tokenmap:
            try:
                pieces.append(bytes(decoder[c] for c in name))
            except (KeyError, TypeError):
                pieces.append(None)
    elif isinstance(detokenizer, SPMStreamingDetokenizer):
        pieces = [piece.replace("\u2581".encode(), b" ") for piece in detokenizer.tokenmap]
    else:
        pieces = []
        for token in range(size):
            text = tokenizer.decode([token])
            pieces.append(None if "\ufffd" in text else text.encode())
    return [None if token in special or not piece else piece for token, piece in enumerate(pieces[:size])]


class JsonConstraint:
    """A grammar over a vocabulary: the tokens each state allows (see the module docstring).

    Attributes:
        grammar: the JSON grammar.
        tokens: the vocabulary as bytes.
        end_tokens: the tokens that end a generation, allowed once the
            text is a whole value (and only then).
    """

    def __init__(
        self, grammar: JsonGrammar, tokens: TokenBytes, end_tokens: Iterable[int], masks: Optional[MaskCache] = None
    ) -> None:
        self.grammar = grammar
        self.tokens = tokens
        self.end_tokens = sorted(token for token in set(end_tokens) if 0 <= token < tokens.width)
        #: Where the allowed tokens are kept (a runtime's, shared by its constraints).
        self.masks = masks if masks is not None else MaskCache()

    def allowed(self, state: State) -> Any:
        """The tokens ``state`` allows next: an MLX bool vector of the
        vocabulary's width, made once a state (found on the host, kept on
        the device, so a step's masks are stacked there, not sent again).

        Raises:
            GrammarTooAmbiguous: a token's text reads more ways at once than
                the grammar takes.
            NoTokenAllowed: no token can come next (nothing is kept).
        """
        key = (self.grammar, state)
        found = self.masks.get(key)
        if found is not None:
            return found
        import numpy as np

        tokens = self.tokens
        free = self.grammar.in_free_text(state)
        if free is not None:
            mask, pieces, ids = tokens.free_text(*free)
            mask = mask.copy()
            self._walk(self.grammar.after_free_text(state), pieces, ids, mask)
        elif (ruled := self.grammar.in_ruled_string(state)) is not None:
            # A string held to a rule: its plain pieces are taken while they
            # fit (lengths alone, between characters), or go through the rule
            # a byte column at a time, all of them at once; the others are read.
            rule, at = ruled
            mask = np.zeros(tokens.width, dtype=bool)
            if rule.pattern is None and at[0] == rule.start[0]:
                room = MAX_LENGTH if rule.max_length is None else rule.max_length - at[1]
                mask[tokens.plain_ids[tokens.plain_chars <= room]] = True
            else:
                mask[tokens.plain_ids[_plain_taken(rule, at, tokens)]] = True
            self._walk(state, tokens.other_pieces, tokens.other_ids, mask)
        elif self.grammar.in_plain_string(state):
            # What stays in the string is allowed whatever holds it; what
            # ends it is read on from its closing quote.
            mask = tokens.in_string.copy()
            self._walk(state, tokens.closing_pieces, tokens.closing_ids, mask)
        else:
            mask = np.zeros(tokens.width, dtype=bool)
            self._walk(state, tokens.sorted_pieces, tokens.sorted_ids, mask)
        if self.grammar.complete(state):
            mask[self.end_tokens] = True
        if not mask.any():
            raise NoTokenAllowed("no token of the model's vocabulary can continue the JSON text here")
        import mlx.core as mx

        kept = mx.array(mask)
        self.masks.put(key, kept)
        return kept

    def _walk(self, start: State, pieces: list[bytes], ids: list[int], mask: Any) -> None:
        """Mark each of ``pieces`` (sorted) the grammar reads whole from ``start``.

        ``states[d]`` is the state after the first ``d`` bytes of ``prefix``,
        the bytes shared with the piece before; a byte refused at depth
        ``d`` rules out every piece that starts with the same ``d + 1``
        bytes, skipped at once."""
        step = self.grammar.step
        states = [start]
        prefix = b""
        index, count = 0, len(pieces)
        while index < count:
            piece = pieces[index]
            shared = 0
            limit = min(len(prefix), len(piece), len(states) - 1)
            while shared < limit and prefix[shared] == piece[shared]:
                shared += 1
            del states[shared + 1 :]
            refused = -1
            for depth in range(shared, len(piece)):
                state = step(states[depth], piece[depth])
                if not state:
                    refused = depth
                    break
                states.append(state)
            if refused < 0:
                mask[ids[index]] = True
                prefix = piece
                index += 1
                continue
            prefix = piece[:refused]
            index = past_prefix(pieces, piece[: refused + 1], index + 1, count)


def _plain_taken(rule: Any, start: Any, tokens: TokenBytes) -> Any:
    """Which of ``tokens``' plain pieces ``rule`` reads whole from its state
    ``start`` (a bool vector over them). The pieces' bytes go through the
    rule column by column, all pieces at once: the rule's states are
    numbered as they are met, and each one met gets its row of 256 steps
    (-1 where a byte cannot come), found once."""
    import numpy as np

    numbered = {start: 0}
    states = [start]

    def number(state: Any) -> int:
        if state is None:
            return -1
        if state not in numbered:
            numbered[state] = len(states)
            states.append(state)
        return numbered[state]

    at = np.zeros(len(tokens.plain_ids), dtype=np.int64)
    table = np.full((1, 256), -1, dtype=np.int64)
    found = np.zeros(1, dtype=bool)  # whether a state's row is in ``table``
    going = np.arange(len(at))
    for column in range(tokens.plain_bytes.shape[1]):
        going = going[(at[going] >= 0) & (tokens.plain_lengths[going] > column)]
        if not going.size:
            break
        here = at[going]
        needed = np.unique(here)
        for index in needed[~found[needed]].tolist():
            row = [number(rule.step(states[index], byte)) for byte in range(256)]
            if len(states) > len(table):  # room for the states numbered since
                grown = max(len(states), 2 * len(table))
                table = np.concatenate([table, np.full((grown - len(table), 256), -1, dtype=np.int64)])
                found = np.concatenate([found, np.zeros(grown - len(found), dtype=bool)])
            table[index], found[index] = row, True
        at[going] = table[here, tokens.plain_bytes[going, column]]
    return at >= 0


def _read_in_string(piece: bytes) -> Optional[bytes]:
    """``piece`` read inside a string between characters: ``b""`` if it stays
    in the string, the rest from the quote that ends it if it does, None if
    it cannot come there (a control byte, a bad escape or UTF-8)."""
    escape: Any = 0
    for index, byte in enumerate(piece):
        escape = string_step(escape, byte)
        if escape is None:
            return None
        if escape is CLOSED:
            return piece[index:]
    return b""


class ConstrainedRow:
    """One generation's place in its constraint.

    Invariants: ``state`` is the grammar's state after the tokens fed so
    far (each allowed by the state before it); it is live until an end
    token is fed.
    """

    __slots__ = ("constraint", "state")

    def __init__(self, constraint: JsonConstraint) -> None:
        self.constraint = constraint
        self.state = constraint.grammar.start

    def allowed(self) -> Any:
        """The tokens allowed next (an MLX bool vector)."""
        return self.constraint.allowed(self.state)

    def fed(self, token: int) -> None:
        """Move past ``token``, generated next.

        Raises:
            ConstraintBroken: the state did not allow ``token``.
        """
        constraint = self.constraint
        piece = constraint.tokens.pieces[token] if 0 <= token < constraint.tokens.width else None
        if piece is None:
            if token in constraint.end_tokens and constraint.grammar.complete(self.state):
                return
            raise ConstraintBroken(f"token {token} is not allowed by the JSON constraint here")
        state = constraint.grammar.read(self.state, piece)  # GrammarTooAmbiguous goes through
        if not state:
            raise ConstraintBroken(f"token {token} ({piece!r}) is not allowed by the JSON constraint here")
        self.state = state


def masked(logits: Any, rows: Sequence[Optional[ConstrainedRow]]) -> tuple[Any, list[tuple[int, Exception]]]:
    """``logits`` ``(rows, vocab)`` with the tokens each constrained row may
    not take next at ``-inf`` (the others' rows as they are), and the rows
    whose allowed tokens could not be found, each with what raised (their
    logits left as they are: the row fails, the others go on)."""
    if all(row is None for row in rows):
        return logits, []
    import mlx.core as mx

    width = logits.shape[-1]
    free = mx.ones((width,), dtype=mx.bool_)
    masks = []
    failed: list[tuple[int, Exception]] = []
    for index, row in enumerate(rows):
        if row is None:
            masks.append(free)
            continue
        try:
            masks.append(_widened(row.allowed(), width))
        except (GrammarTooAmbiguous, NoTokenAllowed) as error:
            failed.append((index, error))
            masks.append(free)
    return mx.where(mx.stack(masks), logits, mx.array(-mx.inf, dtype=logits.dtype)), failed


def _widened(mask: Any, width: int) -> Any:
    """``mask`` cut or padded (nothing allowed past the vocabulary) to ``width``."""
    import mlx.core as mx

    if mask.shape[0] >= width:
        return mask[:width]
    return mx.concatenate([mask, mx.zeros((width - mask.shape[0],), dtype=mx.bool_)])
