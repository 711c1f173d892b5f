"""Back-off of a tier that does not answer: one outage signal, one probe at a time."""

from __future__ import annotations

import pytest

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers import TierHealth


class TestTierHealth:
    def test_an_outage_is_signalled_once(self):
        """Only the first failure starts an outage; later ones while down do not."""
        health = TierHealth(initial_delay=1.0, max_delay=8.0)
        assert health.failed(0.0) is True
        assert health.failed(0.1) is False
        assert not health.available and health.num_outages == 1

    def test_calls_refused_until_the_delay_then_one_probe(self):
        """While down, calls are refused until retry time; then exactly one goes."""
        health = TierHealth(initial_delay=1.0, max_delay=8.0)
        health.failed(0.0)
        assert not health.allows(0.5)
        assert health.allows(1.0)
        assert not health.allows(1.0)

    def test_failed_probes_double_the_delay_up_to_the_cap(self):
        """Each failed probe doubles the delay, never past max_delay."""
        health = TierHealth(initial_delay=1.0, max_delay=4.0)
        health.failed(0.0)
        now, delays = 0.0, []
        for _ in range(4):
            now = health.retry_at
            assert health.allows(now)
            health.failed(now)
            delays.append(health.delay)
        assert delays == [2.0, 4.0, 4.0, 4.0]

    def test_success_ends_the_outage(self):
        """A success after an outage says so once and resets the delay."""
        health = TierHealth(initial_delay=1.0, max_delay=8.0)
        health.failed(0.0)
        assert health.allows(1.0)
        assert health.succeeded() is True
        assert health.succeeded() is False
        assert health.available and health.delay == 1.0 and health.allows(1.0)

    def test_a_cancelled_probe_lets_the_next_call_probe(self):
        """A probe cancelled before its outcome does not shut the tier for good."""
        health = TierHealth(initial_delay=1.0, max_delay=8.0)
        health.failed(0.0)
        assert health.allows(1.0)
        health.abandoned()
        assert health.allows(1.0)

    def test_bad_delays_refused(self):
        """The initial delay must be positive and at most the cap."""
        with pytest.raises(InvalidInput):
            TierHealth(initial_delay=0.0)
        with pytest.raises(InvalidInput):
            TierHealth(initial_delay=2.0, max_delay=1.0)
