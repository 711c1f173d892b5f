"""The server's tests: a real server on a free loopback port, on asyncio and on trio.

Tests of the app need the ``server`` extra and the ``openai`` client (test
extra); their modules skip without them. ``serve`` gives a running server
over a fresh runtime on the built-in model, with the chat template loaded
once per session.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import pytest

from mlxkv.default_model import DEFAULT_MODEL, ensure_model


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The anyio backend of the test (the server's and the client's): asyncio, then trio."""
    return request.param


@pytest.fixture(scope="session")
def default_model_path(model_dir: Any) -> str:
    """The built-in model's directory (written once per session)."""
    return str(ensure_model(DEFAULT_MODEL, model_dir))


@pytest.fixture(scope="session")
def chat_template(default_model_path: str) -> Any:
    """The built-in model's chat template (loading a tokenizer takes a while: once)."""
    from mlxkv.server.chat import ChatTemplate

    return ChatTemplate.load(default_model_path)


@attrs.frozen
class Served:
    """A running server: its runtime, the server object, its URL and an OpenAI client."""

    runtime: Any
    server: Any
    url: str
    client: Any


@pytest.fixture
def serve(default_model_path: str, chat_template: Any) -> Callable[..., Any]:
    """``async with serve(api_keys=..., max_concurrent=..., **runtime_options) as s``:
    a fresh runtime on the built-in model, served on a free loopback port."""
    from openai import AsyncOpenAI

    from mlxkv import CacheRuntime
    from mlxkv.server import OpenAIServer, ServerConfig, running

    @contextlib.asynccontextmanager
    async def serving(
        *, api_key: str = "unused", path: str = default_model_path, chat: Any = chat_template,
        server_options: dict[str, Any] | None = None, **runtime_options: Any,
    ) -> AsyncIterator[Served]:  # fmt: skip
        runtime_options.setdefault("block_size", 16)
        async with CacheRuntime(model=path, **runtime_options) as rt:
            config = ServerConfig(model_name="tiny", **(server_options or {}))
            server = OpenAIServer(rt, config, chat=chat)
            async with running(server, graceful_timeout=0.5) as url:
                async with AsyncOpenAI(
                    base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=30
                ) as client:
                    yield Served(rt, server, url, client)

    return serving


#: A chat template that offers tools and writes calls as Qwen's do
#: (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``: mlx-lm's
#: ``json_tools`` syntax, which it infers from this template), over the
#: built-in model's byte-level tokenizer; without tools it renders what the
#: built-in template renders.
TOOL_TEMPLATE = (
    "{% if tools %}<|begin_of_text|>system: Tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% for call in m.tool_calls or [] %}{% set tool_call = call.function %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|begin_of_text|>assistant: {% endif %}"
)


@pytest.fixture(scope="session")
def tool_model_path(default_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in model with :data:`TOOL_TEMPLATE` for its chat template
    (its other files linked, not copied)."""
    import json
    from pathlib import Path

    source, target = Path(default_model_path), tmp_path_factory.mktemp("tool-model")
    for file in source.iterdir():
        if file.name != "tokenizer_config.json":
            (target / file.name).symlink_to(file)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    return str(target)


@pytest.fixture(scope="session")
def tool_chat_template(tool_model_path: str) -> Any:
    """:data:`TOOL_TEMPLATE`, loaded as the server loads a model's template."""
    from mlxkv.server.chat import ChatTemplate

    return ChatTemplate.load(tool_model_path)
