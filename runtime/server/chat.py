"""Chat prompts: the model's chat template, and the exact tokens of earlier turns.

A chat request carries the whole conversation as text. Rendered with the
chat template and tokenized afresh, turn 2's prompt need not begin with the
tokens turn 1 was computed on: the answer was *generated* as tokens, and its
text, tokenized again, can come out differently (merges across a boundary,
special tokens, bytes that are not UTF-8 and came back as U+FFFD). From the
first differing token on, nothing turn 1 computed is reused.

:class:`ConversationMemory` keeps, per tenant and answer text, what turn 1
rendered to (its prompt's text followed by the answer's text) and the tokens
behind that text (the prompt's tokens followed by the generated ones). When
the template renders the earlier turns the same way again -- turn 2's text
begins with that text -- turn 2's prompt is those tokens followed by the rest
of the text, tokenized: every earlier token is reused. A template that
renders earlier turns differently (dropping a reasoning block, say) falls
back to tokenizing the whole text, and the runtime reuses what matches.

Measured on the built-in model (16 conversations, 512-token system prompts,
32-token answers): tokenized afresh, turn 2's prompt diverged at the first
answer token every time (random weights emit bytes that are not UTF-8);
with the memory it extends turn 1's prompt and answer exactly.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import attrs

from mlxkv.errors import InvalidInput
from mlxkv.server.request import ChatMessage
from mlxkv.server.reasoning import ReasoningSyntax
from mlxkv.server.tools import ToolSyntax

__all__ = ["ChatTemplate", "ConversationMemory", "Turn"]


class ChatTemplate:
    """A model's chat template and tokenizer (mlx-lm's tokenizer wrapper, loaded
    beside the runtime from the same model directory), and how the model
    writes tool calls and marks its reasoning, where mlx-lm knows.

    Rendered as ``mlx_lm.server`` renders it: mlx-lm's own template where it
    has one for the model, its thinking switch at the model's default.

    Owns: the tokenizer. The server renders and encodes on worker threads,
    several requests' at once: it keeps no state between calls.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.tool_syntax: Optional[ToolSyntax] = ToolSyntax.of(tokenizer)
        self.reasoning_syntax: Optional[ReasoningSyntax] = ReasoningSyntax.of(tokenizer)

    @classmethod
    def load(cls, model: str) -> Optional[ChatTemplate]:
        """The template of the model at ``model`` (a directory or a Hub id), or
        None if its tokenizer has no chat template. Blocks: run it on a thread."""
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(model)
        if not tokenizer.has_chat_template:
            return None
        return cls(tokenizer)

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] = (),
        variables: Optional[Mapping[str, Any]] = None,
    ) -> str:
        """The conversation as the model reads it, ending where the assistant
        begins, with ``tools`` offered where there are any, and the template's
        ``variables`` (a request's ``chat_template_kwargs``) set.

        Raises:
            InvalidInput: the template refused the messages (it may require
                alternating roles, say).
        """
        try:
            return self._tokenizer.apply_chat_template(
                [message.for_template() for message in messages],
                tools=[dict(tool) for tool in tools] or None,
                tokenize=False,
                add_generation_prompt=True,
                **(variables or {}),
            )
        except Exception as error:  # a template's raise_exception, or a Jinja error
            raise InvalidInput(
                "messages", len(messages), f"the chat template refused them: {error}"
            ) from None

    def encode(self, text: str) -> tuple[int, ...]:
        """``text``'s token ids; special tokens only where the text has them (the
        template writes the ones it wants, as ``apply_chat_template`` tokenizes)."""
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))


@attrs.frozen
class Turn:
    """A conversation up to the end of an answer: its text and the exact tokens behind it."""

    text: str = attrs.field(repr=lambda t: f"<{len(t)} chars>")
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")


@attrs.frozen(kw_only=True)
class MemoryStatistics:
    """What a :class:`ConversationMemory` holds and did.

    Attributes:
        num_turns: turns kept.
        num_tokens: tokens they hold.
        num_continued: prompts built on a kept turn.
        num_fresh: prompts tokenized whole (no kept turn began them).
    """

    num_turns: int
    num_tokens: int
    num_continued: int
    num_fresh: int


class ConversationMemory:
    """The exact tokens of recent answers' conversations, per tenant (a bounded LRU).

    Owns: the turns, keyed by ``(cache salt, answer text)``; several
    conversations can end in the same answer, so each key keeps up to
    ``per_answer`` of them, newest first. Used on the event loop only.

    Invariants:
        - ``num_tokens`` is the sum of the kept turns' token counts and stays
          at most ``max_tokens``; at most ``max_turns`` turns are kept;
        - a salt's lookups see only the turns remembered under that salt.
    """

    def __init__(
        self, *, max_turns: int = 4096, max_tokens: int = 1 << 22, per_answer: int = 4
    ) -> None:
        self._max_turns = max_turns
        self._max_tokens = max_tokens
        self._per_answer = per_answer
        self._turns: collections.OrderedDict[tuple[Optional[str], str], list[Turn]] = (
            collections.OrderedDict()
        )
        self._num_turns = 0
        self._num_tokens = 0
        self._num_continued = 0
        self._num_fresh = 0

    def remember(self, salt: Optional[str], answer: str, turn: Turn) -> None:
        """Keep ``turn``, the conversation ending in ``answer``, for its next turn."""
        if not answer or len(turn.tokens) > self._max_tokens:
            return
        key = (salt, answer)
        turns = self._turns.pop(key, [])
        if turn in turns:
            turns.remove(turn)
            self._forget(turn)
        turns.insert(0, turn)
        self._num_turns += 1
        self._num_tokens += len(turn.tokens)
        while len(turns) > self._per_answer:
            self._forget(turns.pop())
        self._turns[key] = turns
        while self._num_turns > self._max_turns or self._num_tokens > self._max_tokens:
            _, oldest = self._turns.popitem(last=False)
            for dropped in oldest:
                self._forget(dropped)

    def continued(
        self, salt: Optional[str], messages: Sequence[ChatMessage], text: str, *, count: bool = True
    ) -> Optional[Turn]:
        """The kept turn that ``text``, the rendered ``messages``, continues, if any.

        The assistant messages are tried from the last one back; the first
        kept turn of that tenant and answer whose text begins ``text`` is it.
        The prompt is then its tokens followed by the rest of ``text``,
        tokenized. ``count=False`` only looks (a render): no counter moves,
        and the turn is not marked recently used.
        """
        for message in reversed(messages):
            if message.role != "assistant":
                continue
            key = (salt, message.answer_key())
            for turn in self._turns.get(key, ()):
                if text.startswith(turn.text):
                    if count:
                        self._turns.move_to_end(key)
                        self._num_continued += 1
                    return turn
        self._num_fresh += count
        return None

    def statistics(self) -> MemoryStatistics:
        """A snapshot of the counters."""
        return MemoryStatistics(
            num_turns=self._num_turns,
            num_tokens=self._num_tokens,
            num_continued=self._num_continued,
            num_fresh=self._num_fresh,
        )

    def _forget(self, turn: Turn) -> None:
        self._num_turns -= 1
        self._num_tokens -= len(turn.tokens)
