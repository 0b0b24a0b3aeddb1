"""The network as data: NVLink domains, transports and their learned priors, NVLS, node-count scaling,
the spine's oversubscription, and who picks the algorithm across nodes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from trainsim.comm.model import CommModel, choose, fabric, p2p_peer_channels, predict_seconds, prior_params
from trainsim.comm.nccl_tuner import tuner_estimates, tuner_topology
from trainsim.comm.network import PRIORS_FILE, domain_bandwidth, domain_size, network_prior
from trainsim.comm.network_fit import learn, load_clusters, render
from trainsim.comm.placement import job_placement
from trainsim.config import compose_run
from trainsim.errors import ConfigError
from trainsim.timeline.provenance import calibration_inputs

MIB = 1 << 20


def hardware(name: str, *overrides: str):
    return compose_run([f"hardware={name}", *overrides], check="layout").hardware


def test_an_nvl72_rack_is_one_domain_of_the_collective_model():
    hw = hardware("gb200-nvl72")
    assert domain_size(hw) == 72 and hw.devices_per_node == 4
    assert domain_bandwidth(hw) == pytest.approx(18 * 4 * 50e9)  # 18 trays, one 400 Gb/s NIC per GPU
    rack = job_placement(hw, 144)
    assert rack.domains_spanned(range(72)) == 1 and rack.domains_spanned([0, 72]) == 2
    model = CommModel.from_hardware(hw)
    assert model.params("all_reduce").fabric.devices_per_node == 72
    # 64 GPUs on 16 trays of one rack all-reduce over NVLink 5, far faster than 64 H100s on 8 DGX nodes
    h100 = CommModel.from_hardware(hardware("h100-sxm-dgx"))
    assert model.collective_seconds("all_reduce", 1 << 30, 64, 1) < 0.5 * h100.collective_seconds(
        "all_reduce", 1 << 30, 64, 8)


def test_nvls_gain_follows_the_h200_measurements():
    """8x H200, 8 GiB: NVLS bus bandwidth 1.14 / 1.19 / 1.26 / 1.29 x the ring's at 5 / 6 / 7 / 8 GPUs
    (data/nccl-tests/h200-8gpu-nvlink_allreduce-nvls-vs-ring_mlengineering.txt)."""
    hw = hardware("h100-sxm-dgx")
    with_nvls = prior_params(hw, "all_reduce")
    ring_only = prior_params(hardware("h100-sxm-dgx", "hardware.nccl.algorithms=[ring,tree]"), "all_reduce")
    size = np.array([8 << 30])
    for gpus, gain in ((5, 1.14), (6, 1.19), (7, 1.26), (8, 1.29)):
        ratio = predict_seconds(ring_only, size, gpus, 1)[0] / predict_seconds(with_nvls, size, gpus, 1)[0]
        assert ratio == pytest.approx(gain, rel=0.1)
        assert choose(with_nvls, 8 << 30, gpus, 1) == ("nvls", "Simple")
    assert choose(with_nvls, 8 << 30, 16, 2)[0] != "nvls"  # NVLSTree: NCCL's estimate here has no formula for it
    with pytest.raises(ConfigError, match="hardware.network.nvls=true needs NVLink SHARP"):
        compose_run(["hardware=a100-80g-dgx", "hardware.network.nvls=true"])


def test_ring_latency_grows_linearly_and_tree_logarithmically_with_nodes():
    hw = hardware("a100-80g-selene", "hardware.nccl.algorithms=[ring]")
    ring = prior_params(hw, "all_reduce")
    tree = prior_params(hardware("a100-80g-selene", "hardware.nccl.algorithms=[tree]"), "all_reduce")
    small = np.array([1024])
    ring_t = [predict_seconds(ring, small, 8 * m, m)[0] for m in (16, 32, 64, 128)]
    tree_t = [predict_seconds(tree, small, 8 * m, m)[0] for m in (16, 32, 64, 128)]
    ring_steps, tree_steps = np.diff(ring_t), np.diff(tree_t)
    assert ring_steps[1] == pytest.approx(2 * ring_steps[0], rel=0.05)  # doubling the nodes doubles the increase
    assert ring_steps[2] == pytest.approx(2 * ring_steps[1], rel=0.05)
    assert tree_steps[0] == pytest.approx(tree_steps[1], rel=0.05)  # one more tree level per doubling
    assert tree_t[-1] < ring_t[-1] / 5
    # large messages: both bandwidth-bound at the same per-node load once the tree carries 2S per node
    large = np.array([4 << 30])
    assert predict_seconds(tree, large, 1024, 128)[0] == pytest.approx(predict_seconds(ring, large, 1024, 128)[0],
                                                                       rel=0.15)


def test_the_network_hop_latency_is_paid_per_hop_on_the_critical_path_not_per_loop():
    """The learned latency of a network hop: a ring all-gather over M nodes crosses M - 1 of them, a tree 2 per
    level, a send/recv one, whatever the message size (the loops stream behind it)."""
    hw = hardware("h100-80g-p5", "hardware.nccl.algorithms=[ring]")
    params = prior_params(hw, "all_gather")
    hop = params.values["latency.network"]
    assert hop == pytest.approx(network_prior(hw).hop_latency_s)
    without = dataclasses.replace(params, values={k: v for k, v in params.values.items() if k != "latency.network"})
    for size in (1 << 20, 1 << 32):
        for nodes in (2, 8, 32):
            added = predict_seconds(params, np.array([size]), 8 * nodes, nodes)[0] - predict_seconds(
                without, np.array([size]), 8 * nodes, nodes)[0]
            assert added == pytest.approx((nodes - 1) * hop, rel=1e-6)
    one_node = predict_seconds(params, np.array([1 << 20]), 8, 1)[0]
    assert one_node == predict_seconds(without, np.array([1 << 20]), 8, 1)[0]


def test_an_all_to_all_pays_the_network_hop_once_per_batch_of_remote_peers():
    """NCCL works through a grouped send/recv's peers 8 at a time (NCCL_MAX_DEV_WORK_P2P_PER_BATCH), and each batch
    across nodes waits for the network's hop: on 8-GPU nodes 1 batch at 2 nodes (8 remote peers), 31 at 32."""
    params = prior_params(hardware("h100-80g-p5"), "all_to_all")
    hop = params.values["latency.network"]
    without = dataclasses.replace(params, values={k: v for k, v in params.values.items() if k != "latency.network"})
    for nodes, batches in ((2, 1), (4, 3), (32, 31)):
        added = predict_seconds(params, np.array([1 << 20]), 8 * nodes, nodes)[0] - predict_seconds(
            without, np.array([1 << 20]), 8 * nodes, nodes)[0]
        assert added == pytest.approx(batches * hop, rel=1e-6)


def test_a_send_recv_crosses_nodes_through_one_gpus_nic():
    """nccl-tests' sendrecv_perf on 2 x 8 B200 (Together, 8 x 400 Gb/s InfiniBand per node): every rank sends to the
    next, the two pairs that cross nodes bound the step at one NIC's rate, 43 GB/s at 256 MiB (not the node's 8)."""
    model = CommModel.from_hardware(hardware("dgx-b200", "hardware.num_nodes=2", "hardware.nccl.version=2.29.7"))
    size = 256 << 20
    busbw = size / model.collective_seconds("send_recv", size, 16, 2)
    assert busbw == pytest.approx(43.14e9, rel=0.1)
    assert model.collective_seconds("send_recv", size, 16, 2) == model.p2p_seconds(size, same_node=False)


@pytest.mark.parametrize(("version", "channels"), [("2.29.7", {16: 4, 32: 4, 64: 2, 128: 1, 512: 1}),
                                                   ("2.28.9", {16: 2, 32: 2, 64: 1, 512: 1}),
                                                   ("2.18.3", {2: 2, 16: 2, 512: 2})])
def test_a_send_recv_peer_across_nodes_gets_the_channels_nccl_gives_it(version, channels):
    """NCCL's p2p channels per remote peer (paths.cc) on 8-GPU nodes with a 400 Gb/s NIC per GPU: 2.29 starts from
    the NIC's 50 GB/s over 14 GB/s per channel (4) and 2.20-2.28 from 2, both halved as the communicator grows; the
    B200 sendrecv_perf logs show it (43, 26, 14.6 GB/s at 2-4, 8, 16-64 nodes on 2.29.7; 34, 17 GB/s on 2.28.9)."""
    hw = hardware("dgx-b200", "hardware.num_nodes=2", f"hardware.nccl.version={version}")
    for ranks, expected in channels.items():
        assert p2p_peer_channels(fabric(hw), ranks) == expected
    model = CommModel.from_hardware(hw)
    size = 256 << 20
    rates = {ranks: size / model.collective_seconds("send_recv", size, ranks, ranks // 8) for ranks in channels
             if ranks >= 16}
    nic = hw.network.nic_bandwidth_bytes_per_s
    for ranks, rate in rates.items():
        assert rate <= min(nic, channels[ranks] * 14e9) * 1.001
    assert rates[512] == pytest.approx(min(nic, channels[512] * 14e9), rel=0.1)


def test_gloo_send_recv_has_no_nccl_channel_limit():
    hw = hardware("local-cpu")
    assert fabric(hw).p2p_channel_bytes_per_s == 0.0


def test_groups_that_cross_the_spine_get_its_oversubscribed_share():
    blocking = prior_params(hardware("a100-80g-selene", "hardware.network.oversubscription=2"), "all_reduce")
    assert blocking.nic_share(8 * 20, 20) == 1.0  # one leaf (20 nodes per scalable unit)
    assert blocking.nic_share(8 * 40, 40) == 0.5
    size = np.array([1 << 30])
    inside, across = predict_seconds(blocking, size, 8 * 20, 20)[0], predict_seconds(blocking, size, 8 * 40, 40)[0]
    assert across > 1.8 * inside


def test_the_tuner_of_the_network_plugin_picks_the_algorithm_across_nodes():
    """NCCL's own cost model keeps 2-node all-reduces on rings (Azure's InfiniBand measurements are ring-level);
    aws-ofi-nccl's tuner runs trees there (the p4de and p5 logs exceed the NIC rate, which rings cannot)."""
    infiniband = CommModel.from_hardware(hardware("a100-80g-selene"))
    efa = CommModel.from_hardware(hardware("a100-80g-p4de", "hardware.calibration.files=[]"))
    assert infiniband.params("all_reduce").fabric.tuner == "nccl"
    assert efa.params("all_reduce").fabric.tuner == "model"
    assert choose(infiniband.params("all_reduce"), 1 << 30, 16, 2)[0] == "ring"
    assert choose(efa.params("all_reduce"), 1 << 30, 16, 2)[0] == "tree"


def test_nccls_estimate_sees_the_graphs_its_topology_search_finds():
    """On up to 2 nodes NCCL prices a tree by the tree graph's intra-node bandwidth, which its search raises above
    the ring's while NVLink carries it, under per-channel caps (search.cc, tuning.cc). OCI's 16 NICs of 100 Gb/s
    leave a tree that headroom: from 512 MiB, where the tree correction ends, NCCL runs trees (the log's bus
    bandwidth jumps to 220-238 GB/s at 1 GiB, above the 200 GB/s a ring's NIC traffic allows). A DGX A100's 8 NICs
    of 200 Gb/s leave the tree capped below the ring; on 12 H100 nodes the caps keep large messages on rings."""
    oci = tuner_topology(16, 12.5e9, 300e9, "ampere")
    assert (oci.channels, oci.ring_bytes_per_s, oci.tree_intra_bytes_per_s) == (16, 12e9, 15e9)
    dgx = tuner_topology(8, 25e9, 300e9, "ampere")
    assert (dgx.ring_bytes_per_s, dgx.tree_intra_bytes_per_s) == (24e9, 30e9)
    assert tuner_topology(8, 50e9, 450e9, "hopper").ring_bytes_per_s == 45e9  # 8 x 48 exceeds NVLink
    assert tuner_topology(8, 50e9, 450e9, "") is None
    params = CommModel.from_hardware(hardware("a100-40g-oci", "hardware.calibration.files=[]")).params("all_reduce")
    assert choose(params, 8 << 30, 16, 2) == ("tree", "Simple")
    selene = CommModel.from_hardware(hardware("a100-80g-selene")).params("all_reduce")
    assert choose(selene, 8 << 30, 16, 2) == ("ring", "Simple")
    coreweave = CommModel.from_hardware(hardware("h100-sxm-dgx", "hardware.num_nodes=12")).params("all_reduce")
    assert choose(coreweave, 2 << 30, 96, 12) == ("ring", "Simple")
    # the tree correction: a 256 MiB tree Simple all-reduce at 0.9 of its bandwidth, none from 512 MiB
    pairs, sizes = [("tree", "Simple")], np.array([256 * MIB, 512 * MIB])
    corrected = tuner_estimates("2.20.5", "all_reduce", pairs, sizes, 16, 2, 0.0, oci)[0]
    bus = 16 * 15e9 * 0.92 / 2
    latency = 2 * (7 * 28.0 + 1 * 28.0) * 1e-6  # NCCL 2.20's tree Simple hwLat, NVLink and NET
    assert corrected == pytest.approx([latency + sizes[0] / (bus * 0.9), latency + sizes[1] / bus])


def test_a_tree_chain_sends_up_and_down_through_one_switch_port():
    """Inside a node NCCL's tree is a chain; behind an NVSwitch each GPU sends the reduction up and the broadcast
    down through its one port, 2 S in all: with a network faster than that, the chain paces a 2-node tree."""
    hw = hardware("a100-80g-selene", "hardware.nccl.algorithms=[tree]",
                  "hardware.network.nic_bandwidth_bytes_per_s=1e12")
    params = prior_params(hw, "all_reduce")
    size = 8 << 30
    nvlink = params.values["bandwidth.intra.Simple"] * params.channels
    assert 2 * size / nvlink < predict_seconds(params, [size], 16, 2)[0] < 2.5 * size / nvlink  # + step latencies


def test_nvls_tree_spans_nodes_where_the_tuner_is_the_models():
    """NVLSTree: the switch reduces inside each node (S per GPU each way at NVLS's rate), a tree between nodes. The
    p5 log's 260 GB/s at 16 GiB is above what a chain allows (2 S per GPU over 450 GB/s NVLink: 211 GB/s)."""
    p5 = CommModel.from_hardware(hardware("h100-80g-p5", "hardware.calibration.files=[]")).params("all_reduce")
    assert choose(p5, 16 << 30, 16, 2) == ("nvls", "Simple")
    assert 16 * 2**30 / predict_seconds(p5, [16 << 30], 16, 2)[0] > 211e9
    no_nvls = dataclasses.replace(p5, algorithms=("ring", "tree"))
    assert predict_seconds(no_nvls, [16 << 30], 16, 2)[0] > predict_seconds(p5, [16 << 30], 16, 2)[0]


def test_a_prediction_from_the_description_names_its_prior_and_band(tmp_path):
    hw = hardware("h100-sxm-dgx")
    prior = network_prior(hw)
    assert prior.level == "link_generation" and prior.key == "infiniband/ndr"
    assert 0 < prior.bandwidth_efficiency <= 1  # a network cannot beat its NICs' nominal bandwidth
    # one cluster cannot narrow the band below the mean held-out error of all clusters (the "all" entry); and a
    # band of +-50 % or more tells a user nothing to plan with (the held-out errors are 4-26 % today)
    everything = yaml.safe_load(PRIORS_FILE.read_text())["all"]["all"]
    assert len(prior.clusters) > 1 or prior.error_pct >= everything["error_pct"]
    assert 0 < prior.error_pct < 50
    inputs, warnings = calibration_inputs(hw, tmp_path, nodes_used=4)
    assert inputs["network"]["uncertainty_pct"] == pytest.approx(prior.error_pct, abs=0.1)
    assert any("infiniband/ndr" in w and "+-" in w for w in warnings)
    # no transport: the datasheet rate, and the warning says how to get a prior
    plain = dataclasses.replace(hw, network=dataclasses.replace(hw.network, transport=""))
    assert network_prior(plain) is None
    _, warnings = calibration_inputs(plain, tmp_path, nodes_used=4)
    assert any("set hardware.network.transport" in w for w in warnings)
    # an unknown generation falls back to its transport
    other = dataclasses.replace(hw, network=dataclasses.replace(hw.network, link_generation="xdr"))
    assert network_prior(other).level == "transport"


def test_network_priors_file_is_what_the_measured_clusters_give():
    """network_priors.yaml is learned (python -m trainsim.comm.network_fit --write), never edited by hand."""
    fresh = yaml.safe_load(render(learn(load_clusters())))
    stored = yaml.safe_load(PRIORS_FILE.read_text())
    assert stored.keys() == fresh.keys()
    for level, entries in fresh.items():
        assert stored[level].keys() == entries.keys(), level
        for key, entry in entries.items():
            assert stored[level][key]["clusters"] == entry["clusters"]
            for name in ("bandwidth_efficiency", "hop_latency_s", "error_pct"):
                assert stored[level][key][name] == pytest.approx(entry[name], rel=0.02, abs=0.2 if name == "error_pct"
                                                                 else 0), (level, key, name)


def test_nvlink_efficiency_is_what_its_sources_give():
    """NVLINK_EFFICIENCY is the output of its fitting script (comm/nvlink_fit.py), not a number typed in."""
    from trainsim.comm.network import NVLINK_EFFICIENCY
    from trainsim.comm.nvlink_fit import nvlink_efficiency

    assert NVLINK_EFFICIENCY == nvlink_efficiency()


def test_blackwell_800g_links_without_a_learned_prior_take_the_infiniband_transports():
    """ConnectX-8 (XDR, 800 Gb/s per GPU) has no measured cluster: the prior learned over all InfiniBand ones
    stands in, at the configs' own nominal rate (one NIC per GPU)."""
    for name in ("gb300-nvl72", "dgx-b300"):
        prior = network_prior(hardware(name))
        assert (prior.level, prior.key) == ("transport", "infiniband")
    assert domain_bandwidth(hardware("gb300-nvl72")) == pytest.approx(72 * 100e9)
    assert domain_bandwidth(hardware("dgx-b200")) == pytest.approx(8 * 50e9)
