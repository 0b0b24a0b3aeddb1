"""Collective sweeps: gloo here, and the torchrun entry point users run on a cluster (with gloo in tests)."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest

from trainsim.comm.nccl_tests import COLUMNS, bus_bandwidth_factor
from trainsim.comm.sweep import SWEEP_COLLECTIVES, default_sizes, run_local_sweep


def test_default_sizes_are_powers_of_two():
    assert default_sizes(1024, 8192) == [1024, 2048, 4096, 8192]


@pytest.mark.slow
def test_local_gloo_sweep_measures_every_collective():
    table = run_local_sweep(2, sizes=[4096, 262144], iters=3, warmup=1)
    assert list(table.columns) == [*COLUMNS, "nranks", "nodes"]
    assert sorted(set(table["collective"])) == sorted(SWEEP_COLLECTIVES)
    assert len(table) == 2 * len(SWEEP_COLLECTIVES) and (table["time_s"] > 0).all()
    ar = table[table["collective"] == "all_reduce"].iloc[0]
    algbw_gbps = ar["message_bytes"] / ar["time_s"] / 1e9
    assert ar["busbw_gbps"] == pytest.approx(algbw_gbps * bus_bandwidth_factor("all_reduce", 2))


def test_unknown_collective_is_refused():
    with pytest.raises(ValueError, match=r"unknown collective\(s\) \['all_fancy'\]"):
        run_local_sweep(2, collectives=["all_fancy"])


@pytest.mark.slow
def test_torchrun_entry_point(tmp_path):
    out = tmp_path / "sweep.parquet"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "trainsim.comm.sweep", "--output", str(out), "--sizes", "1024,8192",
                    "--collectives", "all_reduce,all_gather", "--iters", "2", "--warmup", "1"],
                   check=True, env=env, capture_output=True, timeout=300)
    table = pd.read_parquet(out)
    assert len(table) == 4 and set(table["nranks"]) == {2}
