"""A reasoning model's reasoning, read out of its answer.

Models that reason before they answer (Qwen3, DeepSeek-R1 and their
kind) write the reasoning between markers (``<think>`` ... ``</think>``);
mlx-lm knows the markers of each family from the tokenizer's vocabulary.
:class:`ReasoningSyntax` is that, as this server uses it: the reasoning is
sent apart from the answer's content (``message.reasoning``, a streamed
``delta.reasoning``, as ``mlx_lm.server`` sends it), as it is written. A
template that opens the block itself (the prompt ends inside it: the model
writes only the end marker) begins the answer in its reasoning.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from mlxkv.server.markers import MarkedSplitter

__all__ = ["ReasoningSyntax"]


@attrs.frozen(kw_only=True)
class ReasoningSyntax:
    """How a model marks its reasoning: the ``start`` and ``end`` markers."""

    start: str
    end: str

    @classmethod
    def of(cls, tokenizer: Any) -> Optional[ReasoningSyntax]:
        """The markers of an mlx-lm ``TokenizerWrapper``, or None if mlx-lm
        knows of no reasoning for its model."""
        if not getattr(tokenizer, "has_thinking", False) or not tokenizer.think_start or not tokenizer.think_end:
            return None
        return cls(start=tokenizer.think_start, end=tokenizer.think_end)

    def opened(self, prompt: str) -> bool:
        """Whether ``prompt`` ends inside a block of reasoning (its last start
        marker after its last end marker)."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def splitter(self, prompt: str) -> MarkedSplitter:
        """A splitter for the answer to ``prompt``: its reasoning comes out as
        it is written, from the first token where the prompt opened it."""
        return MarkedSplitter(self.start, self.end, streamed=True, inside=self.opened(prompt))
