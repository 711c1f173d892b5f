"""The OpenAI-compatible HTTP server: a Starlette app over one :class:`~mlxkv.CacheRuntime`.

:class:`OpenAIServer` builds the ASGI app; :func:`serve` runs it with
Hypercorn on whichever anyio backend is running (asyncio or trio), on a
socket the caller bound; :func:`running` does both for an ``async with``::

    async with CacheRuntime(model=path) as rt:
        chat = await load_chat_template(path)
        server = OpenAIServer(rt, ServerConfig(model_name="tiny"), chat=chat)
        async with running(server, port=0) as url:
            ...  # an OpenAI client at url + "/v1"

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST
/v1/completions`` (text or token ids), ``POST /v1/chat/completions``
(rendered with the model's chat template, offering the request's ``tools``;
image parts as ``data:`` URLs on a vision-language model; the answer's
reasoning and tool calls read out of its text, in the syntax mlx-lm knows for
the model: :mod:`mlxkv.server.reasoning`, :mod:`mlxkv.server.tools`), ``GET
/health``, ``GET /metrics``. Streaming is
server-sent events, with a usage chunk on ``stream_options.include_usage``;
``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens
came from the cache, and a chat's ``usage.completion_tokens_details.reasoning_tokens``
how many it generated inside reasoning blocks.

A generation request's life (:class:`_Answering`): it waits for an admission
slot (503 at once if the queue is full too), reads its body (only then: a
queued request holds at most its first 64 KiB; 408 past ``body_timeout``,
413 past ``max_body_bytes``), prepares its prompt (refused untokenized if its
text cannot fit the context; the chat template and the tokenizer run on a
worker thread), and generates; all of it under a watch on the connection: a
client that leaves cancels the request wherever it is, and the runtime's
generation releases everything it held. A streamed answer's
headers go out with its first text, so an error before then still gets its
status; after it, an error is a last ``data: {"error": ...}`` event.

Tenants: with API keys, each key's requests are salted with a digest of the
key (so one tenant's cached prefixes are never served to, or timed by,
another), and a request's own ``cache_salt`` subdivides its key's namespace.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Optional, Union

import anyio
import anyio.to_thread
import attrs
import sniffio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from mlxkv.actors.event_log import EventLog
from mlxkv.actors.json_constraint import NoTokenAllowed
from mlxkv.actors.json_grammar import GrammarTooAmbiguous
from mlxkv.cache.errors import Shown
from mlxkv.cache.validators import int_at_least
from mlxkv.errors import CacheError, ComputeFailed, InvalidInput, RuntimeClosed
from mlxkv.freed_memory import TRIM_AFTER_BYTES, return_freed_memory
from mlxkv.generation import Generation
from mlxkv.json_output import JsonText
from mlxkv.runtime import CacheRuntime
from mlxkv.server.admission import Admission, Overloaded
from mlxkv.server.answer import Answer, Piece, Prompt, Reading, each_piece
from mlxkv.server.body import RequestBody
from mlxkv.server.chat import ChatTemplate, ConversationMemory, Turn
from mlxkv.server.errors import ApiError
from mlxkv.server.kv_wire import KVEventPublisher, KVWireConfig
from mlxkv.server.logprobs import LoggedToken, TokenTexts, chat_logprobs, completion_logprobs, echoed_logprobs
from mlxkv.server.metrics import CONTENT_TYPE, ServerMetrics
from mlxkv.server.request import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Options,
    ToolCall,
    answer_key,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json,
    parse_tokenize,
    template_variables,
)

__all__ = ["OpenAIServer", "ServerConfig", "load_chat_template", "listen", "running", "serve"]

_LOG = EventLog(component="server")

#: OpenAI's default ``max_tokens`` for completions.
_COMPLETION_MAX_TOKENS = 16


def _seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidInput(attribute.name, value, "must be a number of seconds > 0")


def _keys(value: Any) -> tuple[str, ...]:
    keys = tuple(value)
    if not all(isinstance(key, str) and key for key in keys):
        raise InvalidInput("api_keys", keys, "must be non-empty strings")
    return keys


@attrs.frozen(kw_only=True)
class ServerConfig:
    """How the server answers (the runtime's own settings are its :class:`~mlxkv.RuntimeConfig`).

    Attributes:
        model_name: the model's id in ``/v1/models`` and in requests.
        api_keys: the accepted API keys (``Authorization: Bearer KEY``); each
            is a tenant with its own cache namespace. Empty: no key needed,
            one namespace.
        max_concurrent: the most generations admitted at once (a request of
            ``n`` choices is ``n``).
        max_queue: the most requests waiting for admission; beyond, 503.
        max_tokens: a chat request's ``max_tokens`` when it names none (also
            bounded by the model's context); completions default to 16, as
            OpenAI's do.
        max_body_bytes: the largest request body taken (images included);
            bodies are read only once a request is admitted, so at most
            ``max_concurrent`` of them are held at once.
        body_timeout: seconds an admitted request's body may take to arrive
            whole; past them, 408 and the connection is closed.
        header_timeout: seconds a connection may take to send a request's
            headers, from its opening or from the end of its previous
            response (so also how long an idle connection stays open);
            past them it is closed without an answer. A slow client's
            headers hold no more than this (the body has ``body_timeout``).
        public_metrics: with ``api_keys``, answer ``/metrics`` without a key
            (for a scraper that sends none); off, it needs one. ``/health``
            answers anyone, with its admission state only (its counts and the
            model's name need a key, or no keys at all).
        kv_events: publish the runtime's KV events on the wire, as vLLM
            does (:mod:`mlxkv.server.kv_wire`), while serving; None: not.
        max_choices: the most generations one request may ask for: ``n``
            choices, times its prompts on ``/v1/completions`` (and at most
            ``max_concurrent``). Each is a generation of its own, side by
            side in the decode batch and over its prompt's KV computed
            once, and holds an admission slot of its own.
        chat_template_args: the chat template's variables where a request
            sets none of its own (``mlx_lm.server``'s
            ``--chat-template-args``; a request's ``chat_template_kwargs``
            set over them): ``{"enable_thinking": false}`` for a Qwen3, say.
    """

    model_name: str
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_keys)
    max_concurrent: int = attrs.field(default=32, validator=int_at_least(1))
    max_queue: int = attrs.field(default=128, validator=int_at_least(0))
    max_tokens: int = attrs.field(default=512, validator=int_at_least(1))
    max_body_bytes: int = attrs.field(default=64 << 20, validator=int_at_least(1))
    body_timeout: float = attrs.field(default=30.0, validator=_seconds)
    header_timeout: float = attrs.field(default=5.0, validator=_seconds)
    public_metrics: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    kv_events: Optional[KVWireConfig] = None
    max_choices: int = attrs.field(default=16, validator=int_at_least(1))
    chat_template_args: Mapping[str, Any] = attrs.field(
        factory=dict, converter=lambda value: template_variables(value, "chat_template_args")
    )


async def load_chat_template(model: str) -> Optional[ChatTemplate]:
    """The chat template of ``model`` (the runtime's model directory), loaded on a
    worker thread; None if the model has none (then only completions are served)."""
    return await anyio.to_thread.run_sync(ChatTemplate.load, model)


class OpenAIServer:
    """The OpenAI API over one running :class:`~mlxkv.CacheRuntime`; ``app`` is the ASGI app.

    Owns: the admission slots, the metrics, the conversation memory and the
    tenants' salts. The runtime belongs to the caller, who keeps it running
    while the app serves (a closed runtime is answered with 503).
    """

    def __init__(
        self, runtime: CacheRuntime, config: ServerConfig, *, chat: Optional[ChatTemplate] = None
    ) -> None:
        if runtime.model_info is None:
            raise InvalidInput("runtime", runtime, "must be running with a model")
        self.runtime = runtime
        self.config = config
        self.chat = chat
        self.admission = Admission(config.max_concurrent, config.max_queue)
        self._info = runtime.model_info
        self.metrics = ServerMetrics(self._info)
        self.memory = ConversationMemory()
        assert runtime.preparer is not None, "a runtime with a model has its preparer"
        #: Token ids' texts, for log-probabilities.
        self.token_texts = TokenTexts(runtime.preparer.decode)
        self.created = int(time.time())
        self._tenants = tuple((key.encode(), _tenant_salt(key)) for key in config.api_keys)
        self._names = {config.model_name, runtime.config.model}
        per_token = runtime.preparer.max_chars_per_token if runtime.preparer is not None else None
        context = self._info.max_context
        #: The longest prompt text that can fit the model's context (its
        #: tokenizer's sound bound), or None where no characters bound is sound.
        self.max_prompt_chars = None if per_token is None or context is None else context * per_token
        #: The cancel scopes of the generation requests being answered.
        self._answering: set[anyio.CancelScope] = set()
        #: Large bodies are parsed one at a time: parsed, a body of many small
        #: values is many times its bytes (2M items, the most taken, ~150 MB),
        #: and the memory a parse held stays the process's (the allocator's
        #: fragments); one at a time, that is one parse's, not a parse's
        #: times the requests admitted. It guards no state: it bounds work.
        self.parsing = anyio.CapacityLimiter(1)
        #: Set by :meth:`drain`: generation requests are refused from then on.
        self.draining = False
        #: The KV events' publisher while :func:`serve` runs with ``kv_events``.
        self.kv_publisher: Optional[KVEventPublisher] = None
        self.app = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
                Route("/v1/completions/render", self._render_completions, methods=["POST"]),
                Route("/v1/chat/completions/render", self._render_chat, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/detokenize", self._detokenize, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},
        )

    # -- endpoints -------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        try:
            self._tenant(request)
        except ApiError as error:
            return _error_response(error)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        try:
            self._tenant(request)
            self._check_model(request.path_params["model"])
        except ApiError as error:
            return _error_response(error)
        return JSONResponse(self._model_card())

    async def _completions(self, request: Request) -> Response:
        return await self._generation(request, "completions")

    async def _chat_completions(self, request: Request) -> Response:
        return await self._generation(request, "chat")

    async def _render_completions(self, request: Request) -> Response:
        return await self._generation(request, "completions", mode="render")

    async def _render_chat(self, request: Request) -> Response:
        return await self._generation(request, "chat", mode="render")

    async def _tokenize(self, request: Request) -> Response:
        return await self._generation(request, "tokenize", mode="tokenize")

    async def _detokenize(self, request: Request) -> Response:
        return await self._generation(request, "detokenize", mode="detokenize")

    async def _health(self, request: Request) -> Response:
        """Liveness (503 once the server cannot serve at all) and the admission
        state: ``ok`` (a slot is free), ``busy`` (a request would wait for one)
        or ``full`` (a request would be refused with 503 now)."""
        if self.runtime.closed or self.draining:
            detail = (
                "the server is shutting down" if self.draining else "the runtime is not running"
            )
            return JSONResponse({"status": "unavailable", "detail": detail}, 503)
        admission = self.admission.statistics()
        if admission.num_running < admission.max_running:
            status = "ok"
        elif admission.num_waiting < admission.max_waiting:
            status = "busy"
        else:
            status = "full"
        body: dict[str, Any] = {"status": status}
        if self._authorized(request):
            body.update(
                model=self.config.model_name,
                compute=self._info.summary(),
                running=admission.num_running,
                waiting=admission.num_waiting,
                max_running=admission.max_running,
                max_waiting=admission.max_waiting,
            )
        return JSONResponse(body)

    async def _metrics(self, request: Request) -> Response:
        try:
            if not self.config.public_metrics:
                self._tenant(request)
            stats = await self.runtime.stats()
        except RuntimeClosed as error:
            return _error_response(ApiError.from_error(error))
        except ApiError as error:
            return _error_response(error)
        body = self.metrics.render(stats, self.admission.statistics(), self.memory.statistics())
        return Response(body, media_type=CONTENT_TYPE)

    async def _http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException), f"not an HTTP error: {error!r}"
        code = "not_found" if error.status_code == 404 else None
        api = ApiError(
            error.status_code, f"{request.method} {request.url.path}: {error.detail}", code=code,
            headers=dict(error.headers or {}),
        )  # fmt: skip
        return _error_response(api)

    # -- generation requests ---------------------------------------------------

    async def _generation(self, request: Request, endpoint: str, *, mode: str = "generate") -> Response:
        """Refuse at once what the headers refuse (shutting down, no key); the
        rest is answered by :class:`_Answering`, body and all (its ``mode``:
        a generation, or the prompt's tokens as a render or a tokenize
        request answers them, or a detokenize request's text)."""
        arrived = time.perf_counter()
        try:
            if self.draining:
                raise _shutting_down()
            salt = self._tenant(request)
            RequestBody.refuse_declared(request.headers, self.config.max_body_bytes)
        except ApiError as api:
            self.metrics.requests.labels(_label(endpoint, mode), _outcome(api)).inc()
            return _error_response(api)
        return _Answering(self, endpoint, salt, arrived, mode=mode)

    def parse(
        self, endpoint: str, raw: Union[bytes, bytearray]
    ) -> Union[ChatRequest, CompletionRequest, DetokenizeRequest]:
        """A request body, checked (any thread: it reads only the server's
        settings); a ``tokenize`` body is a chat or a completion, as it holds
        ``messages`` or not.

        Raises:
            InvalidInput: a bad body (400).
            ApiError: an unknown model (404).
        """
        body = parse_json(raw)
        parsed: Union[ChatRequest, CompletionRequest]
        takes_tools = self.chat is not None and self.chat.tool_syntax is not None
        if endpoint == "detokenize":
            detokenize = parse_detokenize(body)
            self._check_model(detokenize.model)
            return detokenize
        if endpoint == "tokenize":
            parsed = parse_tokenize(body, takes_images=self._info.takes_images, takes_tools=takes_tools)
        elif endpoint == "chat":
            parsed = parse_chat(body, takes_images=self._info.takes_images, takes_tools=takes_tools)
        else:
            parsed = parse_completion(body)
        if isinstance(parsed, ChatRequest) and self.chat is None:
            raise InvalidInput(
                "messages",
                len(parsed.messages),
                "this model has no chat template: use /v1/completions",
            )
        self._check_model(parsed.options.model)
        most, bound = min((self.config.max_choices, "--max-choices"), (self.config.max_concurrent, "--max-concurrent"))
        prompts = len(parsed.prompts) if isinstance(parsed, CompletionRequest) else 1
        if parsed.options.n > most:
            raise InvalidInput("n", parsed.options.n, f"must be <= {most} ({bound})")
        if prompts * parsed.options.n > most:
            raise InvalidInput(
                "prompt", Shown(f"<{prompts} prompts>"),
                f"asks for {prompts} x n={parsed.options.n} generations: at most {most} ({bound})",
            )  # fmt: skip
        return parsed

    async def drain(self, timeout: float) -> None:
        """Refuse new generation requests (503), give those being answered
        ``timeout`` seconds to finish, then cancel the rest (each releases what it
        holds and ends its response with a 503 error) and wait for them."""
        self.draining = True
        with anyio.move_on_after(timeout):
            await self._wait_answered()
        self.cancel_requests()
        await self._wait_answered()

    def cancel_requests(self) -> None:
        """Cancel every generation request being answered (each releases what it
        holds and ends its response with a 503 error)."""
        for scope in self._answering:
            scope.cancel()

    async def _wait_answered(self) -> None:
        while self._answering:
            await anyio.sleep(0.01)

    def _authorized(self, request: Request) -> bool:
        """Whether the request may see the server's details (no keys, or one of them)."""
        try:
            self._tenant(request)
        except ApiError:
            return False
        return True

    def _tenant(self, request: Request) -> Optional[str]:
        """The request's tenant salt (None without API keys).

        Raises:
            ApiError: 401, keys are required and the request has none of them.
        """
        if not self._tenants:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = key.strip().encode()
        if scheme.lower() == "bearer" and given:
            for accepted, salt in self._tenants:
                if hmac.compare_digest(given, accepted):
                    return salt
        raise ApiError(
            401,
            "missing or unknown API key: send Authorization: Bearer KEY with one of the server's --api-key",
            code="invalid_api_key",
        )

    def _check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self._names:
            raise ApiError(
                404, f"the model {name!r} does not exist: this server serves {self.config.model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "mlxkv",
        }


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")


def _tenant_salt(key: str) -> str:
    """A key's cache namespace: a digest, so that the key itself never reaches a trace."""
    return "key-" + hashlib.sha256(b"mlxkv-tenant\0" + key.encode()).hexdigest()[:32]


def _salt(tenant: Optional[str], own: Optional[str]) -> Optional[str]:
    """The request's cache salt: its own salt within its tenant's namespace."""
    if tenant is None:
        return own
    return tenant if own is None else f"{tenant}/{own}"


def _label(endpoint: str, mode: str) -> str:
    """A request's endpoint as ``/metrics`` counts it."""
    return f"{endpoint}_render" if mode == "render" else endpoint


def _outcome(error: ApiError) -> str:
    if error.code == "overloaded":
        return "overloaded"
    if error.status == 503:
        return "unavailable"
    return "invalid" if error.status < 500 else "failed"


#: Bodies up to this size are parsed on the event loop (faster than the hop to a thread).
_INLINE_BODY = 256 << 10


async def _off_the_loop(
    size: int, function: Callable[..., Any], *args: Any, limiter: Optional[anyio.CapacityLimiter] = None
) -> Any:
    """``function(*args)``, on a worker thread (of ``limiter``'s, if given)
    when ``size`` (bytes it works through) is past :data:`_INLINE_BODY`."""
    if size <= _INLINE_BODY:
        return function(*args)
    return await anyio.to_thread.run_sync(function, *args, limiter=limiter)


_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class _Answering(Response):
    """A generation request's response: admission, body, prompt, generation and
    sending (see the module docstring). A render request (vLLM's
    ``/render`` endpoints) goes the same way up to its prompt's tokens, and
    answers with them instead of generating: a router keys its blocks on
    exactly the tokens this server would run; so does a tokenize request
    (vLLM's ``/tokenize``: a client counting what a prompt costs), in its
    own shape. A detokenize request answers its tokens' text.

    One task reads the connection throughout (:class:`RequestBody`): the body
    as admission allows (whole within ``body_timeout`` of admission), then
    nothing until the client leaves, which cancels the request wherever it
    is, queued or generating.
    """

    def __init__(
        self,
        server: OpenAIServer,
        endpoint: str,
        salt: Optional[str],
        arrived: float,
        *,
        mode: str = "generate",
    ) -> None:
        self._server = server
        self._endpoint = endpoint
        self._mode = mode
        self._label = _label(endpoint, mode)
        self._body = RequestBody(server.config.max_body_bytes)
        self._tenant_salt = salt
        self._salt = salt  # until the body's own cache_salt is read
        self._arrived = arrived
        self._options = Options()  # until the body is parsed
        #: Its answer is held to one tool call (``tool_choice``).
        self._forced = False
        self._id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        self._created = int(time.time())
        self._disconnected = False
        self._headers_sent = False
        self._answered = False  # a first token came, of any choice
        self._sent = False
        self._outcome = "cancelled"  # until it is known (the server stopping cancels)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self._sent = True  # a disconnect from now on only ends the exchange
            await send(message)

        answering = self._server._answering
        try:
            async with anyio.create_task_group() as tg:
                answering.add(tg.cancel_scope)
                tg.start_soon(self._body.pump, receive, functools.partial(self._left, tg.cancel_scope))
                await self._answer(sending)
                tg.cancel_scope.cancel()
            if not self._sent and not self._disconnected:  # cancelled by drain()
                await self._fail(sending, _shutting_down())
        finally:
            outcome = "disconnected" if self._disconnected else self._outcome
            self._server.metrics.requests.labels(self._label, outcome).inc()
            if self._body.peak_bytes >= TRIM_AFTER_BYTES:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(return_freed_memory)
            answering.discard(tg.cancel_scope)

    def _left(self, scope: anyio.CancelScope) -> None:
        """The client closed the connection."""
        if not self._sent:  # else the server only says the exchange is over
            self._disconnected = True
            scope.cancel()

    async def _answer(self, send: Send) -> None:
        """Answer the request, setting its outcome before the last send."""
        server = self._server
        try:
            async with server.admission.slot() as slot:
                body = await self._body.wait(server.config.body_timeout)
                if body is None:
                    return  # the client left (and the request is being cancelled)
                parsed = await _off_the_loop(len(body), server.parse, self._endpoint, body, limiter=server.parsing)
                del body
                if isinstance(parsed, DetokenizeRequest):
                    await self._detokenized(send, parsed.tokens)
                    return
                self._endpoint = "chat" if isinstance(parsed, ChatRequest) else "completions"  # a tokenize body's
                self._options = options = self._with_forced_call(parsed)
                self._salt = _salt(self._tenant_salt, options.cache_salt)
                prompts = await self._prompts(parsed)
                if self._mode == "render":
                    await self._rendered(send, prompts)
                    return
                if self._mode == "tokenize":
                    await self._tokenized(send, prompts[0])
                    return
                limits = [self._max_tokens(prompt) for prompt in prompts]
                reading = self._reading(parsed)
                await server.admission.widen(slot, len(prompts) * options.n)  # a slot a choice
                async with contextlib.AsyncExitStack() as generations:
                    answers = []
                    for prompt, max_tokens in zip(prompts, limits):
                        for choice in range(options.n):
                            index = len(answers)
                            request_id = self._id if len(prompts) * options.n == 1 else f"{self._id}-{index}"
                            generation = self._generation(prompt, max_tokens, choice, request_id)
                            await generations.enter_async_context(generation)
                            answers.append(
                                Answer(index, prompt, generation, options.stop, self._first_token, reading)
                            )
                    if options.stream:
                        await self._stream(send, answers)
                    else:
                        await self._reply(send, answers)
                self._count(answers)
                return
        except Overloaded:
            admission = server.admission.statistics()
            error = ApiError.overloaded(admission.num_running, admission.num_waiting)
        except ApiError as api:
            error = api
        except InvalidInput as invalid:
            error = ApiError.from_error(self._in_request_terms(invalid))
        except ComputeFailed as failure:
            if isinstance(failure.cause, (GrammarTooAmbiguous, NoTokenAllowed)):  # the request's schema, not the server
                error = ApiError.from_error(InvalidInput(self._schema_field(), Shown("<schema>"), str(failure.cause)))
            else:
                _LOG.error("server.compute_failed", request_id=self._id, error=repr(failure.cause))
                error = ApiError.from_error(failure)
        except CacheError as failure:
            error = ApiError.from_error(failure)
        except Exception as bug:  # never a bare 500 page: log it, answer OpenAI-shaped
            _LOG.error("server.request_failed", request_id=self._id, error=repr(bug))
            error = ApiError(500, f"internal error while answering request {self._id}", type="server_error")
        await self._fail(send, error)

    def _generation(self, prompt: Prompt, max_tokens: int, choice: int, request_id: str) -> Generation:
        """The generation of choice ``choice`` of ``prompt``, as the options ask
        (a seed moves by the choice, so a prompt's answers do not depend on
        the other prompts of its batch)."""
        options = self._options
        penalties = options.penalties
        return self._server.runtime.generate(
            prompt.tokens,
            max_tokens=max_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            min_p=options.min_p,
            seed=None if options.seed is None else options.seed + choice,
            images=list(prompt.images) or None,
            cache_salt=self._salt,
            request_id=request_id,
            logprobs=options.logprobs,
            presence_penalty=penalties.presence_penalty,
            frequency_penalty=penalties.frequency_penalty,
            repetition_penalty=penalties.repetition_penalty,
            logit_bias=dict(penalties.logit_bias),
            prompt_logprobs=options.logprobs if options.echo else None,
            json_schema=options.json_schema,
            json_text=self._json_text(prompt),
        )

    def _reading(self, parsed: Union[ChatRequest, CompletionRequest]) -> Reading:
        """What a chat answer reads out of its text: its reasoning, where the
        model reasons and the request keeps it apart; its tool calls, where
        the request asks for them read. A completion: nothing."""
        chat = self._server.chat
        if not isinstance(parsed, ChatRequest) or chat is None:
            return Reading()
        options = parsed.options
        return Reading(
            reasoning=chat.reasoning_syntax if options.separate_reasoning else None,
            include_reasoning=options.include_reasoning,
            calls=chat.tool_syntax if parsed.read_calls else None,
            tools=parsed.tools,
            one_call=parsed.one_call,
        )

    def _json_text(self, prompt: Prompt) -> Optional[JsonText]:
        """Where a held answer's JSON sits in its text: where the model
        reasons, after a reasoning block it may write first (or is in, where
        the chat's prompt opened one)."""
        text = self._options.json_text
        syntax = self._server.chat.reasoning_syntax if self._server.chat is not None else None
        if self._options.json_schema is None or syntax is None or prompt.text is None:
            return text
        return attrs.evolve(text, reasoning=(syntax.start, syntax.end), reasoning_opened=syntax.opened(prompt.text))

    def _with_forced_call(self, parsed: Union[ChatRequest, CompletionRequest]) -> Options:
        """The request's options, holding the answer to its one call where
        ``tool_choice`` forces one (in the model's syntax: a forced call
        names tools, which are taken only where the model has one)."""
        if not isinstance(parsed, ChatRequest) or not parsed.forced_call:
            return parsed.options
        schema, text = self._server.chat.tool_syntax.forced(parsed.tools, parsed.forced_call)
        self._forced = True
        return attrs.evolve(parsed.options, json_schema=schema, json_text=text)

    def _in_request_terms(self, error: InvalidInput) -> InvalidInput:
        """A chat prompt's fault is its messages' (the runtime says
        ``prompt``); a schema's is the response format's, or a forced call's
        tools'."""
        if self._endpoint == "chat" and error.argument in ("prompt", "images"):
            return InvalidInput("messages", error.value, error.reason)
        if error.argument == "json_schema":
            return InvalidInput(self._schema_field(), error.value, error.reason)
        return error

    def _schema_field(self) -> str:
        """The field whose schema the answer is held to."""
        return "tools" if self._forced else "response_format"

    async def _fail(self, send: Send, error: ApiError) -> None:
        """Answer with ``error``: its status, or a last event once streaming.

        A refusal sent while the client is still sending its body may find
        the connection closing under it (Hypercorn on trio closes it from its
        reading task as the response ends); the answer has gone out by then,
        and there is nothing more to tell that client.
        """
        self._outcome = _outcome(error)
        try:
            if self._headers_sent:  # the stream ends with the error
                await _send_event(send, error.body())
                await _send_body(send, b"", more=False)
            else:
                await _send_json(send, error.status, error.body(), error.headers)
        except Exception as gone:
            if self._body.whole:
                raise
            _LOG.debug("server.refusal_cut_short", request_id=self._id, error=repr(gone))

    async def _prompts(self, parsed: Union[ChatRequest, CompletionRequest]) -> list[Prompt]:
        """The prompts' tokens (and images, and chat text): tokenized on a worker
        thread, after a text that cannot fit the context is refused untokenized."""
        server = self._server
        if isinstance(parsed, CompletionRequest):
            prompts = []
            for prompt in parsed.prompts:
                if isinstance(prompt, tuple):
                    preparer = server.runtime.preparer
                    assert preparer is not None, "a served runtime has its preparer"
                    echo = await anyio.to_thread.run_sync(preparer.decode, prompt) if parsed.options.echo else None
                    prompts.append(Prompt(tokens=prompt, echo=echo))
                    continue
                self._check_length("prompt", prompt)
                tokens = await server.runtime.tokenize(prompt)
                prompts.append(Prompt(tokens=tokens, echo=prompt if parsed.options.echo else None))
            return prompts
        chat = server.chat
        assert chat is not None, "a chat request is refused without a template"
        variables = {**server.config.chat_template_args, **parsed.template_kwargs}
        text = await anyio.to_thread.run_sync(chat.render, parsed.messages, parsed.tools, variables)
        self._check_length("messages", text)
        turn = server.memory.continued(self._salt, parsed.messages, text, count=self._mode == "generate")
        if turn is None:
            tokens = await anyio.to_thread.run_sync(chat.encode, text)
        else:
            rest = text[len(turn.text) :]
            tokens = turn.tokens + ((await anyio.to_thread.run_sync(chat.encode, rest)) if rest else ())
        return [Prompt(tokens=tokens, images=parsed.images, text=text)]

    def _check_length(self, field: str, text: str) -> None:
        """Refuse a text too long to fit the model's context, by its characters alone."""
        limit = self._server.max_prompt_chars
        if limit is not None and len(text) > limit:
            context = self._server._info.max_context
            raise InvalidInput(
                field,
                Shown(f"<{len(text)} characters>"),
                f"cannot fit the model's context of {context} tokens"
                f" (this tokenizer needs more than {context} tokens for over {limit} characters)",
            )

    def _max_tokens(self, prompt: Prompt) -> int:
        """The request's ``max_tokens``, or its endpoint's default; refuses a
        prompt that leaves no room for it in the model's context."""
        context = self._server.runtime.model_info.max_context  # type: ignore[union-attr]
        field = "messages" if self._endpoint == "chat" else "prompt"
        if context is not None and len(prompt.tokens) >= context:
            raise InvalidInput(
                field,
                Shown(f"<{len(prompt.tokens)} tokens>"),
                f"its {len(prompt.tokens)} tokens fill the model's context of {context}",
            )
        if self._options.max_tokens is not None:
            return self._options.max_tokens  # the runtime refuses it past the context
        if self._endpoint == "completions":
            return _COMPLETION_MAX_TOKENS
        limit = self._server.config.max_tokens
        return limit if context is None else min(limit, context - len(prompt.tokens))

    async def _rendered(self, send: Send, prompts: Sequence[Prompt]) -> None:
        """Answer a render request: the prompts as this server would run them
        (vLLM's shape: one object for chat, a list, one a prompt, for completions)."""
        options = self._options
        rendered = [
            {
                "request_id": self._id,
                "token_ids": list(prompt.tokens),
                "features": {"num_images": len(prompt.images)} if prompt.images else None,
                "sampling_params": {
                    "max_tokens": self._max_tokens(prompt),
                    "temperature": options.temperature,
                    "top_p": options.top_p,
                    "top_k": options.top_k,
                    "min_p": options.min_p,
                    "seed": options.seed,
                    "stop": list(options.stop),
                    "n": options.n,
                },
                "model": self._server.config.model_name,
                "stream": options.stream,
            }
            for prompt in prompts
        ]
        self._outcome = "rendered"
        await _send_json(send, 200, rendered[0] if self._endpoint == "chat" else rendered)

    async def _tokenized(self, send: Send, prompt: Prompt) -> None:
        """Answer a tokenize request: the prompt's tokens, as this server
        would run them, their count, and the model's context (vLLM's shape)."""
        self._outcome = "rendered"
        context = self._server._info.max_context
        body = {"count": len(prompt.tokens), "max_model_len": context, "tokens": list(prompt.tokens)}
        await _send_json(send, 200, body)

    async def _detokenized(self, send: Send, tokens: tuple[int, ...]) -> None:
        """Answer a detokenize request: the tokens' text (an id past the
        vocabulary is refused, naming it)."""
        vocab = self._server._info.vocab_size
        for index, token in enumerate(tokens):
            if token < 0 or (vocab is not None and token >= vocab):
                raise InvalidInput("tokens", token, f"is not a token id of this model (at index {index})")
        preparer = self._server.runtime.preparer
        assert preparer is not None, "a served runtime has its preparer"
        text = await anyio.to_thread.run_sync(preparer.decode, tokens)
        self._outcome = "rendered"
        await _send_json(send, 200, {"prompt": text})

    def _first_token(self) -> None:
        """The request's first token, of whichever choice: its time to it, once."""
        if not self._answered:
            self._answered = True
            self._server.metrics.time_to_first_token.observe(time.perf_counter() - self._arrived)

    async def _reply(self, send: Send, answers: Sequence[Answer]) -> None:
        texts: list[list[str]] = [[] for _ in answers]
        thoughts: list[list[str]] = [[] for _ in answers]
        logged: list[list[LoggedToken]] = [[] for _ in answers]

        async def collect(answer: Answer, piece: Optional[Piece]) -> None:
            if piece is not None:
                texts[answer.index].append(piece.text)
                thoughts[answer.index].append(piece.reasoning)
                logged[answer.index].extend(piece.tokens)

        await each_piece(answers, collect)
        whole = ["".join(text) for text in texts]
        self._remember(answers, whole)
        if self._endpoint == "chat":
            kind = "chat.completion"
            contents = [
                {"message": _message(text, answer.calls, "".join(thought))}
                for answer, text, thought in zip(answers, whole, thoughts)
            ]
        else:
            kind = "text_completion"
            contents = [{"text": (a.prompt.echo or "") + text} for a, text in zip(answers, whole)]
        choices = [
            _choice(answer, content, logprobs=self._logprobs(tokens, answer, echoed=True))
            for answer, content, tokens in zip(answers, contents, logged)
        ]
        body = self._envelope(kind, choices)
        body["usage"] = self._usage(answers)
        self._outcome = _request_outcome(answers)
        await _send_json(send, 200, body)

    async def _stream(self, send: Send, answers: Sequence[Answer]) -> None:
        texts: list[list[str]] = [[] for _ in answers]
        echoed: set[int] = set()
        held: dict[int, list[Piece]] = {}  # reasoning not streamed, until its block ends

        async def release(answer: Answer) -> None:
            pieces = held.pop(answer.index, [])
            if pieces:
                reasoning = "".join(piece.reasoning for piece in pieces)
                tokens = [token for piece in pieces for token in piece.tokens]
                await self._chunk(send, answer, {"reasoning": reasoning}, logprobs=self._logprobs(tokens))

        async def forward(answer: Answer, piece: Optional[Piece]) -> None:
            if not self._headers_sent:
                # The headers wait for the first text (or end): an error before it keeps its status.
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                self._headers_sent = True
                if self._endpoint == "chat":
                    for each in answers:
                        await self._chunk(send, each, {"role": "assistant", "content": ""})
            if answer.prompt.echo is not None and answer.index not in echoed:
                # Its prompt's records are known from its first token on.
                echoed.add(answer.index)
                await self._chunk(send, answer, answer.prompt.echo, logprobs=self._logprobs((), answer, echoed=True))
            if piece is not None and piece.reasoning and not self._options.stream_reasoning:
                held.setdefault(answer.index, []).append(piece)
                return
            await release(answer)
            if piece is None:
                await self._chunk(send, answer, None)
            elif piece.reasoning:
                await self._chunk(send, answer, {"reasoning": piece.reasoning}, logprobs=self._logprobs(piece.tokens))
            elif piece.calls:
                calls = [call.for_response(piece.first_call + i) for i, call in enumerate(piece.calls)]
                await self._chunk(send, answer, {"tool_calls": calls}, logprobs=self._logprobs(piece.tokens))
            else:
                texts[answer.index].append(piece.text)
                await self._chunk(send, answer, piece.text, logprobs=self._logprobs(piece.tokens))

        await each_piece(answers, forward)
        self._remember(answers, ["".join(text) for text in texts])
        self._outcome = _request_outcome(answers)
        if self._options.include_usage:
            await _send_event(send, {**self._envelope(self._chunk_kind, []), "usage": self._usage(answers)})
        await _send_body(send, b"data: [DONE]\n\n", more=False)

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self._endpoint == "chat" else "text_completion"

    async def _chunk(
        self, send: Send, answer: Answer, delta: Union[str, dict, None], *, logprobs: Optional[dict] = None
    ) -> None:
        """One streamed chunk of ``answer``'s choice: a piece of text (with
        its tokens' ``logprobs``), the chat's opening role, or (None) its
        end, with its finish reason."""
        ended = delta is None
        if self._endpoint == "chat":
            if not isinstance(delta, dict):
                delta = {} if delta is None else {"content": delta}
            content: dict[str, Any] = {"delta": delta}
        else:
            content = {"text": delta or ""}
        body = self._envelope(self._chunk_kind, [_choice(answer, content, ended=ended, logprobs=logprobs)])
        if self._options.include_usage:
            body["usage"] = None
        await _send_event(send, body)

    def _logprobs(
        self, tokens: Sequence[LoggedToken], answer: Optional[Answer] = None, *, echoed: bool = False
    ) -> Optional[dict[str, Any]]:
        """``tokens``' log-probabilities in the endpoint's shape, after their
        prompt's where ``echoed`` and ``answer``'s prompt is echoed; None
        where the request did not ask for them."""
        if self._options.logprobs is None:
            return None
        texts = self._server.token_texts
        if self._endpoint == "chat":
            return chat_logprobs(tokens, texts)
        shape = completion_logprobs(tokens, texts)
        if not echoed or answer is None or answer.prompt.echo is None:
            return shape
        prompt = answer.prompt
        assert prompt.echo is not None
        return echoed_logprobs(prompt.tokens, answer.generation.prompt_logprobs, texts, len(prompt.echo), shape)

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A response body or chunk of these choices (none: the usage chunk)."""
        body: dict[str, Any] = {
            "id": self._id,
            "object": kind,
            "created": self._created,
            "model": self._server.config.model_name,
            "choices": choices,
        }
        if self._endpoint == "chat":
            body["system_fingerprint"] = None
        return body

    def _usage(self, answers: Sequence[Answer]) -> dict[str, Any]:
        """Each prompt counted once, every choice's tokens (OpenAI's usage for ``n``)."""
        prompt_tokens = _prompt_tokens(answers)
        completion_tokens = sum(answer.num_tokens for answer in answers)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": _cached_tokens(answers)},
        }
        if self._endpoint == "chat":  # a chat answer's reasoning is read out of it
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(a.reasoning_tokens for a in answers)}
        return usage

    def _remember(self, answers: Sequence[Answer], texts: Sequence[str]) -> None:
        """Keep a whole chat answer's conversation for its next turn (a request
        of one choice: of several, none is the conversation's)."""
        if len(answers) != 1:
            return
        (answer,), (text,) = answers, texts
        prompt = answer.prompt
        report = answer.report
        if prompt.text is None or report is None or not answer.complete:
            return
        self._server.memory.remember(
            self._salt, answer_key(text, answer.calls), Turn(prompt.text + report.text, prompt.tokens + report.tokens)
        )

    def _count(self, answers: Sequence[Answer]) -> None:
        metrics = self._server.metrics
        cached, generated = _cached_tokens(answers), sum(answer.num_tokens for answer in answers)
        prompt_tokens = _prompt_tokens(answers)
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.cached_tokens.inc(cached)
        metrics.generated_tokens.inc(generated)
        if self._server.runtime.config.trace:
            _LOG.info(
                "server.request_finished", request_id=self._id, endpoint=self._endpoint,
                prompt_tokens=prompt_tokens, cached_tokens=cached, generated_tokens=generated,
                choices=len(answers), finish_reason=_request_outcome(answers),
            )  # fmt: skip


def _choice(
    answer: Answer, content: dict[str, Any], *, ended: bool = True, logprobs: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """One choice of a body or chunk: ``answer``'s index, its content, its
    tokens' ``logprobs`` (None unless asked for), and its finish reason
    where it has ``ended`` (a chunk's piece: not yet)."""
    finish_reason = answer.finish_reason if ended else None
    return {"index": answer.index, **content, "logprobs": logprobs, "finish_reason": finish_reason}


def _message(text: str, calls: Sequence[ToolCall], reasoning: str) -> dict[str, Any]:
    """A chat answer's message: its text, its reasoning where it was read
    apart, and its calls where it made any (then a message of calls alone
    has no content, as OpenAI's)."""
    message: dict[str, Any] = {"role": "assistant", "content": (text or None) if calls else text}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [call.for_response() for call in calls]
    return message


def _request_outcome(answers: Sequence[Answer]) -> str:
    """A request's outcome as its choices finished: ``length`` if any ran
    out of tokens, else ``stop``."""
    return "length" if any(answer.finish_reason == "length" for answer in answers) else "stop"


def _by_prompt(answers: Sequence[Answer]) -> list[list[Answer]]:
    """The answers grouped by their prompt (the choices of one), in order."""
    groups: dict[int, list[Answer]] = {}
    for answer in answers:
        groups.setdefault(id(answer.prompt), []).append(answer)
    return list(groups.values())


def _prompt_tokens(answers: Sequence[Answer]) -> int:
    """The request's prompt tokens: each prompt's counted once, whatever its choices."""
    return sum(len(group[0].prompt.tokens) for group in _by_prompt(answers))


def _cached_tokens(answers: Sequence[Answer]) -> int:
    """The prompt tokens the request did not compute: of each prompt, those
    every one of its choices found cached (one that computed the prompt
    computed it for the request)."""
    return sum(min(answer.cached_tokens for answer in group) for group in _by_prompt(answers))


async def _send_json(
    send: Send, status: int, body: dict[str, Any], headers: Optional[dict[str, str]] = None
) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await _send_body(send, data, more=False)


async def _send_event(send: Send, body: dict[str, Any]) -> None:
    await _send_body(send, b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


async def _send_body(send: Send, data: bytes, *, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


# -- serving ---------------------------------------------------------------------


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one; read it with
    ``getsockname()``). Connections queue from here on, before :func:`serve`
    accepts them.

    Raises:
        OSError: the address cannot be bound (in use, not this host's).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(
    server: OpenAIServer,
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    graceful_timeout: float = 3.0,
    on_ready: Optional[Callable[[], None]] = None,
) -> None:
    """Serve ``server.app`` with Hypercorn on ``sock`` until ``shutdown_trigger`` returns.

    Runs on the current anyio backend (Hypercorn's asyncio or trio worker).
    The socket is handed over (closed when serving ends). On shutdown, the
    server drains (:meth:`OpenAIServer.drain`): requests still running get
    ``graceful_timeout`` seconds, then are cancelled (each releases what it
    holds); then Hypercorn closes the idle connections and stops. With
    ``kv_events`` in its config, the server publishes the runtime's KV events
    from before the first request to after the last (``server.kv_publisher``).

    Raises:
        InvalidInput: the KV events' sockets cannot be opened.
    """
    from hypercorn.config import Config

    async def trigger() -> None:
        await shutdown_trigger()
        await server.drain(graceful_timeout)

    with contextlib.ExitStack() as stack:
        publisher = None
        if server.config.kv_events is not None:
            publisher = stack.enter_context(KVEventPublisher(server.config.kv_events))
            server.kv_publisher = publisher
            stack.callback(setattr, server, "kv_publisher", None)
        server.draining = False  # served again after a drain
        if on_ready is not None:
            on_ready()
        config = Config()
        config.bind = [f"fd://{sock.detach()}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("mlxkv.server")
        config.graceful_timeout = 1.0  # only idle connections are left by then
        # Hypercorn's keep-alive timer runs from a connection's opening (and
        # each response's end) until a request's headers are whole.
        config.keep_alive_timeout = server.config.header_timeout
        if sniffio.current_async_library() == "trio":
            from hypercorn.trio import serve as hypercorn_serve
        else:
            from hypercorn.asyncio import serve as hypercorn_serve
        async with anyio.create_task_group() as forwarding:
            if publisher is not None:
                forwarding.start_soon(publisher.forward, server.runtime.kv_events(buffer=1 << 16))
            # In a task of its own: on asyncio, Hypercorn's shutdown leaves its task
            # with a cancellation request never taken back, which anyio would later
            # read as the caller's own cancellation.
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    functools.partial(hypercorn_serve, server.app, config, shutdown_trigger=trigger)
                )
            forwarding.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def running(
    server: OpenAIServer, host: str = "127.0.0.1", port: int = 0, *, graceful_timeout: float = 3.0
) -> AsyncIterator[str]:
    """Serve ``server`` for the body of the ``async with``; yields its ``http://host:port``.

    Raises:
        OSError: the address cannot be bound.
    """
    sock = listen(host, port)
    url = url_of(sock)
    stop, stopped = anyio.Event(), anyio.Event()

    async def serving() -> None:
        try:
            await serve(server, sock, shutdown_trigger=stop.wait, graceful_timeout=graceful_timeout)
        finally:
            stopped.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serving)
        try:
            yield url
        finally:
            # Whatever ends the body, the server drains and stops before the
            # task group would cancel it (Hypercorn's shutdown is not
            # cancellation-safe on asyncio).
            stop.set()
            with anyio.move_on_after(graceful_timeout + 5, shield=True):
                await stopped.wait()
