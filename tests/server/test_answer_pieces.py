"""An answer's pieces (``_Answer`` in ``mlxkv.server.app``): text cut by stop
strings, and every counted token's log-probabilities carried out.

The generation here is a scripted sequence of the records a real one yields
(a stand-in: a real model cannot be made to yield a token of no text at its
end, or a stop string split just so); the served paths are tested in
``test_app.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("starlette")

from mlxkv.actors.token_logprobs import TokenLogprob  # noqa: E402
from mlxkv.generation import GeneratedToken, GenerationReport  # noqa: E402
from mlxkv.server.app import _Answer, _Prompt  # noqa: E402


class _Scripted:
    """Yields ``records`` as a generation would."""

    def __init__(self, records: list[Any]) -> None:
        self._records = iter(records)

    def __aiter__(self) -> Any:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._records)
        except StopIteration:
            raise StopAsyncIteration from None


def _tokens(*texts: str) -> list[GeneratedToken]:
    return [
        GeneratedToken(index=i, token=100 + i, text=text, logprob=TokenLogprob(100 + i, -0.5 * i))
        for i, text in enumerate(texts)
    ]


def _report(tokens: list[GeneratedToken]) -> GenerationReport:
    return GenerationReport(
        request_id="r", prompt_tokens=1, cached_tokens=0, generated_tokens=len(tokens), finish_reason="length",
        tokens=tuple(t.token for t in tokens), text="".join(t.text for t in tokens), time_to_first_token=0.0,
        decode_tokens_per_second=0.0, total_time=0.0, stored_blocks=0, stored_bytes=0,
    )  # fmt: skip


async def _pieces(records: list[Any], stops: tuple[str, ...] = ()) -> tuple[list[Any], _Answer]:
    answer = _Answer(0, _Prompt(tokens=(1,)), _Scripted(records), stops, lambda: None)  # type: ignore[arg-type]
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
    tokens = _tokens(*texts)
    records: list[Any] = [*tokens, _report(tokens)]
    pieces, answer = await _pieces(records, stops)
    assert "".join(piece.text for piece in pieces) == sent
    logged = [token for piece in pieces for token in piece.tokens]
    assert [t.record.token for t in logged] == [t.token for t in tokens[: answer.num_tokens]]
    assert [t.offset for t in logged] == [len("".join(texts[:i])) for i in range(answer.num_tokens)]
    assert all(piece.text or piece.tokens for piece in pieces)


async def test_without_log_probabilities_no_piece_is_empty():
    tokens = [GeneratedToken(index=i, token=i, text=text) for i, text in enumerate(("a", "", "b", ""))]
    pieces, _ = await _pieces([*tokens, _report(tokens)])
    assert [piece.text for piece in pieces] == ["a", "b"]
    assert all(piece.tokens == () for piece in pieces)
