"""A generation request's body, read as admission allows, and the client's leaving noticed.

An ASGI app learns that a client left only by reading past the body it sent,
and a body read whole before the request is admitted costs its bytes for as
long as the request waits: sixteen connections queued with 40 MB bodies held
640 MB. :class:`RequestBody` does both with one reader: before the request is
admitted it takes at most :data:`QUEUED_BYTES` of the body (a chat request's
body is whole by then; the rest of a larger one waits in the server's and
the kernel's bounded buffers), after it up to the body limit; once the body
is whole it goes on reading until the client leaves, and says so at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import anyio
from starlette.types import Receive

from mlxkv.server.errors import ApiError

__all__ = ["QUEUED_BYTES", "RequestBody"]

#: The most body bytes a request takes while it waits for admission.
QUEUED_BYTES = 64 << 10
#: A refusal that leaves the rest of a body unread ends the connection.
CLOSE = {"Connection": "close"}


class RequestBody:
    """The body of one request, read by :meth:`pump` and handed over by :meth:`wait`.

    Owns: the bytes received so far and whether they are the whole body. One
    task reads (:meth:`pump`); one waits (:meth:`wait`); both on the event loop.

    Invariants:
        - until :meth:`admit`, reading stops once ``QUEUED_BYTES`` are held (so
          at most that plus one message's bytes are held);
        - past ``limit`` bytes, nothing is held and nothing more is read: the
          body is refused (413).
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._body = bytearray()  # grown in place: no list of chunks, no copy when joined
        self._admitted = anyio.Event()
        self._settled = anyio.Event()  # the body is whole, too large, or the client left
        self._too_large = False
        self._left = False
        self._whole = False
        #: The most bytes held at once.
        self.peak_bytes = 0

    @staticmethod
    def refuse_declared(headers: Any, limit: int) -> None:
        """Refuse a body whose ``Content-Length`` is past ``limit``, before reading it.

        Raises:
            ApiError: 413.
        """
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)

    @property
    def whole(self) -> bool:
        """Whether the client sent its whole body (else a response cuts it short)."""
        return self._whole

    def admit(self) -> None:
        """The request holds a slot: read the body to its end."""
        self._admitted.set()

    async def pump(self, receive: Receive, left: Callable[[], None]) -> None:
        """Read the body as admission allows, then wait for the client to leave;
        call ``left()`` when it does (at any point). Runs until then, or until
        cancelled (the answer is sent)."""
        while True:
            if not self._settled.is_set() and len(self._body) >= QUEUED_BYTES:
                await self._admitted.wait()
            message = await receive()
            if message["type"] == "http.disconnect":
                self._left = True
                self._settled.set()
                left()
                return
            if self._settled.is_set():
                continue  # a body past its end: nothing of it is kept
            self._body += message.get("body", b"")
            self.peak_bytes = max(self.peak_bytes, len(self._body))
            if len(self._body) > self._limit:
                self._too_large = True
                self._body = bytearray()
                self._settled.set()
                await anyio.sleep_forever()  # the rest stays unread; the answer closes
            if not message.get("more_body", False):
                self._whole = True
                self._settled.set()

    async def wait(self, timeout: float) -> Optional[bytearray]:
        """The whole body, once admitted (:meth:`admit` is called here); None if the
        client left. The body is handed over: this object keeps no reference.

        Raises:
            ApiError: 413 past the limit, 408 if the body is not whole within
                ``timeout`` seconds of now.
        """
        self.admit()
        with anyio.move_on_after(timeout):
            await self._settled.wait()
        if not self._settled.is_set():
            self._settled.set()  # what arrives from now on is dropped
            self._body = bytearray()
            raise ApiError(
                408,
                f"the request body did not arrive within {timeout:g} s",
                code="body_timeout",
                headers=CLOSE,
            )
        if self._left:
            return None
        if self._too_large:
            raise _too_large(self._limit)
        body, self._body = self._body, bytearray()
        return body


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes", code="body_too_large", headers=CLOSE)
