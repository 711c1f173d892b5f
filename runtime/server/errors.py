"""Errors as the OpenAI API shapes them: a status and ``{"error": {...}}``.

Every refusal of ``mlxkv serve`` is an :class:`ApiError`; the runtime's typed
errors map onto one with :meth:`ApiError.from_error`:

=====================================  ======  ===============================
what                                   status  ``type`` / ``code``
=====================================  ======  ===============================
bad JSON, an unknown or mistyped       400     ``invalid_request_error``
field, a prompt past the context
(:class:`~mlxkv.InvalidInput`)
no or a wrong API key                  401     ``invalid_request_error`` /
                                               ``invalid_api_key``
a body still arriving after            408     ``invalid_request_error`` /
``body_timeout`` seconds                       ``body_timeout``
a body over ``max_body_bytes``         413     ``invalid_request_error`` /
                                               ``body_too_large``
an unknown model or path               404     ``invalid_request_error`` /
                                               ``model_not_found``,
                                               ``not_found``
at the admission limit                 503     ``server_error`` / ``overloaded``
the runtime is not running             503     ``server_error`` /
(:class:`~mlxkv.RuntimeClosed`)                ``runtime_closed``
a computation failed                   500     ``server_error`` /
(:class:`~mlxkv.ComputeFailed`: the            ``compute_failed``
cause is logged, not sent)
=====================================  ======  ===============================
"""

from __future__ import annotations

from typing import Any, Optional

from mlxkv.errors import CacheError, ComputeFailed, InvalidInput, RuntimeClosed

__all__ = ["ApiError"]


class ApiError(Exception):
    """A request refused or failed, with the OpenAI error body to answer it with.

    Attributes:
        status: the HTTP status.
        message: what went wrong, for a person.
        type: the OpenAI error type.
        param: the request field at fault, or None.
        code: a machine-readable code, or None.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_error(cls, error: CacheError) -> ApiError:
        """The response to one of the runtime's typed errors."""
        if isinstance(error, InvalidInput):
            return cls(400, str(error), param=error.argument)
        if isinstance(error, RuntimeClosed):
            return cls(503, str(error), type="server_error", code="runtime_closed")
        if isinstance(error, ComputeFailed):
            # What raised stays in the server's log: MLX's messages name its internals.
            return cls(
                500,
                f"the computation of request {error.request_id} failed",
                type="server_error",
                code="compute_failed",
            )
        return cls(500, f"{type(error).__name__}: {error}", type="server_error")

    @classmethod
    def overloaded(cls, running: int, waiting: int) -> ApiError:
        """503: every generation slot is taken and the queue is full."""
        return cls(
            503,
            f"the server is at its admission limit ({running} requests running,"
            f" {waiting} waiting): retry later",
            type="server_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )
