"""The command line's tables: named columns with units, as a table where the terminal is wide enough and as
one block of `name: value unit` lines per row where it is not (rich would cut every cell to "7.…"), and
the same rows as plain records for `--json`.

A table is a list of `Field`s (what each column holds, in which unit) and rows of already formatted cells;
`show` picks the layout from the console's width, so 80 columns and 200 columns both show every digit.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

GIB = 1024**3
SECONDS_FORMAT = "{:.4f}"
"""Seconds in the compose table: 0.1 ms resolution, as the step time line above it."""


@dataclass(frozen=True)
class Field:
    """One column: its name, its unit ('' for counts and words), the record key `--json` uses, and the format
    spec of its numbers where a table builds the cells from numbers."""

    name: str
    unit: str = ""
    key: str = ""
    number_format: str = ".4g"

    @property
    def header(self) -> str:
        return f"{self.name} ({self.unit})" if self.unit else self.name


@dataclass(frozen=True)
class Rows:
    """A titled table: fields, rows of formatted cells (rich markup allowed), and the raw values per row for
    `--json` (same order as the fields)."""

    title: str
    fields: Sequence[Field]
    cells: list[list[str]]
    values: list[list[object]]

    def records(self) -> list[dict]:
        """One dict per row, keyed by each field's `key` (or its name)."""
        return [{f.key or f.name: v for f, v in zip(self.fields, row, strict=True)} for row in self.values]


def column_widths(rows: Rows, wrap_headers: bool) -> list[int]:
    """Each column as wide as its widest cell or its header (its longest word where headers may wrap)."""
    widths = []
    for i, field in enumerate(rows.fields):
        header = [len(word) for word in field.header.split()] if wrap_headers else [len(field.header)]
        widths.append(max([Text.from_markup(row[i]).cell_len for row in rows.cells] + header))
    return widths


def table_width(widths: list[int]) -> int:
    """Characters a rich table with these column widths takes: one space of padding each side and one rule per
    column."""
    return sum(widths) + 3 * len(widths) + 1


def as_table(rows: Rows, widths: list[int] | None = None) -> Table:
    """A rich table; with `widths`, columns that wide (headers wrap between words, cells are never cut)."""
    table = Table(title=rows.title)
    for i, field in enumerate(rows.fields):
        table.add_column(field.header, justify="right", width=widths[i] if widths else None)
    for row in rows.cells:
        table.add_row(*row)
    return table


def as_blocks(rows: Rows) -> list[str]:
    """One block per row: the first field as its heading, then `name: value unit` lines."""
    lines = [rows.title]
    first, rest = rows.fields[0], rows.fields[1:]
    for row in rows.cells:
        lines.append(f"{first.name} {row[0]}" + (f" {first.unit}" if first.unit else ""))
        lines.extend(f"  {f.name}: {cell}" + (f" {f.unit}" if f.unit else "") for f, cell in zip(rest, row[1:],
                                                                                                  strict=True))
    return lines


def show(console: Console, rows: Rows) -> None:
    """Print `rows` as a table when it fits the console's width (its headers wrapped between words if need be),
    else as blocks of lines."""
    if table_width(column_widths(rows, wrap_headers=False)) <= console.width:
        console.print(as_table(rows))
        return
    narrow = column_widths(rows, wrap_headers=True)
    if table_width(narrow) <= console.width:
        console.print(as_table(rows, narrow))
        return
    for line in as_blocks(rows):
        console.print(line, highlight=False, overflow="fold")


def plain(value: object) -> object:
    """A JSON value for a numpy scalar (its Python value), a missing number (None) or a path (its text)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value if isinstance(value, int | float | str | bool | type(None)) else str(value)


def print_json(document: object) -> None:
    """The one JSON document of `--json` on stdout (anything else a command says goes to stderr)."""
    sys.stdout.write(json.dumps(document, indent=2, default=plain) + "\n")


def breakdown_rows(step_time_s: float, classes: list[dict]) -> Rows:
    """Where each rank class's step goes (the timeline summary's `classes`). Exposed communication gets a
    column per group kind that has some (tp, dp, pp, ep, ...); NIC contention only where there is any."""
    kinds = [k for k in dict.fromkeys(k for row in classes for k in row["exposed_comm_s"])
             if any(row["exposed_comm_s"].get(k, 0.0) > 0 for row in classes)]
    contention = any(row.get("contention_added_s", 0.0) > 0 for row in classes)
    copies = any(row.get("exposed_host_copy_s", 0.0) > 0 for row in classes)
    fields = [Field("class", key="rank_class"), Field("ranks", key="ranks"), Field("stage", key="pp_rank"),
              Field("compute", "s", "compute_s"), Field("slowdown", "s", "slowdown_added_s"),
              *(Field(f"exposed {k}", "s", f"exposed_{k}_s") for k in kinds),
              *([Field("host copies", "s", "exposed_host_copy_s")] if copies else []),
              Field("bubble", "s", "pipeline_bubble_s"), Field("idle", "s", "idle_s"),
              Field("of which optimizer", "s", "optimizer_step_s"),
              *([Field("NIC contention", "s", "contention_added_s")] if contention else []),
              Field("memory", key="oom")]
    cells, values = [], []
    for row in classes:
        seconds = [row["compute_s"], row["slowdown_added_s"], *(row["exposed_comm_s"].get(k, 0.0) for k in kinds),
                   *([row.get("exposed_host_copy_s", 0.0)] if copies else []), row["pipeline_bubble_s"], row["idle_s"],
                   row["optimizer_step_s"],
                   *([row.get("contention_added_s", 0.0)] if contention else [])]
        head = [row["rank_class"], row["ranks"], row["pp_rank"]]
        cells.append([*map(str, head), *(SECONDS_FORMAT.format(s) for s in seconds),
                      "[red]OOM[/red]" if row["oom"] else "fits"])
        values.append([*head, *seconds, bool(row["oom"])])
    title = f"step {step_time_s:.4f} s: where each rank class's time goes"
    return Rows(title, fields, cells, values)


def memory_rows(memory: list[dict], capacity_bytes: float, hardware: str) -> Rows:
    """Memory per rank class of a trace (the trace's memory table, bytes) against the device's capacity."""
    from trainsim.trace.memory import oom_verdict

    fields = [Field("class", key="rank_class"), Field("weights", "GiB", "parameter_bytes"),
              Field("grads", "GiB", "gradient_bytes"), Field("optimizer", "GiB", "optimizer_state_bytes"),
              Field("activations", "GiB", "peak_activation_bytes"),
              Field("in flight", key="max_inflight_microbatches"), Field("peak", "GiB", "peak_bytes"),
              Field("memory", key="oom")]
    cells, values = [], []
    for row in memory:
        oom = bool(oom_verdict(row["peak_bytes"], capacity_bytes))
        gib = [row[f.key] / GIB for f in fields if f.unit == "GiB"]
        cells.append([str(row["rank_class"]), *(f"{v:.2f}" for v in gib[:4]), str(row["max_inflight_microbatches"]),
                      f"{gib[4]:.2f}", "[red]OOM[/red]" if oom else "fits"])
        values.append([row["rank_class"], *gib[:4], row["max_inflight_microbatches"], gib[4], oom])
    return Rows(f"memory per rank class vs {hardware} ({capacity_bytes / GIB:.1f} GiB)", fields, cells, values)


SEARCH_FIELDS = {
    "layout": Field("layout", key="layout"), "step_time_s": Field("step time", "s", "step_time_s"),
    "tokens_per_s": Field("throughput", "tokens/s", "tokens_per_s", ",.0f"),
    "mfu_pct": Field("MFU", "%", "mfu_pct", ".1f"),
    "peak_memory_gib": Field("peak memory", "GiB", "peak_memory_gib", ".2f"),
    "cost_per_million_tokens_usd": Field("cost", "USD per million tokens", "cost_per_million_tokens_usd", ",.3g"),
    "gpu_seconds_per_step": Field("cost", "GPU-s per step", "gpu_seconds_per_step"),
    "training_days": Field("training", "days", "training_days", ",.1f"),
    "training_cost_usd": Field("training cost", "USD", "training_cost_usd", ",.0f"),
}
"""The search table's columns by the layouts table's column names."""


def search_rows(title: str, shown: list[dict], columns: Sequence[str]) -> Rows:
    """Layouts of a search (rows of its layouts table), in the given columns of SEARCH_FIELDS."""
    fields = [SEARCH_FIELDS[c] for c in columns]
    cells = [[format(row[f.key], f.number_format) if isinstance(row[f.key], float) else str(row[f.key])
              for f in fields] for row in shown]
    values = [[plain(row[c]) for c in columns] for row in shown]
    return Rows(title, fields, cells, values)
