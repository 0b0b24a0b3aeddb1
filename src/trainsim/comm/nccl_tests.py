"""Read nccl-tests results (all_reduce_perf, all_gather_perf, ...) into one tidy table.

The NCCL cost model is calibrated against measured collective times, and published measurements come
in several shapes: raw nccl-tests output, hand-trimmed copies, CSV lookup tables. This module turns
each into rows of (collective, message_bytes, dtype, placement, time_s, algbw_gbps, busbw_gbps) and
refuses, with file and line, anything it cannot read as a measurement rather than guessing.

Supported formats
  * nccl-tests tables: the `#  size count type redop root time algbw busbw #wrong ...` header selects
    the columns, so older layouts (no `root`, `error` for `#wrong`) and sendrecv/alltoall tables
    (`redop` none, maybe no `root`) work too. Two column groups are out-of-place then in-place. A
    leading srun task label (`0: `) is stripped and NCCL INFO/WARN log lines are skipped. Time is in
    microseconds. Without a header, 13 (modern) or 12 (no `root`) columns are accepted.
  * trimmed tables (`size time algbw busbw`, sizes like `1_073_741_824`): a single column group,
    taken as out-of-place because nccl-tests prints that group first.
  * CSV lookup tables (vTrain): header `size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)`;
    the time unit comes from the header.
  `N/A` in algbw/busbw/#wrong becomes NaN; a missing algbw column gives NaN (message_bytes / time_s
  is nccl-tests' algbw if needed).
Files in data/nccl-tests: the two AWS all_reduce tables, the three vTrain CSVs, the
ml-engineering A100 table and the li-plus sendrecv table parse. The h200 nvls-vs-ring and mscclpp files
are markdown summaries (busbw at one size against GPU count, latency and busbw at different sizes,
a torch benchmark); they hold no (size, time) sweep, so parsing them raises NcclTestsFormatError.

Size semantics (nccl-tests prints max(send, recv) bytes of one rank, and algbw = size / time):
all_reduce, broadcast, reduce, send_recv: the buffer of one rank; all_gather: the gathered output,
each rank contributes size / nranks; reduce_scatter: the input, each rank keeps size / nranks;
all_to_all: a rank's whole send buffer, size / nranks to each peer.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast", "reduce")
COLUMNS = ("collective", "message_bytes", "dtype", "placement", "time_s", "algbw_gbps", "busbw_gbps", "source")
PLACEMENTS = ("out_of_place", "in_place")

_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
            "alltoall": "all_to_all", "sendrecv": "send_recv", "broadcast": "broadcast", "bcast": "broadcast",
            "reduce": "reduce"}
# nccl-tests type names -> project dtype names
_DTYPES = {"float": "fp32", "float32": "fp32", "half": "fp16", "float16": "fp16", "bfloat16": "bf16",
           "double": "fp64", "float64": "fp64", "int8": "int8", "char": "int8", "uint8": "uint8",
           "int32": "int32", "int": "int32", "uint32": "uint32", "int64": "int64", "uint64": "uint64",
           "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_KEY_COLUMNS = ("size", "count", "type", "redop", "root")
_GROUP_COLUMNS = ("time", "algbw", "busbw", "#wrong")
_TIME_UNITS_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NA = {"n/a", "na", "nan", "-"}

_SRUN_PREFIX = re.compile(r"^\s*\d+:\s*")
_NCCL_LOG = re.compile(r"\bNCCL (INFO|WARN|TRACE)\b")
_INT = re.compile(r"[+-]?\d+(?:_\d+)*")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_HEADER_CELL = re.compile(r"(#?[A-Za-z]+)(?:\(([^)]*)\))?")
_PERF_BINARY = re.compile(
    r"(?<![A-Za-z0-9_])(all_reduce|all_gather|reduce_scatter|alltoall|sendrecv|broadcast|reduce)_perf"
)
_NAME_PATTERNS = (("reduce_scatter", r"reduce[-_]?scatter"), ("all_reduce", r"all[-_]?reduce"),
                  ("all_gather", r"all[-_]?gather"), ("all_to_all", r"all[-_]?to[-_]?all"),
                  ("send_recv", r"send[-_]?recv"), ("broadcast", r"broadcast|bcast"),
                  ("reduce", r"(?<![a-z])reduce(?![a-z])"))
_RANK_LINE = re.compile(r"Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device")


class NcclTestsFormatError(ValueError):
    """An nccl-tests file cannot be read; the message names the file, the line and what was expected."""


class _CellError(ValueError):
    """One cell of a data row is not what its column holds (caught and re-raised with file and line)."""


@dataclass(frozen=True)
class NcclTestsResult:
    table: pd.DataFrame  # one row per (size, placement), columns COLUMNS
    collective: str
    nranks: int | None
    nodes: int | None
    source: str
    skipped_wrong: int = 0  # measurements dropped because nccl-tests counted wrong results (#wrong > 0)


@dataclass(frozen=True)
class _Layout:
    columns: tuple[str, ...]  # names in file order
    n_keys: int  # leading size/count/type/redop/root columns
    group: tuple[str, ...]  # one placement's columns, starting with 'time'
    time_scale_s: float
    csv: bool


_FALLBACK = {13: ("size", "count", "type", "redop", "root"), 12: ("size", "count", "type", "redop")}


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
    name = normalize_collective(collective)
    if name == "all_reduce":
        return 2.0 * (nranks - 1) / nranks
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return (nranks - 1) / nranks
    return 1.0


def parse_nccl_tests(path: str | os.PathLike[str], collective: str | None = None,
                     nranks: int | None = None) -> NcclTestsResult:
    """Parse one nccl-tests result file; collective and nranks override what the file says."""
    source = os.fspath(path)
    if nranks is not None:
        _check_nranks(nranks)
    comments, rows, skipped_wrong = _scan(source, Path(path).read_text(encoding="utf-8", errors="replace").splitlines())
    if not rows:
        raise NcclTestsFormatError(f"{source}: no measurements found; expected nccl-tests data rows "
                                   "(size time algbw busbw ...) after a column header")
    name = normalize_collective(collective) if collective is not None else _infer_collective(source, comments)
    table = pd.DataFrame([(name, *row, source) for row in rows], columns=list(COLUMNS))
    table = table.astype({"message_bytes": "int64", "time_s": "float64",
                          "algbw_gbps": "float64", "busbw_gbps": "float64"})
    filename = Path(source).name
    return NcclTestsResult(table=table, collective=name, nranks=nranks or _infer_nranks(comments, filename),
                           nodes=_infer_nodes(comments, filename), source=source, skipped_wrong=skipped_wrong)


def _scan(source: str, lines: list[str]) -> tuple[list[str], list[tuple], int]:
    """Header comments, (message_bytes, dtype, placement, time_s, algbw, busbw) rows of a file, and the
    number of measurements skipped because nccl-tests found wrong results in them (#wrong > 0)."""
    comments: list[str] = []
    rows: list[tuple] = []
    skipped_wrong = 0
    layout: _Layout | None = None
    for lineno, raw in enumerate(lines, start=1):
        text = _SRUN_PREFIX.sub("", raw, count=1).strip()
        if not text or _NCCL_LOG.search(text):
            continue
        if text.startswith("#"):
            body = text.lstrip("#").strip()
            header = _parse_header(body) if body.split()[:1] == ["size"] else None
            layout = header or layout
            if header is None:
                comments.append(body)
            continue
        if all(t.startswith("(") and t.endswith(")") for t in text.split()):
            continue  # units line under a header: (B) (elements) (us) (GB/s)
        if re.split(r"[,\s(]", text, maxsplit=1)[0].lower() == "size":
            layout = _parse_header(text)
            if layout is None:
                raise _error(source, lineno, raw, "unrecognised column header",
                             "columns size [count type redop root] then 1 or 2 groups of time [algbw busbw #wrong]")
            continue
        if text.startswith(("|", "**")):
            raise _error(source, lineno, raw, "markdown summary table, not an nccl-tests measurement",
                         "an nccl-tests table or CSV lookup table")
        tokens = [t.strip() for t in text.split(",")] if layout and layout.csv else text.split()
        if layout is None and len(tokens) in _FALLBACK:
            layout = _layout(_FALLBACK[len(tokens)] + _GROUP_COLUMNS * 2, time_unit="us", csv=False)
        if layout is None:
            raise _error(source, lineno, raw, "data before any column header",
                         "a header line starting with 'size', or 13 / 12 columns of classic nccl-tests output")
        if len(tokens) != len(layout.columns):
            raise _error(source, lineno, raw, f"{len(tokens)} columns",
                         f"{len(layout.columns)} columns ({' '.join(layout.columns)})")
        try:
            parsed = _parse_row(tokens, layout)
        except _CellError as exc:
            raise _error(source, lineno, raw, "bad value", str(exc)) from None
        for *row, wrong in parsed:
            if wrong > 0:
                skipped_wrong += 1
                continue
            _check_units(source, lineno, raw, row, layout)
            rows.append(tuple(row))
    _check_single_collective(source, comments)
    return comments, rows, skipped_wrong


def _parse_header(text: str) -> _Layout | None:
    """The layout a header line describes, or None if it is not an nccl-tests column header."""
    csv = "," in text
    cells = [c.strip() for c in text.split(",")] if csv else text.split()
    names: list[str] = []
    time_unit = "us"  # nccl-tests prints microseconds
    for cell in cells:
        match = _HEADER_CELL.fullmatch(cell)
        if match is None:
            return None
        name = match.group(1).lower()
        name = "#wrong" if name in ("error", "wrong", "#wrong") else name
        if name == "time" and match.group(2):
            time_unit = match.group(2).lower()
        names.append(name)
    if time_unit not in _TIME_UNITS_S:
        return None
    return _layout(tuple(names), time_unit=time_unit, csv=csv)


def _layout(names: tuple[str, ...], time_unit: str, csv: bool) -> _Layout | None:
    n_keys = next((i for i, n in enumerate(names) if n not in _KEY_COLUMNS), len(names))
    rest = names[n_keys:]
    if not names or names[0] != "size" or len(set(names[:n_keys])) != n_keys or not rest:
        return None
    half = len(rest) // 2
    group = rest[:half] if len(rest) % 2 == 0 and rest[:half] == rest[half:] else rest
    if group[0] != "time" or len(set(group)) != len(group) or not set(group) <= set(_GROUP_COLUMNS):
        return None
    return _Layout(names, n_keys, group, _TIME_UNITS_S[time_unit], csv)


def _parse_row(tokens: list[str], layout: _Layout) -> list[tuple]:
    """One (message_bytes, dtype, placement, time_s, algbw, busbw) per placement; _CellError names the column."""
    keys = dict(zip(layout.columns[: layout.n_keys], tokens[: layout.n_keys], strict=True))
    message_bytes = _integer(keys["size"], "size")
    for column in ("count", "root"):
        if column in keys:
            _integer(keys[column], column)
    dtype = None
    if "type" in keys:
        if keys["type"].lower() not in _DTYPES:
            known = ", ".join(_DTYPES)
            raise _CellError(f"column 'type' to be an nccl-tests data type ({known}), got {keys['type']!r}")
        dtype = _DTYPES[keys["type"].lower()]
    rows = []
    width = len(layout.group)
    for index, placement in enumerate(PLACEMENTS[: (len(tokens) - layout.n_keys) // width]):
        start = layout.n_keys + index * width
        cells = dict(zip(layout.group, tokens[start : start + width], strict=True))
        time_s = _number(cells["time"], "time", allow_na=False) * layout.time_scale_s
        algbw = _number(cells.get("algbw", "N/A"), "algbw", allow_na=True)
        busbw = _number(cells.get("busbw", "N/A"), "busbw", allow_na=True)
        wrong = _number(cells["#wrong"], "#wrong", allow_na=True) if "#wrong" in cells else math.nan
        rows.append((message_bytes, dtype, placement, time_s, algbw, busbw, wrong))
    return rows


def _check_units(source: str, lineno: int, line: str, row: list, layout: _Layout) -> None:
    """algbw must be size / time in GB/s; a mismatch means the time column is not in the header's unit."""
    message_bytes, _, _, time_s, algbw, _ = row
    if not (algbw >= 1.0) or time_s <= 0:  # two printed decimals: too coarse to check below 1 GB/s
        return
    implied = message_bytes / time_s / 1e9
    if abs(implied / algbw - 1.0) > 0.1:
        unit = {1.0: "s", 1e-3: "ms", 1e-6: "us", 1e-9: "ns"}.get(layout.time_scale_s, "?")
        raise _error(source, lineno, line, f"time unit mismatch: size / time gives {implied:.3g} GB/s with time in "
                     f"{unit} (the header's unit) but algbw says {algbw:g} GB/s",
                     "times in the unit the header states")


def _check_single_collective(source: str, comments: list[str]) -> None:
    """One file, one collective: two different *_perf commands mean concatenated runs."""
    found = {normalize_collective(m.group(1)) for m in _PERF_BINARY.finditer("\n".join(comments))}
    if len(found) > 1:
        raise NcclTestsFormatError(f"{source}: mixed collectives in one file ({', '.join(sorted(found))}); "
                                   "expected one nccl-tests run per file (split it)")


def _integer(token: str, column: str) -> int:
    if _INT.fullmatch(token) is None:
        raise _CellError(f"column {column!r} to be an integer, got {token!r}")
    return int(token.replace("_", ""))


def _number(token: str, column: str, allow_na: bool) -> float:
    if allow_na and token.lower() in _NA:
        return math.nan
    if _NUMBER.fullmatch(token) is None and not (allow_na and token.lower() in ("inf", "+inf")):
        raise _CellError(f"column {column!r} to be a number{' or N/A' if allow_na else ''}, got {token!r}")
    value = float(token)
    if value < 0:
        raise _CellError(f"column {column!r} to be non-negative, got {token!r}")
    return value


def _error(source: str, lineno: int, line: str, problem: str, expected: str) -> NcclTestsFormatError:
    return NcclTestsFormatError(f"{source}, line {lineno}: {problem} in {line.strip()!r}; expected {expected}")


def _infer_collective(source: str, comments: list[str]) -> str:
    """From an `*_perf` binary named in the header comments, else from the file name."""
    match = _PERF_BINARY.search("\n".join(comments))
    if match:
        return normalize_collective(match.group(1))
    filename = Path(source).name.lower()
    for name, pattern in _NAME_PATTERNS:
        if re.search(pattern, filename):
            return name
    raise NcclTestsFormatError(f"{source}: cannot tell the collective (no '*_perf' command in the header, "
                               f"none in the file name); expected collective= one of {', '.join(COLLECTIVES)}")


def _first_int(pattern: str, text: str, flags: int = 0) -> int | None:
    match = re.search(pattern, text, flags=flags)
    return int(next(g for g in match.groups() if g is not None)) if match else None


def _infer_nranks(comments: list[str], filename: str) -> int | None:
    """Rank lines of real output, 'N ranks', mpirun -np x -g, -g alone, 'GPU<N>', then '<N>gpu' in the name."""
    text = "\n".join(comments)
    ranks = {m.group(1) for m in _RANK_LINE.finditer(text)}
    if ranks:
        return len(ranks)
    stated = _first_int(r"\b(\d+)\s+ranks?\b", text, re.IGNORECASE)
    gpus = _first_int(r"(?:^|\s)-g\s+(\d+)|\bnGpus\s+(\d+)", text)
    threads = _first_int(r"(?:^|\s)-t\s+(\d+)|\bnThread\s+(\d+)", text) or 1
    processes = _first_int(r"(?:^|\s)-np\s+(\d+)", text)  # not -n: that is nccl-tests' iteration count
    if stated:
        return stated
    if processes:
        return processes * threads * (gpus or 1)
    if gpus and not re.search(r"\b(mpirun|mpiexec|srun)\b", text):
        return gpus * threads
    in_text = _first_int(r"(?<![A-Za-z])GPU(\d+)", text)
    return in_text or _first_int(r"(?<![a-z0-9])(\d+)[-_]?gpus?(?![a-z])", filename, re.IGNORECASE)


def _infer_nodes(comments: list[str], filename: str) -> int | None:
    text = "\n".join(comments)
    hosts = {m.group(2) for m in _RANK_LINE.finditer(text)}
    if hosts:
        return len(hosts)
    stated = _first_int(r"\b(\d+)\s*nodes?\b", text, re.IGNORECASE)
    if stated:
        return stated
    if re.search(r"\b(single|one)[- ]node\b", text, flags=re.IGNORECASE):
        return 1
    return _first_int(r"(?<![a-z0-9])(\d+)[-_]?nodes?(?![a-z])", filename, re.IGNORECASE)
