"""Whether a tier's storage answers, and when to try it again after it did not.

A tier that is down must cost its callers nothing: no timeout per call, no
warning per block. :class:`TierHealth` is the sans-I/O state machine that
decides it. The tier asks :meth:`~TierHealth.allows` before each call to its
storage (with the event loop's monotonic clock), and reports the outcome
with :meth:`~TierHealth.succeeded` or :meth:`~TierHealth.failed`; the return
values say when an outage starts and ends, which is when the tier logs
(one warning per outage, one info line when it is over).

While down, calls are refused until the back-off delay has passed; then one
call is let through as a probe. A probe that fails doubles the delay (up to
``max_delay``); one that succeeds, or any call that succeeds, ends the
outage and resets the delay. A call cancelled before its outcome is known
must be reported with :meth:`~TierHealth.abandoned`.
"""

from __future__ import annotations

import attrs

from mlxkv.cache.errors import InvalidInput

__all__ = ["TierHealth"]


@attrs.define
class TierHealth:
    """Back-off state of one tier's storage.

    Invariants:
        - ``available`` or ``retry_at`` is the earliest time a probe may go.
        - ``probing`` only while not ``available``.
        - ``initial_delay <= delay <= max_delay``.
    """

    initial_delay: float = 0.5
    max_delay: float = 30.0
    available: bool = attrs.field(default=True, init=False)
    probing: bool = attrs.field(default=False, init=False)
    delay: float = attrs.field(init=False)
    retry_at: float = attrs.field(default=0.0, init=False)
    num_outages: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if not 0 < self.initial_delay <= self.max_delay:
            raise InvalidInput(
                "initial_delay", self.initial_delay, f"must be in (0, max_delay={self.max_delay}]"
            )
        self.delay = self.initial_delay

    def allows(self, now: float) -> bool:
        """Whether a call may go to the storage now (the probe, while down)."""
        if self.available:
            return True
        if self.probing or now < self.retry_at:
            return False
        self.probing = True
        return True

    def succeeded(self) -> bool:
        """Record a call that the storage answered; True if that ends an outage."""
        recovered = not self.available
        self.available = True
        self.probing = False
        self.delay = self.initial_delay
        return recovered

    def failed(self, now: float) -> bool:
        """Record a call that failed; True if that starts an outage.

        A failure while down that is not the probe's (a call that was already
        under way when the outage began) changes nothing.
        """
        if self.available:
            self.available = False
            self.num_outages += 1
            self.delay = self.initial_delay
            self.retry_at = now + self.delay
            return True
        if self.probing:
            self.probing = False
            self.delay = min(self.delay * 2, self.max_delay)
            self.retry_at = now + self.delay
        return False

    def abandoned(self) -> None:
        """Record a call that ended without an outcome (it was cancelled).

        A cancelled probe says nothing about the storage: the next call may
        probe again at once, rather than the tier being refused for good.
        """
        self.probing = False
