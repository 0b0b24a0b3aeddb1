"""Progress bars for long work (sweeps, profiling, dataset collection, layout search), on stderr.

One module so every bar follows the same rules:
  * nothing at all is written unless stderr is a terminal: Snakemake logs, pipes, CI and tests stay
    clean; TRAINSIM_PROGRESS=0 turns bars off on a terminal too, CI (env CI set) turns them off unless
    TRAINSIM_PROGRESS=1;
  * rich cannot show two live displays at once (a second Live on the same console raises LiveError in
    rich 13, one on another console garbles both), so a bar started while `status` or another bar of
    this module is showing becomes one more line of that display; while some other rich live display
    is active (a caller's `console.status`), bars stay silent rather than fight it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.file_proxy import FileProxy
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

from trainsim import processes

T = TypeVar("T")
Update = Callable[..., None]
"""`update(done, total=None)`: the `progress(done, total)` callback the tracing, profiling and collection
functions take."""

_display: Progress | None = None
"""The live display this process shows now; later bars join it."""
_display_pid = 0
"""The process that shows `_display` (a forked worker inherits the variable, not the terminal's display)."""


class _Count(ProgressColumn):
    """'done/total' for a bar, nothing for a spinner (no total)."""

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        return Text(f"{int(task.completed)}/{int(task.total)}", style="progress.download")


def _stderr_console() -> Console:
    # bars follow the real stream, not FORCE_COLOR / TTY_COMPATIBLE: colour in a CI log is fine, animation is not
    isatty = getattr(sys.stderr, "isatty", None)
    return Console(stderr=True, force_terminal=bool(isatty and isatty()))


def enabled(console: Console | None = None) -> bool:
    """Whether a bar would be drawn on `console` (default: stderr) now."""
    setting = os.environ.get("TRAINSIM_PROGRESS", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if os.environ.get("CI") and setting not in ("1", "true", "yes", "on"):
        return False
    if _display is None and (isinstance(sys.stdout, FileProxy) or isinstance(sys.stderr, FileProxy)):
        return False  # another rich live display owns the terminal
    return (console or _stderr_console()).is_terminal


@contextmanager
def tracked(description: str, total: float | None = None, console: Console | None = None) -> Iterator[Update]:
    """Show one bar (no `total`: a spinner) while the block runs; yields `update(done, total=None)`.

    Silent, with a no-op `update`, where `enabled` says no. Inside another bar or `status` of this
    module, the bar is added to that display and removed when the block ends.
    """
    global _display, _display_pid
    forked = _display is not None and _display_pid != os.getpid()  # the parent draws; a worker keeps quiet
    if forked or (_display is None and not enabled(console)):
        yield lambda done, total=None: None
        return
    owner = _display is None
    if owner:
        _display_pid = os.getpid()
        console = console or _stderr_console()
        # the description takes what the bar, count and clock leave of the width, cut with an ellipsis
        description_column = TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True,
                                                                                   overflow="ellipsis"))
        _display = Progress(SpinnerColumn(), description_column, BarColumn(bar_width=24), _Count(),
                            TimeElapsedColumn(), console=console, transient=True, expand=True,
                            redirect_stdout=bool(getattr(sys.stdout, "isatty", lambda: False)()),
                            redirect_stderr=True)
        _display.start()
    display = _display
    task = display.add_task(description, total=total)

    def update(done: float, total: float | None = None) -> None:
        display.update(task, completed=done, **({"total": total} if total is not None else {}))

    try:
        yield update
    finally:
        display.refresh()  # draw the final count once: a fast loop may end between two timed refreshes
        display.remove_task(task)
        if owner:
            display.stop()
            _display = None


def status(description: str, console: Console | None = None):
    """A spinner for work without a count (the CLI's 'composing ...'); bars started inside join it."""
    return tracked(description, None, console)


def progress(iterable: Iterable[T], total: float | None = None, description: str = "",
             console: Console | None = None) -> Iterator[T]:
    """Yield every item of `iterable` in order, advancing a bar of `total` items (default: len(iterable))."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    with tracked(description, total, console) as update:
        for done, item in enumerate(iterable, 1):
            yield item
            update(done)


def spawn(fn: Callable[..., None], nprocs: int, args: tuple, description: str, total: float | None = None) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs) with a bar the workers feed.

    `fn(rank, slot, *args)`: one worker (rank 0, say) passes `feed(slot)` to its loop as the
    `progress(done, total)` callback; the bar is drawn here, in the parent, so no worker's output competes
    with the parent's display. Worker failures are raised as by `spawn` itself.
    """
    slot = processes.context().Array("d", [0.0, total or 0.0], lock=False)  # done, total
    context = processes.start(fn, nprocs, (slot, *args), join=False)
    with tracked(description, total) as update:
        while not context.join(timeout=0.1):
            update(slot[0], slot[1] or None)
        update(slot[0], slot[1] or None)  # the last report, made after the previous poll


def feed(slot) -> Update:
    """The `progress(done, total)` callback that reports a `spawn` worker's work to the parent's bar."""

    def update(done: float, total: float | None = None) -> None:
        if total is not None:
            slot[1] = total
        slot[0] = done

    return update
