"""The bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``, checked.

:func:`parse_completion` and :func:`parse_chat` turn a decoded JSON body
into a frozen record or raise :class:`~mlxkv.InvalidInput` naming the field
(the server answers 400 with its message). Everything is checked before
anything is sent to the runtime: the JSON types, the ranges the OpenAI API
gives (a completion's prompt: one, or a batch), fields this server cannot
honour at other than their default (``best_of``, ``suffix``, a forced tool
call...), and fields it does not know. Values the
runtime checks itself (a token id past the vocabulary, a prompt past the
context) are left to it.

Beyond the OpenAI fields, both take vLLM's extensions ``cache_salt``,
``top_k``, ``min_p`` and ``repetition_penalty``, and the SGLang/vLLM extension fields that routers
add to every request they forward (vllm-router, sglang-router) where their
value is what this server does anyway: ``ignore_eos``, ``no_stop_trim``,
``continue_final_message`` and ``return_hidden_states`` false,
``skip_special_tokens`` true; and SGLang's reasoning switches
(``separate_reasoning``, ``stream_reasoning``, ``include_reasoning``), which
a chat answer honours where its model reasons (a completion is text as
written, whatever they say).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import attrs

from mlxkv.actors.penalties import NO_PENALTIES, Penalties
from mlxkv.actors.token_logprobs import MAX_TOP_LOGPROBS
from mlxkv.cache.errors import Shown
from mlxkv.errors import InvalidInput
from mlxkv.json_output import JSON_OBJECT, JsonText

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "Options",
    "ToolCall",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_json",
    "parse_tokenize",
    "template_variables",
]

#: The most stop strings (as OpenAI), and the longest one.
MAX_STOPS, MAX_STOP_LENGTH = 4, 256

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
#: The most tools a request may offer, and a function name's form (OpenAI's).
MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: What ``tool_choice`` may be: offer the tools and read the calls, or offer them and read none.
_TOOL_CHOICES = ("auto", "none")


@attrs.frozen(kw_only=True)
class Options:
    """What both endpoints take besides the prompt.

    Attributes:
        model: the model asked for, or None (the served one).
        max_tokens: the most tokens to generate, or None (the endpoint's default).
        temperature: 0 for greedy decoding (OpenAI's default is 1).
        top_p: nucleus sampling (1: off).
        top_k: sample among the ``k`` most likely tokens (0: off).
        min_p: drop tokens below ``min_p`` times the top probability.
        seed: makes sampling reproducible.
        stop: strings that end the answer (not included in it).
        stream: answer with server-sent events.
        include_usage: with ``stream``, end with a chunk carrying the usage.
        cache_salt: the request's own cache namespace (within its API key's).
        n: how many answers (choices) to generate from the prompt; the
            server bounds it (``--max-choices``).
        logprobs: give each generated token's log-probability and this many
            alternatives (completions' ``logprobs``; chat's ``top_logprobs``
            with ``logprobs: true``), or None: none.
        penalties: ``presence_penalty``, ``frequency_penalty``,
            ``repetition_penalty`` and ``logit_bias`` (its keys token ids
            written as strings, as JSON must).
        echo: (completions) the answer begins with the prompt; with
            ``logprobs``, so do its entries (the first token's has none).
        separate_reasoning: (chat, on a model that reasons) send the
            reasoning apart from the content (else it stays in the content,
            markers and all).
        include_reasoning: send the reasoning at all (false: only the content).
        stream_reasoning: stream the reasoning as it is written (false: in
            one delta, once its block ends).
        json_schema: the schema the answer's text is held to (OpenAI's
            ``response_format``: ``json_object`` is any JSON object,
            ``json_schema`` its ``schema``; a forced tool call's), or None: free text.
        json_text: where the JSON value sits in the answer's text (a forced
            call's markers around it).
    """

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    cache_salt: Optional[str] = None
    n: int = 1
    logprobs: Optional[int] = None
    penalties: Penalties = NO_PENALTIES
    echo: bool = False
    separate_reasoning: bool = True
    include_reasoning: bool = True
    stream_reasoning: bool = True
    json_schema: Optional[Any] = None
    json_text: JsonText = JsonText()


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A checked ``/v1/completions`` body: its prompts (text or token ids each;
    a batch of several is answered as ``n`` choices each, in order), and the
    options."""

    prompts: tuple[Union[str, tuple[int, ...]], ...]
    options: Options


@attrs.frozen(kw_only=True)
class ToolCall:
    """A call of a function (OpenAI's shape): an answer's, or an assistant message's.

    Attributes:
        id: the handle the tool's result is sent back under (None where a
            message gave none).
        name: the function's.
        arguments: its arguments as JSON text (as the OpenAI API carries them).
    """

    id: Optional[str]
    name: str
    arguments: str

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates take it: arguments that are a JSON
        object as the object (templates write them with ``tojson``), others
        as the text."""
        try:
            arguments: Any = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        if not isinstance(arguments, dict):
            arguments = self.arguments
        call: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call

    def for_response(self, index: Optional[int] = None) -> dict[str, Any]:
        """The call in a response (with its ``index`` among the answer's calls in a streamed chunk)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}

    def key(self) -> str:
        """The call as a conversation is remembered by: its name and its
        arguments as canonical JSON (a client may send them back spaced
        otherwise), not its id."""
        try:
            arguments = json.dumps(json.loads(self.arguments), sort_keys=True, separators=(",", ":"))
        except ValueError:
            arguments = self.arguments
        return f"{self.name}\x00{arguments}"


def answer_key(text: str, calls: Sequence[ToolCall]) -> str:
    """What an assistant's answer is remembered and found under: its text,
    then (where it called tools) each call's :meth:`ToolCall.key`."""
    return text + "".join(f"\x00{call.key()}" for call in calls)


@attrs.frozen(kw_only=True)
class ChatMessage:
    """One message as the chat template takes it.

    Attributes:
        role: ``system``, ``user``, ``assistant`` or ``tool`` (``developer``
            is ``system``).
        content: a string, or (on a vision-language model, when the message
            has images) a tuple of ``{"type": "text", "text": ...}`` and
            ``{"type": "image"}`` parts.
        tool_calls: an assistant message's calls of the request's tools.
        tool_call_id: a ``tool`` message's: the call it answers.
        reasoning: an assistant message's reasoning, sent back; the template
            gets it as ``reasoning_content`` (what Qwen3's and GLM's read) and
            as ``reasoning``.
    """

    role: str
    content: Union[str, tuple[Mapping[str, str], ...]]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: Optional[str] = None
    reasoning: Optional[str] = None

    def text(self) -> str:
        """The message's text, its parts' texts joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content)

    def answer_key(self) -> str:
        """What an assistant message is found under in the conversation memory
        (:func:`answer_key`: its text and its calls)."""
        return answer_key(self.text(), self.tool_calls)

    def for_template(self) -> dict[str, Any]:
        """The message as ``apply_chat_template`` takes it."""
        content = self.content if isinstance(self.content, str) else [dict(p) for p in self.content]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = self.reasoning
        return message


@attrs.frozen(kw_only=True)
class ChatRequest:
    """A checked ``/v1/chat/completions`` body.

    Attributes:
        messages: the conversation.
        images: the ``data:`` URLs of its images, in order of appearance.
        options: the options.
        tools: the functions the model is offered (OpenAI's ``tools``, each
            ``{"type": "function", "function": {...}}``), as the template takes them.
        read_calls: whether the answer's tool calls are read out of its text
            (``tool_choice`` ``auto``, with tools); with ``none`` the tools
            are still offered (the prompt, and what is cached of it, is the
            same) and the answer is all text.
        one_call: ``parallel_tool_calls: false``: the answer ends with its
            first call (the first of a block that holds several).
        template_kwargs: variables for the chat template (vLLM's and
            ``mlx_lm.server``'s ``chat_template_kwargs``: Qwen3's
            ``enable_thinking``, say).
        forced_call: (``tool_choice`` ``required`` or a function) the names
            the answer's one call may have: the answer is held to that call
            (decoding constrained to it); empty: not forced.
    """

    messages: tuple[ChatMessage, ...]
    images: tuple[str, ...]
    options: Options
    tools: tuple[Mapping[str, Any], ...] = ()
    read_calls: bool = False
    one_call: bool = False
    template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    forced_call: tuple[str, ...] = ()


def parse_json(raw: Union[bytes, bytearray]) -> dict[str, Any]:
    """The body as a JSON object, every string of it valid Unicode.

    The body must be UTF-8 (RFC 8259; no other encoding is guessed), nested
    at most :data:`MAX_DEPTH` deep, with at most :data:`MAX_ITEMS` items in
    its arrays and objects together (counted before it is parsed: parsed,
    each item is a Python object, 25 times the bytes of ``[],`` an item),
    with no lone surrogate (``"\\ud800"``,
    which no UTF-8 text can hold) in a string or a field name. An integer of
    more than :data:`MAX_INT_DIGITS` digits is read as a float (infinite), so
    the field that holds one is refused by name as not an integer.

    Raises:
        InvalidInput: not UTF-8, not JSON, not an object, too deep, too many
            items, or a string with a lone surrogate (naming where).
    """
    if len(raw) > 2 * MAX_ITEMS:  # a smaller body cannot hold more (an item takes two bytes)
        items = _STRING.sub(b'""', raw).count(b",") + 1
        if items > MAX_ITEMS:
            raise InvalidInput(
                "body", Shown(f"<{len(raw)} bytes>"), f"holds more than {MAX_ITEMS} items in its arrays and objects"
            )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidInput(
            "body", Shown(f"<{len(raw)} bytes>"), f"is not UTF-8 (byte {error.start} is not)"
        ) from None
    try:
        body = json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise InvalidInput("body", Shown(f"<{len(raw)} bytes>"), f"is nested more than {MAX_DEPTH} deep") from None
    except ValueError as error:
        where = f"line {error.lineno} column {error.colno}" if isinstance(error, json.JSONDecodeError) else "it"
        raise InvalidInput("body", Shown(f"<{len(raw)} bytes>"), f"is not JSON (at {where})") from None
    if not isinstance(body, dict):
        raise InvalidInput("body", body, "must be a JSON object")
    _check_strings(body, "body", 0)
    return body


#: How deep a request body may nest (an OpenAI body nests 6 deep at most).
MAX_DEPTH = 32
#: The most items a body's arrays and objects may hold together: a batch of
#: 16 prompts of 128k token ids each fits.
MAX_ITEMS = 1 << 21
#: A JSON string (its escapes included), found in the raw body.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: The most digits an integer may have (a 64-bit seed has 20).
MAX_INT_DIGITS = 40
_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_int(digits: str) -> Union[int, float]:
    return int(digits) if len(digits) <= MAX_INT_DIGITS else float("inf")


def _check_strings(value: Any, where: str, depth: int) -> None:
    """Refuse a value nested past :data:`MAX_DEPTH`, or holding a lone surrogate."""
    if depth > MAX_DEPTH:
        field = re.split(r"[.\[]", where, maxsplit=1)[0]
        raise InvalidInput(_printable(field), Shown("<...>"), f"is nested more than {MAX_DEPTH} deep")
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise InvalidInput(where, Shown("<text>"), "holds a lone surrogate: not valid Unicode")
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where != "body" else key
            if _SURROGATE.search(key):
                raise InvalidInput(
                    _printable(path), Shown("<field name>"), "holds a lone surrogate: not valid Unicode"
                )
            _check_strings(item, path, depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_strings(item, f"{where}[{index}]", depth + 1)


def _printable(text: str) -> str:
    """``text`` with lone surrogates written as escapes (``\\ud800``)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_completion(body: Mapping[str, Any]) -> CompletionRequest:
    """Check a ``/v1/completions`` body.

    Raises:
        InvalidInput: naming the first field at fault.
    """
    fields = _Fields(body)
    prompts = _prompts(fields.take("prompt", required=True))
    echo = _bool("echo", fields.take("echo"), default=False)
    fields.default_only("suffix", None)
    fields.default_only("best_of", 1)
    logprobs = _int("logprobs", fields.take("logprobs"), minimum=0, maximum=MAX_TOP_LOGPROBS)
    options = attrs.evolve(_options(fields, max_tokens=fields.take("max_tokens")), logprobs=logprobs, echo=echo)
    fields.finish()
    return CompletionRequest(prompts=prompts, options=options)


def parse_chat(body: Mapping[str, Any], *, takes_images: bool, takes_tools: bool = False) -> ChatRequest:
    """Check a ``/v1/chat/completions`` body.

    Args:
        body: the decoded JSON.
        takes_images: whether the model sees images (else an image part is refused).
        takes_tools: whether the model calls tools (its chat template takes
            them and mlx-lm can read its calls; else ``tools`` is refused).

    Raises:
        InvalidInput: naming the first field at fault.
    """
    fields = _Fields(body)
    messages, images = _messages(fields.take("messages", required=True), takes_images)
    wanted = _bool("logprobs", fields.take("logprobs"), default=False)
    top = _int("top_logprobs", fields.take("top_logprobs"), minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise InvalidInput("top_logprobs", top, "is only allowed with logprobs: true")
    tools = _tools(fields.take("tools"), takes_tools)
    template_kwargs = template_variables(fields.take("chat_template_kwargs"))
    choice, forced = _tool_choice(fields.take("tool_choice"), tools)
    parallel = _bool("parallel_tool_calls", fields.take("parallel_tool_calls"), default=True)
    max_tokens = fields.take("max_completion_tokens")
    legacy = fields.take("max_tokens")
    options = _options(fields, max_tokens=legacy if max_tokens is None else max_tokens)
    if wanted:
        options = attrs.evolve(options, logprobs=top or 0)
    if options.json_schema is not None and tools and choice != "none":
        raise InvalidInput(
            "response_format", Shown("<a JSON format>"), 'is not supported with tools (unless tool_choice is "none")'
        )
    fields.finish()
    return ChatRequest(
        messages=messages, images=images, options=options, tools=tools, read_calls=bool(tools) and choice != "none",
        one_call=not parallel or bool(forced), template_kwargs=template_kwargs, forced_call=forced,
    )  # fmt: skip


#: The template's own arguments, which ``chat_template_kwargs`` cannot set.
_TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "documents", "return_dict"})
#: The most variables ``chat_template_kwargs`` may set.
MAX_TEMPLATE_KWARGS = 32


def template_variables(value: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """Variables for the chat template (a request's ``chat_template_kwargs``,
    or the server's defaults, ``where`` naming them): an object of at most
    :data:`MAX_TEMPLATE_KWARGS`, none of them the template's own arguments
    (which the request's other fields set)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(where, value, "must be an object of template variables")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise InvalidInput(where, Shown(f"<{len(value)} keys>"), f"sets at most {MAX_TEMPLATE_KWARGS}")
    for name in value:
        if name in _TEMPLATE_ARGUMENTS or not name.isidentifier():
            raise InvalidInput(f"{where}.{name}", value[name], "is not a variable a request may set")
    return dict(value)


def _tools(value: Any, takes_tools: bool) -> tuple[Mapping[str, Any], ...]:
    """OpenAI's ``tools``: functions, each named, as the template takes them."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidInput("tools", value, 'must be a list of {"type": "function", "function": {...}}')
    if not value:
        return ()
    if not takes_tools:
        raise InvalidInput(
            "tools",
            Shown(f"<{len(value)} tools>"),
            "this model does not call tools (mlx-lm knows no tool syntax for it)",
        )
    if len(value) > MAX_TOOLS:
        raise InvalidInput("tools", Shown(f"<{len(value)} tools>"), f"at most {MAX_TOOLS} are taken")
    names = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise InvalidInput(where, tool, 'must be {"type": "function", "function": {...}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidInput(f"{where}.function", function, "must be an object with a name")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            name = sorted(unknown)[0]
            raise InvalidInput(f"{where}.function.{name}", function[name], "is not a field of a function")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise InvalidInput(
                f"{where}.function.name", name, "must be 1-64 letters, digits, underscores, dots or dashes"
            )
        if name in names:
            raise InvalidInput(f"{where}.function.name", name, "names another tool's function")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise InvalidInput(f"{where}.function.description", function["description"], "must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidInput(f"{where}.function.parameters", function["parameters"], "must be a JSON Schema object")
        _bool(f"{where}.function.strict", function.get("strict"), default=False)
    return tuple(value)


def _tool_choice(value: Any, tools: Sequence[Mapping[str, Any]]) -> tuple[str, tuple[str, ...]]:
    """``tool_choice``: ``auto`` (the default with tools), ``none``,
    ``required`` (a call of any of the tools) or ``{"type": "function",
    "function": {"name": ...}}`` (a call of that one): the choice (``forced``
    for the last two) and the names a forced call may have."""
    if value is None:
        return ("auto" if tools else "none"), ()
    if value in _TOOL_CHOICES or value == "required":
        if value != "none" and not tools:
            raise InvalidInput("tool_choice", value, "is only allowed with tools")
        if value == "required":
            return "forced", tuple(tool["function"]["name"] for tool in tools)
        return value, ()
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(function, dict) or set(value) != {"type", "function"} or set(function) != {"name"}:
        shapes = '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
        raise InvalidInput("tool_choice", value, f"must be {shapes}")
    if function["name"] not in {tool["function"]["name"] for tool in tools}:
        raise InvalidInput("tool_choice.function.name", function["name"], "names none of the tools")
    return "forced", (function["name"],)


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    """A checked ``/detokenize`` body (vLLM's): token ids to turn into text."""

    tokens: tuple[int, ...]
    model: Optional[str] = None


def parse_tokenize(
    body: Mapping[str, Any], *, takes_images: bool, takes_tools: bool = False
) -> Union[ChatRequest, CompletionRequest]:
    """Check a ``/tokenize`` body (vLLM's): a chat (``messages``, as
    ``/v1/chat/completions`` takes them) or one completion ``prompt``, to be
    answered with the tokens this server would run. vLLM's switches are
    taken at what the server runs: ``add_special_tokens`` (true for a
    prompt, false for a chat: the template writes its own),
    ``add_generation_prompt`` true, ``return_token_strs`` false.

    Raises:
        InvalidInput: naming the first field at fault.
    """
    chat = "messages" in body
    fields = _Fields(body)
    fields.default_only("return_token_strs", False)
    fields.default_only("add_special_tokens", not chat)
    if chat:
        fields.default_only("add_generation_prompt", True)
        return parse_chat(fields.rest(), takes_images=takes_images, takes_tools=takes_tools)
    request = parse_completion(fields.rest())
    if len(request.prompts) != 1:
        raise InvalidInput("prompt", Shown(f"<{len(request.prompts)} prompts>"), "must be one prompt to tokenize")
    return request


def parse_detokenize(body: Mapping[str, Any]) -> DetokenizeRequest:
    """Check a ``/detokenize`` body: ``tokens``, a list of token ids (the
    vocabulary is the server's to check).

    Raises:
        InvalidInput: naming the first field at fault.
    """
    fields = _Fields(body)
    tokens = fields.take("tokens", required=True)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidInput("tokens", Shown("<...>") if isinstance(tokens, list) else tokens, "must be a list of token ids")
    model = fields.take("model")
    if model is not None and not isinstance(model, str):
        raise InvalidInput("model", model, "must be a string")
    fields.finish()
    return DetokenizeRequest(tokens=tuple(tokens), model=model)


class _Fields:
    """A body's fields, taken one by one; :meth:`finish` refuses what is left."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self._body = dict(body)

    def take(self, name: str, *, required: bool = False) -> Any:
        if required and self._body.get(name) is None:
            raise InvalidInput(name, None, "is required")
        return self._body.pop(name, None)

    def default_only(self, name: str, default: Any, *, also: tuple[Any, ...] = ()) -> None:
        """A field this server takes only at its default (or null)."""
        value = self.take(name)
        if value is not None and value != default and value not in also:
            raise InvalidInput(
                name, value, f"is not supported by this server (only {json.dumps(default)})"
            )

    def rest(self) -> dict[str, Any]:
        """The fields not taken."""
        return dict(self._body)

    def finish(self) -> None:
        for ignored in ("user", "metadata"):
            self._body.pop(ignored, None)
        if self._body:
            name = sorted(self._body)[0]
            raise InvalidInput(name, self._body[name], "is not a request field this server takes")


#: Extension fields routers forward, at the value that is this server's behaviour.
_ROUTER_FIELDS = (
    ("ignore_eos", False),
    ("no_stop_trim", False),
    ("continue_final_message", False),
    ("return_hidden_states", False),
    ("skip_special_tokens", True),
)


def _options(fields: _Fields, *, max_tokens: Any) -> Options:
    for name, value in _ROUTER_FIELDS:
        fields.default_only(name, value)
    reasoning = {
        name: _bool(name, fields.take(name), default=True)
        for name in ("separate_reasoning", "include_reasoning", "stream_reasoning")
    }
    given = {name: fields.take(name) for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")}
    # Penalties checks each value's type and range, naming the field.
    penalties = Penalties(
        **{name: value for name, value in given.items() if value is not None},
        logit_bias=_logit_bias(fields.take("logit_bias")),
    )
    stream = _bool("stream", fields.take("stream"), default=False)
    stream_options = fields.take("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise InvalidInput("stream_options", stream_options, 'must be {"include_usage": bool}')
        if not stream:
            raise InvalidInput(
                "stream_options", stream_options, "is only allowed with stream: true"
            )
        include_usage = _bool(
            "stream_options.include_usage", stream_options.get("include_usage"), default=False
        )
    model = fields.take("model")
    if model is not None and not isinstance(model, str):
        raise InvalidInput("model", model, "must be a string")
    salt = fields.take("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidInput("cache_salt", salt, "must be a non-empty string")
    return Options(
        model=model,
        max_tokens=_int("max_tokens", max_tokens, minimum=1),
        temperature=_number("temperature", fields.take("temperature"), 0.0, 2.0, default=1.0),
        top_p=_number("top_p", fields.take("top_p"), 0.0, 1.0, default=1.0),
        top_k=_int("top_k", fields.take("top_k"), minimum=0) or 0,
        min_p=_number("min_p", fields.take("min_p"), 0.0, 1.0, default=0.0),
        seed=_int("seed", fields.take("seed")),
        stop=_stop(fields.take("stop")),
        stream=stream,
        include_usage=include_usage,
        cache_salt=salt,
        n=_int("n", fields.take("n"), minimum=1) or 1,
        penalties=penalties,
        json_schema=_response_format(fields.take("response_format")),
        **reasoning,
    )


#: A ``json_schema`` format's name (OpenAI's rule).
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(value: Any) -> Optional[Any]:
    """OpenAI's ``response_format``: ``text`` (None), ``json_object`` (any
    JSON object) or ``json_schema`` (its ``schema``; any JSON value where it
    gives none). Whether the grammar supports the schema is the runtime's
    check (refused naming ``response_format``)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object" and len(value) == 1:
        return JSON_OBJECT
    if kind != "json_schema" or set(value) != {"type", "json_schema"}:
        raise InvalidInput(
            "response_format", value,
            'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}',
        )  # fmt: skip
    spec = value["json_schema"]
    if not isinstance(spec, dict) or set(spec) - {"name", "schema", "description", "strict"}:
        raise InvalidInput(
            "response_format.json_schema", spec, 'must be {"name": ..., "schema": {...}} (description, strict optional)'
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _FORMAT_NAME.fullmatch(name):
        raise InvalidInput("response_format.json_schema.name", name, "must be 1-64 letters, digits, _ or -")
    _bool("response_format.json_schema.strict", spec.get("strict"), default=False)
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise InvalidInput("response_format.json_schema.schema", schema, "must be a JSON schema (an object)")
    return schema


def _logit_bias(value: Any) -> Optional[dict[int, Any]]:
    """OpenAI's ``logit_bias``: token ids written as strings, to numbers
    (checked with the penalties)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidInput("logit_bias", value, "must map token ids (as strings) to numbers")
    bias = {}
    for key, number in value.items():
        if not key.isdecimal() or len(key) > MAX_INT_DIGITS:
            raise InvalidInput("logit_bias", value, f"has a key that is not a token id: {key!r}")
        bias[int(key)] = number
    return bias


def _bool(name: str, value: Any, *, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInput(name, value, "must be a boolean")
    return value


def _int(
    name: str, value: Any, *, minimum: Optional[int] = None, maximum: Optional[int] = None
) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(name, value, "must be an integer")
    if minimum is not None and value < minimum:
        raise InvalidInput(name, value, f"must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise InvalidInput(name, value, f"must be <= {maximum}")
    return value


def _number(name: str, value: Any, low: float, high: float, *, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(name, value, "must be a number")
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidInput(name, value, f"must be in [{low:g}, {high:g}]")
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidInput("stop", value, "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise InvalidInput("stop", value, f"takes at most {MAX_STOPS} strings")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise InvalidInput("stop", value, f"strings are at most {MAX_STOP_LENGTH} characters")
    return tuple(stops)


def _prompts(value: Any) -> tuple[Union[str, tuple[int, ...]], ...]:
    """One prompt (a string or a list of token ids) or a list of several
    (strings, or lists of token ids), as the prompts in order."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(value))
    return (_prompt(value, "prompt"),)


def _prompt(value: Any, where: str) -> Union[str, tuple[int, ...]]:
    """A string or a list of token ids."""
    if isinstance(value, str):
        if not value:
            raise InvalidInput(where, value, "must not be empty")
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return tuple(value)
    raise InvalidInput(where, value, "must be a non-empty string or a list of token ids")


def _messages(value: Any, takes_images: bool) -> tuple[tuple[ChatMessage, ...], tuple[str, ...]]:
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages", value, "must be a non-empty list of messages")
    messages, images = [], []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidInput(where, message, "must be an object with a role and a content")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise InvalidInput(f"{where}.role", role, f"must be one of {', '.join(_ROLES)}")
        allowed = {"role", "content", "name"} | _MESSAGE_FIELDS.get(role, set())
        unknown = set(message) - allowed
        if unknown:
            name = sorted(unknown)[0]
            raise InvalidInput(f"{where}.{name}", message[name], f"is not a field of a {role} message")
        calls = _calls(message.get("tool_calls"), f"{where}.tool_calls")
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidInput(f"{where}.tool_call_id", call_id, "must be a string")
        reasoning = _reasoning(message, where)
        besides = {"tool_calls": calls, "tool_call_id": call_id, "reasoning": reasoning}
        content = message.get("content")
        if content is None and (calls or reasoning is not None):
            content = ""  # an assistant's calls, or reasoning, alone
        if isinstance(content, str):
            messages.append(ChatMessage(role=_ROLES[role], content=content, **besides))
            continue
        if not isinstance(content, list):
            raise InvalidInput(f"{where}.content", content, "must be a string or a list of parts")
        parts: list[dict[str, str]] = []
        for j, part in enumerate(content):
            url = _part(part, f"{where}.content[{j}]", takes_images)
            if url is None:
                parts.append({"type": "text", "text": part["text"]})
            else:
                parts.append({"type": "image"})
                images.append(url)
        if any(part["type"] == "image" for part in parts):
            messages.append(ChatMessage(role=_ROLES[role], content=tuple(parts), **besides))
        else:
            messages.append(ChatMessage(role=_ROLES[role], content="\n".join(p["text"] for p in parts), **besides))
    return tuple(messages), tuple(images)


#: Fields a message of a role has besides ``role``, ``content`` and ``name``:
#: an assistant's reasoning under either name clients send it back by (vLLM's
#: and mlx_lm.server's ``reasoning``, DeepSeek's ``reasoning_content``).
_MESSAGE_FIELDS = {"assistant": {"tool_calls", "reasoning", "reasoning_content"}, "tool": {"tool_call_id"}}


def _reasoning(message: Mapping[str, Any], where: str) -> Optional[str]:
    """An assistant message's reasoning, sent back (for templates that
    render earlier turns' reasoning), under either name -- not two that differ."""
    given = {name: message[name] for name in ("reasoning", "reasoning_content") if message.get(name) is not None}
    for name, value in given.items():
        if not isinstance(value, str):
            raise InvalidInput(f"{where}.{name}", value, "must be a string")
    if len(set(given.values())) > 1:
        raise InvalidInput(f"{where}.reasoning_content", Shown("<text>"), "differs from the message's reasoning")
    return next(iter(given.values()), None)


def _calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``: each ``{"id", "type": "function",
    "function": {"name", "arguments"}}``, the arguments JSON text."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidInput(where, value, "must be a list of calls")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function" or set(call) - {
            "id", "type", "function"
        }:
            raise InvalidInput(at, call, 'must be {"id": ..., "type": "function", "function": {...}}')
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidInput(f"{at}.id", call_id, "must be a string")
        function = call.get("function")
        if (
            not isinstance(function, dict)
            or set(function) - {"name", "arguments"}
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), str)
        ):
            raise InvalidInput(f"{at}.function", function, 'must be {"name": str, "arguments": JSON text}')
        calls.append(ToolCall(id=call_id, name=function["name"], arguments=function.get("arguments", "")))
    return tuple(calls)


def _part(part: Any, where: str, takes_images: bool) -> Optional[str]:
    """A content part's image URL, or None for a text part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return None
    if kind != "image_url":
        raise InvalidInput(
            where, part, 'must be {"type": "text", "text": ...} or {"type": "image_url", ...}'
        )
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise InvalidInput(f"{where}.image_url", image, 'must be {"url": "data:..."}')
    if not takes_images:
        raise InvalidInput(f"{where}.image_url", url, "this model does not take images")
    if not url.startswith("data:"):
        raise InvalidInput(
            f"{where}.image_url.url", url, "only data: URLs are taken (URLs are not fetched)"
        )
    return url
