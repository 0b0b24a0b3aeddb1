"""Column layouts of nccl-tests tables, and one data row read under one.

A header line starting with `size` or `bytes` selects the columns:
  * nccl-tests since 2022: `size count type redop root time algbw busbw #wrong`, then the same group for
    in-place. #wrong counts wrong elements (N/A: not checked). Per-iteration columns (i_min i_max i_p99
    i_cv%) are read and ignored.
  * 2019-2022: no `root` (some tables no `redop` either) and `error` is the largest deviation from the
    expected values (5e-07 is normal for float sums): not a failure count, so those rows are kept.
  * before 2019: `bytes N type op time algbw busbw res`, time in milliseconds (src/common.cu of that time).
  * a header naming one column group over rows with two: out-of-place then in-place, as nccl-tests prints.
  * trimmed tables (`size time algbw busbw`, sizes like `1_073_741_824`): taken as out-of-place, the group
    nccl-tests prints first.
  * CSV lookup tables (vTrain): `size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)`.
Without a header, 13 (modern) or 12 (no `root`) columns are accepted. Time is in microseconds unless the
header says otherwise; algbw must equal size / time (its definition in nccl-tests doc/PERFORMANCE.md), which
catches a wrong unit. `N/A` in algbw/busbw/#wrong becomes NaN; a missing algbw column gives NaN.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

PLACEMENTS = ("out_of_place", "in_place")
# set: the rounding of nccl-tests' printed digits
DERIVED_ALGBW_REL_ERROR = 5e-4
"""size / time is known to the time's printed digits: nccl-tests prints at least 4 significant ones."""

# nccl-tests type names -> project dtype names
_DTYPES = {"float": "fp32", "float32": "fp32", "half": "fp16", "float16": "fp16", "bfloat16": "bf16",
           "double": "fp64", "float64": "fp64", "int8": "int8", "char": "int8", "uint8": "uint8",
           "int32": "int32", "int": "int32", "uint32": "uint32", "int64": "int64", "uint64": "uint64",
           "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_KEY_COLUMNS = ("size", "count", "type", "redop", "root")
_GROUP_COLUMNS = ("time", "algbw", "busbw", "#wrong", "error", "i_min", "i_max", "i_p99", "i_cv%")
_HEADER_ALIASES = {"bytes": "size", "n": "count", "op": "redop", "wrong": "#wrong", "res": "error"}
# set: time units
_TIME_UNITS_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NA = {"n/a", "na", "nan", "-"}
# cite: nccl-tests' table layouts (12 and 13 key columns)
_FALLBACK = {13: ("size", "count", "type", "redop", "root"), 12: ("size", "count", "type", "redop")}
_INT = re.compile(r"[+-]?\d+(?:_\d+)*")
_NUMBER = re.compile(r"[+-]?(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?")
_HEADER_CELL = re.compile(r"(#?[A-Za-z_][A-Za-z0-9_]*%?)(?:\(([^)]*)\))?")
FALLBACK_COUNTS = tuple(_FALLBACK)


class RowError(ValueError):
    """A data row holds something its column cannot: the problem and what the column accepts."""

    def __init__(self, problem: str, expected: str) -> None:
        super().__init__(f"{problem}; expected {expected}")
        self.problem, self.expected = problem, expected


class Measurement(NamedTuple):
    message_bytes: int
    dtype: str | None
    placement: str
    time_s: float
    algbw: float
    busbw: float
    wrong: float  # wrong elements; NaN when not reported or the column is a deviation
    bandwidth: tuple[float, float, float, float]  # algbw (or size / time), its error, busbw, its error


@dataclass(frozen=True)
class Layout:
    columns: tuple[str, ...]  # names in file order
    n_keys: int  # leading size/count/type/redop/root columns
    group: tuple[str, ...]  # one placement's columns, starting with 'time'
    time_scale_s: float
    csv: bool

    @property
    def counts(self) -> tuple[int, ...]:
        """Accepted fields per row: the header's, or two groups under a header naming one."""
        two = self.n_keys + 2 * len(self.group)
        return (len(self.columns), two) if len(self.columns) < two else (len(self.columns),)

    def tokens(self, text: str) -> list[str]:
        return [t.strip() for t in text.split(",")] if self.csv else text.split()


def is_header(text: str) -> bool:
    return re.split(r"[,\s(]", text, maxsplit=1)[0].lower() in ("size", "bytes")


def fallback_layout(n_fields: int) -> Layout | None:
    """The classic nccl-tests layout with that many fields, for rows under no header."""
    keys = _FALLBACK.get(n_fields)
    return _layout(keys + _GROUP_COLUMNS[:4] * 2, time_unit="us", csv=False) if keys else None


def parse_header(text: str) -> Layout | None:
    """The layout a header line describes, or None if it is not an nccl-tests column header."""
    csv = "," in text
    cells = [c.strip() for c in text.split(",")] if csv else text.split()
    names: list[str] = []
    time_unit = "ms" if cells[0].lower().startswith("bytes") else "us"  # nccl-tests before 2019 printed ms
    for cell in cells:
        match = _HEADER_CELL.fullmatch(cell)
        if match is None:
            return None
        name = match.group(1).lower()
        name = _HEADER_ALIASES.get(name, name)
        if name == "time" and match.group(2):
            time_unit = match.group(2).lower()
        names.append(name)
    if time_unit not in _TIME_UNITS_S:
        return None
    return _layout(tuple(names), time_unit=time_unit, csv=csv)


def _layout(names: tuple[str, ...], time_unit: str, csv: bool) -> Layout | None:
    n_keys = next((i for i, n in enumerate(names) if n not in _KEY_COLUMNS), len(names))
    rest = names[n_keys:]
    if not names or names[0] != "size" or len(set(names[:n_keys])) != n_keys or not rest:
        return None
    half = len(rest) // 2
    group = rest[:half] if len(rest) % 2 == 0 and rest[:half] == rest[half:] else rest
    if group[0] != "time" or len(set(group)) != len(group) or not set(group) <= set(_GROUP_COLUMNS):
        return None
    return Layout(names, n_keys, group, _TIME_UNITS_S[time_unit], csv)


def parse_row(tokens: list[str], layout: Layout) -> list[Measurement]:
    """One measurement per placement of a row with one of layout.counts fields; RowError names the column."""
    keys = dict(zip(layout.columns[: layout.n_keys], tokens[: layout.n_keys], strict=True))
    message_bytes = _integer(keys["size"], "size")
    for column in ("count", "root"):
        if column in keys:
            _integer(keys[column], column)
    dtype = None
    if "type" in keys:
        if keys["type"].lower() not in _DTYPES:
            raise RowError("bad value", f"column 'type' to be an nccl-tests data type ({', '.join(_DTYPES)}), "
                           f"got {keys['type']!r}")
        dtype = _DTYPES[keys["type"].lower()]
    rows = []
    width = len(layout.group)
    for index, placement in enumerate(PLACEMENTS[: (len(tokens) - layout.n_keys) // width]):
        start = layout.n_keys + index * width
        cells = dict(zip(layout.group, tokens[start : start + width], strict=True))
        for column in sorted(set(cells) - {"time", "algbw", "busbw", "#wrong"}):
            _number(cells[column], column, allow_na=True)  # a deviation, per-iteration statistics: unused
        time = _number(cells["time"], "time", allow_na=False)
        time_s = time * layout.time_scale_s
        algbw = _number(cells.get("algbw", "N/A"), "algbw", allow_na=True)
        busbw = _number(cells.get("busbw", "N/A"), "busbw", allow_na=True)
        wrong = _number(cells["#wrong"], "#wrong", allow_na=True) if "#wrong" in cells else math.nan
        if math.isnan(algbw):  # nccl-tests' definition, known to the time's printed digits
            bw = message_bytes / time_s / 1e9 if time_s > 0 else math.nan
            bw_err = bw * max(DERIVED_ALGBW_REL_ERROR, _half_unit(cells["time"]) / time if time > 0 else 0)
        else:
            bw, bw_err = algbw, _half_unit(cells["algbw"])
        bandwidth = (bw, bw_err, busbw, _half_unit(cells.get("busbw", "0")))
        measurement = Measurement(message_bytes, dtype, placement, time_s, algbw, busbw, wrong, bandwidth)
        _check_units(measurement, layout)
        rows.append(measurement)
    return rows


def _check_units(m: Measurement, layout: Layout) -> None:
    """algbw must be size / time in GB/s; a mismatch means the time column is not in the header's unit."""
    if not (m.algbw >= 1.0) or m.time_s <= 0 or m.wrong > 0:  # two printed decimals: too coarse below 1 GB/s
        return
    implied = m.message_bytes / m.time_s / 1e9
    if abs(implied / m.algbw - 1.0) > 0.1:
        unit = {1.0: "s", 1e-3: "ms", 1e-6: "us", 1e-9: "ns"}.get(layout.time_scale_s, "?")
        raise RowError(f"time unit mismatch: size / time gives {implied:.3g} GB/s with time in {unit} (the "
                       f"header's unit) but algbw says {m.algbw:g} GB/s", "times in the unit the header states")


def _integer(token: str, column: str) -> int:
    if _INT.fullmatch(token) is None:
        raise RowError("bad value", f"column {column!r} to be an integer, got {token!r}")
    return int(token.replace("_", ""))


def _number(token: str, column: str, allow_na: bool) -> float:
    if allow_na and token.lower() in _NA:
        return math.nan
    valid = _NUMBER.fullmatch(token) is not None and any(c.isdigit() for c in token)
    if not valid and not (allow_na and token.lower() in ("inf", "+inf")):
        raise RowError("bad value", f"column {column!r} to be a number{' or N/A' if allow_na else ''}, got {token!r}")
    value = float(token)
    if value < 0:
        raise RowError("bad value", f"column {column!r} to be non-negative, got {token!r}")
    return value


def _half_unit(token: str) -> float:
    """Half a unit of a printed number's last digit: how far the true value may be from it."""
    match = _NUMBER.fullmatch(token)
    if match is None or not any(c.isdigit() for c in token):
        return math.nan
    return 0.5 * 10.0 ** (int(match.group(3) or 0) - len(match.group(2) or ""))
