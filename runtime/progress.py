"""Progress and reports on a terminal, drawn by ``rich``; plain lines elsewhere.

:class:`Progress` shows how far a workload is: a live ``rich`` bar when its
stream is a terminal, otherwise one plain status line every few seconds (and
one at the end), which reads well in logs and CI. :func:`print_table` prints
a report's ``(name, value)`` rows as a ``rich`` table.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Optional, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

__all__ = ["Progress", "print_table"]


class Progress:
    """How many of ``total`` items are done, with a status text, on ``stream``.

    Times shown are the caller's (``elapsed`` passed in), so the display and
    the caller's final report agree: the caller ends with :meth:`finish`
    and the figure it reports.

    Owns: the ``rich`` progress display (on a terminal) or the time of the
    last plain line.

    Invariants:
        - ``done <= total``; nothing is written after :meth:`close`.
    """

    def __init__(
        self, total: int, stream: TextIO = sys.stderr, *, label: str = "mlxkv run", every: float = 2.0
    ) -> None:
        """Prepare the display; nothing is shown before the first :meth:`update`.

        Args:
            total: items in all.
            stream: where to draw.
            label: the prefix of plain lines.
            every: seconds between plain lines (not on a terminal).
        """
        self.total = total
        self.done = 0
        self._stream = stream
        self._label = label
        self._every = every
        self._printed = -math.inf
        self._closed = False
        self._bar: Optional[RichProgress] = None
        console = Console(file=stream)
        if console.is_terminal:
            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task(label, total=total, status="")
            self._bar.start()

    def update(self, done: int, status: str, elapsed: float) -> None:
        """Show ``done`` of ``total`` with ``status`` after ``elapsed`` seconds."""
        self._show(done, status, elapsed, final=False)

    def finish(self, done: int, status: str, elapsed: float) -> None:
        """Show the final state (always printed, also off a terminal) and close."""
        self._show(done, status, elapsed, final=True)
        self.close()

    def close(self) -> None:
        """End the display (the bar stays on screen); idempotent."""
        if self._bar is not None and not self._closed:
            self._bar.stop()
        self._closed = True

    def _show(self, done: int, status: str, elapsed: float, *, final: bool) -> None:
        if self._closed:
            return
        self.done = min(done, self.total)
        text = f"{status}, {elapsed:.1f} s"
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, status=text)
        elif final or elapsed - self._printed >= self._every:
            self._printed = elapsed
            self._stream.write(f"{self._label}: {self.done}/{self.total} {text}\n")
            self._stream.flush()


def print_table(rows: Sequence[tuple[str, str]], stream: TextIO = sys.stdout, title: Optional[str] = None) -> None:
    """Print ``(name, value)`` rows as two aligned columns, names in bold on a terminal.

    No line ends in spaces (a table would pad every value to the widest, and
    rich's wrapping would leave them at the break): each row is one line,
    which a terminal folds if it must.
    """
    console = Console(file=stream, soft_wrap=True)
    if title is not None:
        console.print(title, style="bold")
    width = max((len(name) for name, _ in rows), default=0)
    for name, value in rows:
        console.print(Text.assemble((name.ljust(width), "bold"), "  ", value) if value else Text(name, "bold"))
