"""Keep the objects a runtime starts with out of the cyclic garbage collector's scans.

A full collection (generation 2) visits every tracked object. After a model
loads, a process holds about 100,000 of them (the model, mlx-lm, the
tokenizer, their libraries), and a full collection scans them all: every
request in flight stalls for that long, at whichever step the collector
happens to run. ``gc.freeze()`` moves every tracked object into the
permanent generation, which collections skip (the figures before and after:
docs/benchmarks.md, ``scripts/bench_gc.py``); reference counting still frees those objects as usual, only
reference cycles among them wait.

:class:`HeapFreeze` counts the runtimes that asked for it in this process:
each start freezes what is alive then, and when the last of them stops,
``gc.unfreeze()`` hands the permanent generation back to the collector, so
a cycle left behind by a closed runtime is still collected. An application
that calls ``gc.freeze()`` itself should turn the runtime's off
(``RuntimeConfig(freeze_gc=False)``): the last runtime to stop would
unfreeze its objects too.
"""

from __future__ import annotations

import gc

__all__ = ["HEAP_FREEZE", "HeapFreeze"]


class HeapFreeze:
    """The process's count of runtimes that keep the heap frozen.

    No lock: runtimes start and stop on their event loop's thread, and the
    count is a list, whose appends and pops the interpreter does whole. Two
    threads starting and stopping runtimes at the same moment can at worst
    leave the heap unfrozen while one of them runs (slower collections),
    never frozen with no holder.

    Invariants:
        - ``holders >= 0``; the permanent generation is the collector's
          again whenever ``holders`` returns to 0.
    """

    def __init__(self) -> None:
        self._holds: list[None] = []

    @property
    def holders(self) -> int:
        return len(self._holds)

    def hold(self) -> None:
        """Freeze every object tracked now; count one more holder."""
        gc.freeze()
        self._holds.append(None)

    def release(self) -> None:
        """Count one holder less; the last one unfreezes the heap."""
        assert self._holds, "released more often than held"
        self._holds.pop()
        if not self._holds:
            gc.unfreeze()


#: The one count of the process (the collector is process-wide).
HEAP_FREEZE = HeapFreeze()
