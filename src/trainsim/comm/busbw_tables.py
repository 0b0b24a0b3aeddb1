"""Author-compiled algbw/busbw tables (data/nccl-tests/*_table*.txt, the p5 2-32 node CSVs) as measurements.

Some public nccl-tests results survive only as tables an author compiled from logs no longer published.
They carry no time column, so each row's time is size / algbw. The documented format (docs/comm.md):

* header lines start with '#'; a line '# ---- verbatim CSV below ----' or '# ---- verbatim tables below ----'
  ends the header;
* CSV form: columns Nodes, GPUs, size(MB) (MiB as passed to nccl-tests), and any of
  'out algbw(GB/s)', 'out busbw(GB/s)', 'in algbw(GB/s)', 'in busbw(GB/s)'; the collective is the file
  name's last token (all_reduce, all_gather, alltoall, sendrecv);
* Markdown form: '## ' section titles name the collective; a table whose first column is 'Size'
  (1K, 2M, ... binary units) has one column per 'N-Node'; a table whose first column is 'Nodes (GPUs)'
  ('2n (16)') has one column per forced NCCL algorithm and measures the size the title states ('@ 32 GiB').
  Values are busbw in GB/s; cells that are not numbers (failed runs) are left out.

* Summary form (the mscclpp performance summary): '### N node(s), K gpus/node' sections, each with a
  '**Latency (us)**' and a '**BusBW (GB/s)**' table whose first column is the message size and whose
  'NCCL <Collective>' columns are nccl-tests' (the other libraries' columns are not NCCL and are left out).
  A latency row is the time itself, a busbw row gives it through nccl-tests' bus factor; the one placement
  the summary reports is taken as the measurement.

* Sections form (ml-engineering's single-node summaries): a comment '# (a) <what was measured>' above each table
  names the tool, the GPUs and the payload ('nccl-tests all_reduce_perf, 8 GiB payload, H200'). A table whose
  first column is 'GPUs' has one row per GPU count at that payload, its 'busbw' column NCCL's own choice and a
  'busbw, NVLS off' column the ring NCCL runs without NVLS; a table whose first column is 'collective' has one
  row per collective ('all-reduce, `NCCL_NVLS_ENABLE=0`'), its 'algo' column the algorithm NCCL ran. Sections
  measured on another GPU than the file's HARDWARE line names first, or not with nccl-tests, are not read and
  are reported as skipped, with their reason and lines.

Each (section, collective, nodes, algorithm) becomes one NcclTestsResult, the record comm/nccl_tests.py
yields for a full log, so calibration reads both alike.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from trainsim.comm.nccl_ranks import busbw_factor
from trainsim.comm.nccl_tests import COLUMNS, NcclTestsFormatError, NcclTestsResult

# set: binary units as nccl-tests prints sizes (1K = 1024 B)
UNIT_BYTES = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_CSV_MARK = "# ---- verbatim CSV below ----"
_TABLES_MARK = "# ---- verbatim tables below ----"
_SUMMARY_SECTION = re.compile(r"### (\d+) nodes?, (\d+) gpus?/node")
_NOTE_SECTION = re.compile(r"#\s*\(([a-z])\)\s*(.+)")
"""A sections-form section: '# (a) <tool, GPUs, payload>' above its table."""
_GPU_NAME = re.compile(r"\b\d+x\s*(?:NVIDIA\s+)?([A-Z]+\d+[A-Z]*)\b")
"""'8x H200', '8x B200': the GPU a HARDWARE line or a section note names."""
_COLLECTIVE_WORDS = (("all_reduce", r"all[-_ ]?reduce"), ("all_gather", r"all[-_ ]?gather"),
                     ("reduce_scatter", r"reduce[-_ ]?scatter"),
                     ("all_to_all", r"all[-_ ]?to[-_ ]?all"), ("send_recv", r"send[-_ ]?recv"))


def nccl_algorithm(column: str) -> str:
    """The algorithm a table column forces, in hardware.nccl.algorithms' spelling: 'Ring' -> 'ring',
    'NVLS / NVLSTree' -> 'nvls' (NVLSTree is NVLS across nodes), 'CollnetDirect' -> 'collnet_direct'."""
    first = re.split(r"\s*/\s*", column.strip())[0]
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", first).lower()


def is_busbw_table(path: str | os.PathLike[str]) -> bool:
    """Whether the file is an author-compiled table: a header line ends in one of the two marks, or it has the
    summary form's sections."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return any(line.strip() in (_CSV_MARK, _TABLES_MARK) or _SUMMARY_SECTION.fullmatch(line.strip())
                   or _NOTE_SECTION.fullmatch(line.strip()) for line in handle)


@dataclass(frozen=True)
class TableRun:
    """One curve of an author table: its measurements and the NCCL algorithm forced, if the table names one."""

    result: NcclTestsResult
    algorithm: str | None
    """The NCCL algorithm the table forces (nccl_algorithm's spelling); None: NCCL's own choice."""
    section: str


def _collective_in(text: str) -> str | None:
    for name, pattern in _COLLECTIVE_WORDS:
        if re.search(pattern, text, re.IGNORECASE):
            return name
    return None


def _error(source: str, lineno: int, line: str, problem: str) -> NcclTestsFormatError:
    return NcclTestsFormatError(f"{source}:{lineno}: {problem}: {line.strip()!r}")


def _rows_to_result(source: str, collective: str, nranks: int, nodes: int, rows: list[tuple[int, str, float]],
                    measured: str, lines: tuple[int, int]) -> NcclTestsResult:
    """rows: (bytes, placement, value GB/s); measured says whether value is 'algbw' or 'busbw'."""
    factor = busbw_factor(collective, nranks)
    records = []
    for size, placement, value in rows:
        algbw = value if measured == "algbw" else value / factor
        records.append((collective, size, "unknown", placement, size / (algbw * 1e9), algbw, algbw * factor, source))
    table = pd.DataFrame(records, columns=list(COLUMNS))
    return NcclTestsResult(table=table, collective=collective, nranks=nranks, nodes=nodes, source=source,
                           lines=lines)


def _size_bytes(token: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGB]?)i?B?\s*", token, re.IGNORECASE)
    if match is None:
        raise ValueError(token)
    return int(float(match.group(1)) * UNIT_BYTES[match.group(2).upper()])


def _read_csv(source: str, lines: list[str], start: int) -> list[TableRun]:
    collective = _collective_in(Path(source).stem.rsplit("-", 1)[-1])
    if collective is None:
        raise _error(source, start, Path(source).name, "the file name does not end in a collective name")
    header = [h.strip() for h in lines[start].split(",")]
    need = ("Nodes", "GPUs", "size(MB)")
    if any(n not in header for n in need):
        raise _error(source, start + 1, lines[start], f"expected columns {', '.join(need)}")
    value_columns = [(i, h.split()[0], h.split()[1].split("(")[0]) for i, h in enumerate(header)
                     if re.fullmatch(r"(out|in) (algbw|busbw)\(GB/s\)", h)]
    if not value_columns:
        raise _error(source, start + 1, lines[start], "no 'out|in algbw|busbw(GB/s)' column")
    groups: dict[tuple[int, int], list] = {}
    spans: dict[tuple[int, int], list[int]] = {}
    for lineno, line in enumerate(lines[start + 1:], start=start + 2):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(header):
            raise _error(source, lineno, line, f"{len(cells)} fields, expected {len(header)}")
        try:
            nodes, gpus = int(cells[header.index("Nodes")]), int(cells[header.index("GPUs")])
            size = int(float(cells[header.index("size(MB)")]) * (1 << 20))
            key = (nodes, gpus)
            for i, where, kind in value_columns:
                placement = "out_of_place" if where == "out" else "in_place"
                if kind == "algbw" or not any(k == "algbw" and w == where for _, w, k in value_columns):
                    groups.setdefault(key, []).append((size, placement, float(cells[i]), kind))
        except ValueError as exc:
            raise _error(source, lineno, line, f"not a number ({exc})") from None
        spans.setdefault(key, [lineno, lineno])[1] = lineno
    runs = []
    for (nodes, gpus), rows in groups.items():
        kind = rows[0][3]
        span = tuple(spans[(nodes, gpus)])
        result = _rows_to_result(source, collective, gpus, nodes, [r[:3] for r in rows], kind, span)
        runs.append(TableRun(result=result, algorithm=None, section="csv"))
    return runs


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*").strip() for c in line.strip().strip("|").split("|")]


def _is_rule(cells: list[str]) -> bool:
    """A markdown table's header rule ('|---|:--:|')."""
    return all(re.fullmatch(r":?-+:?", c) for c in cells)


def _read_markdown(source: str, lines: list[str], start: int, gpus_per_node: int | None) -> list[TableRun]:
    runs: list[TableRun] = []
    section, collective, header, block = "", None, None, []

    def flush() -> None:
        if header is not None and block:
            runs.extend(_markdown_table(source, section, collective, header, block, gpus_per_node))

    for lineno, line in enumerate(lines[start:], start=start + 1):
        if line.startswith("## "):
            flush()
            section, header, block = line[3:].strip(), None, []
            collective = _collective_in(section) or _collective_in(Path(source).name)
        elif line.lstrip().startswith("|"):
            cells = _cells(line)
            if header is None:
                header = cells
            elif not _is_rule(cells):
                block.append((lineno, line, cells))
        elif line.strip() and header is not None:
            flush()
            header, block = None, []
    flush()
    return runs


def _markdown_table(source: str, section: str, collective: str | None, header: list[str], block: list,
                    gpus_per_node: int | None) -> list[TableRun]:
    if collective is None:
        raise _error(source, block[0][0], section, "the section names no collective")
    curves: dict[tuple[int, int, str | None], list] = {}
    spans: dict[tuple[int, int, str | None], list[int]] = {}
    by_size = header[0].lower() == "size"
    title_size = re.search(r"@\s*([0-9.]+\s*[KMG])i?B", section)
    for lineno, line, cells in block:
        if len(cells) != len(header):
            raise _error(source, lineno, line, f"{len(cells)} cells, expected {len(header)} ({' | '.join(header)})")
        for column, cell in zip(header[1:], cells[1:]):
            if column.lower() == "best":
                continue
            try:
                value = float(cell)
            except ValueError:
                continue  # a failed or missing run ('✗', '(retry ...)'): no measurement
            if by_size:
                node_match = re.fullmatch(r"(\d+)-Node", column)
                if node_match is None or gpus_per_node is None:
                    raise _error(source, lineno, " | ".join(header), "expected 'N-Node' columns and GPUs per node")
                nodes, size, algorithm = int(node_match.group(1)), _size_bytes(cells[0]), None
                gpus = nodes * gpus_per_node
            else:
                row = re.fullmatch(r"(\d+)n \((\d+)\)", cells[0])
                if row is None or title_size is None:
                    raise _error(source, lineno, line, "expected rows 'Nn (GPUs)' under a title stating '@ <size>'")
                nodes, gpus = int(row.group(1)), int(row.group(2))
                size = _size_bytes(title_size.group(1))
                algorithm = None if len(header) == 2 else nccl_algorithm(column)
            key = (nodes, gpus, algorithm)
            curves.setdefault(key, []).append((size, "out_of_place", value))
            spans.setdefault(key, [lineno, lineno])[1] = lineno
    return [TableRun(result=_rows_to_result(source, collective, gpus, nodes, rows, "busbw", tuple(spans[key])),
                     algorithm=algorithm, section=section)
            for key, rows in curves.items() for nodes, gpus, algorithm in [key]]


def _read_summary(source: str, lines: list[str]) -> list[TableRun]:
    curves: dict[tuple[int, int, str], list] = {}
    spans: dict[tuple[int, int, str], list[int]] = {}
    section, kind, header = None, None, None
    for lineno, line in enumerate(lines, start=1):
        if match := _SUMMARY_SECTION.fullmatch(line.strip()):
            nodes, per_node = int(match.group(1)), int(match.group(2))
            section, header = (nodes, nodes * per_node), None
        elif line.startswith("**"):
            kind, header = ("latency" if "Latency" in line else "busbw"), None
        elif line.lstrip().startswith("|") and section is not None:
            cells = _cells(line)
            if header is None:
                header = cells
            elif not _is_rule(cells):
                for column, cell in zip(header[1:], cells[1:], strict=True):
                    if not column.startswith("NCCL ") or (collective := _collective_in(column)) is None:
                        continue
                    try:
                        size, value = _size_bytes(cells[0]), float(cell)
                    except ValueError:
                        raise _error(source, lineno, line, f"not a number in column {column!r}") from None
                    nodes, ranks = section
                    factor = busbw_factor(collective, ranks)
                    seconds = value * 1e-6 if kind == "latency" else size * factor / (value * 1e9)
                    key = (nodes, ranks, collective)
                    curves.setdefault(key, []).append((size, "out_of_place", size / seconds / 1e9))
                    spans.setdefault(key, [lineno, lineno])[1] = lineno
    return [TableRun(result=_rows_to_result(source, collective, ranks, nodes, rows, "algbw", tuple(spans[key])),
                     algorithm=None, section=f"{nodes} node(s), {ranks} GPUs")
            for key, rows in curves.items() for nodes, ranks, collective in [key]]


def _section_curves(source: str, note: str, header: list[str], block: list) -> list[TableRun]:
    """The curves of one sections-form table (see the module docstring); `note` is its '# (x)' comment."""
    payload = re.search(r"([0-9.]+)\s*([KMG])i?B", note)
    if payload is None:
        raise _error(source, block[0][0], note, "the section's note states no payload ('8 GiB')")
    size = _size_bytes(payload.group(1) + payload.group(2))
    columns = [c.lower() for c in header]
    curves: dict[tuple[str, int, str | None], list] = {}
    spans: dict[tuple[str, int, str | None], list[int]] = {}
    for lineno, line, cells in block:
        if len(cells) != len(header):
            raise _error(source, lineno, line, f"{len(cells)} cells, expected {len(header)} ({' | '.join(header)})")
        if columns[0] == "gpus":  # one all-reduce per GPU count: NCCL's choice, and the ring it runs without NVLS
            collective, ranks = _collective_in(note), int(cells[0])
            chosen = [(c, None) for c in columns if c == "busbw"] + [(c, "ring") for c in columns if "nvls off" in c]
        elif columns[0] == "collective":  # one row per collective on the note's GPUs
            if (gpus := re.search(r"(\d+) GPUs", note)) is None:
                raise _error(source, lineno, note, "the section's note states no GPU count ('8 GPUs')")
            collective, ranks = _collective_in(cells[0]), int(gpus.group(1))
            forced = "NVLS_ENABLE=0" in cells[0]
            chosen = [("busbw", nccl_algorithm(cells[columns.index("algo")]) if forced else None)]
        else:
            raise _error(source, lineno, " | ".join(header), "expected a first column 'GPUs' or 'collective'")
        if collective is None:
            raise _error(source, lineno, line, "names no collective")
        for column, algorithm in chosen:
            value = re.fullmatch(r"([0-9.]+)\s*GBps", cells[columns.index(column)])
            if value is None:
                raise _error(source, lineno, line, f"column {column!r} is not '<number>GBps'")
            key = (collective, ranks, algorithm)
            curves.setdefault(key, []).append((size, "out_of_place", float(value.group(1))))
            spans.setdefault(key, [lineno, lineno])[1] = lineno
    return [TableRun(result=_rows_to_result(source, collective, ranks, 1, rows, "busbw", tuple(spans[key])),
                     algorithm=algorithm, section=note)
            for key, rows in curves.items() for collective, ranks, algorithm in [key]]


def _read_sections(source: str, lines: list[str], skipped: dict) -> list[TableRun]:
    """The sections form's curves of the file's own GPU measured with nccl-tests; the other sections are added to
    `skipped` ({reason: {"count", "lines"}}, as comm/calibration.py reports skipped lines)."""
    hardware = next((line for line in lines if line.startswith("# HARDWARE:")), "")
    own = _GPU_NAME.search(hardware)
    runs: list[TableRun] = []
    note, header, block = None, None, []

    def flush() -> None:
        if note is None or header is None or not block:
            return
        other = _GPU_NAME.search(note[1])
        if other is not None and own is not None and other.group(1) != own.group(1):
            reason = f"section ({note[0]}) measured on {other.group(1)}, not this file's {own.group(1)}"
        elif "not nccl-tests" in note[1].lower() or "nccl-tests" not in note[1].lower():
            reason = f"section ({note[0]}) not measured with nccl-tests"
        else:
            runs.extend(_section_curves(source, note[1], header, block))
            return
        skipped[reason] = {"count": len(block), "lines": [lineno for lineno, _, _ in block]}

    for lineno, line in enumerate(lines, start=1):
        if match := _NOTE_SECTION.fullmatch(line.strip()):
            flush()
            note, header, block = (match.group(1), match.group(2)), None, []
        elif line.lstrip().startswith("|") and note is not None:
            cells = _cells(line)
            if header is None:
                header = cells
            elif not _is_rule(cells):
                block.append((lineno, line, cells))
    flush()
    return runs


def read_busbw_table(path: str | os.PathLike[str], skipped: dict | None = None) -> list[TableRun]:
    """Every curve of an author-compiled table file; NcclTestsFormatError names the line and reason. Sections
    not read (sections form) are added to `skipped` as {reason: {"count", "lines"}}."""
    source = os.fspath(path)
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    per_node = re.search(r"(\d+)x NVIDIA|(\d+)x H100|8 GPUs per node", "\n".join(lines[:10]))
    gpus_per_node = None
    if per_node is not None:
        gpus_per_node = int(next((g for g in per_node.groups() if g), "8"))
    for index, line in enumerate(lines):
        if line.strip() == _CSV_MARK:
            return _read_csv(source, lines, index + 1)
        if line.strip() == _TABLES_MARK:
            return _read_markdown(source, lines, index + 1, gpus_per_node)
    if runs := _read_summary(source, lines):
        return runs
    if any(_NOTE_SECTION.fullmatch(line.strip()) for line in lines):
        return _read_sections(source, lines, {} if skipped is None else skipped)
    raise NcclTestsFormatError(f"{source}: no '{_CSV_MARK}' or '{_TABLES_MARK}' line ends the header, no "
                               "'### N nodes, K gpus/node' summary sections with NCCL columns, and no '# (a) ...' "
                               "sections")
