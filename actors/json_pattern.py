"""What a JSON string's characters may be: a ``pattern`` and length bounds, read a byte at a time.

A :class:`StringRule` holds a string's decoded text (its characters, not
their JSON escapes) to a regular expression (JSON Schema's ``pattern``: the
ECMAScript syntax, matched anywhere in the text unless anchored) and to
``minLength``/``maxLength`` (counted in code points). It is compiled to an
automaton over the text's UTF-8 bytes: each character class becomes the
byte sequences of its code points, so a byte the rule takes is always a
step of valid UTF-8.

A rule's states are ``(positions, count)``: the automaton's positions (a
frozenset, closed over its empty moves) and the characters read so far
(counted at each character's first byte; held at a cap past which counts
read alike, so states repeat).

Invariants:
    - a state :meth:`StringRule.step` returns is live: from it, some text
      leads to a whole string the rule takes (every position kept can reach
      the end within the lengths still allowed); a dead step is None;
    - the automaton has at most :data:`MAX_POSITIONS` positions (a bounded
      repetition is written out: ``{1000}`` of a class costs its positions
      a thousand times), so what a byte costs is bounded.

The syntax taken: characters and escapes (``\\d \\w \\s`` and their negations,
``\\t \\n \\r \\v \\f \\0 \\cX \\xHH \\uHHHH``, escaped punctuation), ``.``
(any character but a line terminator), classes ``[...]`` with ranges and
``^``, groups ``(...)``, ``(?:...)``, ``(?<name>...)``, alternation, the
quantifiers ``* + ? {n} {n,} {n,m}`` (lazy ones read alike: they match the
same texts), and ``^``/``$`` at the ends of the pattern's top-level
alternatives. Refused (:class:`PatternNotSupported`): backreferences,
lookaround, word boundaries, Unicode property escapes, anchors elsewhere.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["MAX_LEVEL_WORK", "MAX_POSITIONS", "PatternNotSupported", "StringRule", "utf8_sequences"]

#: Automaton positions a rule may have.
MAX_POSITIONS = 4096
#: Positions the character counts of rules with length bounds may take
#: finding, by default (summed over the counts until they repeat; see
#: ``_reach_lengths``): about 50 ms of work.
MAX_LEVEL_WORK = 1 << 16

_MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_ANY = ((0, _MAX_CODE_POINT),)
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = (
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
    (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF),
)  # fmt: skip
_LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_CONTROL_ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "v": 0x0B, "f": 0x0C}


class PatternNotSupported(ValueError):
    """A pattern outside the syntax taken, or too large (the message says what)."""


# -- code point sets ---------------------------------------------------------


def _normalised(ranges) -> tuple[tuple[int, int], ...]:
    """``ranges`` sorted, merged, without surrogates (no UTF-8 text holds one)."""
    cut = []
    for low, high in ranges:
        if low <= _SURROGATES[0] - 1:
            cut.append((low, min(high, _SURROGATES[0] - 1)))
        if high >= _SURROGATES[1] + 1:
            cut.append((max(low, _SURROGATES[1] + 1), high))
    merged: list[list[int]] = []
    for low, high in sorted(cut):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return tuple((low, high) for low, high in merged)


def _complement(ranges) -> tuple[tuple[int, int], ...]:
    out, at = [], 0
    for low, high in _normalised(ranges):
        if low > at:
            out.append((at, low - 1))
        at = high + 1
    if at <= _MAX_CODE_POINT:
        out.append((at, _MAX_CODE_POINT))
    return _normalised(out)


def utf8_sequences(low: int, high: int) -> list[tuple[tuple[int, int], ...]]:
    """The code points ``low..high`` (surrogates left out) as UTF-8: byte
    range sequences, each meaning every combination of its bytes, which
    together encode exactly those code points."""
    out: list[tuple[tuple[int, int], ...]] = []
    for part_low, part_high in _normalised([(low, high)]):
        _split(part_low, part_high, out)
    return out


def _split(low: int, high: int, out: list) -> None:
    for limit in (0x7F, 0x7FF, 0xFFFF):  # where the encoded length changes
        if low <= limit < high:
            _split(low, limit, out)
            _split(limit + 1, high, out)
            return
    if high < 0x80:
        out.append(((low, high),))
        return
    # Split until every byte but the first ranges over whole blocks of
    # continuation bytes, or the two ends share all bytes but the last.
    length = len(chr(low).encode())
    for shift in range(1, length):
        block = (1 << (6 * shift)) - 1
        if low & ~block != high & ~block:
            if low & block:
                _split(low, low | block, out)
                _split((low | block) + 1, high, out)
                return
            if high & block != block:
                _split(low, (high & ~block) - 1, out)
                _split(high & ~block, high, out)
                return
    first, last = chr(low).encode(), chr(high).encode()
    out.append(tuple(zip(first, last)))


# -- parsing -----------------------------------------------------------------


class _Parser:
    """ECMAScript pattern text -> a tree: ``("chars", ranges)``, ``("seq",
    items)``, ``("alt", items)``, ``("repeat", item, low, high|None)``."""

    def __init__(self, source: str) -> None:
        self.text = source
        self.at = 0

    def fail(self, what: str) -> PatternNotSupported:
        return PatternNotSupported(f"pattern {self.text!r}: {what} (at {self.at})")

    def peek(self, ahead: int = 0) -> Optional[str]:
        index = self.at + ahead
        return self.text[index] if index < len(self.text) else None

    def take(self) -> str:
        char = self.text[self.at]
        self.at += 1
        return char

    def top(self) -> tuple:
        """The whole pattern: each top-level alternative unanchored at an end
        matches anywhere, so it is read with any text around it there."""
        branches = []
        while True:
            anchored_start = self.peek() == "^"
            if anchored_start:
                self.at += 1
            items = self.sequence(top=True)
            anchored_end = self.peek() == "$"
            if anchored_end:
                self.at += 1
            around = ("repeat", ("chars", _ANY), 0, None)
            items = ([] if anchored_start else [around]) + items + ([] if anchored_end else [around])
            branches.append(("seq", items))
            if self.peek() is None:
                return ("alt", branches)
            self.at += 1  # the "|" before the next alternative

    def alternatives(self) -> tuple:
        """A group's alternatives (up to its ``)``)."""
        branches = [("seq", self.sequence())]
        while self.peek() == "|":
            self.at += 1
            branches.append(("seq", self.sequence()))
        return ("alt", branches)

    def sequence(self, top: bool = False) -> list:
        """Quantified atoms up to an alternative's end (at the ``top``
        level, a ``$`` ending it is left to the caller)."""
        items: list = []
        while True:
            char = self.peek()
            if char is None or char in "|)" or (top and char == "$" and self._at_branch_end()):
                if char == ")" and top:
                    raise self.fail("unbalanced ')'")
                return items
            if char in "^$":
                raise self.fail("'^' and '$' are taken only at the ends of the pattern's alternatives")
            items.append(self.quantified(self.atom()))

    def _at_branch_end(self) -> bool:
        following = self.peek(1)
        return following is None or following == "|"

    def atom(self) -> tuple:
        char = self.take()
        if char == "(":
            if self.text.startswith("?:", self.at):
                self.at += 2
            elif self.text.startswith("?<", self.at) and self.peek(2) not in ("=", "!"):
                end = self.text.find(">", self.at)
                if end < 0:
                    raise self.fail("an unclosed group name")
                self.at = end + 1
            elif self.peek() == "?":
                raise self.fail("lookaround is not supported")
            inner = self.alternatives()
            if self.peek() != ")":
                raise self.fail("an unclosed group")
            self.at += 1
            return inner
        if char == "[":
            return ("chars", self.char_class())
        if char == ".":
            return ("chars", _complement(_LINE_TERMINATORS))
        if char == "\\":
            return ("chars", self.escape(in_class=False))
        if char in "*+?":
            raise self.fail(f"nothing to repeat before {char!r}")
        if char == "{" and self._quantifier_ahead(self.at - 1):
            raise self.fail("nothing to repeat before '{'")
        return ("chars", ((ord(char), ord(char)),))

    def _quantifier_ahead(self, at: int) -> bool:
        end = self.text.find("}", at)
        if end < 0:
            return False
        body = self.text[at + 1 : end]
        low, _, high = body.partition(",")
        return low.isdigit() and (high == "" or high.isdigit())

    def quantified(self, item: tuple) -> tuple:
        char = self.peek()
        if char in ("*", "+", "?"):
            self.at += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        elif char == "{" and self._quantifier_ahead(self.at):
            end = self.text.index("}", self.at)
            body = self.text[self.at + 1 : end]
            self.at = end + 1
            first, comma, last = body.partition(",")
            low = int(first)
            high = low if not comma else (int(last) if last else None)
            if high is not None and high < low:
                raise self.fail("a repetition's bounds are out of order")
        else:
            return item
        if self.peek() == "?":  # lazy: the same texts match
            self.at += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._quantifier_ahead(self.at)):
            raise self.fail("nothing to repeat")
        return ("repeat", item, low, high)

    def char_class(self) -> tuple[tuple[int, int], ...]:
        negated = self.peek() == "^"
        if negated:
            self.at += 1
        ranges: list[tuple[int, int]] = []
        while True:
            char = self.peek()
            if char is None:
                raise self.fail("an unclosed character class")
            if char == "]":
                self.at += 1
                break
            low = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in (None, "]"):
                self.at += 1
                high = self.class_atom()
                if len(low) != 1 or len(high) != 1 or low[0][0] != low[0][1] or high[0][0] != high[0][1]:
                    raise self.fail("a class range needs single characters at its ends")
                if high[0][0] < low[0][0]:
                    raise self.fail("a class range is out of order")
                ranges.append((low[0][0], high[0][0]))
            else:
                ranges.extend(low)
        return _complement(ranges) if negated else _normalised(ranges)

    def class_atom(self) -> tuple[tuple[int, int], ...]:
        char = self.take()
        if char == "\\":
            return self.escape(in_class=True)
        return ((ord(char), ord(char)),)

    def escape(self, in_class: bool) -> tuple[tuple[int, int], ...]:
        char = self.peek()
        if char is None:
            raise self.fail("a pattern ends with '\\'")
        self.at += 1
        sets = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
        if char in sets:
            return _normalised(sets[char])
        if char.lower() in sets:
            return _complement(sets[char.lower()])
        if char in _CONTROL_ESCAPES:
            return _single(_CONTROL_ESCAPES[char])
        if char == "b" and in_class:
            return _single(0x08)
        if char == "0" and not (self.peek() or "").isdigit():
            return _single(0)
        if char == "c" and (self.peek() or "").isascii() and (self.peek() or "").isalpha():
            return _single(ord(self.take()) % 32)
        if char == "x":
            return _single(self.hex_digits(2))
        if char == "u":
            if self.peek() == "{":
                raise self.fail("'\\u{...}' needs the u flag, which a schema's pattern does not have")
            value = self.hex_digits(4)
            if 0xD800 <= value <= 0xDBFF and self.text.startswith("\\u", self.at):
                mark = self.at
                self.at += 2
                low = self.hex_digits(4)
                if 0xDC00 <= low <= 0xDFFF:
                    return _single(0x10000 + ((value - 0xD800) << 10) + (low - 0xDC00))
                self.at = mark
            if 0xD800 <= value <= 0xDFFF:
                raise self.fail("a lone surrogate matches no UTF-8 text")
            return _single(value)
        if char.isdigit():
            raise self.fail("backreferences are not supported")
        if char in "bB":
            raise self.fail("word boundaries are not supported")
        if char in "pP":
            raise self.fail("Unicode property escapes are not supported")
        if char.isalnum():
            raise self.fail(f"unknown escape '\\{char}'")
        return _single(ord(char))

    def hex_digits(self, count: int) -> int:
        digits = self.text[self.at : self.at + count]
        if len(digits) != count or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise self.fail(f"an escape needs {count} hex digits")
        self.at += count
        return int(digits, 16)


def _single(code: int) -> tuple[tuple[int, int], ...]:
    return _normalised([(code, code)])


# -- the automaton -----------------------------------------------------------


class _Automaton:
    """A Thompson automaton over bytes: ``edges[p]`` the byte ranges out of
    position ``p`` (``(low, high, to)``), ``empty[p]`` its moves on no byte;
    ``accept`` the one position where the text may end."""

    def __init__(self, tree: tuple) -> None:
        self.edges: list[list[tuple[int, int, int]]] = []
        self.empty: list[list[int]] = []
        start = self.position()
        self.accept = self.build(tree, start)
        self.start = start

    def position(self) -> int:
        if len(self.edges) >= MAX_POSITIONS:
            raise PatternNotSupported(f"the pattern needs more than {MAX_POSITIONS} automaton positions")
        self.edges.append([])
        self.empty.append([])
        return len(self.edges) - 1

    def build(self, tree: tuple, entry: int) -> int:
        """Add ``tree``'s positions from ``entry``; the position it ends at."""
        kind = tree[0]
        if kind == "chars":
            exit_ = self.position()
            for low, high in tree[1]:
                for sequence in utf8_sequences(low, high):
                    at = entry
                    for byte_low, byte_high in sequence[:-1]:
                        following = self.position()
                        self.edges[at].append((byte_low, byte_high, following))
                        at = following
                    self.edges[at].append((*sequence[-1], exit_))
            return exit_
        if kind == "seq":
            for item in tree[1]:
                entry = self.build(item, entry)
            return entry
        if kind == "alt":
            exit_ = self.position()
            for item in tree[1]:
                self.empty[self.build(item, entry)].append(exit_)
            return exit_
        _, item, low, high = tree
        for _ in range(low):
            entry = self.build(item, entry)
        if high is None:
            loop = self.position()
            self.empty[entry].append(loop)
            self.empty[self.build(item, loop)].append(loop)
            return loop
        # Nested: (item (item (...)?)?)?, so no position's empty moves reach
        # more than one other (a chain of optional copies would close over all).
        exit_ = self.position()
        for _ in range(high - low):
            self.empty[entry].append(exit_)
            entry = self.build(item, entry)
        self.empty[entry].append(exit_)
        return exit_


class StringRule:
    """A string's characters held to a pattern and length bounds (see the
    module docstring). Immutable once made, but for its step memo; compared
    by identity.

    Raises (on construction):
        PatternNotSupported: a pattern outside the syntax taken, too large,
            or a rule no string satisfies.
    """

    def __init__(
        self,
        pattern: Optional[str] = None,
        min_length: int = 0,
        max_length: Optional[int] = None,
        *,
        level_budget: int = MAX_LEVEL_WORK,
    ) -> None:
        self.pattern = pattern
        self.min_length, self.max_length = min_length, max_length
        tree = _Parser(pattern).top() if pattern is not None else ("repeat", ("chars", _ANY), 0, None)
        automaton = _Automaton(tree)
        #: The automaton's size (what the rule costs a grammar).
        self.positions = len(automaton.edges)
        self._edges = automaton.edges
        self._accept = automaton.accept
        #: Counts past this read alike: the least length where there is no
        #: bound (a count past a bound is never live, so is never held).
        self.count_cap = max_length + 1 if max_length is not None else min_length
        closures = _closures(automaton)
        self._closures = [frozenset(p for p in closure if self._edges[p] or p == self._accept) for closure in closures]
        #: The work finding the character counts took (within ``level_budget``).
        self.level_work = 0
        self._lengths = self._reach_lengths(automaton, level_budget)
        start = self._live(self._closures[automaton.start], 0)
        if not start:
            raise PatternNotSupported("no string satisfies the pattern and length bounds together")
        self.start: tuple[frozenset, int] = (start, 0)
        self._steps: dict[tuple, Optional[tuple[frozenset, int]]] = {}

    def step(self, state: tuple[frozenset, int], byte: int) -> Optional[tuple[frozenset, int]]:
        """The state after the text's next byte (None: it cannot come)."""
        key = (state, byte)
        if key in self._steps:
            return self._steps[key]
        positions, count = state
        if not 0x80 <= byte <= 0xBF:  # a character's first byte
            count = min(count + 1, self.count_cap)
        moved = set()
        for position in positions:
            for low, high, to in self._edges[position]:
                if low <= byte <= high:
                    moved |= self._closures[to]
        found = self._live(moved, count)
        after = (found, count) if found else None
        if len(self._steps) >= 65_536:
            self._steps.clear()
        self._steps[key] = after
        return after

    def takes_code_point(self, state: tuple[frozenset, int], low: int, high: int) -> bool:
        """Whether some code point in ``low..high`` may come next (a ``\\u``
        escape being written: its digits so far leave that range)."""
        positions, count = state
        count = min(count + 1, self.count_cap)
        for sequence in utf8_sequences(low, high):
            at = set(positions)
            for byte_low, byte_high in sequence:
                at = {
                    reached for p in at for low_, high_, to in self._edges[p] if low_ <= byte_high and byte_low <= high_
                    for reached in self._closures[to]
                }  # fmt: skip
            if self._live(at, count):
                return True
        return False

    def complete(self, state: tuple[frozenset, int]) -> bool:
        """Whether the string may end here (its quote may come)."""
        positions, count = state
        return self._accept in positions and count >= self.min_length

    def matches(self, text: str) -> bool:
        """Whether ``text`` (a decoded string) is one the rule takes."""
        state: Optional[tuple[frozenset, int]] = self.start
        for byte in text.encode("utf-8", "surrogatepass"):
            state = self.step(state, byte)
            if state is None:
                return False
        return self.complete(state)

    def _live(self, positions, count: int) -> frozenset:
        """The positions from which the text can still end within the
        lengths allowed, having read ``count`` characters."""
        lengths = self._lengths
        needed_low = max(0, self.min_length - count)
        if self.max_length is None:
            wanted = ~((1 << needed_low) - 1)
        else:
            room = self.max_length - count
            wanted = ((1 << (room + 1)) - 1) & ~((1 << needed_low) - 1) if room >= needed_low else 0
        return frozenset(p for p in positions if lengths[p] & wanted)

    def _reach_lengths(self, automaton: _Automaton, budget: int) -> list[int]:
        """For each position, the character counts of the texts that lead
        from it to the end, as bits (bit ``n``: ``n`` characters), counts
        from ``cap`` on held at ``cap`` (with no upper bound: they read alike
        past the least length; with one, ``max + 1`` means too long).

        Found level by level backwards from the end: ``levels[n]`` holds
        the positions ``n`` characters away from it. A level equal to an
        earlier one repeats the levels since (what comes before a set of
        positions depends on the set alone), so the rest is that period
        written on to ``cap``. Work past ``budget`` (positions summed over
        the levels) raises :class:`PatternNotSupported`."""
        cap = self.max_length + 1 if self.max_length is not None else self.min_length
        free: list[list[int]] = [[] for _ in automaton.edges]  # reached back on no character
        one: list[list[int]] = [[] for _ in automaton.edges]  # reached back on a character's first byte
        for position, edges in enumerate(automaton.edges):
            for low, _, to in edges:
                (free if 0x80 <= low <= 0xBF else one)[to].append(position)
        for position, targets in enumerate(automaton.empty):
            for to in targets:
                free[to].append(position)

        def closed(positions: set[int]) -> frozenset:
            work = list(positions)
            while work:
                for before in free[work.pop()]:
                    if before not in positions:
                        positions.add(before)
                        work.append(before)
            return frozenset(positions)

        if cap == 0:  # no bound: a position is live where it reaches the end at all
            reaching = closed({automaton.accept})
            while True:
                more = closed(set(reaching) | {before for to in reaching for before in one[to]})
                if more == reaching:
                    return [1 if position in reaching else 0 for position in range(len(automaton.edges))]
                reaching = more
        levels: list[frozenset] = []
        first_seen: dict[frozenset, int] = {}
        level = closed({automaton.accept})
        # With a bound, counts past it never matter (``cap`` means too long):
        # the levels stop there; without one, they go on until they repeat.
        while level and level not in first_seen and (self.max_length is None or len(levels) <= cap):
            self.level_work += len(level)
            if self.level_work > budget:
                raise PatternNotSupported("the patterns are too large to hold to length bounds as well")
            first_seen[level] = len(levels)
            levels.append(level)
            level = closed({before for to in level for before in one[to]})
        lengths = [0] * len(automaton.edges)
        for count, found in enumerate(levels):
            for position in found:
                lengths[position] |= 1 << min(count, cap)
        if level in first_seen:  # the levels from ``start`` on repeat forever
            start = first_seen[level]
            period = len(levels) - start
            blocks = [0] * len(automaton.edges)
            for offset in range(period):
                for position in levels[start + offset]:
                    blocks[position] |= 1 << offset
            for position, block in enumerate(blocks):
                if block:
                    written, width = block, period
                    while len(levels) + width <= cap:
                        written |= written << width
                        width *= 2
                    lengths[position] |= ((written << len(levels)) & ((1 << cap) - 1)) | (1 << cap)
        return lengths


def _closures(automaton: _Automaton) -> list[frozenset]:
    """Each position with every position its moves on no byte reach."""
    out = []
    for start in range(len(automaton.edges)):
        seen = {start}
        work = [start]
        while work:
            for to in automaton.empty[work.pop()]:
                if to not in seen:
                    seen.add(to)
                    work.append(to)
        out.append(frozenset(seen))
    return out
