"""Random walks through a JSON grammar's states, byte by byte: the liveness
check the grammar's tests share (no state reached is stuck)."""

from __future__ import annotations

import random
from collections.abc import Iterator

from mlxkv.actors.json_grammar import JsonGrammar


def walked_texts(
    grammar: JsonGrammar, rng: random.Random, walks: int, steps: int, *, stop: float = 0.3, close: float = 0.3
) -> Iterator[bytes]:
    """Each of ``walks`` random walks over the bytes each state allows, that
    ended whole within ``steps`` bytes: it stops where the text is whole
    with chance ``stop`` (always where nothing may follow), and picks a
    closing byte (``}``, ``]``, ``"``), where one may come, with chance
    ``close``, so that walks finish. Asserts that no state is stuck."""
    for _ in range(walks):
        state, text = grammar.start, b""
        for _ in range(steps):
            nexts = [byte for byte in range(256) if grammar.step(state, byte)]
            if grammar.complete(state) and (not nexts or rng.random() < stop):
                yield text
                break
            assert nexts, text
            closing = [byte for byte in nexts if byte in b'}]"']
            byte = rng.choice(closing if closing and rng.random() < close else nexts)
            state, text = grammar.step(state, byte), text + bytes([byte])
