"""Import torch.profiler (Kineto) Chrome traces of a real GPU run into the kernel profile database.

Per trace file:

1. Read the gzip/JSON (errors name the file and what is wrong) and check its events: an event that is
   not an object, or a kernel / CPU op / runtime event missing a field the import needs, is counted by
   reason and left out; it does not stop the import.
2. Link each GPU kernel to the CUDA runtime call that launched it with HolisticTraceAnalysis'
   correlation (`hta.common.trace.transform_correlation_to_index`: kernel and launch share the
   `correlation` id), then the launch to the innermost CPU op enclosing it on the launching thread
   (the call-stack rule of HTA's CallStackGraph; done here with an interval stack per thread because
   HTA 0.5.0's CallGraph fails under pandas 3 / numpy 2, see docs/kineto_import.md).
3. NCCL kernels are communication: counted (per collective) and reported, never put in the compute
   database. Every other kernel either lands in a row or is counted under the reason it was skipped;
   per file, imported + NCCL + skipped = all kernel events.
4. An op instance's GPU time is the sum of the kernels it launched. Instances with the same signature
   (op + input shapes + input dtypes, from `record_shapes`' Input Dims / Input type) are aggregated
   into one database row: median, min, spread ((p75 - p25) / median), repeats = instances. FLOPs and
   bytes come from the shapes the way the trace stage computes them (`trainsim.trace.recorder`): the op
   runs on meta tensors of those shapes and dtypes, FLOPs from torch's flop_registry for matmul-class
   ops, one per output element otherwise, bytes = inputs + outputs.

Re-importing is idempotent: every row keeps, in `metrics`, the SHA-256 of the trace files it pooled and
its per-instance samples; a file already imported for this hardware adds nothing, and a signature
already in the database from another trace gets one new row that pools both files' samples (the
database reads the newest row per signature), so no signature is duplicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gzip
import hashlib
import json
import logging
import math
import re
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from trainsim.config.choices import MEASURED_BACKENDS
from trainsim.config.schema import HardwareConfig
from trainsim.errors import ArtifactError, ConfigError
from trainsim.profile.analytical import evaluate_fit, fit_rates
from trainsim.profile.database import PROFILE_SCHEMA, ProfileDatabase, now_utc, tool_versions_json

BACKEND = "kineto"
FIT_BACKENDS = (*MEASURED_BACKENDS, BACKEND)
"""Measured backends whose rows the refit after an import uses."""
# set: how many samples a row keeps
MAX_SAMPLES = 10_000
"""Per-instance times kept per row (for pooling later imports); the row's statistics use all of them."""

# Kineto's "Input type" strings of tensor arguments -> torch dtype name
KINETO_TENSOR_TYPES = {
    "float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
    "long": "int64", "long int": "int64", "int": "int32", "short": "int16", "signed char": "int8",
    "unsigned char": "uint8", "bool": "bool", "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2", "c10::complex<float>": "complex64",
}
LIST_TYPES = ("TensorList", "GenericList", "ScalarList")

# skip reasons (kernel counts); the report prints them as they are
SKIP_MALFORMED = "kernel event missing fields"
SKIP_NO_LAUNCH = "no launch event with its correlation id in the trace"
SKIP_NO_OP = "launch not inside any CPU op"
SKIP_NOT_ATEN = "CPU op is not an aten op (no FLOP formula)"
SKIP_NO_SHAPES = "CPU op has no recorded input shapes (record_shapes off)"
SKIP_TENSOR_LIST = "CPU op takes a tensor list (element shapes/dtypes not recorded)"
SKIP_NO_TENSORS = "CPU op has no tensor inputs recorded"
SKIP_NO_COST = "FLOPs/bytes not derivable from the recorded inputs"
SKIP_ZERO_TIME = "op's kernels take 0 s (below the trace's time resolution)"

class TraceFileError(ArtifactError):
    """A trace file cannot be read as a Kineto trace; the message names the file and what is wrong."""


@dataclass
class TraceImport:
    """What one trace file contained and what became of its kernels."""

    path: str
    sha256: str
    device_name: str | None = None
    kernels: int = 0
    """Kernel events (cat 'kernel') in the file, malformed ones included."""
    imported_kernels: int = 0
    nccl_kernels: int = 0
    nccl_time_s: float = 0.0
    nccl_by_collective: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    """Kernels not imported, by reason."""
    skipped_ops: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per reason, the CPU ops (names) of those kernels, where there was one."""
    other_events: dict[str, int] = field(default_factory=dict)
    """GPU events that are not kernels (memcpy, memset): not imported."""
    malformed_events: dict[str, int] = field(default_factory=dict)
    """Non-kernel events left out because a field was missing, by reason."""
    op_instances: int = 0
    signatures: int = 0
    already_imported: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def check_counts(self) -> None:
        accounted = self.imported_kernels + self.nccl_kernels + self.skipped_total
        if accounted != self.kernels:  # a bug here, not bad input: never let kernels vanish
            raise AssertionError(f"{self.path}: {self.kernels} kernels but {accounted} accounted for")


@dataclass
class FitResult:
    rows: int
    rates: dict[str, Any]
    train_ops: int = 0
    test_ops: int = 0
    median_error_pct: float | None = None
    p90_error_pct: float | None = None
    note: str = ""


@dataclass
class ImportReport:
    hardware: str
    database: str
    files: list[TraceImport]
    rows: pd.DataFrame
    """The rows this import appended (one per signature)."""
    part: str | None = None
    fit: FitResult | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def appended(self) -> int:
        return len(self.rows)


# -- reading ---------------------------------------------------------------------------------------


def _load_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read the trace file ({exc.strerror or exc})") from exc
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except EOFError as exc:
            raise TraceFileError(f"{path}: the gzip stream is truncated (ends before its last block); "
                                 "copy the file again") from exc
        except (OSError, zlib.error) as exc:
            raise TraceFileError(f"{path}: not a valid gzip file ({exc})") from exc
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise TraceFileError(f"{path}: not a JSON text (not UTF-8: {exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise TraceFileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                             "a Kineto trace is the Chrome-trace JSON torch.profiler writes") from exc


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


REQUIRED = {  # fields an event of the category needs to take part
    "kernel": ("name", "ts", "dur", "args.correlation"),
    "cpu_op": ("name", "ts", "dur", "pid", "tid"),
    "cuda_runtime": ("ts", "dur", "pid", "tid", "args.correlation"),
    "cuda_driver": ("ts", "dur", "pid", "tid", "args.correlation"),
}


def _missing(event: dict, fields: tuple[str, ...]) -> list[str]:
    out = []
    for name in fields:
        if name.startswith("args."):
            args = event.get("args")
            ok = isinstance(args, dict) and isinstance(args.get(name[5:]), (int, float))
        elif name in ("ts", "dur"):
            ok = isinstance(event.get(name), (int, float)) and not isinstance(event.get(name), bool)
        else:
            ok = event.get(name) is not None
        if not ok:
            out.append(name)
    return out


def _device_names(doc: dict) -> dict[int, str]:
    props = doc.get("deviceProperties")
    if not isinstance(props, list):
        return {}
    return {int(p.get("id", i)): str(p["name"]) for i, p in enumerate(props) if isinstance(p, dict) and "name" in p}


def _same_device(a: str, b: str) -> bool:
    norm = lambda s: re.sub(r"\s+", " ", s.strip().lower())  # noqa: E731
    return norm(a) == norm(b)


# -- correlation (HTA) and call stacks ------------------------------------------------------------


def _correlate(kernels: list[dict], launches: list[dict]) -> list[int]:
    """For each kernel, the position in `launches` of its launch, or -1: HTA's correlation of CPU
    launch events and GPU events (`transform_correlation_to_index`)."""
    from hta.common.trace import transform_correlation_to_index
    from hta.common.trace_symbol_table import TraceSymbolTable

    if not kernels:
        return []
    symbols = TraceSymbolTable()
    symbols.add_symbols({"kernel", "cuda_runtime"} | {str(e.get("name", "")) for e in kernels + launches})
    ids = symbols.get_sym_id_map()
    n_k, n = len(kernels), len(kernels) + len(launches)
    index = np.arange(1, n + 1)  # 1-based: HTA uses 0 for "linked event not in the trace"
    streams = [int(e["args"]["stream"]) if isinstance(e["args"].get("stream"), int) else 0 for e in kernels]
    df = pd.DataFrame({
        "index": index,
        "cat": [ids["kernel"]] * n_k + [ids["cuda_runtime"]] * len(launches),
        "name": [ids[str(e.get("name", ""))] for e in kernels + launches],
        "stream": np.array([max(s, 0) for s in streams] + [-1] * len(launches), dtype=np.int64),
        "correlation": np.array([int(e["args"]["correlation"]) for e in kernels + launches], dtype=np.int64),
    }, index=index)
    hta_logger = logging.getLogger("hta")
    level = hta_logger.level
    hta_logger.setLevel(logging.ERROR)
    try:
        df = transform_correlation_to_index(df, symbols)
    finally:
        hta_logger.setLevel(level)
    linked = df["index_correlation"].to_numpy()[:n_k]
    return [int(i) - 1 - n_k if i > n_k else -1 for i in linked]


def _enclosing_ops(ops: list[dict], launches: list[dict]) -> list[int]:
    """For each launch, the position in `ops` of the innermost CPU op on its thread whose interval
    contains the launch's start, or -1."""
    by_thread: dict[tuple, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        by_thread[(op["pid"], op["tid"])].append(i)
    launches_by_thread: dict[tuple, list[int]] = defaultdict(list)
    for i, launch in enumerate(launches):
        launches_by_thread[(launch["pid"], launch["tid"])].append(i)
    out = [-1] * len(launches)
    for thread, launch_ids in launches_by_thread.items():
        op_ids = sorted(by_thread.get(thread, []), key=lambda i: (ops[i]["ts"], -ops[i]["dur"]))
        launch_ids = sorted(launch_ids, key=lambda i: launches[i]["ts"])
        stack: list[int] = []
        j = 0
        for li in launch_ids:
            t = launches[li]["ts"]
            while j < len(op_ids) and ops[op_ids[j]]["ts"] <= t:
                start = ops[op_ids[j]]["ts"]
                while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] < start:
                    stack.pop()
                stack.append(op_ids[j])
                j += 1
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] < t:
                stack.pop()
            out[li] = stack[-1] if stack else -1
    return out


# -- op signatures and their cost ------------------------------------------------------------------


@dataclass(frozen=True)
class OpCall:
    op: str
    shapes: tuple
    dtypes: tuple  # trainsim dtype names of the tensor inputs
    strides: tuple | None
    args: tuple  # per recorded input: ('t', i) tensor i, ('s', value|None) scalar, ('n',) none


def _op_call(op: dict) -> OpCall | str:
    """The signature of a CPU op from its recorded inputs, or the skip reason."""
    import torch

    from trainsim.trace.recorder import dtype_name

    name = str(op["name"])
    if not name.startswith("aten::"):
        return SKIP_NOT_ATEN
    args = op.get("args") or {}
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list) or len(dims) != len(types):
        return SKIP_NO_SHAPES
    strides_in = args.get("Input Strides")
    concrete = args.get("Concrete Inputs")
    shapes, dtypes, strides, call = [], [], [], []
    for pos, (dim, kind) in enumerate(zip(dims, types)):
        if kind == "TensorList":
            return SKIP_TENSOR_LIST
        if kind in KINETO_TENSOR_TYPES and isinstance(dim, list) and all(isinstance(d, int) for d in dim):
            torch_dtype = getattr(torch, KINETO_TENSOR_TYPES[kind], None)
            if torch_dtype is None:
                return SKIP_NO_COST
            call.append(("t", len(shapes)))
            shapes.append(tuple(dim))
            dtypes.append(dtype_name(torch_dtype))
            st = strides_in[pos] if isinstance(strides_in, list) and pos < len(strides_in) else None
            strides.append(tuple(st) if isinstance(st, list) else None)
        elif kind == "Scalar" or kind in LIST_TYPES:
            value = None
            if isinstance(concrete, list) and pos < len(concrete) and concrete[pos] not in ("", None):
                with contextlib.suppress(ValueError):
                    value = json.loads(str(concrete[pos]).replace("True", "true").replace("False", "false"))
            call.append(("s", value))
        else:
            call.append(("n",))
    if not shapes:
        return SKIP_NO_TENSORS
    recorded_strides = tuple(strides) if all(s is not None for s in strides) else None
    return OpCall(name, tuple(shapes), tuple(dtypes), recorded_strides, tuple(call))


def signature(call: OpCall) -> str:
    text = json.dumps([BACKEND, call.op, [list(s) for s in call.shapes], list(call.dtypes)], separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def op_cost(call: OpCall) -> tuple[int, int, str] | None:
    """(flops, bytes_moved, basis) of an op from its input shapes, computed as the trace stage does
    (trainsim.trace.recorder): run on meta tensors; basis 'meta' when every argument was recorded,
    'meta, unrecorded scalars defaulted' when an unrecorded scalar was given a default; None when the op
    does not run on those inputs."""
    import torch
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    from trainsim.profile.replay import DTYPES
    from trainsim.trace.recorder import sdpa_flops

    def to_dtype(name: str):
        return DTYPES.get(name) or getattr(torch, name, None)

    tensors = [torch.empty(s, dtype=to_dtype(d), device="meta") for s, d in zip(call.shapes, call.dtypes)]
    namespace, _, base = call.op.partition("::")
    packet = getattr(getattr(torch.ops, namespace), base.split(".")[0], None)
    if packet is None:
        return None
    unknown = [i for i, a in enumerate(call.args) if a[0] == "s" and a[1] is None]
    # an unrecorded scalar: try the common defaults (alpha/beta = 1, a flag, an absent optional)
    trials = [(d, out_kw) for d in ([1, None, False, 0] if unknown else [None]) for out_kw in (False, True)]
    for default, out_kw in trials:
        args = [tensors[a[1]] if a[0] == "t" else (a[1] if a[0] == "s" and a[1] is not None else
                                                  (default if a[0] == "s" else None)) for a in call.args]
        _layer_norm_shape(call, args)
        while args and args[-1] is None:  # trailing absent optionals
            args.pop()
        kwargs = {}
        if out_kw:  # an `.out` overload: Kineto records the keyword-only out tensor as the last input
            if not args or not isinstance(args[-1], torch.Tensor):
                continue
            kwargs["out"] = args.pop()
        try:
            out = packet(*args, **kwargs)
        except Exception:  # noqa: BLE001 - any dispatcher/meta failure means "not with these arguments"
            continue
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors + outputs)
        if packet in flop_registry:
            try:
                flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001
                continue
        elif "scaled_dot_product" in call.op and len(tensors) >= 2:
            flops = sdpa_flops(call.op, tensors[0], tensors[1])
        else:
            flops = sum(t.numel() for t in outputs)
        return flops, nbytes, "meta" if not unknown else "meta, unrecorded scalars defaulted"
    return None


# cite: aten's native_layer_norm and native_layer_norm_backward signatures (argument positions)
LAYER_NORM_WEIGHT = {"aten::native_layer_norm": (1, 2), "aten::native_layer_norm_backward": (2, 5)}
"""op -> (position of normalized_shape, position of weight): Kineto does not record int lists, but the
normalised shape is the weight's shape."""


def _layer_norm_shape(call: OpCall, args: list) -> None:
    if call.op in LAYER_NORM_WEIGHT:
        shape_pos, weight_pos = LAYER_NORM_WEIGHT[call.op]
        if len(args) > weight_pos and args[shape_pos] is None and call.args[weight_pos][0] == "t":
            args[shape_pos] = list(args[weight_pos].shape)
            if call.op == "aten::native_layer_norm_backward" and len(call.args) > 7 and args[7] is None:
                args[7] = [True, True, True]  # output_mask: grads of input, weight and bias


# -- one trace file --------------------------------------------------------------------------------


def _nccl_collective(kernel_name: str) -> str:
    m = re.search(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", kernel_name)
    return m.group(1) if m else "other"


@dataclass
class _Instance:
    call: OpCall
    seconds: float
    kernels: list[str]
    source: str
    sha256: str


def read_trace(path: str | Path, hw: HardwareConfig | None = None,
               allow_device_mismatch: bool = False) -> tuple[TraceImport, list[_Instance]]:
    """Parse one Kineto trace: its report (counts) and its op instances with their GPU time."""
    path = Path(path)
    doc = _load_json(path)
    if not isinstance(doc, dict):
        raise TraceFileError(f"{path}: the JSON is a {type(doc).__name__}, not an object with 'traceEvents'; "
                             "not a Kineto trace")
    if "traceEvents" not in doc:
        raise TraceFileError(f"{path}: no 'traceEvents' key (keys: {', '.join(sorted(doc)) or 'none'}); "
                             "not a Kineto/Chrome trace")
    events = doc["traceEvents"]
    if not isinstance(events, list):
        raise TraceFileError(f"{path}: 'traceEvents' is a {type(events).__name__}, expected a list of events")
    report = TraceImport(path=str(path), sha256=_sha256(path))
    _check_device(doc, path, hw, allow_device_mismatch, report)

    kernels, launches, ops = [], [], []
    malformed: Counter = Counter()
    other: Counter = Counter()
    for e in events:
        if not isinstance(e, dict):
            malformed["event is not a JSON object"] += 1
            continue
        cat = e.get("cat")
        if cat in ("gpu_memcpy", "gpu_memset"):
            other[cat] += 1
        if cat not in REQUIRED:
            continue
        missing = _missing(e, REQUIRED[cat])
        if cat == "kernel":
            report.kernels += 1
            if missing:
                _skip(report, f"{SKIP_MALFORMED} ({', '.join(missing)})", None)
                continue
            kernels.append(e)
        elif missing:
            malformed[f"{cat} event missing {', '.join(missing)}"] += 1
        elif cat == "cpu_op":
            ops.append(e)
        else:
            launches.append(e)
    report.malformed_events = dict(malformed)
    report.other_events = dict(other)
    if report.kernels == 0:
        report.warnings.append(f"{path}: no GPU kernel events (cat 'kernel'); was the profiler run with "
                               "ProfilerActivity.CUDA?")

    nccl = [k for k in kernels if "nccl" in str(k["name"]).lower()]
    compute = [k for k in kernels if "nccl" not in str(k["name"]).lower()]
    report.nccl_kernels = len(nccl)
    report.nccl_time_s = float(sum(k["dur"] for k in nccl)) * 1e-6
    report.nccl_by_collective = dict(Counter(_nccl_collective(str(k["name"])) for k in nccl))

    launch_of = _correlate(compute, launches)
    op_of_launch = _enclosing_ops(ops, launches)
    by_op: dict[int, list[dict]] = defaultdict(list)
    for kernel, li in zip(compute, launch_of):
        if li < 0:
            _skip(report, SKIP_NO_LAUNCH, None)
        elif op_of_launch[li] < 0:
            _skip(report, SKIP_NO_OP, None)
        else:
            by_op[op_of_launch[li]].append(kernel)

    instances: list[_Instance] = []
    calls: dict[int, OpCall | str] = {}
    for oi, op_kernels in by_op.items():
        call = calls.setdefault(oi, _op_call(ops[oi]))
        seconds = float(sum(k["dur"] for k in op_kernels)) * 1e-6
        if isinstance(call, str):
            reason = call
        elif seconds <= 0:
            reason = SKIP_ZERO_TIME
        else:
            instances.append(_Instance(call, seconds, [str(k["name"]) for k in op_kernels], str(path),
                                       report.sha256))
            report.imported_kernels += len(op_kernels)
            continue
        _skip(report, reason, str(ops[oi]["name"]), len(op_kernels))
    report.op_instances = len(instances)
    return report, instances


def _skip(report: TraceImport, reason: str, op: str | None, n: int = 1) -> None:
    report.skipped[reason] = report.skipped.get(reason, 0) + n
    if op is not None:
        ops = report.skipped_ops.setdefault(reason, {})
        ops[op] = ops.get(op, 0) + n


def _check_device(doc: dict, path: Path, hw: HardwareConfig | None, allow: bool, report: TraceImport) -> None:
    names = _device_names(doc)
    report.device_name = ", ".join(sorted(set(names.values()))) or None
    if hw is None:
        return
    if hw.device_kind == "cpu":
        raise ConfigError(f"hardware '{hw.name}' is a CPU config (device_kind=cpu); Kineto GPU traces are imported "
                          "into the GPU config they were recorded on, e.g. --hardware a100-80g-dgx")
    if not names:
        report.warnings.append(f"{path}: no deviceProperties in the trace; its device cannot be checked against "
                               f"hardware.device_name={hw.device_name!r}")
        return
    wrong = sorted({n for n in names.values() if not _same_device(n, hw.device_name)})
    if wrong:
        message = (f"{path}: recorded on {', '.join(wrong)}, but hardware '{hw.name}' is "
                   f"device_name={hw.device_name!r}")
        if not allow:
            raise ConfigError(f"{message}; import it into a config of that device, or pass "
                              "--allow-device-mismatch (Python: allow_device_mismatch=True) to import anyway")
        report.warnings.append(f"{message}; imported anyway (--allow-device-mismatch)")


# -- rows, the database, the refit -----------------------------------------------------------------


def _previous_samples(row: pd.Series) -> tuple[list[float], list[dict]]:
    try:
        metrics = json.loads(row["metrics"])
    except (TypeError, ValueError):
        return [], []
    return list(metrics.get("samples_s", [])), list(metrics.get("traces", []))


def build_rows(instances: list[_Instance], hardware_key: str, reports: list[TraceImport],
               existing: pd.DataFrame | None = None) -> pd.DataFrame:
    """One database row per signature; a signature already in `existing` (kineto rows of this hardware)
    pools its samples with the new ones."""
    groups: dict[str, list[_Instance]] = defaultdict(list)
    for inst in instances:
        groups[signature(inst.call)].append(inst)
    previous = {} if existing is None or existing.empty else {r["signature"]: r for _, r in existing.iterrows()}
    devices = {r.sha256: r.device_name for r in reports}
    rows, costs = [], {}
    for sig, group in groups.items():
        call = group[0].call
        if call not in costs:
            costs[call] = op_cost(call)
        cost = costs[call]
        if cost is None:
            for r in reports:  # a per-file count: these kernels were not imported after all
                n = sum(len(i.kernels) for i in group if i.sha256 == r.sha256)
                if n:
                    r.imported_kernels -= n
                    r.op_instances -= sum(1 for i in group if i.sha256 == r.sha256)
                    _skip(r, SKIP_NO_COST, call.op, n)
            continue
        flops, nbytes, basis = cost
        samples = [i.seconds for i in group]
        traces = Counter((i.source, i.sha256) for i in group)
        trace_list = [{"file": f, "sha256": s, "instances": n, "device_name": devices.get(s)}
                      for (f, s), n in traces.items()]
        if sig in previous:
            old_samples, old_traces = _previous_samples(previous[sig])
            samples = old_samples + samples
            trace_list = old_traces + trace_list
        values = np.asarray(samples)
        median = float(np.median(values))
        p25, p75 = np.quantile(values, [0.25, 0.75])
        kernel_names = sorted({k for i in group for k in i.kernels})
        rows.append({
            "hardware": hardware_key,
            "signature": sig,
            "op": call.op,
            "input_shapes": json.dumps([list(s) for s in call.shapes], separators=(",", ":")),
            "input_strides": (json.dumps([list(s) for s in call.strides], separators=(",", ":"))
                              if call.strides is not None else "null"),
            "input_dtypes": ",".join(call.dtypes),
            "op_args": json.dumps({"args": [_encode(a) for a in call.args], "kwargs": {}}, separators=(",", ":")),
            "flops": int(flops),
            "bytes_moved": int(nbytes),
            "backend": BACKEND,
            "median_s": median,
            "spread": float((p75 - p25) / median) if median > 0 else 0.0,
            "min_s": float(values.min()),
            "repeats": len(values),
            "threads": 0,
            "kernels": json.dumps(kernel_names),
            "metrics": json.dumps({
                "traces": trace_list,
                "kernels_per_instance": float(np.median([len(i.kernels) for i in group])),
                "cost_basis": basis,
                "strides": "recorded" if call.strides is not None else "not recorded",
                "samples_s": [float(s) for s in samples[-MAX_SAMPLES:]],
            }, separators=(",", ":")),
            "fallback_reason": None,
            "source": "imported from " + ", ".join(sorted({t["file"] for t in trace_list})) + " (kineto)",
            "measured_at": now_utc(),
            "tool_versions": tool_versions_json(),
        })
    for r in reports:
        r.signatures = len({signature(i.call) for i in instances if i.sha256 == r.sha256
                            and costs.get(i.call) is not None})
    return pd.DataFrame(rows, columns=PROFILE_SCHEMA.names)


def _encode(arg: tuple) -> Any:
    """The recorder's op_args encoding: tensors as {'$t': i}; scalars Kineto did not record as {'$obj': 'Scalar'}
    (a replay refuses them)."""
    if arg[0] == "t":
        return {"$t": arg[1]}
    if arg[0] == "s":
        return arg[1] if arg[1] is not None else {"$obj": "Scalar"}
    return None


def imported_hashes(rows: pd.DataFrame) -> set[str]:
    """SHA-256 of every trace file the kineto rows pooled."""
    out: set[str] = set()
    for metrics in rows.loc[rows["backend"] == BACKEND, "metrics"]:
        with contextlib.suppress(TypeError, ValueError):
            out |= {t.get("sha256") for t in json.loads(metrics).get("traces", [])}
    return out


@contextlib.contextmanager
def _import_lock(db: ProfileDatabase):
    """Serialise imports into one database (read what is there, then append), so two concurrent imports of
    the same trace do not both add it."""
    db.path.mkdir(parents=True, exist_ok=True)
    with open(db.path / ".import.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fit_rows(rows: pd.DataFrame, hardware_key: str) -> pd.DataFrame:
    """The database rows of one hardware a compute-model fit can use: measured (cpu, cuda, kineto), with
    positive time and FLOPs or bytes."""
    rows = rows[(rows["hardware"] == hardware_key) & rows["backend"].isin(FIT_BACKENDS)]
    return rows[(rows["median_s"] > 0) & ((rows["flops"] > 0) | (rows["bytes_moved"] > 0))].reset_index(drop=True)


def refit(rows: pd.DataFrame, train_fraction: float = 0.5, seed: int = 0) -> FitResult:
    """Fit the analytical compute model to `rows` (all of them) and its held-out error (fit on a random
    `train_fraction` of the signatures, error on the rest: `evaluate_fit`)."""
    result = FitResult(rows=len(rows), rates={})
    if len(rows) < 6:
        result.note = f"not refitted: {len(rows)} usable row(s), the fit needs at least 6"
        return result
    result.rates = _plain(dataclasses.asdict(fit_rates(rows)))
    try:
        held = evaluate_fit(rows, train_fraction, seed)
    except ValueError as exc:
        result.note = f"no held-out error: {exc}"
        return result
    result.train_ops, result.test_ops = held.train_ops, held.test_ops
    result.median_error_pct, result.p90_error_pct = held.median_error_pct, held.p90_error_pct
    return result


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def import_traces(paths: list[str | Path], hw: HardwareConfig, database: str | Path | None = None,
                  hardware_key: str | None = None, allow_device_mismatch: bool = False, fit: bool = True,
                  train_fraction: float = 0.5, seed: int = 0) -> ImportReport:
    """Import Kineto trace files into the profile database of `hw` and refit its compute model.

    Every file is read and checked before anything is written: a file that cannot be read, or was recorded
    on another device than `hw.device_name` (unless `allow_device_mismatch`), raises and nothing is added.
    `database` defaults to artifacts/profiles/<hardware_key>/kernels.parquet.
    """
    if not paths:
        raise ConfigError("no trace files given; pass torch.profiler (Kineto) traces, *.json or *.json.gz, e.g. "
                          "`trainsim profile-import --hardware a100-80g-dgx run/rank0.json.gz`")
    key = hardware_key or hw.name
    db = ProfileDatabase(Path(database) if database else Path("artifacts/profiles") / key / "kernels.parquet")
    parsed = [read_trace(p, hw, allow_device_mismatch) for p in paths]
    report = ImportReport(hardware=key, database=str(db.path), files=[r for r, _ in parsed],
                          rows=PROFILE_SCHEMA.empty_table().to_pandas())
    with _import_lock(db):
        existing = db.read()
        mine = existing[(existing["hardware"] == key) & (existing["backend"] == BACKEND)]
        done = imported_hashes(mine)
        instances, seen = [], set()
        for file_report, file_instances in parsed:
            if file_report.sha256 in done or file_report.sha256 in seen:
                file_report.already_imported = True
                file_report.warnings.append(f"{file_report.path}: already imported for '{key}' (same SHA-256); "
                                            "nothing added")
                continue
            seen.add(file_report.sha256)
            instances += file_instances
        fresh = [r for r, _ in parsed if not r.already_imported]
        rows = build_rows(instances, key, fresh, mine)
        part = db.append(rows)
    for r in report.files:
        r.check_counts()
        report.warnings += r.warnings
    report.rows = rows
    report.part = str(part) if part else None
    if fit:
        report.fit = refit(fit_rows(db.read(), key), train_fraction, seed)
    return report
