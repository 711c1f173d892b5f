"""``mlxkv serve``: the OpenAI-compatible server as a command.

Imports nothing of the server stack until it runs, so that the ``mlxkv``
command works without the ``server`` extra; ``mlxkv serve`` without it is one
line naming the extra, exit status 2. So is any bad option, a model that does
not load, or an address that cannot be bound. Once the model is loaded and
the socket listens, one line on standard error gives the URL. Ctrl-C (or
SIGTERM) stops it: requests still running get a few seconds, then are
cancelled and release what they hold, the runtime closes, and the command
says "interrupted" (exit 130; "terminated", 143, for SIGTERM). A second
signal cuts the grace period short; a third, or one while the model loads,
cancels everything at once.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import sys
from typing import Any, Optional

import anyio

from mlxkv.errors import CacheError, InvalidInput
from mlxkv.units import parse_bytes

__all__ = ["DESCRIPTION", "HELP", "add_serve_options", "serve_command"]

_USAGE = 2
#: Hypercorn, Starlette and prometheus-client: what the ``server`` extra installs.
_STACK = ("hypercorn", "starlette", "prometheus_client", "zmq", "msgpack")


#: ``mlxkv serve``'s line in ``mlxkv --help``, and its description.
HELP = "serve a model over the OpenAI HTTP API (needs the server extra)"
DESCRIPTION = (
    "An OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions,"
    " their /render, /health, /metrics; KV events for routers with --kv-events) over the runtime, on the built-in model or --model PATH. Needs the"
    " server extra: pip install 'mlxkv[server]'."
)


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``mlxkv serve`` it has alone (:mod:`mlxkv.cli` adds
    the block pool's, the scheduling's, ``--backend`` and ``--trace``, as ``mlxkv run``
    has them)."""
    parser.add_argument(
        "--model", help="an mlx-lm or mlx-vlm model directory (default: the built-in model)"
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's id in the API (default: --model's directory name, or its Hub id as given)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (127.0.0.1: this machine only)",
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="the port (8000; 0 picks a free one)"
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=32,
        metavar="N",
        help="generations admitted at once; a request of n choices is n (32)",
    )
    parser.add_argument(
        "--max-choices",
        type=int,
        default=16,
        metavar="N",
        help="the most generations one request may ask for (n choices, times its prompts on /v1/completions);"
        " each generates side by side (16)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=128,
        metavar="N",
        help="requests waiting for admission; beyond, 503 (128)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="a chat request's max_tokens when it names none (512)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY'; repeat for several tenants, each its own cache namespace",
    )
    parser.add_argument(
        "--public-metrics",
        action="store_true",
        help="with --api-key, answer /metrics without a key too (for a scraper that sends none)",
    )
    parser.add_argument(
        "--max-body",
        default="64MiB",
        metavar="SIZE",
        help="the largest request body taken, images included (64MiB)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long an admitted request's body may take to arrive; then 408 (30)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long a connection may take to send a request's headers, or stay idle"
        " between requests; then it is closed (5)",
    )
    parser.add_argument(
        "--kv-events",
        metavar="ADDRESS",
        help="publish KV events as vLLM does, on a ZMQ PUB socket (tcp://*:5557 binds,"
        " tcp://HOST:PORT connects to a router's SUB)",
    )
    parser.add_argument(
        "--kv-events-replay",
        metavar="ADDRESS",
        help="a ZMQ ROUTER socket answering replay requests from a sequence number (tcp://*:5558)",
    )
    parser.add_argument(
        "--kv-events-topic", default="", metavar="TOPIC", help="the first frame of every KV event message ('')"
    )
    parser.add_argument(
        "--kv-events-salted",
        choices=("omit", "announce"),
        default="omit",
        help="tenants' blocks (cache_salt, or --api-key tenants): kept off the wire (omit, the"
        " default) or announced with their tokens (announce)",
    )
    parser.add_argument(
        "--chat-template-args",
        metavar="JSON",
        help="the chat template's variables where a request sets none, as a JSON object"
        " ('{\"enable_thinking\": false}' for a Qwen3)",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="on Ctrl-C, how long running requests may finish before they are cancelled (3)",
    )


def serve_command(args: argparse.Namespace) -> int:
    """Run ``mlxkv serve``; the exit status."""
    missing = _missing_stack()
    if missing is not None:
        return _say(
            f"needs the server extra: pip install 'mlxkv[server]' ({missing} is not installed)",
            _USAGE,
        )
    from mlxkv.default_model import DEFAULT_MODEL, ensure_model
    from mlxkv.runtime_options import runtime_config
    from mlxkv.server.app import ServerConfig, listen
    from mlxkv.server.kv_wire import KVWireConfig

    try:
        model = args.model or str(ensure_model(DEFAULT_MODEL))
        config = runtime_config(args, model=model)
        server_config = ServerConfig(
            model_name=args.served_model_name or _model_name(args.model) or DEFAULT_MODEL.name,
            api_keys=args.api_key,
            max_concurrent=args.max_concurrent,
            max_queue=args.max_queue,
            max_choices=args.max_choices,
            max_tokens=args.max_tokens,
            max_body_bytes=parse_bytes(args.max_body, argument="--max-body"),
            body_timeout=args.body_timeout,
            header_timeout=args.header_timeout,
            public_metrics=args.public_metrics,
            kv_events=_kv_wire(args, KVWireConfig),
            chat_template_args=_json_object(args.chat_template_args, "--chat-template-args"),
        )
    except InvalidInput as error:
        return _say(str(error), _USAGE)
    if not 0 <= args.port <= 65535:
        return _say(f"invalid --port={args.port}: must be in [0, 65535]", _USAGE)
    if not args.graceful_timeout >= 0:
        return _say(f"invalid --graceful-timeout={args.graceful_timeout}: must be >= 0", _USAGE)
    try:
        sock = listen(args.host, args.port)
    except OSError as error:
        return _say(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}", _USAGE)
    trace = None
    try:
        if args.trace is not None:
            from mlxkv.tracing import configure

            trace = open(args.trace, "w")
            configure(json=True, file=trace)
        serving = functools.partial(
            _serve, config, server_config, sock, args.graceful_timeout
        )
        signum = anyio.run(serving, backend=args.backend)
    except CacheError as error:  # a model that does not load, a pool too small
        return _say(str(error), _USAGE)
    finally:
        sock.close()  # a no-op once the server took it over
        if trace is not None:
            trace.close()
    if signum == signal.SIGTERM:
        return _say("terminated", 128 + signal.SIGTERM)
    return _say("interrupted", 128 + signal.SIGINT)


def _kv_wire(args: argparse.Namespace, config: Any) -> Any:
    """The KV events' :class:`~mlxkv.server.kv_wire.KVWireConfig`, or None without ``--kv-events``."""
    if args.kv_events is None:
        if args.kv_events_replay is not None:
            raise InvalidInput("kv_events_replay", args.kv_events_replay, "needs --kv-events")
        return None
    return config(
        endpoint=args.kv_events,
        replay_endpoint=args.kv_events_replay,
        topic=args.kv_events_topic,
        salted=args.kv_events_salted,
    )


def _json_object(text: Optional[str], option: str) -> Any:
    """``--chat-template-args``' JSON text as the template's variables (None: not given)."""
    from mlxkv.server.request import template_variables

    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidInput(option, text, "must be a JSON object") from None
    return template_variables(value, option)


def _model_name(model: Optional[str]) -> Optional[str]:
    """The API's default id for ``--model``: a local directory's name (its path
    stays off the wire), or a Hub id as given."""
    if model is None:
        return None
    path = os.path.normpath(os.path.expanduser(model))
    return os.path.basename(path) if os.path.isdir(path) else model


def _missing_stack() -> Optional[str]:
    import importlib

    for name in _STACK:
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def _say(message: str, status: int) -> int:
    print(f"mlxkv serve: {message}", file=sys.stderr)
    return status


async def _serve(
    runtime_config: Any, server_config: Any, sock: socket.socket, graceful_timeout: float
) -> int:
    """Load, serve until a signal, close; the signal that stopped it.

    Raises:
        CacheError: the runtime did not start (the model did not load, say).
    """
    from mlxkv.runtime import CacheRuntime
    from mlxkv.server.app import OpenAIServer, load_chat_template, serve, url_of

    stop = anyio.Event()
    received: list[int] = []
    server: Optional[OpenAIServer] = None
    failure: Optional[CacheError] = None
    async with anyio.create_task_group() as tg:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    received.append(signum)
                    if server is None or len(received) > 2:
                        tg.cancel_scope.cancel()  # still loading, or a third signal
                    elif len(received) == 1:
                        stop.set()  # drain: running requests get the grace period
                    else:
                        server.cancel_requests()  # no more grace

        tg.start_soon(on_signals)
        try:
            async with CacheRuntime(runtime_config) as rt:
                chat = await load_chat_template(runtime_config.model)
                server = OpenAIServer(rt, server_config, chat=chat)
                ready = functools.partial(
                    print,
                    f"mlxkv serve: {url_of(sock)}/v1 serves {server_config.model_name}"
                    " (Ctrl-C stops it)",
                    file=sys.stderr,
                    flush=True,
                )
                await serve(
                    server,
                    sock,
                    shutdown_trigger=stop.wait,
                    graceful_timeout=graceful_timeout,
                    on_ready=ready,
                )
        except CacheError as error:  # kept out of the task group's exception group
            failure = error
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return received[0] if received else signal.SIGINT
