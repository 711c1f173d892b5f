"""An answer's pieces (``Answer`` in ``mlxkv.server.app``): text cut by stop
strings, and every counted token's log-probabilities carried out.

The generation here is a scripted sequence of the records a real one yields
(``scripted_generation.py`` says why); the served paths are tested in
``test_app.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("starlette")

from mlxkv.generation import GeneratedToken  # noqa: E402
from mlxkv.server.answer import Answer, Prompt, Reading  # noqa: E402
from mlxkv.server.reasoning import ReasoningSyntax  # noqa: E402

from scripted_generation import Scripted, report, tokens  # noqa: E402


async def _pieces(records: list[Any], stops: tuple[str, ...] = ()) -> tuple[list[Any], Answer]:
    answer = Answer(0, Prompt(tokens=(1,)), Scripted(records), stops, lambda: None)  # type: ignore[arg-type]
    return [piece async for piece in answer.pieces()], answer


@pytest.mark.parametrize(
    ("texts", "stops", "sent"),
    [
        (("a", "b", ""), (), "ab"),  # a last token of no text
        (("a", "", "c"), (), "ac"),  # a token of no text mid-answer
        (("a", "x", "y"), ("xyz",), "axy"),  # a held tail, flushed at the end
        (("a", "xy", "z", "q"), ("xyz",), "a"),  # a stop string over two tokens
        (("xyz", "q"), ("xyz",), ""),  # a stop string first: no text at all
    ],
)
async def test_every_counted_token_comes_out_once_with_its_offset(texts, stops, sent):
    """Joined, the pieces are the text as it may be sent, and carry one
    record for each token counted (with where its text starts), in order --
    whether its text came out, was held, or was cut by a stop string; no
    piece is empty."""
    generated = tokens(*texts)
    records: list[Any] = [*generated, report(generated)]
    pieces, answer = await _pieces(records, stops)
    assert "".join(piece.text for piece in pieces) == sent
    logged = [token for piece in pieces for token in piece.tokens]
    assert [t.record.token for t in logged] == [t.token for t in generated[: answer.num_tokens]]
    assert [t.offset for t in logged] == [len("".join(texts[:i])) for i in range(answer.num_tokens)]
    assert all(piece.text or piece.tokens for piece in pieces)


async def test_without_log_probabilities_no_piece_is_empty():
    generated = [GeneratedToken(index=i, token=i, text=text) for i, text in enumerate(("a", "", "b", ""))]
    pieces, _ = await _pieces([*generated, report(generated)])
    assert [piece.text for piece in pieces] == ["a", "b"]
    assert all(piece.tokens == () for piece in pieces)


@pytest.mark.parametrize(
    ("prompt", "texts", "counted"),
    [
        # From the token that completes the start marker to the one that completes the end.
        ("q", ("<th", "ink>", "a", "", "b", "</thi", "nk>", "x"), 6),
        ("q", ("ab", "<think>x</think>", "y"), 1),  # one token holds the whole block
        ("q", ("a", "<think>", "b"), 2),  # open to the last token
        ("q<think>", ("a", "</think>", "x", "y"), 2),  # the prompt opened the block
        ("q", ("a", "b"), 0),
    ],
)
async def test_reasoning_tokens_are_those_read_inside_a_block(prompt, texts, counted):
    generated = tokens(*texts)
    reading = Reading(reasoning=ReasoningSyntax(start="<think>", end="</think>"))
    answer = Answer(0, Prompt(tokens=(1,), text=prompt), Scripted([*generated, report(generated)]), (), lambda: None,
                    reading)  # type: ignore[arg-type]  # fmt: skip
    [piece async for piece in answer.pieces()]
    assert answer.reasoning_tokens == counted and answer.num_tokens == len(texts)
