"""Author-compiled busbw tables read with their rank and node counts, and a broken line named."""

import pytest

from trainsim.comm.busbw_tables import read_busbw_table
from trainsim.comm.nccl_tests import NcclTestsFormatError

DATA = "data/nccl-tests/"
P5 = "h100-16to256gpu-2to32node-aws_p5_hyperpod-efa_{}.txt"
SENDRECV = "b200-16to512gpu-2to64node-together_use3a-ss-ib_cx7_400g_sendrecv_busbw_table.txt"
SHARP = "b200-8to512gpu-1to64node-together_slinky-ib_ndr400_12hca_sharp_peak_busbw_tables.txt"


@pytest.mark.parametrize("name,collective", [("all_reduce", "all_reduce"), ("all_gather", "all_gather"),
                                             ("alltoall", "all_to_all")])
def test_p5_tables_have_8_gpus_per_node_from_2_to_32_nodes(name, collective):
    runs = read_busbw_table(DATA + P5.format(name))
    assert sorted((r.result.nodes, r.result.nranks) for r in runs) == [(n, 8 * n) for n in (2, 4, 8, 16, 32)]
    assert {r.result.collective for r in runs} == {collective}


def test_p5_all_reduce_busbw_is_the_tabulated_value():
    runs = read_busbw_table(DATA + P5.format("all_reduce"))
    two = next(r.result.table for r in runs if r.result.nodes == 2)
    largest = two[(two.message_bytes == 8192 << 20) & (two.placement == "out_of_place")]
    assert largest.busbw_gbps.iloc[0] == pytest.approx(477.71, rel=1e-3)
    assert largest.time_s.iloc[0] == pytest.approx((8192 << 20) / 254.78e9, rel=1e-6)


def test_sendrecv_table_reads_every_node_count():
    runs = read_busbw_table(DATA + SENDRECV)
    assert {(r.result.nodes, r.result.nranks) for r in runs} == {(n, 8 * n) for n in (2, 4, 8, 16, 32, 64)}
    assert all(r.result.collective == "send_recv" for r in runs)


def test_sharp_table_keeps_each_forced_algorithm_and_skips_failed_runs():
    runs = read_busbw_table(DATA + SHARP)
    allreduce = {(r.result.nodes, r.algorithm) for r in runs if r.result.collective == "all_reduce"}
    assert (2, "collnet_direct") in allreduce and (1, "ring") in allreduce
    assert (8, "collnet_direct") not in allreduce  # '(retry 8n ok, peak not re-parsed in TSV)'
    assert (1, "collnet_chain") not in allreduce
    sendrecv = {r.result.nodes: r.result.table.busbw_gbps.iloc[0] for r in runs if r.result.collective == "send_recv"}
    assert sendrecv[64] == pytest.approx(17.19)


def test_a_broken_line_is_named(tmp_path):
    text = (DATA_TEXT := open(DATA + P5.format("all_reduce")).read()).replace("4,32,64,1000", "4,32,sixty-four,1000")
    assert text != DATA_TEXT
    bad = tmp_path / P5.format("all_reduce")
    bad.write_text(text)
    with pytest.raises(NcclTestsFormatError, match=r":\d+: not a number.*sixty-four"):
        read_busbw_table(bad)


def test_the_calibration_reader_takes_author_tables_with_their_counts_and_forced_algorithms():
    """hardware.calibration.files accepts the tables: each curve keeps its ranks and nodes, a forced algorithm
    its name, and the fit sees only what NCCL picked itself, the forced rows counted."""
    from trainsim.comm.calibration import collect_measurements, read_calibration_file
    from trainsim.config import compose_run
    from trainsim.config.schema import CalibrationFile

    table = read_calibration_file(CalibrationFile(path=DATA + SHARP))
    ring = table[(table.collective == "all_reduce") & (table.algorithm == "ring") & (table.num_nodes == 64)]
    assert ring.num_ranks.tolist() == [512] and ring.time_s.iloc[0] == pytest.approx(
        (32 << 30) * 2 * 511 / 512 / 389.81e9, rel=1e-6)
    assert set(table[table.collective == "send_recv"].algorithm) == {"auto"}
    hw = compose_run(["hardware=dgx-b200", f"hardware.calibration.files=[{{path: {DATA + SHARP}}}]"],
                     check="layout").hardware
    measured = collect_measurements(hw)
    assert set(measured.collective) == {"send_recv"} and len(measured) == 7
    assert measured.attrs["forced_algorithm_rows"] == {DATA + SHARP: len(table) - 7}


def test_the_summary_form_reads_every_nccl_column_and_the_entry_selects_curves():
    """The mscclpp summary's NCCL columns in each section (1 x 8, 2 x 1, 2 x 8 GPUs); MSCCL/MSCCL++ left out."""
    from trainsim.comm.calibration import read_calibration_file
    from trainsim.config.schema import CalibrationFile
    from trainsim.errors import ConfigError

    path = DATA + "a100-ndmv4-azure-1node-2node_summary_mscclpp.txt"
    table = read_calibration_file(CalibrationFile(path=path))
    assert set(map(tuple, table[["num_ranks", "num_nodes"]].drop_duplicates().values)) == {(8, 1), (2, 2), (16, 2)}
    assert set(table.collective) == {"all_gather", "all_reduce", "all_to_all"} and len(table) == 21
    picked = read_calibration_file(CalibrationFile(path=path, collective="all_to_all", num_ranks=16))
    assert picked.time_s.tolist() == pytest.approx([49.75e-6, (1 << 30) * 15 / 16 / 37.80e9,
                                                    (4 << 30) * 15 / 16 / 37.81e9])
    with pytest.raises(ConfigError, match=r"no curve with nranks=4.*\(collective, ranks, nodes\)"):
        read_calibration_file(CalibrationFile(path=path, num_ranks=4))


def test_held_out_sizes_keep_every_repeat_of_a_size_on_one_side():
    """The send/recv table holds three runs of each sweep: a size held out of the fit must be held out in all of
    them, or the fit would see the very size it is scored on."""
    from trainsim.comm.calibration import read_calibration_file
    from trainsim.comm.fit import every_other_size
    from trainsim.config.schema import CalibrationFile

    table = read_calibration_file(CalibrationFile(path=DATA + SENDRECV))
    train = every_other_size(table)
    sides = table.assign(train=train).groupby(["num_ranks", "num_nodes", "message_bytes"])["train"].nunique()
    assert (sides == 1).all() and train.any() and (~train).any()
    two_nodes = sorted(table[(table.num_nodes == 2) & train].message_bytes.unique())
    assert two_nodes == [1 << k for k in range(10, 29, 2)]  # 1K, 4K, ... 256M: every other size, smallest first


H200_SUMMARY = "h200-8gpu-nvlink_allreduce-nvls-vs-ring_mlengineering.txt"


def test_sections_form_reads_its_own_gpus_nccl_tests_and_reports_the_other_sections():
    skipped = {}
    runs = read_busbw_table(DATA + H200_SUMMARY, skipped)
    by_gpus = {(r.result.nranks, r.algorithm): r.result.table.busbw_gbps.iloc[0] for r in runs
               if r.result.collective == "all_reduce" and r.result.table.message_bytes.iloc[0] == 8 << 30}
    assert by_gpus[(8, None)] == pytest.approx(473.1) and by_gpus[(8, "ring")] == pytest.approx(365.6)  # NVLS off
    assert sorted({ranks for ranks, _ in by_gpus}) == [4, 5, 6, 7, 8]
    at_16g = {(r.result.collective, r.algorithm) for r in runs if r.result.table.message_bytes.iloc[0] == 16 << 30}
    assert at_16g == {("all_reduce", None), ("all_reduce", "ring"), ("all_gather", None), ("reduce_scatter", None)}
    # the B200 table and torch's all_reduce_bench are not this file's GPU / not nccl-tests: left out, counted
    assert {reason: seen["count"] for reason, seen in skipped.items()} == {
        "section (b) measured on B200, not this file's H200": 5, "section (d) not measured with nccl-tests": 20}


@pytest.mark.parametrize("stated,missing", [("8 GiB payload, H200", "payload"), ("-g 8 -z 1), 8 GPUs", "GPU count")])
def test_a_section_note_missing_what_its_table_needs_is_named(tmp_path, stated, missing):
    text = open(DATA + H200_SUMMARY).read()
    assert stated in text
    bad = tmp_path / H200_SUMMARY
    bad.write_text(text.replace(stated, "H200" if missing == "payload" else "-g 8 -z 1)"))
    with pytest.raises(NcclTestsFormatError, match=rf":\d+: the section's note states no {missing}"):
        read_busbw_table(bad)


def test_the_calibration_reader_reports_the_sections_it_leaves_out():
    from trainsim.comm.calibration import read_calibration_file
    from trainsim.config.schema import CalibrationFile

    table = read_calibration_file(CalibrationFile(path=DATA + H200_SUMMARY))
    assert set(table["num_nodes"]) == {1} and len(table) == 14
    assert table.attrs["skipped_lines"]["section (d) not measured with nccl-tests"]["lines"][0] == 32
