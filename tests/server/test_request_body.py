"""The request bodies' checks: every field typed, ranged and known, or InvalidInput naming it."""

from __future__ import annotations

from typing import Any

import pytest

from mlxkv import InvalidInput
from mlxkv.server.request import ChatMessage, parse_chat, parse_completion, parse_json

from tool_cases import WEATHER as _TOOL


def refused(parse: Any, body: dict[str, Any], **kwargs: Any) -> InvalidInput:
    with pytest.raises(InvalidInput) as caught:
        parse(body, **kwargs)
    return caught.value


class TestCompletionBody:
    """``/v1/completions`` bodies."""

    def test_defaults_are_openai_s(self):
        """Temperature 1, top_p 1, no stop, not streamed; token ids become a tuple."""
        request = parse_completion({"model": "m", "prompt": [1, 2, 3]})
        assert request.prompts == ((1, 2, 3),)
        options = request.options
        assert (options.temperature, options.top_p, options.max_tokens, options.stop) == (
            1.0,
            1.0,
            None,
            (),
        )
        assert not options.stream and not options.include_usage

    def test_a_batch_of_prompts_is_read_in_order(self):
        """Strings, or lists of token ids; one in a list is one prompt."""
        assert parse_completion({"prompt": ["a", "b"]}).prompts == ("a", "b")
        assert parse_completion({"prompt": [[1, 2], [3]]}).prompts == ((1, 2), (3,))
        assert parse_completion({"prompt": [[1, 2]]}).prompts == ((1, 2),)
        assert parse_completion({"prompt": ["a", [3]]}).prompts == ("a", (3,))

    def test_fields_are_read(self):
        """Sampling, stop, streaming with usage and the extensions are taken."""
        options = parse_completion(
            {"prompt": ["one"], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x",
             "stream": True, "stream_options": {"include_usage": True}, "cache_salt": "s", "top_k": 4,
             "min_p": 0.1, "n": 1, "user": "u", "presence_penalty": 0, "logprobs": None}
        ).options  # fmt: skip
        assert (options.max_tokens, options.temperature, options.top_p, options.seed) == (
            5,
            0.0,
            0.5,
            3,
        )
        assert options.stop == ("x",) and options.stream and options.include_usage
        assert (options.cache_salt, options.top_k, options.min_p) == ("s", 4, 0.1)

    @pytest.mark.parametrize(
        ("body", "argument"),
        [
            ({}, "prompt"),
            ({"prompt": ""}, "prompt"),
            ({"prompt": ["a", ""]}, "prompt[1]"),
            ({"prompt": []}, "prompt"),
            ({"prompt": ["a", 5]}, "prompt"),
            ({"prompt": [1, True]}, "prompt"),
            ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
            ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
            ({"prompt": "x", "temperature": 2.5}, "temperature"),
            ({"prompt": "x", "temperature": "0"}, "temperature"),
            ({"prompt": "x", "top_p": float("nan")}, "top_p"),
            ({"prompt": "x", "seed": 1.0}, "seed"),
            ({"prompt": "x", "stop": ["a", ""]}, "stop"),
            ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
            ({"prompt": "x", "stream": "yes"}, "stream"),
            ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
            ({"prompt": "x", "n": 0}, "n"),
            ({"prompt": "x", "n": 1.5}, "n"),
            ({"prompt": "x", "echo": "yes"}, "echo"),
            ({"prompt": "x", "logprobs": -1}, "logprobs"),
            ({"prompt": "x", "logprobs": 21}, "logprobs"),
            ({"prompt": "x", "logprobs": True}, "logprobs"),
            ({"prompt": "x", "cache_salt": 5}, "cache_salt"),
            ({"prompt": "x", "model": 5}, "model"),
            ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ],
    )
    def test_bad_fields_are_named(self, body: dict[str, Any], argument: str):
        """Each bad field is refused, named as the error's argument."""
        assert refused(parse_completion, body).argument == argument


class TestChatBody:
    """``/v1/chat/completions`` bodies."""

    def test_messages_for_the_template(self):
        """Roles (developer is system), text parts joined, max_completion_tokens first."""
        request = parse_chat(
            {"messages": [{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
             "max_tokens": 9, "max_completion_tokens": 7},
            takes_images=False,
        )  # fmt: skip
        assert request.messages == (
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content="a\nb"),
        )
        assert request.options.max_tokens == 7 and request.images == ()

    def test_images_become_parts_in_order(self):
        """On a vision-language model, image parts keep their place; data URLs are collected in order."""
        parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                 {"type": "text", "text": "and"}, {"type": "image_url", "image_url": "data:image/png;base64,BB"}]  # fmt: skip
        request = parse_chat({"messages": [{"role": "user", "content": parts}]}, takes_images=True)
        assert request.images == ("data:image/png;base64,AA", "data:image/png;base64,BB")
        assert request.messages[0].for_template()["content"] == [
            {"type": "image"},
            {"type": "text", "text": "and"},
            {"type": "image"},
        ]
        assert request.messages[0].text() == "and"

    @pytest.mark.parametrize(
        ("messages", "argument", "takes_images"),
        [
            ([], "messages", False),
            (["hi"], "messages[0]", False),
            ([{"role": "robot", "content": "x"}], "messages[0].role", False),
            ([{"role": "user", "content": 3}], "messages[0].content", False),
            ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls", False),
            ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0]", False),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], "messages[0].content[0].image_url", False),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], "messages[0].content[0].image_url.url", True),
        ],
    )  # fmt: skip
    def test_bad_messages_are_named(self, messages: Any, argument: str, takes_images: bool):
        """A bad message or part is refused, named by its place; no URL but data: is taken."""
        assert (
            refused(parse_chat, {"messages": messages}, takes_images=takes_images).argument
            == argument
        )

    def test_penalties_and_a_bias_are_read(self):
        """OpenAI's penalties and ``logit_bias`` (ids as strings), vLLM's
        ``repetition_penalty``; out of range or malformed: refused by name."""
        body = {"messages": [{"role": "user", "content": "x"}]}
        penalties = parse_chat(
            {**body, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
             "logit_bias": {"7": 5, "3": -100}},
            takes_images=False,
        ).options.penalties  # fmt: skip
        assert (penalties.presence_penalty, penalties.frequency_penalty, penalties.repetition_penalty) == (0.5, -1, 1.2)
        assert penalties.logit_bias == ((3, -100.0), (7, 5.0))
        assert not parse_completion({"prompt": "x", "presence_penalty": 0, "logit_bias": {}}).options.penalties.active
        for bad, argument in (
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"frequency_penalty": "1"}, "frequency_penalty"),
            ({"repetition_penalty": 0}, "repetition_penalty"),
            ({"logit_bias": {"x": 1}}, "logit_bias"),
            ({"logit_bias": {"-1": 1}}, "logit_bias"),
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"logit_bias": {"5": "1"}}, "logit_bias"),
            ({"logit_bias": [5]}, "logit_bias"),
        ):
            assert refused(parse_chat, {**body, **bad}, takes_images=False).argument == argument
            assert refused(parse_completion, {"prompt": "x", **bad}).argument == argument

    def test_log_probabilities_are_read(self):
        """``logprobs`` (completions: how many alternatives; chat: whether,
        with ``top_logprobs`` for how many) become the options' ``logprobs``."""
        assert parse_completion({"prompt": "x"}).options.logprobs is None
        assert parse_completion({"prompt": "x", "logprobs": 0}).options.logprobs == 0
        assert parse_completion({"prompt": "x", "logprobs": 20}).options.logprobs == 20
        body = {"messages": [{"role": "user", "content": "x"}]}
        assert parse_chat(body, takes_images=False).options.logprobs is None
        assert parse_chat({**body, "logprobs": False}, takes_images=False).options.logprobs is None
        assert parse_chat({**body, "logprobs": True}, takes_images=False).options.logprobs == 0
        assert parse_chat({**body, "logprobs": True, "top_logprobs": 3}, takes_images=False).options.logprobs == 3
        for bad, argument in (
            ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
            ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
            ({"logprobs": 1}, "logprobs"),
        ):
            assert refused(parse_chat, {**body, **bad}, takes_images=False).argument == argument

    def test_unsupported_features_are_refused(self):
        """Tools (on a model that calls none), a forced call of no tool, and a
        JSON response format with tools read are refused, not ignored."""  # parallel_tool_calls: false is honoured
        body = {"messages": [{"role": "user", "content": "x"}]}
        assert refused(parse_chat, {**body, "tools": [_TOOL]}, takes_images=False).argument == "tools"
        for bad, argument in (
            ({"tool_choice": "any"}, "tool_choice"),
            ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice.function.name"),
            ({"tool_choice": {"type": "function", "function": {"name": "get_weather", "x": 1}}}, "tool_choice"),
            ({"tool_choice": {"type": "tool", "function": {"name": "get_weather"}}}, "tool_choice"),
            ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ):
            with_tools = {**body, "tools": [_TOOL], **bad}
            assert refused(parse_chat, with_tools, takes_images=False, takes_tools=True).argument == argument
        assert parse_chat({**body, "response_format": {"type": "text"}}, takes_images=False).options.json_schema is None
        json_mode = {**body, "response_format": {"type": "json_object"}}
        assert parse_chat(json_mode, takes_images=False).options.json_schema == {"type": "object"}
        with_tools = {**json_mode, "tools": [_TOOL]}
        assert refused(parse_chat, with_tools, takes_images=False, takes_tools=True).argument == "response_format"
        assert parse_chat({**with_tools, "tool_choice": "none"}, takes_images=False, takes_tools=True)
        forced = {**with_tools, "tool_choice": "required"}
        assert refused(parse_chat, forced, takes_images=False, takes_tools=True).argument == "response_format"

    def test_a_call_is_forced_by_tool_choice(self):
        """``required``: a call of any tool; a function: of that one; each reads
        the one call."""
        other = {"type": "function", "function": {"name": "get_time"}}
        body = {"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL, other]}
        required = parse_chat({**body, "tool_choice": "required"}, takes_images=False, takes_tools=True)
        assert required.forced_call == ("get_weather", "get_time") and required.read_calls and required.one_call
        named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
        assert parse_chat(named, takes_images=False, takes_tools=True).forced_call == ("get_time",)
        assert parse_chat(body, takes_images=False, takes_tools=True).forced_call == ()
        no_tools = {**body, "tools": [], "tool_choice": "required"}
        assert refused(parse_chat, no_tools, takes_images=False, takes_tools=True).argument == "tool_choice"

    def test_response_formats(self):
        """``json_schema`` gives its schema (any value without one); anything
        else is refused naming the part at fault."""
        body = {"messages": [{"role": "user", "content": "x"}]}
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        given = {"type": "json_schema", "json_schema": {"name": "a_b-1", "schema": schema, "strict": True}}
        assert parse_chat({**body, "response_format": given}, takes_images=False).options.json_schema == schema
        bare = {"type": "json_schema", "json_schema": {"name": "x"}}
        assert parse_chat({**body, "response_format": bare}, takes_images=False).options.json_schema == {}
        assert parse_completion({"prompt": "x", "response_format": given}).options.json_schema == schema
        for bad, argument in (
            ({"type": "xml"}, "response_format"),
            ({"type": "json_object", "schema": {}}, "response_format"),
            ({"type": "json_schema"}, "response_format"),
            ({"type": "json_schema", "json_schema": {"name": "x", "other": 1}}, "response_format.json_schema"),
            ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
            ({"type": "json_schema", "json_schema": {"name": "a b"}}, "response_format.json_schema.name"),
            ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}, "response_format.json_schema.strict"),  # noqa: E501
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),  # noqa: E501
            ("json", "response_format"),
        ):
            assert refused(parse_chat, {**body, "response_format": bad}, takes_images=False).argument == argument

    def test_tools_and_calls_are_read(self):
        """Tools are kept as the template takes them; ``tool_choice`` says
        whether calls are read; an assistant's calls and a tool's answer
        reach the template in its shape (arguments that are a JSON object as
        the object)."""
        conversation = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]  # fmt: skip
        request = parse_chat({"messages": conversation, "tools": [_TOOL]}, takes_images=False, takes_tools=True)
        assert request.tools == (_TOOL,) and request.read_calls and not request.one_call
        one = parse_chat(
            {"messages": conversation, "tools": [_TOOL], "parallel_tool_calls": False}, takes_images=False, takes_tools=True
        )
        assert one.one_call
        assistant, tool = request.messages[1:]
        assert assistant.for_template() == {
            "role": "assistant", "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        }  # fmt: skip
        assert tool.for_template() == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
        none = parse_chat(
            {"messages": conversation, "tools": [_TOOL], "tool_choice": "none"}, takes_images=False, takes_tools=True
        )
        assert none.tools == (_TOOL,) and not none.read_calls  # offered (the same prompt), not read
        assert not parse_chat({"messages": conversation}, takes_images=False).read_calls  # a model without tools
        assert parse_chat({"messages": conversation, "tools": []}, takes_images=False).tools == ()

    def test_reasoning_sent_back_reaches_the_template(self):
        """An assistant's reasoning, sent back under either name clients use,
        reaches the template as ``reasoning_content`` (and ``reasoning``);
        with it, the content may be null."""
        for name in ("reasoning", "reasoning_content"):
            body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, name: "hm"}]}
            (_, answer) = parse_chat(body, takes_images=False).messages
            assert answer.for_template() == {"role": "assistant", "content": "", "reasoning_content": "hm", "reasoning": "hm"}
        same = {"role": "assistant", "content": "a", "reasoning": "hm", "reasoning_content": "hm"}
        assert parse_chat({"messages": [same]}, takes_images=False).messages[0].reasoning == "hm"

    @pytest.mark.parametrize(
        ("body", "argument"),
        [
            ({"messages": [{"role": "assistant", "content": "a", "reasoning": "x", "reasoning_content": "y"}]},
             "messages[0].reasoning_content"),
            ({"messages": [{"role": "assistant", "content": "a", "reasoning": 3}]}, "messages[0].reasoning"),
            ({"messages": [{"role": "user", "content": "a", "reasoning": "x"}]}, "messages[0].reasoning"),
            ({"tools": {"type": "function"}}, "tools"),
            ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
            ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
            ({"tools": [{"type": "function", "function": {"name": "f", "exec": 1}}]}, "tools[0].function.exec"),
            ({"tools": [_TOOL, _TOOL]}, "tools[1].function.name"),
            ({"tools": [_TOOL] * 129}, "tools"),
            ({"tool_choice": "auto"}, "tool_choice"),  # with no tools
            ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}]},
             "messages[0].tool_calls[0].function"),  # arguments must be JSON text
            ({"messages": [{"role": "assistant", "tool_calls": "f"}]}, "messages[0].tool_calls"),
            ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),  # no calls: content needed
            ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
            ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
            ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
            ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
            ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs.not a name"),
            ({"chat_template_kwargs": {f"v{i}": 1 for i in range(33)}}, "chat_template_kwargs"),
        ],
    )  # fmt: skip
    def test_bad_tools_and_calls_are_named(self, body: dict[str, Any], argument: str):
        full = {"messages": [{"role": "user", "content": "x"}], **body}
        assert refused(parse_chat, full, takes_images=False, takes_tools=True).argument == argument

    #: What vllm-router 0.1.17 adds to every request it forwards.
    ROUTER_FIELDS = {
        "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
        "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
        "return_hidden_states": False, "include_reasoning": True,
    }  # fmt: skip

    def test_a_routers_extension_fields_are_taken_at_this_servers_behaviour(self):
        """A router's added fields pass where their value is what the server
        does; a value that would change the answer is refused, named."""
        body = {"messages": [{"role": "user", "content": "x"}], **self.ROUTER_FIELDS}
        assert parse_chat(body, takes_images=False).messages
        assert parse_completion({"prompt": "x", **self.ROUTER_FIELDS}).prompts == ("x",)
        options = parse_chat({**body, "include_reasoning": False, "stream_reasoning": False}, takes_images=False).options
        assert (options.separate_reasoning, options.include_reasoning, options.stream_reasoning) == (True, False, False)
        assert parse_chat(body, takes_images=False).options.include_reasoning  # the switches' defaults: true
        for name, changed in (("ignore_eos", True), ("skip_special_tokens", False), ("no_stop_trim", True)):
            assert refused(parse_chat, {**body, name: changed}, takes_images=False).argument == name
        assert refused(parse_chat, {**body, "stream_reasoning": "yes"}, takes_images=False).argument == "stream_reasoning"


class TestJson:
    """The raw body."""

    def test_not_json_or_not_an_object(self):
        """Bytes that are not JSON, or JSON that is not an object, are refused as the body."""
        assert refused(parse_json, b"{nope").argument == "body"
        assert refused(parse_json, b"[1]").argument == "body"
        assert refused(parse_json, b"\xff").argument == "body"
        assert parse_json(b'{"a": 1}') == {"a": 1}

    def test_too_many_items_are_refused_before_parsing(self):
        """A body of more items than :data:`MAX_ITEMS` (each a Python object
        once parsed: ``[],`` is 3 bytes and 64 parsed) is refused as the body;
        commas inside strings (escaped quotes too) are not items."""
        from mlxkv.server.request import MAX_ITEMS

        lists = b'{"prompt": [' + b"[]," * MAX_ITEMS + b"[]]}"
        caught = refused(parse_json, lists)
        assert caught.argument == "body" and "more than 2097152 items" in str(caught)
        text = b'{"prompt": "' + b'a,\\",' * MAX_ITEMS + b'", "n": [' + b"1," * 9 + b"1]}"
        assert len(parse_json(text)["n"]) == 10
        ids = b'{"prompt": [' + b"7," * (MAX_ITEMS - 1) + b"7]}"
        assert len(parse_json(ids)["prompt"]) == MAX_ITEMS
