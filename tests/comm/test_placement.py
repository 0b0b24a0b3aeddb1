"""Which NVLink domain each rank of a job is in (comm/placement.py): jobs smaller than a rack-scale domain, or
not a multiple of it, placed as a scheduler places them."""

from __future__ import annotations

import numpy as np
import pytest

from trainsim.comm.placement import JobPlacement, job_placement
from trainsim.config import compose_run


def nvl72(gpus: int, *overrides: str):
    """gb200-nvl72 sized for a job of `gpus` GPUs (trays of 4), data-parallel over all of them."""
    return compose_run(["hardware=gb200-nvl72", "model=gpt-tiny", f"parallelism.dp={gpus}",
                        f"parallelism.global_batch_size={gpus}", "parallelism.micro_batch_size=1",
                        f"hardware.num_nodes={-(-gpus // 4)}", *overrides], check="run").hardware


@pytest.mark.parametrize(("gpus", "racks"), [(8, 1), (64, 1), (256, 4), (6, 1)])
def test_jobs_that_do_not_fill_or_divide_an_nvl72_rack_are_accepted(gpus, racks):
    assert job_placement(nvl72(gpus), gpus).domains == racks


def test_a_256_gpu_job_composes_on_gb200_nvl72_as_a_user_writes_it():
    """No hardware.num_nodes override: the config's cluster holds the job, whatever the domain size."""
    hw = compose_run(["hardware=gb200-nvl72", "model=gpt-tiny", "parallelism.dp=256",
                      "parallelism.global_batch_size=256", "parallelism.micro_batch_size=1"], check="run").hardware
    assert job_placement(hw, 256).domains == 4


def test_balanced_spreads_the_trays_over_the_fewest_racks_and_packed_fills_each_first():
    counts = {policy: np.bincount(JobPlacement(256, 4, 72, policy).domain_of_rank).tolist()
              for policy in ("balanced", "packed")}
    assert counts == {"balanced": [64, 64, 64, 64], "packed": [72, 72, 72, 40]}
    assert np.bincount(JobPlacement(76, 4, 72, "balanced").domain_of_rank).tolist() == [40, 36]  # 19 trays: 10 + 9
    assert np.bincount(JobPlacement(6, 4, 72, "balanced").domain_of_rank).tolist() == [6]  # a partly filled tray


def test_groups_see_how_many_racks_they_span():
    hw = nvl72(256)
    placement = job_placement(hw, 256)
    assert placement.domains_spanned(range(8)) == 1  # a tp / ep group of 8: all NVLink
    assert placement.domains_spanned(range(0, 256, 4)) == 4  # a dp group of 64 with stride 4: over InfiniBand
    assert placement.domains_spanned(range(64, 128)) == 1  # ... and one of 64 consecutive ranks stays in its rack
    assert job_placement(nvl72(256, "hardware.network.placement=packed"), 256).domains_spanned(range(64, 128)) == 2


def test_a_dgx_node_is_its_own_domain_whatever_the_job():
    hw = compose_run(["hardware=dgx-b200"], check="layout").hardware
    assert job_placement(hw, 20).domain_of([0, 7, 8, 19]).tolist() == [0, 0, 1, 2]
