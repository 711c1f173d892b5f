"""A scripted generation: the records a real one yields, in a given order.

A stand-in for the runtime's :class:`~mlxkv.Generation` in the tests of an
answer's pieces (``Answer``): a model with random weights cannot be made to
yield a token of no text at its end, a stop string split just so, or a tool
call or a reasoning block cut across tokens. The served paths, with real
generations, are tested in ``test_app.py``.
"""

from __future__ import annotations

from typing import Any

from mlxkv.actors.token_logprobs import TokenLogprob
from mlxkv.generation import GeneratedToken, GenerationReport


class Scripted:
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


def tokens(*texts: str) -> list[GeneratedToken]:
    """Generated tokens of these texts (ids 100, 101, ...), each with a log-probability."""
    return [
        GeneratedToken(index=i, token=100 + i, text=text, logprob=TokenLogprob(100 + i, -0.5 * i))
        for i, text in enumerate(texts)
    ]


def report(generated: list[GeneratedToken], finish_reason: str = "length") -> GenerationReport:
    """The report that ends a generation of ``generated``."""
    return GenerationReport(
        request_id="r", prompt_tokens=1, cached_tokens=0, generated_tokens=len(generated), finish_reason=finish_reason,
        tokens=tuple(t.token for t in generated), text="".join(t.text for t in generated), time_to_first_token=0.0,
        decode_tokens_per_second=0.0, total_time=0.0, stored_blocks=0, stored_bytes=0,
    )  # fmt: skip
