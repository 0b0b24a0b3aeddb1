"""The kernel profile database: one row per (hardware, op signature), append-only Parquet.

Layout: `artifacts/profiles/{hardware}/kernels.parquet/` is a Parquet dataset directory; every
write adds one new `part-<time>-<uuid>.parquet` file (written to a hidden temp name, then renamed),
so concurrent writers never overwrite each other and a crash leaves no partial part. Readers take
the union; if a signature was measured twice (two jobs racing), the newest row wins. A part that
cannot be read is reported by name, never silently dropped or rebuilt.
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from trainsim.artifacts.store import tool_versions
from trainsim.config.choices import MEASURED_BACKENDS
from trainsim.errors import ArtifactError

BACKENDS = (*MEASURED_BACKENDS, "analytical")

PROFILE_SCHEMA = pa.schema([
    ("hardware", pa.string()),          # hardware key the row is valid for
    ("signature", pa.string()),         # execution-graph signature (op, shapes, strides, dtypes, args)
    ("op", pa.string()),
    ("input_shapes", pa.string()),
    ("input_strides", pa.string()),
    ("input_dtypes", pa.string()),
    ("op_args", pa.string()),
    ("flops", pa.int64()),
    ("bytes_moved", pa.int64()),
    ("backend", pa.string()),           # cpu | cuda | analytical
    ("median_s", pa.float64()),         # solo running time: median over repeats
    ("spread", pa.float64()),           # (p75 - p25) / median of the repeats; 0 for analytical
    ("min_s", pa.float64()),
    ("repeats", pa.int32()),
    ("threads", pa.int32()),            # host threads used (CPU backend)
    ("kernels", pa.string()),           # JSON list of device kernels the op launched (CUDA), else "[]"
    ("metrics", pa.string()),           # JSON of device metrics where the device exposes them, else "{}"
    ("fallback_reason", pa.string()),   # why an op could not be measured (analytical fallback), else null
    ("source", pa.string()),            # where the row was made: 'measured here' or 'imported from <file>'
    ("measured_at", pa.string()),       # ISO-8601 UTC
    ("tool_versions", pa.string()),     # JSON {python, torch, trainsim, ...}
])


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class ProfileDatabase:
    def __init__(self, path: Path):
        self.path = Path(path)

    def parts(self) -> list[Path]:
        return sorted(self.path.glob("part-*.parquet")) if self.path.is_dir() else []

    def read(self) -> pd.DataFrame:
        """All rows, newest row per (hardware, signature)."""
        tables = []
        for part in self.parts():
            try:
                table = pq.read_table(part)
            except (pa.ArrowInvalid, OSError) as exc:
                raise ArtifactError(f"profile database part {part} is corrupt ({exc}); move it away or restore "
                                    "the database (e.g. `dvc pull`) — it is not rebuilt automatically") from exc
            check_schema(table.schema, str(part))
            tables.append(table.select(PROFILE_SCHEMA.names).cast(PROFILE_SCHEMA))
        if not tables:
            return PROFILE_SCHEMA.empty_table().to_pandas()
        rows = pa.concat_tables(tables).to_pandas()
        rows = rows.sort_values("measured_at", kind="stable")
        return rows.drop_duplicates(["hardware", "signature"], keep="last").reset_index(drop=True)

    def append(self, rows: pd.DataFrame) -> Path | None:
        """Add rows as one new part file (atomic rename); returns its path, or None for no rows."""
        if rows.empty:
            return None
        table = pa.Table.from_pandas(rows[PROFILE_SCHEMA.names], schema=PROFILE_SCHEMA, preserve_index=False)
        self.path.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%f")
        final = self.path / f"part-{stamp}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = self.path / f".{final.name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, final)
        return final

    def import_from(self, source: Path, hardware: str | None = None) -> int:
        """Merge rows measured elsewhere (a database directory or one Parquet file); returns rows added."""
        source = Path(source)
        try:
            table = pq.read_table(source)
        except (pa.ArrowInvalid, OSError) as exc:
            raise ArtifactError(f"cannot read profile database {source}: {exc}") from exc
        check_schema(table.schema, str(source))
        rows = table.select(PROFILE_SCHEMA.names).cast(PROFILE_SCHEMA).to_pandas()
        if hardware is not None:
            rows = rows[rows["hardware"] == hardware]
        known = self.read()[["hardware", "signature"]].apply(tuple, axis=1)
        rows = rows[~rows[["hardware", "signature"]].apply(tuple, axis=1).isin(set(known))]
        rows = rows.assign(source=f"imported from {source}")
        self.append(rows)
        return len(rows)


def check_schema(schema: pa.Schema, where: str) -> None:
    """Every column of PROFILE_SCHEMA must be present with a compatible type; names the first that is not."""
    for field in PROFILE_SCHEMA:
        if field.name not in schema.names:
            raise ArtifactError(f"{where}: column '{field.name}' ({field.type}) is missing; a profile database "
                                f"needs {', '.join(PROFILE_SCHEMA.names)}")
        actual = schema.field(field.name).type
        if actual != field.type and not (pa.types.is_integer(actual) and pa.types.is_integer(field.type)) \
                and not (pa.types.is_floating(actual) and pa.types.is_floating(field.type)):
            raise ArtifactError(f"{where}: column '{field.name}' has type {actual}, expected {field.type}")


def tool_versions_json() -> str:
    return json.dumps(tool_versions(), sort_keys=True)
