"""``mlxkv serve``: an OpenAI-compatible HTTP server over :class:`~mlxkv.CacheRuntime`.

The app (:mod:`mlxkv.server.app`: Starlette, served by Hypercorn on asyncio
or trio, metrics through prometheus-client) needs the ``server`` extra
(``pip install 'mlxkv[server]'``); this package imports it only when one of
its names is used, so ``mlxkv`` works without it. The request checks
(:mod:`~mlxkv.server.request`), stop strings (:mod:`~mlxkv.server.stop`),
admission (:mod:`~mlxkv.server.admission`) and the chat memory
(:mod:`~mlxkv.server.chat`) are plain Python.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OpenAIServer", "ServerConfig", "listen", "load_chat_template", "running", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mlxkv.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'mlxkv.server' has no attribute {name!r}")
