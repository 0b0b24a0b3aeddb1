"""nccl-tests parser: the published tables in data/nccl-tests, real-world log shapes built from their rows
(log records, truncation, several runs, abbreviated rank lists, launcher prefixes, old layouts), bad input."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from trainsim.comm.calibration import collect_measurements, read_calibration_file, write_calibration_artifact
from trainsim.comm.nccl_tests import (
    COLUMNS,
    SKIP_EXTRA,
    SKIP_LOG_DAMAGE,
    SKIP_TRUNCATED,
    NcclTestsFormatError,
    bus_bandwidth_factor,
    parse_nccl_tests,
    parse_nccl_tests_runs,
)
from trainsim.config import compose_run
from trainsim.config.data_path import DATA_DIR
from trainsim.config.schema import CalibrationFile
from trainsim.errors import ConfigError

DATA = DATA_DIR / "nccl-tests"
P4DE = "a100-16gpu-2node-aws-p4de-efa400_allreduce.txt"
P5 = "h100-16gpu-2node-aws-p5-efa3200_allreduce.txt"
TRIMMED = "a100-8gpu-nvlink_allreduce_mlengineering.txt"
SENDRECV = "a100-8gpu-nvlink_sendrecv_liplus.txt"
OCI = "a100-16gpu-2node-oci-bmgpu4.8-roce_allreduce.txt"
COREWEAVE = "h100-64gpu-8node-coreweave-ndr-ib-sharp_allreduce.txt"
# file -> (collective, nranks, nodes, sizes, placements per size)
SUPPORTED = {
    P4DE: ("all_reduce", 16, 2, 29, 2),
    OCI: ("all_reduce", 16, 2, 31, 2),
    P5: ("all_reduce", 16, 2, 32, 2),
    TRIMMED: ("all_reduce", 8, 1, 20, 1),
    SENDRECV: ("send_recv", 8, 1, 4, 2),
    "a100-2gpu-nvlink_allreduce_vtrain-lut.csv": ("all_reduce", 2, 1, 1024, 2),
    "a100-4gpu-nvlink_allreduce_vtrain-lut.csv": ("all_reduce", 4, 1, 1024, 2),
    "a100-8gpu-nvlink_allreduce_vtrain-lut.csv": ("all_reduce", 8, 1, 1024, 2),
    "a100_40g-16gpu-2node-aws_p4d_eks-efa_nccl2.8.3_all_reduce.txt": ("all_reduce", 16, 2, 28, 2),
    "a100_40g-16gpu-2node-aws_p4d_eks-efa_nccl2.9.9_all_reduce.txt": ("all_reduce", 16, 2, 30, 2),
    "h100-16gpu-2node-xxrjun_cluster00-transport_not_stated_alltoall.txt": ("all_to_all", 16, 2, 10, 2),
    "h100-16gpu-2node-xxrjun_cluster00-transport_not_stated_sendrecv.txt": ("send_recv", 16, 2, 10, 2),
}
# logs of several runs (parse_nccl_tests_runs reads each) -> (collective, runs)
MULTI_RUN = {"b200-16gpu-2node-together_use3a-ss-ib_cx7_400g_sendrecv.txt": ("send_recv", 2)}
# author-compiled busbw / algbw tables without a time column: no nccl-tests log, refused by this parser naming the
# file (issue 50 reads them through their own documented format)
AUTHOR_TABLES = (
    "h100-16to256gpu-2to32node-aws_p5_hyperpod-efa_all_gather.txt",
    "h100-16to256gpu-2to32node-aws_p5_hyperpod-efa_all_reduce.txt",
    "h100-16to256gpu-2to32node-aws_p5_hyperpod-efa_alltoall.txt",
    "b200-16to512gpu-2to64node-together_use3a-ss-ib_cx7_400g_sendrecv_busbw_table.txt",
    "b200-8to512gpu-1to64node-together_slinky-ib_ndr400_12hca_sharp_peak_busbw_tables.txt",
)
# markdown summaries with no (size, time) sweep -> (line number of the first table line)
UNSUPPORTED = {
    "h200-8gpu-nvlink_allreduce-nvls-vs-ring_mlengineering.txt": 4,
    "a100-ndmv4-azure-1node-2node_summary_mscclpp.txt": 5,
}
# header's rank count contradicted by busbw / algbw -> (stated, implied)
RANK_CONFLICT = {COREWEAVE: (64, 96)}
MODERN_HEADER = (
    "#    size       count   type  redop  root    time  algbw  busbw #wrong    time  algbw  busbw #wrong\n"
    "#     (B)  (elements)                        (us) (GB/s) (GB/s)           (us) (GB/s) (GB/s)\n"
)


@pytest.fixture(scope="module")
def data() -> Path:
    if not DATA.is_dir():
        pytest.skip(f"no nccl-tests data at {DATA}")
    return DATA


def row(table, message_bytes: int, placement: str):
    rows = table[(table.message_bytes == message_bytes) & (table.placement == placement)]
    assert len(rows) == 1
    return rows.iloc[0]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_data_file_is_classified(data: Path) -> None:
    assert {p.name for p in data.iterdir()} == (set(SUPPORTED) | set(UNSUPPORTED) | set(RANK_CONFLICT)
                                                | set(MULTI_RUN) | set(AUTHOR_TABLES))


@pytest.mark.parametrize("name", sorted(MULTI_RUN))
def test_logs_of_several_runs_are_read_run_by_run(data: Path, name: str) -> None:
    collective, runs = MULTI_RUN[name]
    with pytest.raises(NcclTestsFormatError, match="runs"):
        parse_nccl_tests(data / name)
    results = parse_nccl_tests_runs(data / name)
    assert len(results) == runs and {r.collective for r in results} == {collective}
    assert results[0].nranks == 16 and results[0].nodes == 2
    assert results[1].nodes == 2  # "(Rank lines of this second run omitted: same 16 ranks on the same 2 hosts)"


@pytest.mark.parametrize("name", AUTHOR_TABLES)
def test_author_compiled_tables_are_refused_by_the_log_parser_naming_the_file(data: Path, name: str) -> None:
    with pytest.raises(NcclTestsFormatError, match=re.escape(name)):
        parse_nccl_tests(data / name)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_files_parse(data: Path, name: str) -> None:
    collective, nranks, nodes, n_sizes, n_placements = SUPPORTED[name]
    result = parse_nccl_tests(data / name)
    table = result.table
    assert list(table.columns) == list(COLUMNS)
    assert (result.collective, result.nranks, result.nodes) == (collective, nranks, nodes)
    assert result.source == str(data / name) and set(table.source) == {result.source}
    assert set(table.collective) == {collective}
    assert len(table) == n_sizes * n_placements
    assert table.message_bytes.nunique() == n_sizes
    assert table.placement.value_counts().tolist() == [n_sizes] * n_placements
    assert table.message_bytes.dtype == "int64" and table.time_s.dtype == "float64"
    assert (table.time_s > 0).all() and table.message_bytes.is_monotonic_increasing


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_markdown_summaries_are_refused(data: Path, name: str) -> None:
    with pytest.raises(NcclTestsFormatError, match=rf"{name}, line {UNSUPPORTED[name]}: markdown"):
        parse_nccl_tests(data / name)


def test_aws_p4de_values(data: Path) -> None:
    table = parse_nccl_tests(data / P4DE).table
    out = row(table, 2 * 2**30, "out_of_place")
    assert out.time_s == pytest.approx(0.051406) and out.busbw_gbps == 78.33 and out.algbw_gbps == 41.78
    assert out["dtype"] == "fp32"
    inplace = row(table, 2**20, "in_place")
    assert inplace.time_s == pytest.approx(307.3e-6) and inplace.busbw_gbps == 6.40
    assert table.message_bytes.min() == 8


def test_aws_p5_largest_row(data: Path) -> None:
    out = row(parse_nccl_tests(data / P5).table, 16 * 2**30, "out_of_place")
    assert out.time_s == pytest.approx(0.066132) and out.busbw_gbps == 487.09


def test_vtrain_csv_is_in_nanoseconds_without_algbw(data: Path) -> None:
    table = parse_nccl_tests(data / "a100-2gpu-nvlink_allreduce_vtrain-lut.csv").table
    assert row(table, 2**20, "out_of_place").time_s == pytest.approx(44210e-9)
    assert row(table, 2**20, "in_place").time_s == pytest.approx(45100e-9)
    assert row(table, 2**20, "out_of_place").busbw_gbps == 23.72
    assert table.algbw_gbps.isna().all()
    assert sorted(set(table.message_bytes)) == [i * 2**20 for i in range(1, 1025)]


def test_trimmed_table_with_underscore_sizes(data: Path) -> None:
    table = parse_nccl_tests(data / TRIMMED).table
    # '1_073_741_824', the irregular '1048_576', and 16 GiB
    assert {2**30, 2**20, 16 * 2**30} <= set(table.message_bytes)
    assert set(table.placement) == {"out_of_place"} and table.dtype.isna().all()
    assert row(table, 2**30, "out_of_place").time_s == pytest.approx(8203.9e-6)


def test_sendrecv_na_error_column(data: Path) -> None:
    table = parse_nccl_tests(data / SENDRECV).table
    inplace = row(table, 2**30, "in_place")
    assert inplace.time_s == pytest.approx(5490.5e-6) and inplace.busbw_gbps == 195.56
    assert (table.busbw_gbps == table.algbw_gbps).all()  # send_recv factor is 1


@pytest.mark.parametrize("name", [P4DE, P5, OCI, TRIMMED, SENDRECV])
def test_busbw_is_algbw_times_factor(data: Path, name: str) -> None:
    result = parse_nccl_tests(data / name)
    factor = bus_bandwidth_factor(result.collective, result.nranks)
    tolerance = 0.005 * factor + 0.005 + 1e-9  # both columns are rounded to 0.01
    for algbw, busbw in zip(result.table.algbw_gbps, result.table.busbw_gbps, strict=True):
        assert abs(busbw - algbw * factor) <= tolerance
    big = result.table[result.table.algbw_gbps >= 1]  # algbw = size / time, to the printed digits
    assert (big.message_bytes / big.time_s / 1e9).to_numpy() == pytest.approx(big.algbw_gbps.to_numpy(), rel=0.01)


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_vtrain_busbw_from_size_and_time(data: Path, gpus: int) -> None:
    result = parse_nccl_tests(data / f"a100-{gpus}gpu-nvlink_allreduce_vtrain-lut.csv")
    table = result.table
    busbw = table.message_bytes / table.time_s / 1e9 * bus_bandwidth_factor("all_reduce", gpus)
    assert busbw.to_numpy() == pytest.approx(table.busbw_gbps.to_numpy(), rel=0.005, abs=0.01)


def test_srun_prefix_is_stripped(data: Path, tmp_path: Path) -> None:
    original = parse_nccl_tests(data / P4DE)
    text = "".join(f"0: {line}\n" for line in (data / P4DE).read_text().splitlines())
    prefixed = parse_nccl_tests(write(tmp_path, P4DE, text))
    assert prefixed.table.drop(columns="source").equals(original.table.drop(columns="source"))
    assert (prefixed.nranks, prefixed.collective) == (16, "all_reduce")


def test_real_output_header_and_old_layout(tmp_path: Path) -> None:
    text = (
        "# nThread 1 nGpus 1 minBytes 1024 maxBytes 2048 step: 2(factor) warmup iters: 5 iters: 20\n"
        "#   Rank  0 Pid  11 on nodeA device  0 [0x1a] Tesla V100\n"
        "#   Rank  1 Pid  12 on nodeA device  1 [0x1b] Tesla V100\n"
        "#   Rank  2 Pid  13 on nodeB device  0 [0x1a] Tesla V100\n"
        "#   Rank  3 Pid  14 on nodeB device  1 [0x1b] Tesla V100\n"
        "nodeA:11:11 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>\n"
        "# Collective test starting: alltoall_perf\n"
        "#       size         count      type   redop     time   algbw   busbw  error     time   algbw   busbw  error\n"
        "#        (B)    (elements)                        (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)\n"
        "        1024            64      half    none    20.50    0.05    0.04  0e+00    20.10    0.05    0.04  0e+00\n"
        "        2048           128      half    none    21.00     N/A     N/A  0e+00    20.90    0.10    0.07    N/A\n"
        "# Out of bounds values : 0 OK\n"
        "# Avg bus bandwidth    : 0.05\n"
    )
    result = parse_nccl_tests(write(tmp_path, "run.log", text))
    assert (result.collective, result.nranks, result.nodes) == ("all_to_all", 4, 2)
    assert len(result.table) == 4 and set(result.table.dtype) == {"fp16"}
    out = row(result.table, 2048, "out_of_place")
    assert math.isnan(out.algbw_gbps) and math.isnan(out.busbw_gbps) and out.time_s == pytest.approx(21e-6)


def test_headerless_rows_and_overrides(tmp_path: Path) -> None:
    line = "   1024     256  bfloat16  sum  -1   20.50   0.05   0.09   0   20.10   0.05   0.09   0\n"
    result = parse_nccl_tests(write(tmp_path, "bare.txt", line), collective="reduce-scatter", nranks=4)
    assert (result.collective, result.nranks) == ("reduce_scatter", 4)
    assert row(result.table, 1024, "in_place")["dtype"] == "bf16"
    with pytest.raises(NcclTestsFormatError, match="cannot tell the collective"):
        parse_nccl_tests(tmp_path / "bare.txt")
    with pytest.raises(ValueError, match="unknown collective"):
        parse_nccl_tests(tmp_path / "bare.txt", collective="gossip")


def test_malformed_value_names_file_line_and_column(data: Path, tmp_path: Path) -> None:
    lines = (data / P4DE).read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if line.split()[:1] == ["1073741824"])
    lines[index] = lines[index].replace("26217", "26x17")
    path = write(tmp_path, "corrupt_allreduce.txt", "\n".join(lines) + "\n")
    pattern = rf"corrupt_allreduce\.txt, line {index + 1}: .*26x17.*'time' to be a number"
    with pytest.raises(NcclTestsFormatError, match=pattern):
        parse_nccl_tests(path)


def test_short_row_is_reported_not_dropped(tmp_path: Path) -> None:
    short = "  1024  256  float  sum  -1  20.5  0.05  0.09  0  20.1  0.05  0.09\n"
    text = MODERN_HEADER + "  512  128  float  sum  -1  20.0  0.03  0.05  0  20.1  0.03  0.05  0\n" + short
    result = parse_nccl_tests(write(tmp_path, "short_allreduce.txt", text), nranks=4)
    assert result.table.message_bytes.tolist() == [512, 512]
    [skipped] = result.skipped
    assert (skipped.line, skipped.reason, skipped.text) == (4, SKIP_TRUNCATED, short.strip())
    assert skipped.detail.startswith("12 fields, expected 13 (size count type redop root time")
    assert result.skipped_counts == {SKIP_TRUNCATED: 1}
    pattern = r"short_allreduce\.txt: no measurements found.*1 truncated row; first: line 3 .*12 fields, expected 13"
    with pytest.raises(NcclTestsFormatError, match=pattern):
        parse_nccl_tests(write(tmp_path, "short_allreduce.txt", MODERN_HEADER + short))


def test_malformed_csv_row(tmp_path: Path) -> None:
    text = "size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)\n1048576,262144,float,fast,23.72,45100,23.25\n"
    with pytest.raises(NcclTestsFormatError, match=r"lut_allreduce\.csv, line 2: .*'time'.*'fast'"):
        parse_nccl_tests(write(tmp_path, "lut_allreduce.csv", text))


def test_unknown_type_and_bad_size(tmp_path: Path) -> None:
    bad_type = MODERN_HEADER + "  1024  256  float17  sum  -1  20.5  0.05  0.09  0  20.1  0.05  0.09  0\n"
    with pytest.raises(NcclTestsFormatError, match=r"line 3: .*'type'.*float17"):
        parse_nccl_tests(write(tmp_path, "t_allreduce.txt", bad_type))
    bad_size = MODERN_HEADER + "  1K  256  float  sum  -1  20.5  0.05  0.09  0  20.1  0.05  0.09  0\n"
    with pytest.raises(NcclTestsFormatError, match=r"line 3: .*'size' to be an integer.*1K"):
        parse_nccl_tests(write(tmp_path, "s_allreduce.txt", bad_size))


@pytest.mark.parametrize("text", ["", "# only comments\n" + MODERN_HEADER])
def test_no_measurements(tmp_path: Path, text: str) -> None:
    with pytest.raises(NcclTestsFormatError, match=r"empty_allreduce\.txt: no measurements found"):
        parse_nccl_tests(write(tmp_path, "empty_allreduce.txt", text))


def test_bus_bandwidth_factor() -> None:
    assert bus_bandwidth_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_bandwidth_factor("allgather", 4) == pytest.approx(0.75)
    assert bus_bandwidth_factor("reduce_scatter", 16) == pytest.approx(15 / 16)
    assert bus_bandwidth_factor("alltoall", 2) == pytest.approx(0.5)
    for name in ("broadcast", "reduce", "sendrecv"):
        assert bus_bandwidth_factor(name, 8) == 1.0
    assert bus_bandwidth_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError):
        bus_bandwidth_factor("all_reduce", 0)
    with pytest.raises(ValueError):
        bus_bandwidth_factor("scatter", 4)


# --- real-world log shapes, built from the rows of the published tables ---------------------------------

NCCL_LOG = "mpiworker-0:43:43 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC"
NCCL_LOG_2 = "mpiworker-0:43:43 [0] NCCL INFO Connected all rings"
SHARP_LOG = ("[mpiworker-0:0:2916721 - context.c:589] INFO job (ID: 2838387367436317) resource request quota: "
             "( osts:0 user_data_per_ost:0 max_groups:0 max_qps:1 max_group_channels:1, num_trees:1)")


def lines_of(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


def is_row(line: str) -> bool:
    return bool(re.match(r"\s*\d", line))


def data_rows(name: str) -> list[str]:
    """The measured rows of a data file, as printed."""
    return [line for line in lines_of(name) if is_row(line)]


def rank_lines(name: str) -> list[str]:
    return [line for line in lines_of(name) if re.match(r"#\s+Rank\s+\d", line)]


def same_table(result, original) -> bool:
    return result.table.drop(columns="source").equals(original.table.drop(columns="source"))


def accounted_sizes(result) -> set[int]:
    """Sizes that came through, and sizes of the lines reported as left out."""
    return set(result.table.message_bytes) | {int(s.text.split()[0]) for s in result.skipped}


def sizes(name: str) -> set[int]:
    return {int(row.split()[0].replace("_", "")) for row in data_rows(name)}


def test_header_count_contradicted_by_busbw_is_an_error_naming_both(data: Path) -> None:
    """CoreWeave's README table: its header says 64 ranks, busbw / algbw = 2(n-1)/n = 1.979 says 96."""
    (stated, implied), = RANK_CONFLICT.values()
    pattern = rf"{COREWEAVE}: '64 ranks' \(line 3\) says {stated} ranks, but busbw / algbw implies {implied} \("
    with pytest.raises(NcclTestsFormatError, match=pattern):
        parse_nccl_tests(data / COREWEAVE)
    with pytest.raises(NcclTestsFormatError, match=r"nranks=64 \(given\) says 64 ranks, .* implies 96"):
        parse_nccl_tests(data / COREWEAVE, nranks=64)
    result = parse_nccl_tests(data / COREWEAVE, nranks=96)
    assert result.nranks == 96 and len(result.table) == 10


def test_old_layout_between_nccl_and_sharp_log_lines(data: Path, tmp_path: Path) -> None:
    """2019-2022 layout (no root; `error` is a deviation such as 5e-07, not a failure count) in a job log."""
    def old(row: str, deviation: str) -> str:
        f = row.split()
        return "  ".join(f[:4] + f[5:8] + [deviation] + f[9:12] + [deviation])

    lines = ["mpirun -np 16 -map-by ppr:8:node -x NCCL_COLLNET_ENABLE=1 ./build/all_reduce_perf -b 8 -e 8G -f 2 -g 1",
             "# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) warmup iters: 5 iters: 20 "
             "validation: 1", "#", "# Using devices"]
    lines += [re.sub(r" Group\s+\d+", "", line) for line in rank_lines(OCI)]  # the old rank line had no group
    lines += [SHARP_LOG, NCCL_LOG, "#",
              "#     size      count   type  redop   time  algbw  busbw  error   time  algbw  busbw  error",
              "#      (B) (elements)                 (us) (GB/s) (GB/s)          (us) (GB/s) (GB/s)"]
    for i, row in enumerate(data_rows(OCI)):
        lines += [old(row, "0e+00" if i == 0 else "5e-07")] + [NCCL_LOG] * (i % 3 == 0) + [SHARP_LOG] * (i % 7 == 0)
    lines += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 66.4834"]
    result = parse_nccl_tests(write(tmp_path, "job.log", "\n".join(lines) + "\n"))
    assert same_table(result, parse_nccl_tests(data / OCI))  # every row, none taken for a failure
    assert (result.nranks, result.nodes, result.skipped, result.skipped_wrong) == (16, 2, (), 0)


def test_log_records_written_into_rows_are_cut_out(data: Path, tmp_path: Path) -> None:
    """NCCL writes to the same stdout while nccl-tests prints a row in pieces (here under srun's labels)."""
    rows = data_rows(P5)
    cut_at = {3: lambda f: f[4].end(), 10: lambda f: f[5].start() + 2, 20: lambda f: f[-1].end()}
    lines = [line for line in lines_of(P5) if not is_row(line)]
    for i, row in enumerate(rows):
        if i in cut_at:  # after the key columns, inside the out-of-place time, after the last column
            at = cut_at[i](list(re.finditer(r"\S+", row)))
            lines += [row[:at] + NCCL_LOG, NCCL_LOG_2, row[at:]]
        else:
            lines.append(row)
    text = "".join(f"0: {line}\n" for line in lines)
    result = parse_nccl_tests(write(tmp_path, P5, text))
    assert same_table(result, parse_nccl_tests(data / P5)) and result.skipped == ()


def test_truncated_and_damaged_rows_are_reported(data: Path, tmp_path: Path) -> None:
    lines = lines_of(OCI)
    first = next(i for i, line in enumerate(lines) if is_row(line))
    fields = {i: list(re.finditer(r"\S+", lines[i])) for i in range(first, len(lines)) if is_row(lines[i])}
    lines[first + 4] = lines[first + 4][: fields[first + 4][5].end()]  # cut after the time
    lines[first + 9] += "   0.00"  # a field too many
    lines[first + 12] = lines[first + 12][: fields[first + 12][4].end()] + NCCL_LOG  # the rest never came
    last = max(fields)
    lines[last] = lines[last][: fields[last][6].start() + 3]  # the log ends inside algbw
    result = parse_nccl_tests(write(tmp_path, OCI, "\n".join(lines[: last + 1])))
    reported = [(s.line, s.reason) for s in result.skipped]
    assert reported == [(first + 5, SKIP_TRUNCATED), (first + 10, SKIP_EXTRA), (first + 13, SKIP_LOG_DAMAGE),
                        (last + 1, SKIP_TRUNCATED)]
    assert len(result.table) == 2 * (31 - 4) and accounted_sizes(result) == sizes(OCI)
    assert result.skipped_counts == {SKIP_TRUNCATED: 2, SKIP_EXTRA: 1, SKIP_LOG_DAMAGE: 1}


def test_several_runs_in_one_file(data: Path, tmp_path: Path) -> None:
    """Each run keeps its own header: OCI (16 ranks on 2 hosts), ml-engineering (-g 8, single node), p4de."""
    names = (OCI, TRIMMED, P4DE)
    path = write(tmp_path, "allreduce_sweep.log", "".join((data / n).read_text() for n in names))
    runs = parse_nccl_tests_runs(path)
    assert [(r.run, r.nranks, r.nodes, len(r.table)) for r in runs] == [(1, 16, 2, 62), (2, 8, 1, 20),
                                                                       (3, 16, None, 58)]
    offset = 0
    for run, name in zip(runs, names, strict=True):
        original = parse_nccl_tests(data / name)
        assert same_table(run, original) and run.lines == tuple(offset + n for n in original.lines)
        offset += len(lines_of(name))
    with pytest.raises(NcclTestsFormatError, match=r"sweep\.log: 3 runs \(lines 26-56, .*parse_nccl_tests_runs"):
        parse_nccl_tests(path)
    with pytest.raises(ConfigError, match=r"allreduce_sweep\.log \(run 3, lines \d+-\d+\): cannot tell num_nodes"):
        read_calibration_file(CalibrationFile(path=str(path)))
    two = write(tmp_path, "two_runs_allreduce.log", "".join((data / n).read_text() for n in names[:2]))
    table = read_calibration_file(CalibrationFile(path=str(two)))
    assert table.groupby(["num_ranks", "num_nodes"]).size().to_dict() == {(8, 1): 20, (16, 2): 31}


def test_rank_list_is_a_lower_bound_and_busbw_gives_the_count(data: Path, tmp_path: Path) -> None:
    lines = lines_of(OCI)[3:]  # nccl-tests' own output: no curator line saying '16 ranks' or '2 nodes'
    ranks = [i for i, line in enumerate(lines) if re.match(r"#\s+Rank", line)]
    full = parse_nccl_tests(write(tmp_path, "full_allreduce.log", "\n".join(lines)))
    assert (full.nranks, full.nodes) == (16, 2)
    abbreviated = lines[: ranks[4]] + lines[ranks[-1] + 1 :]  # ranks 0-3 listed, all on the first host
    result = parse_nccl_tests(write(tmp_path, "cut_allreduce.log", "\n".join(abbreviated)))
    assert (result.nranks, result.nodes) == (16, None) and same_table(result, full)
    elided = lines[: ranks[4]] + ["#  ..."] + lines[ranks[-1] + 1 :]
    assert parse_nccl_tests(write(tmp_path, "dots_allreduce.log", "\n".join(elided))).nranks == 16
    nccl_says_4 = ["mpiworker-0:43:43 [0] NCCL INFO comm 0x5581 rank 0 nranks 4 cudaDev 0 busId 101c0 - Init COMPLETE"]
    pattern = r"NCCL's log \(nranks 4\) says 4 ranks, but busbw / algbw implies 16"
    with pytest.raises(NcclTestsFormatError, match=pattern):
        parse_nccl_tests(write(tmp_path, "log4_allreduce.log", "\n".join(nccl_says_4 + abbreviated)))
    eight_rank_rows = lines_of(TRIMMED)[5:]  # an 8-rank table under OCI's 16 listed ranks
    mixed = lines[: ranks[-1] + 1] + eight_rank_rows
    with pytest.raises(NcclTestsFormatError, match=r"lists ranks up to 15 \(16 ranks\), but busbw / algbw implies 8"):
        parse_nccl_tests(write(tmp_path, "mixed_allreduce.log", "\n".join(mixed)))


def test_open_mpi_output_tags_are_stripped(data: Path, tmp_path: Path) -> None:
    text = "".join(f"[1,0]<stdout>:{line}\n" for line in lines_of(OCI))
    result = parse_nccl_tests(write(tmp_path, OCI, text))
    assert same_table(result, parse_nccl_tests(data / OCI)) and (result.nranks, result.nodes) == (16, 2)


def test_pre_2019_layout_in_milliseconds(data: Path, tmp_path: Path) -> None:
    """`bytes N type op time algbw busbw res`, time printed in ms with 3 decimals."""
    def old(row: str) -> str:
        f = row.split()
        return "  ".join(f[:4] + [f"{float(f[5]) / 1e3:.3f}", *f[6:8], "0e+00", f"{float(f[9]) / 1e3:.3f}",
                                  *f[10:12], "1e-06"])

    header = "#     bytes          N   type    op    time  algbw  busbw    res    time  algbw  busbw    res"
    comments = [line for line in lines_of(P4DE) if line.startswith("#") and "size" not in line]
    text = "\n".join(comments[:-1] + [header] + [old(row) for row in data_rows(P4DE)])
    result = parse_nccl_tests(write(tmp_path, P4DE, text))
    original = parse_nccl_tests(data / P4DE).table
    assert len(result.table) == 58 and result.nranks == 16
    assert result.table.time_s.to_numpy() == pytest.approx(original.time_s.to_numpy(), abs=5.01e-7)
    assert result.table.busbw_gbps.equals(original.busbw_gbps)


def test_header_naming_one_group_and_per_iteration_columns(data: Path, tmp_path: Path) -> None:
    lines = lines_of(P4DE)
    header = next(i for i, line in enumerate(lines) if "#wrong" in line)
    one_group = lines[:header] + ["#  size count type redop root time algbw busbw #wrong"] + lines[header + 1 :]
    original = parse_nccl_tests(data / P4DE)
    assert same_table(parse_nccl_tests(write(tmp_path, P4DE, "\n".join(one_group))), original)

    def per_iteration(row: str) -> str:  # nccl-tests -I: min, max, p99 and cv of the iterations per group
        f = row.split()
        return "  ".join(f[:9] + [f[5], f[5], f[5], "1.5"] + f[9:13] + [f[9], f[9], f[9], "1.5"])

    names = "time algbw busbw #wrong i_min i_max i_p99 i_cv%"
    text = "\n".join(lines[:header] + [f"#  size count type redop root {names} {names}"]
                     + [per_iteration(row) for row in data_rows(P4DE)])
    assert same_table(parse_nccl_tests(write(tmp_path, P4DE, text)), original)


def test_rows_before_any_header_are_reported(tmp_path: Path) -> None:
    text = "1024 256 float sum 20.5 0.05 0.09\n2048 512 float sum 21.0 0.10 0.17\n"
    with pytest.raises(NcclTestsFormatError, match=r"no measurements found.*2 data before any column header"):
        parse_nccl_tests(write(tmp_path, "bare_allreduce.txt", text))


def test_calibration_records_skipped_lines(data: Path, tmp_path: Path) -> None:
    lines = lines_of(P5)
    last = max(i for i, line in enumerate(lines) if is_row(line))
    lines[last] = lines[last][:60]  # the log was cut inside the last row
    path = write(tmp_path, P5, "\n".join(lines))
    expected = {SKIP_TRUNCATED: {"count": 1, "lines": [last + 1]}}
    table = read_calibration_file(CalibrationFile(path=str(path)))
    assert table.attrs["skipped_lines"] == expected and len(table) == 31
    hw = compose_run(["hardware=h100-sxm-dgx"], check="layout").hardware
    hw.calibration.files = [CalibrationFile(path=str(path))]
    assert collect_measurements(hw).attrs["skipped_lines"] == {str(path): expected}
    write_calibration_artifact(hw, {"hardware": "h100-sxm-dgx"}, tmp_path / "cal")
    assert json.loads((tmp_path / "cal" / "fit.json").read_text())["skipped_lines"] == {str(path): expected}


def test_a_launch_line_echoed_without_mpirun_does_not_make_g_the_rank_count(data: Path, tmp_path: Path) -> None:
    """`-g 1` is GPUs per process (nccl-tests' meaning): an MPI job's log that echoes only the test's own command
    line is a 16-rank run, as its numbers and rank list say, not a 1-rank one."""
    header = [line for line in lines_of(OCI) if not is_row(line) and not re.match(r"#\s+Rank\s+\d", line)]
    columns = [line for line in header if "size" in line or "(B)" in line]
    lines = ["./build/all_reduce_perf -b 8 -e 8G -f 2 -g 1", *rank_lines(OCI), *columns, *data_rows(OCI)]
    result = parse_nccl_tests(write(tmp_path, "echoed.log", "\n".join(lines) + "\n"))
    assert (result.nranks, result.nodes) == (16, 2)
    unlisted = ["./build/all_reduce_perf -b 8 -e 8G -f 2 -g 1", *columns, *data_rows(OCI)]
    assert parse_nccl_tests(write(tmp_path, "unlisted.log", "\n".join(unlisted) + "\n")).nranks == 16


def test_output_tags_interleaved_into_the_rank_list_leave_its_hosts_intact(data: Path, tmp_path: Path) -> None:
    """Open MPI tags land inside other ranks' lines when ranks print at once: inside a host name, and between
    two rank lines joined on one line. The hosts stay 2, the ranks 16."""
    ranks = rank_lines(OCI)
    host = re.search(r" on (\S+) ", ranks[3]).group(1)
    ranks[3] = ranks[3].replace(host, host[:3] + "[1,5]<stdout>:" + host[3:])
    ranks[6:8] = [ranks[6] + "[1,7]<stdout>:" + ranks[7]]
    lines = [line for line in lines_of(OCI)  # without the provenance header, which states "2 nodes = 16 ranks"
             if not re.match(r"#\s+Rank\s+\d", line) and not re.match(r"#\s*[A-Z ]+:", line)]
    first_row = next(i for i, line in enumerate(lines) if line.startswith("#") and "size" in line)
    lines[first_row:first_row] = ["[1,0]<stdout>:" + line for line in ranks]
    lines.insert(0, "mpirun -np 16 ./build/all_reduce_perf -b 8 -e 8G -f 2 -g 1")
    result = parse_nccl_tests(write(tmp_path, "tagged.log", "\n".join(lines) + "\n"))
    assert (result.nranks, result.nodes) == (16, 2)
    assert same_table(result, parse_nccl_tests(data / OCI))
