"""Tool calls and reasoning: parsed with mlx-lm's parser of the model's
syntax (:class:`ToolSyntax`), marked as mlx-lm knows (:class:`ReasoningSyntax`),
and an answer's pieces carrying them (``Answer``), text and log-probabilities
kept whole. The splitting itself is ``test_markers.py``'s; the served paths
are ``test_app.py``'s ``TestTools`` and ``TestReasoning``."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("starlette")

from mlx_lm.tool_parsers import json_tools, mistral  # noqa: E402

from mlxkv.server.answer import Answer, Prompt, Reading  # noqa: E402
from mlxkv.server.request import ToolCall  # noqa: E402
from mlxkv.server.markers import Inside  # noqa: E402
from mlxkv.server.reasoning import ReasoningSyntax  # noqa: E402
from mlxkv.server.tools import ToolSyntax  # noqa: E402

from scripted_generation import Scripted, report, tokens  # noqa: E402

JSON_TOOLS, MISTRAL = (
    ToolSyntax(start=module.tool_call_start, end=module.tool_call_end, parse=module.parse_tool_call)
    for module in (json_tools, mistral)
)


class TestToolSyntax:
    def test_a_forced_call_is_a_schema_between_the_markers(self):
        """One call of the named functions, each name with its own
        arguments' schema (none given: any object); where the model does not
        write calls as JSON, forcing one is refused."""
        from mlxkv.actors.json_grammar import JsonGrammar
        from mlxkv.errors import InvalidInput

        integer_x = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
        tools = [
            {"type": "function", "function": {"name": "a", "parameters": integer_x}},
            {"type": "function", "function": {"name": "b"}},
            {"type": "function", "function": {"name": "c", "parameters": {"type": "object"}}},
        ]
        syntax = ToolSyntax(start="<tool_call>", end="</tool_call>", parse=json_tools.parse_tool_call, json_body=True)
        schema, around = syntax.forced(tools, ("a", "b"))
        assert (around.before, around.after) == ("<tool_call>\n", "\n</tool_call>")
        grammar = JsonGrammar(schema, before=around.before.encode(), after=around.after.encode())
        assert grammar.accepts(b'<tool_call>\n{"name":"a","arguments":{"x":1}}\n</tool_call>')
        assert grammar.accepts(b'<tool_call>\n{"name":"b","arguments":{"y":[]}}\n</tool_call>')
        for wrong in (b'{"name":"a","arguments":{"x":"1"}}', b'{"name":"c","arguments":{}}', b'{"name":"b"}'):
            assert not grammar.accepts(b"<tool_call>\n" + wrong + b"\n</tool_call>")
        single, _ = syntax.forced(tools, ("c",))
        assert single["properties"]["name"] == {"const": "c"}
        with pytest.raises(InvalidInput) as refused:
            MISTRAL.forced(tools, ("a",))
        assert refused.value.argument == "tool_choice"

    def test_a_call_is_parsed_with_an_id(self):
        (call,) = JSON_TOOLS.calls(Inside('\n{"name": "get", "arguments": {"city": "Zürich"}}\n'), [])
        assert (call.name, json.loads(call.arguments)) == ("get", {"city": "Zürich"})
        assert call.id.startswith("call_") and "Zürich" in call.arguments  # JSON text, not escaped

    def test_several_calls_in_one_and_the_models_ids(self):
        raw = Inside('[{"name": "a", "arguments": {}, "id": "abc123def"}, {"name": "b", "arguments": {"x": 1}}]')
        calls = MISTRAL.calls(raw, [])
        assert [c.name for c in calls] == ["a", "b"] and calls[0].id == "abc123def"
        assert calls[1].id != calls[0].id and json.loads(calls[1].arguments) == {"x": 1}

    @pytest.mark.parametrize("text", ['{"name": "get", "argu', '{"arguments": {}}', '"just text"', "[1]"])
    def test_an_unreadable_call_is_given_back_as_written(self, text: str):
        """Nothing the model wrote is dropped: what the parser cannot read (or
        names no function) is text, markers and all."""
        assert JSON_TOOLS.calls(Inside(text), []) == "<tool_call>" + text + "</tool_call>"

    #: A call of ``get`` with ``x`` = 1, as each family writes it between its markers.
    FAMILIES = {
        "json_tools": '{"name": "get", "arguments": {"x": 1}}',
        "mistral": 'get[ARGS]{"x": 1}',
        "pythonic": "[get(x=1)]",
        "qwen3_coder": "<function=get>\n<parameter=x>\n1\n</parameter>\n</function>",
        "glm47": "get\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n",
        "function_gemma": "call:get{x:1}",
        "kimi_k2": '<|tool_call_begin|>functions.get:0<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|>',
    }

    @pytest.mark.parametrize("family", sorted(FAMILIES))
    def test_every_familys_parser_gives_an_openai_call(self, family: str):
        """mlx-lm's parsers answer in their own shapes (a mapping or a list,
        arguments parsed or as text, an id or none); each becomes an OpenAI
        call with JSON text for its arguments and an id."""
        import importlib

        module = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
        syntax = ToolSyntax(start=module.tool_call_start, end=module.tool_call_end, parse=module.parse_tool_call)
        tools = [{"type": "function", "function": {"name": "get", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}}}}]  # fmt: skip
        (call,) = syntax.calls(Inside(self.FAMILIES[family]), tools)
        assert call.name == "get" and json.loads(call.arguments) == {"x": 1} and call.id

    def test_a_parser_that_fails_otherwise_leaves_text(self):
        """Whatever a parser raises on text it cannot read (an IndexError, say), the call is text."""
        syntax = ToolSyntax(start="<c>", end="</c>", parse=lambda text, tools: [][0])
        assert syntax.calls(Inside("x"), []) == "<c>x</c>"

    def test_of_a_tokenizer(self, tool_chat_template, chat_template):
        """mlx-lm infers the syntax from the template (json_tools here); the
        built-in model's template takes no tools."""
        syntax = tool_chat_template.tool_syntax
        assert (syntax.start, syntax.end) == ("<tool_call>", "</tool_call>")
        assert chat_template.tool_syntax is None


THINK = ReasoningSyntax(start="<think>", end="</think>")


async def _answer(
    texts: list[str], finish_reason: str, stops: tuple[str, ...] = (), *, prompt: str = "",
    reading: Reading = Reading(calls=JSON_TOOLS),
) -> tuple[list[Any], Answer]:  # fmt: skip
    generated = tokens(*texts)
    generation = Scripted([*generated, report(generated, finish_reason)])
    answer = Answer(0, Prompt(tokens=(1,), text=prompt), generation, stops, lambda: None, reading)  # type: ignore[arg-type]
    return [piece async for piece in answer.pieces()], answer


class TestAnswerWithCalls:
    async def test_text_and_calls_in_order_every_token_logged(self):
        texts = [
            "Sure. <tool", '_call>{"name": "a", ', '"arguments": {}}</tool_call><tool_call>{"name": "b"}', "</tool_call>"
        ]
        pieces, answer = await _answer(texts, "stop")
        assert [(p.text, [c.name for c in p.calls], p.first_call) for p in pieces] == [
            ("Sure. ", [], 0), ("", ["a"], 0), ("", ["b"], 1),
        ]  # fmt: skip
        assert [t.record.token for p in pieces for t in p.tokens] == [100, 101, 102, 103]
        assert answer.finish_reason == "tool_calls" and [c.name for c in answer.calls] == ["a", "b"]

    async def test_cut_by_max_tokens_a_call_is_text(self):
        pieces, answer = await _answer(["ok <tool_call>", '{"name": "a", "argu'], "length")
        assert "".join(p.text for p in pieces) == 'ok <tool_call>{"name": "a", "argu'
        assert answer.calls == [] and answer.finish_reason == "length"

    async def test_a_stop_string_after_a_call(self):
        """A stop string ends the answer: a call before it counts, text after it is cut."""
        pieces, answer = await _answer(['<tool_call>{"name": "a"}</tool_call> END', " more"], "length", ("END",))
        assert [p.text for p in pieces] == ["", " "] and answer.finish_reason == "tool_calls"

    async def test_one_call_ends_the_answer(self):
        """``parallel_tool_calls: false``: the answer ends at its first call
        (the first of a block of several); what follows is not read, the
        generation is closed there, and no token after it is counted."""
        texts = ['a<tool_call>[{"name": "x"}, {"name": "y"}]</tool_call> b', '<tool_call>{"name": "z"}</tool_call>']
        generated = tokens(*texts)
        generation = Scripted([*generated, report(generated, "stop")])
        mistral_like = ToolSyntax(start="<tool_call>", end="</tool_call>", parse=mistral.parse_tool_call)
        answer = Answer(
            0, Prompt(tokens=(1,)), generation, (), lambda: None,  # type: ignore[arg-type]
            Reading(calls=mistral_like, one_call=True),
        )  # fmt: skip
        pieces = [piece async for piece in answer.pieces()]
        assert [(p.text, [c.name for c in p.calls]) for p in pieces] == [("a", []), ("", ["x"])]
        assert answer.finish_reason == "tool_calls" and answer.num_tokens == 1 and not answer.complete
        assert await generation.__anext__() is generated[1]  # never read

    async def test_no_calls_is_plain_text(self):
        pieces, answer = await _answer(["a", "b <", "x"], "stop")
        assert "".join(p.text for p in pieces) == "ab <x" and answer.finish_reason == "stop"


class TestAnswerWithReasoning:
    async def test_reasoning_streams_apart_then_text_and_calls(self):
        """Reasoning comes out as it is written, apart; a call inside it is
        reasoning, not a call; after it, text and calls as without it."""
        texts = ["<thi", "nk>hmm <tool_call>{}", "</tool_call></th", "ink>Yes.", ' <tool_call>{"name": "a"}</tool_call>']
        pieces, answer = await _answer(texts, "stop", reading=Reading(reasoning=THINK, calls=JSON_TOOLS))
        assert [(p.reasoning, p.text, [c.name for c in p.calls]) for p in pieces] == [
            ("hmm <tool_call>{}", "", []), ("</tool_call>", "", []), ("", "Yes.", []), ("", " ", []), ("", "", ["a"]),
        ]  # fmt: skip
        assert [t.record.token for p in pieces for t in p.tokens] == [100, 101, 102, 103, 104]
        assert answer.finish_reason == "tool_calls"

    async def test_a_prompt_that_opened_the_block(self):
        """The template opened the reasoning (the prompt ends inside it): the
        answer begins in it; one cut short by max_tokens stays reasoning."""
        pieces, _ = await _answer(["so", "</think>ok"], "stop", prompt="user: q <think>\n", reading=Reading(reasoning=THINK))
        assert [(p.reasoning, p.text) for p in pieces] == [("so", ""), ("", "ok")]
        pieces, _ = await _answer(["so", " far"], "length", prompt="<think>", reading=Reading(reasoning=THINK))
        assert "".join(p.reasoning for p in pieces) == "so far" and not any(p.text for p in pieces)
        closed = "<think>a</think> user: q"  # a block of an earlier turn, closed: the answer begins outside
        pieces, _ = await _answer(["so"], "stop", prompt=closed, reading=Reading(reasoning=THINK))
        assert [(p.reasoning, p.text) for p in pieces] == [("", "so")]

    async def test_left_out_its_tokens_still_logged(self):
        """``include_reasoning: false`` sends no reasoning; its tokens'
        log-probabilities still come out (with the next piece)."""
        reading = Reading(reasoning=THINK, include_reasoning=False)
        pieces, _ = await _answer(["<think>x", "y</think>", "z"], "stop", reading=reading)
        assert [(p.reasoning, p.text) for p in pieces] == [("", "z")]
        assert [t.record.token for p in pieces for t in p.tokens] == [100, 101, 102]

    def test_of_a_tokenizer(self, tmp_path, chat_template):
        """mlx-lm knows a model reasons from its vocabulary (``<think>`` and
        ``</think>`` tokens); the built-in model does not."""
        from tokenizers import Tokenizer, models

        from mlxkv.server.chat import ChatTemplate

        tokenizer = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
        tokenizer.add_special_tokens(["<think>", "</think>"])
        tokenizer.save(str(tmp_path / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{{ messages[0]['content'] }}"}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        assert ChatTemplate.load(str(tmp_path)).reasoning_syntax == THINK
        assert chat_template.reasoning_syntax is None


def test_a_calls_key_ignores_its_id_and_spacing():
    """A conversation is remembered under its calls' names and arguments as
    canonical JSON: a client that sends them back spaced otherwise, or with
    another id, finds it; other arguments do not."""
    ours = ToolCall(id="call_1", name="get", arguments='{"city": "Paris", "days": 2}')
    assert ours.key() == ToolCall(id="x", name="get", arguments='{"days":2,"city":"Paris"}').key()
    assert ours.key() != ToolCall(id="call_1", name="get", arguments='{"city": "Rome", "days": 2}').key()
    assert ToolCall(id=None, name="f", arguments="not json").key() == "f\x00not json"
