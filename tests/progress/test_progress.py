"""Progress bars (trainsim.progress): silent unless stderr is a terminal, one display at a time."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from trainsim import progress as bars
from trainsim.progress import feed, progress, spawn, status, tracked


@pytest.fixture
def terminal(monkeypatch) -> io.StringIO:
    """A console that claims to be a terminal, writing into a buffer; no CI / TRAINSIM_PROGRESS in the way."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("TRAINSIM_PROGRESS", raising=False)
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100)
    monkeypatch.setattr(bars, "_stderr_console", lambda: console)
    return buffer


def test_silent_and_in_order_when_not_a_terminal(capfd, monkeypatch):
    monkeypatch.delenv("TRAINSIM_PROGRESS", raising=False)
    items = list(progress(iter(["a", "b", "c"]), 3, "timing ops"))
    with status("composing"), tracked("tracing", 4) as update:
        update(2)
        nested = list(progress(range(5), description="estimating"))
    assert items == ["a", "b", "c"] and nested == [0, 1, 2, 3, 4]
    assert capfd.readouterr() == ("", "")
    assert bars._display is None


def test_bar_renders_on_a_terminal_with_description_and_total(terminal):
    assert list(progress(range(7), description="estimating 7 layouts")) == list(range(7))
    out = terminal.getvalue()
    assert "estimating 7 layouts" in out and "7/7" in out
    assert bars._display is None  # stopped, so the next bar starts its own display


@pytest.mark.parametrize("env", [{"TRAINSIM_PROGRESS": "0"}, {"CI": "true"}])
def test_switched_off_by_environment(terminal, monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert list(progress(range(3), description="sweeping")) == [0, 1, 2]
    assert terminal.getvalue() == ""


def test_ci_with_progress_forced_on(terminal, monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("TRAINSIM_PROGRESS", "1")
    list(progress(range(2), description="sweeping"))
    assert "sweeping" in terminal.getvalue()


def test_bar_inside_a_spinner_joins_its_display(terminal):
    """rich cannot nest live displays (LiveError in rich 13): the inner bar becomes a line of the outer."""
    with status("composing") as spin:
        outer = bars._display
        spin(0)
        assert list(progress(range(3), description="timing 3 op(s)")) == [0, 1, 2]
        assert bars._display is outer
    out = terminal.getvalue()
    assert "composing" in out and "timing 3 op(s)" in out and "3/3" in out
    assert bars._display is None


def test_silent_under_a_foreign_live_display(terminal):
    """A caller's own `console.status` owns the terminal: the bar keeps quiet rather than garble it."""
    other = io.StringIO()
    with Console(file=other, force_terminal=True).status("someone else's spinner"):
        assert list(progress(range(3), description="sweeping")) == [0, 1, 2]
    assert terminal.getvalue() == ""


def _worker(rank: int, slot, steps: int) -> None:
    report = feed(slot)
    for done in range(1, steps + 1):
        report(done, steps)


def test_spawned_workers_feed_the_parents_bar(terminal):
    spawn(_worker, 1, (5,), "collecting windows")
    out = terminal.getvalue()
    assert "collecting windows" in out and "5/5" in out


def test_a_forked_worker_keeps_quiet_under_the_parents_display(terminal, monkeypatch):
    """A fork copies the parent's display variable, not its display: the worker must not draw into it."""
    with status("searching"):
        monkeypatch.setattr(bars, "_display_pid", -1)  # as seen from a forked child
        assert list(progress(range(3), description="worker bar")) == [0, 1, 2]
        monkeypatch.setattr(bars, "_display_pid", os.getpid())
    assert "worker bar" not in terminal.getvalue() and "searching" in terminal.getvalue()
