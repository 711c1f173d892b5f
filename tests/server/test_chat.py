"""The chat template and the conversation memory that keeps earlier turns' exact tokens."""

from __future__ import annotations

import pytest

from mlxkv import InvalidInput
from mlxkv.server.chat import ConversationMemory, Turn
from mlxkv.server.request import ChatMessage

USER, ASSISTANT = "user", "assistant"


def messages(*contents: str) -> list[ChatMessage]:
    return [ChatMessage(role=(USER, ASSISTANT)[i % 2], content=c) for i, c in enumerate(contents)]


class TestConversationMemory:
    """Kept turns by tenant and answer, found when a prompt's text begins with theirs."""

    def test_continues_the_last_answer_s_turn(self):
        """A conversation whose text begins with a kept turn's text is found by its
        last assistant message; one whose earlier text differs is not."""
        memory = ConversationMemory()
        memory.remember(None, "A1", Turn("<u>Q1<a>A1", (1, 2, 3)))
        assert memory.continued(None, messages("Q1", "A1", "Q2"), "<u>Q1<a>A1<u>Q2<a>") == Turn(
            "<u>Q1<a>A1", (1, 2, 3)
        )
        assert memory.continued(None, messages("Q0", "A1", "Q2"), "<u>Q0<a>A1<u>Q2<a>") is None
        assert memory.continued(None, messages("Q1"), "<u>Q1<a>") is None
        stats = memory.statistics()
        assert (stats.num_continued, stats.num_fresh, stats.num_turns, stats.num_tokens) == (
            1,
            2,
            1,
            3,
        )

    def test_an_earlier_answer_when_the_last_is_unknown(self):
        """If the last answer's turn is not kept, an earlier one's is used."""
        memory = ConversationMemory()
        memory.remember(None, "A1", Turn("<u>Q1<a>A1", (1, 2)))
        turn = memory.continued(
            None, messages("Q1", "A1", "Q2", "A2", "Q3"), "<u>Q1<a>A1<u>Q2<a>A2<u>Q3<a>"
        )
        assert turn == Turn("<u>Q1<a>A1", (1, 2))

    def test_tenants_do_not_see_each_other(self):
        """A turn kept under one salt is not found under another (or none)."""
        memory = ConversationMemory()
        memory.remember("alice", "A", Turn("QA", (1,)))
        assert memory.continued("bob", messages("Q", "A", "R"), "QAR") is None
        assert memory.continued(None, messages("Q", "A", "R"), "QAR") is None
        assert memory.continued("alice", messages("Q", "A", "R"), "QAR") == Turn("QA", (1,))

    def test_same_answer_in_several_conversations(self):
        """Conversations ending in the same answer are told apart by their text."""
        memory = ConversationMemory()
        memory.remember(None, "OK", Turn("xOK", (1,)))
        memory.remember(None, "OK", Turn("yOK", (2,)))
        assert memory.continued(None, messages("x", "OK", "z"), "xOKz") == Turn("xOK", (1,))
        assert memory.continued(None, messages("y", "OK", "z"), "yOKz") == Turn("yOK", (2,))

    def test_bounded_by_turns_and_tokens(self):
        """The oldest turns go first once there are too many or they hold too many
        tokens; the counts stay the sums of what is kept."""
        memory = ConversationMemory(max_turns=3, max_tokens=10, per_answer=2)
        for i in range(5):
            memory.remember(None, f"A{i}", Turn(f"Q{i}A{i}", (i, i)))
        assert memory.statistics().num_turns == 3 and memory.statistics().num_tokens == 6
        assert memory.continued(None, messages("Q1", "A1", "R"), "Q1A1R") is None
        assert memory.continued(None, messages("Q4", "A4", "R"), "Q4A4R") is not None
        memory.remember(None, "B", Turn("QB", tuple(range(9))))
        assert memory.statistics().num_tokens <= 10
        memory.remember(None, "C", Turn("QC", tuple(range(11))))  # larger than the whole memory
        assert memory.continued(None, messages("Q", "C", "R"), "QCR") is None
        for i in range(3):
            memory.remember(None, "same", Turn(f"{i}same", (i,)))
        assert memory.statistics().num_turns <= 3

    def test_remembering_twice_counts_once(self):
        """The same turn kept again is not counted twice."""
        memory = ConversationMemory()
        memory.remember(None, "A", Turn("QA", (1, 2)))
        memory.remember(None, "A", Turn("QA", (1, 2)))
        assert (memory.statistics().num_turns, memory.statistics().num_tokens) == (1, 2)


class TestChatTemplate:
    """The built-in model's template, through its Hugging Face tokenizer."""

    def test_renders_and_encodes_without_added_specials(self, chat_template):
        """The template writes the special tokens; encoding adds none of its own."""
        text = chat_template.render(messages("Hi"))
        assert text == "<|begin_of_text|>user: Hi\n<|begin_of_text|>assistant: "
        tokens = chat_template.encode(text)
        assert tokens.count(256) == 2 and len(tokens) == len(text.encode()) - 2 * (
            len("<|begin_of_text|>") - 1
        )

    def test_template_errors_are_invalid_input(self, default_model_path):
        """A template that refuses the messages (its ``raise_exception``) is InvalidInput about them."""
        from transformers import AutoTokenizer

        from mlxkv.server.chat import ChatTemplate

        tokenizer = AutoTokenizer.from_pretrained(default_model_path)
        tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
        with pytest.raises(InvalidInput) as caught:
            ChatTemplate(tokenizer).render(messages("Hi"))
        assert caught.value.argument == "messages" and "roles must alternate" in str(caught.value)
