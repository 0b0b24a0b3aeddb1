"""nccl-tests parser: the published tables in data/nccl-tests, and synthetic quirks and bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trainsim.comm.nccl_tests import (
    COLUMNS,
    NcclTestsFormatError,
    bus_bandwidth_factor,
    parse_nccl_tests,
)
from trainsim.config.data_path import DATA_DIR

DATA = DATA_DIR / "nccl-tests"
P4DE = "a100-16gpu-2node-aws-p4de-efa400_allreduce.txt"
P5 = "h100-16gpu-2node-aws-p5-efa3200_allreduce.txt"
TRIMMED = "a100-8gpu-nvlink_allreduce_mlengineering.txt"
SENDRECV = "a100-8gpu-nvlink_sendrecv_liplus.txt"
# file -> (collective, nranks, nodes, sizes, placements per size)
SUPPORTED = {
    P4DE: ("all_reduce", 16, 2, 29, 2),
    P5: ("all_reduce", 16, 2, 32, 2),
    TRIMMED: ("all_reduce", 8, 1, 20, 1),
    SENDRECV: ("send_recv", 8, 1, 4, 2),
    "a100-2gpu-nvlink_allreduce_vtrain-lut.csv": ("all_reduce", 2, 1, 1024, 2),
    "a100-4gpu-nvlink_allreduce_vtrain-lut.csv": ("all_reduce", 4, 1, 1024, 2),
    "a100-8gpu-nvlink_allreduce_vtrain-lut.csv": ("all_reduce", 8, 1, 1024, 2),
}
# markdown summaries with no (size, time) sweep -> (line number of the first table line)
UNSUPPORTED = {
    "h200-8gpu-nvlink_allreduce-nvls-vs-ring_mlengineering.txt": 4,
    "a100-ndmv4-azure-1node-2node_summary_mscclpp.txt": 5,
}
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
    assert {p.name for p in data.iterdir()} == set(SUPPORTED) | set(UNSUPPORTED)


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


@pytest.mark.parametrize("name", [P4DE, P5, TRIMMED, SENDRECV])
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


def test_wrong_column_count(tmp_path: Path) -> None:
    text = MODERN_HEADER + "  1024  256  float  sum  -1  20.5  0.05  0.09  0  20.1  0.05  0.09\n"
    with pytest.raises(NcclTestsFormatError, match=r"short_allreduce\.txt, line 3: 12 columns.*expected 13 columns"):
        parse_nccl_tests(write(tmp_path, "short_allreduce.txt", text))


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
