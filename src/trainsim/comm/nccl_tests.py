"""Read nccl-tests results (all_reduce_perf, all_gather_perf, ...) into tidy tables, one per run.

The NCCL cost model is calibrated against measured collective times, and published measurements come
in several shapes: raw nccl-tests output (often inside a whole job log), hand-trimmed copies, CSV lookup
tables. This module turns each run into rows of (collective, message_bytes, dtype, placement, time_s,
algbw_gbps, busbw_gbps) and refuses, with file and line, anything it cannot read as a measurement rather
than guessing.

Column layouts (modern and old nccl-tests, trimmed tables, CSV lookup tables): see nccl_layout.py.
Measurements with #wrong > 0 (nccl-tests counted wrong elements) are left out and counted (skipped_wrong).

Job logs
  * srun task labels (`0: `) and Open MPI tags (`[1,0]<stdout>:`) are stripped, a tag also where concurrent
    output put it inside another line (a host name of the rank list, between two rank lines).
  * NCCL INFO/WARN, SHARP (`[host:0:pid - context.c:589] INFO ...`) and UCX log records are skipped, also
    one written into the middle of a data row (NCCL writes to the same stdout while nccl-tests prints a row
    in pieces): the pieces on either side are joined back into the row.
  * No line that looks like a data row (its first field starts with a digit) is dropped silently: one cut
    short, with extra fields, damaged by log output or before any header is left out and listed in the
    result's `skipped` with its line and reason. A complete row whose cell is not what its column holds is
    an error instead: that is a layout this parser does not understand, not damage.
  * Several runs in one file (a column header after data rows starts the next; so does nccl-tests' run
    preamble before headerless rows): one table each, with its own rank and node count
    (parse_nccl_tests_runs; parse_nccl_tests wants exactly one). One file holds one collective.
Rank and node counts: the run's header checked against busbw / algbw, see nccl_ranks.py.

Files in data/nccl-tests: the AWS and OCI all_reduce tables, the three vTrain CSVs, the ml-engineering A100
table and the li-plus sendrecv table parse. The CoreWeave table is refused: its header says 64 ranks but
busbw / algbw says 96. The h200 nvls-vs-ring and mscclpp files are markdown summaries with no (size, time)
sweep, so parsing them here raises NcclTestsFormatError; comm/busbw_tables.py reads them.

Size semantics (nccl-tests prints max(send, recv) bytes of one rank, and algbw = size / time):
all_reduce, broadcast, reduce, send_recv: the buffer of one rank; all_gather: the gathered output,
each rank contributes size / nranks; reduce_scatter: the input, each rank keeps size / nranks;
all_to_all: a rank's whole send buffer, size / nranks to each peer.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from trainsim.comm.nccl_layout import (
    FALLBACK_COUNTS,
    Layout,
    Measurement,
    RowError,
    fallback_layout,
    is_header,
    parse_header,
    parse_row,
)
from trainsim.comm.nccl_ranks import BandwidthRow, RankCountError, busbw_factor, run_counts

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast", "reduce")
COLUMNS = ("collective", "message_bytes", "dtype", "placement", "time_s", "algbw_gbps", "busbw_gbps", "source")
SKIP_TRUNCATED = "truncated row"
SKIP_EXTRA = "extra columns"
SKIP_LOG_DAMAGE = "row damaged by log output"
SKIP_NO_HEADER = "data before any column header"

_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
            "alltoall": "all_to_all", "sendrecv": "send_recv", "broadcast": "broadcast", "bcast": "broadcast",
            "reduce": "reduce"}
_LAUNCHER_PREFIX = re.compile(r"^(?:\s*\d+: ?|\[\d+,\d+\]<std(?:out|err)>: ?)")
_OUTPUT_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>: ?")
"""An Open MPI output tag anywhere in a line: ranks writing at once interleave their output, so a tag can land
inside another rank's line (a host name, between two rank lines)."""
_LOG_RECORD = re.compile(
    r"[A-Za-z][\w.-]*:\d+:\d+ \[\d+\] NCCL (?:INFO|WARN|TRACE|ERROR)"  # NCCL_DEBUG: host:pid:tid [dev] NCCL INFO
    r"|\[[\w.-]+:\d+:\d+ - [\w.]+:\d+\]"  # SHARP: [host:rank:pid - context.c:589]
    r"|\[\d+\.\d+\] \[[\w.-]+:\d+ *:\d+\]"  # UCX: [1700000000.123456] [host:pid:tid]
    r"|\bNCCL (?:INFO|WARN|TRACE|ERROR)\b"
)
_DATA_START = re.compile(r"\d[\w.]*(?=[\s,]|$)")
_RUN_START = re.compile(r"\bnThread\s+\d|Collective test starting|nccl-tests version|Using devices|_perf\b")
_PERF_BINARY = re.compile(
    r"(?<![A-Za-z0-9_])(all_reduce|all_gather|reduce_scatter|alltoall|sendrecv|broadcast|reduce)_perf"
)
_NAME_PATTERNS = (("reduce_scatter", r"reduce[-_]?scatter"), ("all_reduce", r"all[-_]?reduce"),
                  ("all_gather", r"all[-_]?gather"), ("all_to_all", r"all[-_]?to[-_]?all"),
                  ("send_recv", r"send[-_]?recv"), ("broadcast", r"broadcast|bcast"),
                  ("reduce", r"(?<![a-z])reduce(?![a-z])"))


class NcclTestsFormatError(ValueError):
    """An nccl-tests file cannot be read; the message names the file, the line and what was expected."""


@dataclass(frozen=True)
class SkippedLine:
    """A line that looked like a data row but was left out: where, why (one of the SKIP_* reasons), what."""

    line: int
    reason: str
    text: str
    detail: str = ""  # e.g. '6 fields, expected 13 (size count type ...)'


@dataclass(frozen=True)
class NcclTestsResult:
    table: pd.DataFrame  # one row per (size, placement), columns COLUMNS
    collective: str
    nranks: int | None
    nodes: int | None
    source: str
    skipped_wrong: int = 0  # measurements dropped because nccl-tests counted wrong results (#wrong > 0)
    skipped: tuple[SkippedLine, ...] = ()  # data-like lines left out, with line and reason
    run: int = 1  # position of this run in its file
    lines: tuple[int, int] = (0, 0)  # first and last line of its data rows

    @property
    def skipped_counts(self) -> dict[str, int]:
        return dict(Counter(s.reason for s in self.skipped))


def normalize_collective(name: str) -> str:
    """The canonical name (one of COLLECTIVES) for spellings like 'allreduce', 'all-gather', 'sendrecv'."""
    key = re.sub(r"[-_ ]", "", name.strip().lower())
    if key not in _ALIASES:
        raise ValueError(f"unknown collective {name!r}; expected one of {', '.join(COLLECTIVES)}")
    return _ALIASES[key]


def _check_nranks(nranks: int) -> None:
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise ValueError(f"nranks must be a positive integer, got {nranks!r}")


def bus_bandwidth_factor(collective: str, nranks: int) -> float:
    """busbw / algbw for a collective on nranks ranks.

    Formulas from nccl-tests doc/PERFORMANCE.md (github.com/NVIDIA/nccl-tests): all_reduce 2(n-1)/n,
    reduce_scatter and all_gather (n-1)/n, broadcast and reduce 1; alltoall.cu uses (n-1)/n and
    sendrecv.cu 1. busbw is then comparable to the hardware link bandwidth whatever n is.
    """
    _check_nranks(nranks)
    return busbw_factor(normalize_collective(collective), nranks)


def parse_nccl_tests(path: str | os.PathLike[str], collective: str | None = None,
                     nranks: int | None = None) -> NcclTestsResult:
    """Parse a file holding one nccl-tests run; collective and nranks override what the file says."""
    runs = parse_nccl_tests_runs(path, collective, nranks)
    if len(runs) > 1:
        spans = ", ".join(f"lines {r.lines[0]}-{r.lines[1]}" for r in runs)
        raise NcclTestsFormatError(f"{os.fspath(path)}: {len(runs)} runs ({spans}); expected one here "
                                   "(parse_nccl_tests_runs reads each)")
    return runs[0]


def parse_nccl_tests_runs(path: str | os.PathLike[str], collective: str | None = None,
                          nranks: int | None = None) -> list[NcclTestsResult]:
    """Every run of an nccl-tests file, in file order; collective and nranks (if given) apply to each."""
    source = os.fspath(path)
    if nranks is not None:
        _check_nranks(nranks)
    name = normalize_collective(collective) if collective is not None else None
    scanner = _Scanner(source)
    for lineno, raw in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").split("\n"), start=1):
        scanner.feed(lineno, raw)
    runs = scanner.finish()
    file_text = [line for run in runs for _, line in run.text]
    _check_single_collective(source, file_text)
    if not any(run.rows for run in runs):
        raise NcclTestsFormatError(f"{source}: no measurements found; expected nccl-tests data rows "
                                   f"(size time algbw busbw ...) after a column header{_skip_note(runs)}")
    filename = Path(source).name if len(runs) == 1 else None
    results = []
    for index, run in enumerate(runs, start=1):
        where = source if len(runs) == 1 else f"{source} (run {index} of {len(runs)})"
        if not run.rows:
            raise NcclTestsFormatError(f"{where}: no measurements in this run{_skip_note([run])}")
        run_name = name or _infer_collective(source, [t for _, t in run.text], file_text)
        bandwidth = [BandwidthRow(line, *m.bandwidth) for line, m in run.rows]
        try:
            run_nranks, nodes = run_counts(run_name, bandwidth, run.text, run.logs, filename, nranks)
        except RankCountError as exc:
            raise NcclTestsFormatError(f"{where}: {exc}") from None
        table = pd.DataFrame([(run_name, *m[:6], source) for _, m in run.rows], columns=list(COLUMNS))
        table = table.astype({"message_bytes": "int64", "time_s": "float64",
                              "algbw_gbps": "float64", "busbw_gbps": "float64"})
        results.append(NcclTestsResult(table=table, collective=run_name, nranks=run_nranks, nodes=nodes,
                                       source=source, skipped_wrong=run.skipped_wrong, skipped=tuple(run.skipped),
                                       run=index, lines=(run.rows[0][0], run.rows[-1][0])))
    return results


def _skip_note(runs: list[_Run]) -> str:
    """What was left out, for an error about a run without measurements."""
    skipped = [s for run in runs for s in run.skipped]
    wrong = sum(run.skipped_wrong for run in runs)
    notes = [f"{wrong} measurement(s) with #wrong > 0"] if wrong else []
    if skipped:
        counts = ", ".join(f"{n} {reason}" for reason, n in Counter(s.reason for s in skipped).items())
        first = skipped[0]
        notes.append(f"{len(skipped)} data-like line(s) left out: {counts}; first: line {first.line} "
                     f"{first.text!r}, {first.detail}")
    return f" ({'; '.join(notes)})" if notes else ""


@dataclass
class _Run:
    text: list[tuple[int, str]] = field(default_factory=list)  # header comments and plain lines
    logs: list[str] = field(default_factory=list)  # NCCL / SHARP / UCX log records
    rows: list[tuple[int, Measurement]] = field(default_factory=list)
    skipped: list[SkippedLine] = field(default_factory=list)
    skipped_wrong: int = 0

    def absorb(self, other: _Run) -> None:
        self.text += other.text
        self.logs += other.logs


class _Scanner:
    """Reads a file line by line into runs; keeps a row whose pieces are split by log output until whole."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.layout: Layout | None = None
        self.runs = [_Run()]
        self.after = _Run()  # text and logs after the current run's rows: the next run's if one starts
        self.piece: tuple[int, str, bool] | None = None  # (first line, text so far, damaged) of an unfinished row
        self.interrupted = False  # a log record or other text came after that piece

    @property
    def run(self) -> _Run:
        return self.runs[-1]

    def feed(self, lineno: int, raw: str) -> None:
        line = raw.rstrip("\r")
        for _ in range(2):  # srun label, then an Open MPI tag
            line = _LAUNCHER_PREFIX.sub("", line, count=1)
        line = _OUTPUT_TAG.sub("", line)  # a tag interleaved inside the line
        text = line.strip()
        if not text or text.startswith("#") or is_header(text):
            self._flush_piece()
        if not text:
            return
        if text.startswith("#"):
            body = text.lstrip("#").strip()
            layout = parse_header(body) if is_header(body) else None
            if layout:
                self._header(layout)
            else:
                self._note(lineno, body)
            return
        if is_header(text):
            layout = parse_header(text)
            if layout is None:
                raise _error(self.source, lineno, raw, "unrecognised column header",
                             "columns size [count type redop root] then 1 or 2 groups of time [algbw busbw #wrong]")
            self._header(layout)
            return
        if text.startswith(("|", "**")):
            raise _error(self.source, lineno, raw, "markdown summary table, not an nccl-tests measurement",
                         "an nccl-tests table or CSV lookup table")
        if all(t.startswith("(") and t.endswith(")") for t in text.split()):
            return  # units line under a header: (B) (elements) (us) (GB/s)
        log = _LOG_RECORD.search(line)
        data = line[: log.start()] if log else line
        if log:
            (self.after if self.run.rows else self.run).logs.append(line[log.start():])
        looks_like_data = _DATA_START.match(data.strip()) is not None
        if self.piece is not None and data.strip() and not looks_like_data and self._join(data, log is not None):
            return  # the rest of a row whose last piece was cut inside a field ('.44 ...')
        if looks_like_data:
            self._data(lineno, data, cut=log is not None)
            return
        if not log:
            self._note(lineno, text)  # plain text: a command line, a job script's echo, ...
        self.interrupted = True

    def finish(self) -> list[_Run]:
        self._flush_piece()
        self.run.absorb(self.after)
        return [run for run in self.runs if run.rows or run.skipped or run.skipped_wrong]

    def _note(self, lineno: int, text: str) -> None:
        (self.after if self.run.rows else self.run).text.append((lineno, text))

    def _header(self, layout: Layout) -> None:
        if self.run.rows:
            self.runs.append(self.after)
        else:
            self.run.absorb(self.after)
        self.after, self.layout = _Run(), layout

    def _data(self, lineno: int, data: str, cut: bool) -> None:
        if self.run.rows and any(_RUN_START.search(t) for _, t in self.after.text):
            self._flush_piece()
            self._header(self.layout)  # a new run's preamble, then rows under the same columns
        else:
            self.run.absorb(self.after)
            self.after = _Run()
        if self.piece is not None and self._join(data, cut):
            return
        self._flush_piece()
        self._place(lineno, data, cut, damaged=cut)

    def _join(self, data: str, cut: bool) -> bool:
        """Continue the unfinished row with data if something came in between and the two fit in one row."""
        first, head, damaged = self.piece
        if not (damaged or self.interrupted) or self._count(head + data) > max(self._counts()):
            return False
        self.piece = None
        self._place(first, head + data, cut, damaged=True)
        return True

    def _place(self, start: int, data: str, cut: bool, damaged: bool) -> None:
        self.interrupted = False
        if cut or self._count(data) < min(self._counts()):  # wait for the rest of the row
            self.piece = (start, data if cut else data + " ", damaged)
        else:
            self._row(start, data, damaged)

    def _flush_piece(self) -> None:
        if self.piece is not None:
            start, text, damaged = self.piece
            self.piece = None
            self._row(start, text, damaged)

    def _counts(self) -> tuple[int, ...]:
        return self.layout.counts if self.layout else FALLBACK_COUNTS

    def _count(self, text: str) -> int:
        return len(self._tokens(text))

    def _tokens(self, text: str) -> list[str]:
        return self.layout.tokens(text) if self.layout else text.split()

    def _skip(self, lineno: int, reason: str, text: str, detail: str) -> None:
        self.run.skipped.append(SkippedLine(lineno, reason, text.strip(), detail))

    def _row(self, lineno: int, text: str, damaged: bool) -> None:
        tokens = self._tokens(text)
        self.layout = self.layout or fallback_layout(len(tokens))
        if self.layout is None:
            return self._skip(lineno, SKIP_NO_HEADER, text, f"{len(tokens)} fields, and no header line before it")
        if len(tokens) not in self.layout.counts:
            short = len(tokens) < min(self.layout.counts)
            counts = " or ".join(map(str, self.layout.counts))
            return self._skip(lineno, SKIP_LOG_DAMAGE if damaged else SKIP_TRUNCATED if short else SKIP_EXTRA, text,
                              f"{len(tokens)} fields, expected {counts} ({' '.join(self.layout.columns)})")
        try:
            measurements = parse_row(tokens, self.layout)
        except RowError as exc:
            if damaged:
                return self._skip(lineno, SKIP_LOG_DAMAGE, text, exc.problem + "; expected " + exc.expected)
            raise _error(self.source, lineno, text, exc.problem, exc.expected) from None
        for m in measurements:
            if m.wrong > 0:
                self.run.skipped_wrong += 1
            else:
                self.run.rows.append((lineno, m))


def _check_single_collective(source: str, text: list[str]) -> None:
    """One file, one collective: two different *_perf commands mean concatenated runs of different tests."""
    found = {normalize_collective(m.group(1)) for m in _PERF_BINARY.finditer("\n".join(text))}
    if len(found) > 1:
        raise NcclTestsFormatError(f"{source}: mixed collectives in one file ({', '.join(sorted(found))}); "
                                   "expected one nccl-tests run per file (split it)")


def _error(source: str, lineno: int, line: str, problem: str, expected: str) -> NcclTestsFormatError:
    return NcclTestsFormatError(f"{source}, line {lineno}: {problem} in {line.strip()!r}; expected {expected}")


def _infer_collective(source: str, run_text: list[str], file_text: list[str]) -> str:
    """From an `*_perf` binary named in the run's header, else in the file's, else from the file name."""
    for text in (run_text, file_text):
        match = _PERF_BINARY.search("\n".join(text))
        if match:
            return normalize_collective(match.group(1))
    filename = Path(source).name.lower()
    for name, pattern in _NAME_PATTERNS:
        if re.search(pattern, filename):
            return name
    raise NcclTestsFormatError(f"{source}: cannot tell the collective (no '*_perf' command in the header, "
                               f"none in the file name); expected collective= one of {', '.join(COLLECTIVES)}")
