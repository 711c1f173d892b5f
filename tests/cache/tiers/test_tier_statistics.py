"""A tier's counters, shown one way by the statistics, the run report and /metrics."""

from __future__ import annotations

from mlxkv.cache.tiers.tier import TierStatistics


def _stats(available: bool = True) -> TierStatistics:
    return TierStatistics(
        name="file:///kv", num_written=1, num_loaded=2, num_missed=3, num_dropped=4,
        num_corrupt=5, num_evicted=6, num_bytes=None, available=available,
    )  # fmt: skip


def test_counts_name_every_block_counter_once():
    """Each counter under its event, in one order."""
    assert _stats().counts() == (
        ("written", 1), ("loaded", 2), ("missed", 3), ("dropped", 4), ("corrupt", 5), ("evicted", 6),
    )  # fmt: skip


def test_summary_reads_the_counts_and_says_when_unavailable():
    assert _stats().summary() == "1 written, 2 loaded, 3 missed, 4 dropped, 5 corrupt, 6 evicted"
    assert _stats(available=False).summary().endswith("6 evicted (unavailable)")
