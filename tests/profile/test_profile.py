"""Kernel profiling: replay, the append-only database, backends, fallbacks and incremental runs."""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainsim.config import compose_run
from trainsim.errors import ArtifactError, ConfigError, ReplayError
from trainsim.profile.analytical import fit_rates, is_matmul, op_kind, predict, predict_rows
from trainsim.profile.database import PROFILE_SCHEMA, ProfileDatabase
from trainsim.profile.measure import CacheFlush, Lockstep, last_level_cache_bytes, time_cpu
from trainsim.profile.replay import build_call
from trainsim.profile.stage import choose_backend, distinct_ops, profile_ops
from trainsim.trace import trace_layout


def _ops(*overrides) -> pd.DataFrame:
    run = compose_run(list(overrides), check="layout")
    return distinct_ops(trace_layout(run.model, run.parallelism).graph.to_pandas())


@pytest.fixture(scope="module")
def tiny_ops() -> pd.DataFrame:
    return _ops("parallelism=tp2")


def test_every_traced_op_of_gpt_and_llama_replays(tiny_ops):
    llama = _ops("model=llama3-8b", "model.num_layers=1", "model.hidden_size=256", "model.num_attention_heads=4",
                 "model.num_kv_heads=2", "model.ffn_hidden_size=512", "model.seq_length=32",
                 "model.vocab_size=1000", "parallelism=tp2", "parallelism.precision=bf16")
    for ops in (tiny_ops, llama):
        for _, op in ops.iterrows():
            build_call(op.to_dict())()  # raises ReplayError with the reason if an op cannot run


def test_replay_reproduces_shapes_strides_and_dtypes(tiny_ops):
    mm = tiny_ops[tiny_ops["op"] == "aten::mm"].iloc[0]
    out = build_call(mm.to_dict())()
    a, b = json.loads(mm["input_shapes"])
    assert list(out.shape) == [a[0], b[1]]
    transposed = tiny_ops[tiny_ops["input_strides"].str.contains(r"\[1,")]
    assert len(transposed) > 0  # non-contiguous layouts are traced and rebuilt as such


def test_traced_cpu_attention_is_rebuilt_as_the_devices_own(monkeypatch):
    """A trace made on the CPU holds the CPU's flash-attention ops; a GPU replays the same shapes through
    scaled_dot_product_attention (its own kernel), the backward through autograd. Run here on the CPU: the
    same path, with the device check bypassed."""
    import torch

    from trainsim.profile import replay

    ops = _ops("model=llama3-8b", "model.num_layers=1", "model.hidden_size=256", "model.num_attention_heads=4",
               "model.num_kv_heads=2", "model.ffn_hidden_size=512", "model.seq_length=32", "model.vocab_size=1000",
               "parallelism=single", "parallelism.precision=bf16")
    attention = ops[ops["op"].isin(replay.DEVICE_ATTENTION)]
    assert len(attention) == 2
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, **kwargs):
        seen.append((q.shape[1], k.shape[1], kwargs["is_causal"], kwargs["enable_gqa"], q.requires_grad))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    for _, op in attention.iterrows():
        row = op.to_dict()
        tensors = [replay._make_tensor(s, st, d, torch.device("cpu")) for s, st, d in zip(
            json.loads(row["input_shapes"]), json.loads(row["input_strides"]), row["input_dtypes"].split(","))]
        encoded = json.loads(row["op_args"])
        call = replay._device_flash_attention(row["op"], replay._decode(encoded["args"], tensors, "cpu"),
                                              replay._decode(encoded["kwargs"], tensors, "cpu"))
        result = call()
        if row["op"].endswith("_backward"):  # gradients of q, k and v with their shapes
            assert [list(g.shape) for g in result] == json.loads(row["input_shapes"])[1:4]
    assert seen and all(s == (4, 2, True, True, True) for s in seen)  # causal, grouped-query, as traced


def test_indices_are_spread_over_the_rows_they_address():
    """All-zero indices are valid but not what a step meets (every token on one embedding row, every expert's
    output added onto one token: atomics piling on one address on a GPU); rebuilt indices cover the rows."""
    import torch

    from trainsim.profile.replay import rebuild_arguments

    ops = _ops("model=gpt-tiny", "model.num_experts=4", "model.moe_top_k=2", "parallelism=single")
    checked = set()
    for _, op in ops[ops["input_dtypes"].str.contains("int64")].iterrows():
        name = op["op"].split(".")[0]
        args, _ = rebuild_arguments(op.to_dict(), torch.device("cpu"))
        if name in ("aten::index_select", "aten::index_add", "aten::gather", "aten::scatter"):
            index, bound = args[2], args[0].shape[args[1]]
        elif name in ("aten::embedding", "aten::embedding_dense_backward"):
            index, bound = args[1], args[2] if name.endswith("backward") else args[0].shape[0]
        elif name in ("aten::index", "aten::index_put_"):
            index, bound = args[1][-1], args[0].shape[len(args[1]) - 1]
        else:
            continue
        assert 0 <= int(index.min()) and int(index.max()) < bound, op["op"]
        assert len(index.unique()) == min(bound, index.numel()), op["op"]  # every row (or every index) distinct
        checked.add(name)
    assert {"aten::embedding", "aten::index_select", "aten::index_add", "aten::scatter"} <= checked


def test_unreplayable_ops_say_why():
    base = {"input_shapes": "[[4]]", "input_strides": "[[1]]", "input_dtypes": "fp32",
            "op_args": json.dumps({"args": [{"$t": 0}], "kwargs": {}})}
    with pytest.raises(ReplayError, match="not a compute op this replay can run"):
        build_call({**base, "op": "mylib::fused_thing"})
    with pytest.raises(ReplayError, match="not available in this torch build"):
        build_call({**base, "op": "aten::no_such_op"})
    with pytest.raises(ReplayError, match="cannot be materialised"):
        build_call({**base, "op": "aten::relu", "op_args": json.dumps({"args": [{"$obj": "Generator"}], "kwargs": {}})})
    with pytest.raises(ReplayError, match="dtype 'complex32' cannot be materialised"):
        build_call({**base, "op": "aten::relu", "input_dtypes": "complex32"})


def test_profile_measures_once_then_reuses(tmp_path, tiny_ops):
    """Six ops of the tiny model, then a mix of three of them and three of another model's, show the reuse; every
    traced op is built and run by test_every_traced_op_of_gpt_and_llama_replays (timing them all here took two
    minutes)."""
    hw = compose_run([]).hardware
    db = ProfileDatabase(tmp_path / "kernels.parquet")
    some = tiny_ops.head(6)
    rows, first = profile_ops(some, hw, "local-cpu", db)
    assert first.backend == "cpu" and first.measured == len(some) and first.reused == 0
    assert set(rows["signature"]) == set(some["signature"])
    assert (rows["median_s"] > 0).all() and (rows["repeats"] >= 7).all() and (rows["backend"] == "cpu").all()
    # cores share caches and DRAM: each op was timed while every device of the node ran it
    assert rows["metrics"].map(lambda m: json.loads(m)["colocated_devices"]).eq(hw.devices_per_node).all()
    assert rows["metrics"].map(lambda m: json.loads(m)["cold_cache"]).all()
    _, second = profile_ops(some, hw, "local-cpu", db)
    assert second.measured == 0 and second.reused == len(some)

    # a second model measures only the signatures the database lacks
    other = _ops("parallelism=tp2", "model.seq_length=32")
    fresh = other[~other["signature"].isin(tiny_ops["signature"])].head(3)
    mixed = pd.concat([some.head(3), fresh], ignore_index=True)
    _, third = profile_ops(mixed, hw, "local-cpu", db)
    assert len(fresh) == 3 and third.measured == 3 and third.reused == 3



def test_remeasure_times_every_op_again_and_newer_rows_win(tmp_path, tiny_ops):
    hw = compose_run([]).hardware
    db = ProfileDatabase(tmp_path / "kernels.parquet")
    some = tiny_ops.head(4)
    before, _ = profile_ops(some, hw, "local-cpu", db)
    again, summary = profile_ops(some, hw, "local-cpu", db, remeasure=True)
    assert summary.measured == len(some) and summary.reused == 0
    assert len(again) == len(some)  # one row per signature, the new one
    assert (again.set_index("signature")["measured_at"] >= before.set_index("signature")["measured_at"]).all()
    stored = db.read().set_index("signature").loc[again["signature"]]
    assert (stored["median_s"].to_numpy() == again["median_s"].to_numpy()).all()
    assert len(db.parts()) == 2  # the old rows are kept (append-only), only superseded


def test_lockstep_processes_take_the_same_samples_together():
    """Co-located timing: every process times each op the same number of times, each sample started
    after all have flushed (threads stand in for the processes; the lockstep is the same)."""
    lockstep = Lockstep(mp.get_context("spawn"), 2)  # each process has its own copy (its block counter)
    events: list[tuple[str, str]] = []
    results: dict[str, list] = {}

    def run(name: str, leader: bool, op_seconds: float) -> None:
        own = copy.copy(lockstep)

        def op():
            events.append((name, "call"))
            time.sleep(op_seconds)
        results[name] = time_cpu([op, op], min_samples=2, min_seconds=0.02, warmup=0, rounds=2,
                                 flush=lambda: events.append((name, "flush")), lockstep=own, leader=leader)

    follower = threading.Thread(target=run, args=("follower", False, 0.001))
    follower.start()
    run("leader", True, 0.004)
    follower.join()
    assert [t.repeats for t in results["leader"]] == [t.repeats for t in results["follower"]]
    assert all(t.repeats >= 5 for t in results["leader"])  # 20 ms of the leader's 4 ms op
    # the j-th call (both threads) starts after both have flushed for its sample, j // 2
    kinds = [kind for _, kind in events]
    calls = [i for i, kind in enumerate(kinds) if kind == "call"]
    assert all(kinds[:i].count("flush") >= 2 * (j // 2 + 1) for j, i in enumerate(calls))


def test_lockstep_survives_a_follower_descheduled_after_each_barrier(monkeypatch):
    """A follower that reads the leader's decision late (descheduled right after the barrier, as on a
    busy 2-core machine) must not see the decision meant for the next sample: it would stop a sample
    early and leave the leader waiting at a barrier alone (CI hung here for the barrier timeout)."""
    monkeypatch.setattr("trainsim.profile.measure.BARRIER_TIMEOUT_S", 5.0)
    lockstep = Lockstep(mp.get_context("spawn"), 2)
    results: dict[str, list] = {}

    def run(name: str, leader: bool) -> None:
        own = copy.copy(lockstep)
        if not leader:
            barrier_wait = own.wait
            own.wait = lambda: (barrier_wait(), time.sleep(0.003))
        results[name] = time_cpu([lambda: time.sleep(0.001)] * 3, min_samples=1, min_seconds=0.0, warmup=0,
                                 rounds=2, lockstep=own, leader=leader)

    follower = threading.Thread(target=run, args=("follower", False))
    follower.start()
    run("leader", True)
    follower.join()
    assert [t.repeats for t in results["leader"]] == [t.repeats for t in results["follower"]] == [2] * 3


def test_caches_are_flushed_before_every_timed_call():
    flushes, calls = [], []
    timings = time_cpu([lambda: calls.append(1), lambda: calls.append(2)], min_samples=4, warmup=2,
                       flush=lambda: flushes.append(len(calls)))
    # every sample is preceded by a flush; warm-up calls are not
    assert len(flushes) == sum(t.repeats for t in timings) == len(calls) - 4
    assert flushes[0] == 4 and all(b - a == 1 for a, b in zip(flushes, flushes[1:]))
    flush = CacheFlush("cpu")
    assert flush.buffer.numel() * 4 == 2 * last_level_cache_bytes("cpu") > 0
    before = flush.buffer.clone()
    flush()
    assert (flush.buffer == before + 1).all()  # writes the whole buffer
    assert CacheFlush("cpu", enabled=False).buffer.numel() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph timing needs a GPU")
def test_an_op_that_syncs_with_the_host_is_timed_without_a_graph_and_random_numbers_still_work():
    """A failed graph capture leaves CUDA's random generator marked as capturing (every later op that draws
    random numbers failed, rebuilt inputs included): syncing ops are found before any capture."""
    from trainsim.profile.measure import time_cuda

    x = torch.randn(1 << 16, device="cuda")
    assert time_cuda(lambda: x.nonzero()).metrics["graph_s"] is None
    dropout = time_cuda(lambda: torch.nn.functional.dropout(x, 0.1))
    assert dropout.metrics["graph_s"] is not None and torch.randn(8, device="cuda").isfinite().all()


def test_gpu_hardware_uses_the_analytical_backend(tmp_path, tiny_ops):
    hw = compose_run(["hardware=a100-80g-dgx"]).hardware
    assert choose_backend(hw) == "analytical"
    rows, summary = profile_ops(tiny_ops, hw, "a100-80g-dgx", ProfileDatabase(tmp_path / "db"))
    assert summary.analytical == len(tiny_ops) and (rows["backend"] == "analytical").all()
    assert (rows["median_s"] >= hw.kernel_model.launch_overhead_s).all()
    with pytest.raises(ConfigError, match="needs a cuda device"):
        choose_backend(compose_run(["hardware=a100-80g-dgx", "hardware.profile_backend=measure"]).hardware)


def test_analytical_backend_names_missing_peak_rate(tiny_ops):
    hw = compose_run(["hardware=a100-80g-dgx", "parallelism.precision=fp32"]).hardware
    hw.peak_flops_per_s.pop("fp32")
    with pytest.raises(ConfigError, match=r"hardware.peak_flops_per_s.fp32"):
        predict_rows(tiny_ops, hw)


def test_roofline_shape():
    from trainsim.profile.analytical import rates_for

    hw = compose_run(["hardware=h100-sxm-dgx"]).hardware
    rates = rates_for(hw, "bf16")
    big = predict(rates, [2 * 8192**3], [3 * 2 * 8192**2], ["matmul"])[0]
    efficiency = hw.kernel_model.matmul_efficiency
    assert big == pytest.approx(2 * 8192**3 / (989e12 * efficiency), rel=0.05)  # compute-bound at peak x efficiency
    tiny, eight_times_the_work = predict(rates, [2 * 16**3, 2 * 32**3], [6 * 16**2, 6 * 32**2], ["matmul"] * 2)
    assert tiny > rates.launch_overhead_s and eight_times_the_work < 1.01 * tiny  # latency-bound: FLOPs do not count
    assert is_matmul("aten::addmm") and is_matmul("aten::_scaled_dot_product_flash_attention_for_cpu")
    assert not is_matmul("aten::add.Tensor")
    assert op_kind("aten::native_layer_norm_backward") == "normalization"
    assert op_kind("aten::_foreach_addcdiv_.ScalarList") == "optimizer"
    assert op_kind("aten::add.Tensor") == "elementwise"


def test_fit_recovers_rates_from_synthetic_measurements():
    from trainsim.profile.analytical import RooflineRates

    truth = RooflineRates(5e10, 1e7, 1e10, 1e5, 2e9, 3e-6, kind_efficiency=(("normalization", 0.3),))
    sizes, elements = (8, 32, 64, 128, 256, 512, 1024), (1e3, 1e4, 1e5, 1e6, 1e7, 1e8)
    flops = [2 * n**3 for n in sizes] + list(elements)
    bytes_moved = [12 * n**2 for n in sizes] + [12 * n for n in elements]
    ops = ["aten::mm"] * 7 + ["aten::add.Tensor"] * 3 + ["aten::native_layer_norm"] * 3
    rows = pd.DataFrame({"flops": flops, "bytes_moved": bytes_moved, "op": ops})
    rows["median_s"] = predict(truth, rows["flops"], rows["bytes_moved"], rows["op"].map(op_kind))
    fitted = fit_rates(rows)
    again = predict(fitted, rows["flops"], rows["bytes_moved"], rows["op"].map(op_kind))
    # noiseless times from the model itself: the fit reproduces every op to the optimiser's tolerance (today
    # 0.4 % at worst), and the large GEMMs, compute-bound, pin the matmul rate. The memory, vector and launch
    # terms trade off against each other on these rows, so they are not compared one by one.
    assert (abs(again / rows["median_s"] - 1) < 0.01).all()
    assert fitted.matmul_flops_per_s == pytest.approx(truth.matmul_flops_per_s, rel=0.01)
    assert dict(fitted.kind_efficiency)["normalization"] == pytest.approx(0.3, rel=0.02)


def test_unreplayable_op_falls_back_to_analytical_with_reason(tmp_path, rate_ops):
    """The fallback's rates come from the ops measured beside it."""
    hw = compose_run([]).hardware
    weird = rate_ops.iloc[:1].assign(signature="custom0", op="mylib::fused_thing")
    rows, summary = profile_ops(pd.concat([rate_ops, weird], ignore_index=True), hw, "local-cpu",
                                ProfileDatabase(tmp_path / "db"))
    assert summary.analytical == 1 and summary.fallback[0]["op"] == "mylib::fused_thing"
    row = rows[rows["signature"] == "custom0"].iloc[0]
    assert row["backend"] == "analytical" and "not a compute op" in row["fallback_reason"]
    assert row["median_s"] > 0  # rates fitted to this machine's measured ops


def _append_rows(path: str, start: int) -> None:
    rows = pd.DataFrame([{name: None for name in PROFILE_SCHEMA.names} | {
        "hardware": "hw", "signature": f"sig{start + i}", "op": "aten::mm", "input_shapes": "[]",
        "input_strides": "[]", "input_dtypes": "", "op_args": "{}", "flops": 1, "bytes_moved": 1,
        "backend": "cpu", "median_s": 1e-6, "spread": 0.0, "min_s": 1e-6, "repeats": 1, "threads": 1,
        "kernels": "[]", "metrics": "{}", "source": "measured here", "measured_at": "2026-01-01T00:00:00+00:00",
        "tool_versions": "{}"} for i in range(50)])
    db = ProfileDatabase(Path(path))
    for k in range(5):
        db.append(rows.iloc[k * 10:(k + 1) * 10])


def test_concurrent_writers_lose_no_rows(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_rows, args=(str(tmp_path / "db"), 1000 * i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(ProfileDatabase(tmp_path / "db").read()) == 200


def test_corrupt_part_is_reported_not_rebuilt(tmp_path):
    _append_rows(str(tmp_path / "db"), 0)
    part = ProfileDatabase(tmp_path / "db").parts()[0]
    part.write_bytes(b"not parquet")
    with pytest.raises(ArtifactError, match=rf"{part.name} is corrupt"):
        ProfileDatabase(tmp_path / "db").read()
    assert part.exists()


def test_import_merges_and_checks_schema(tmp_path):
    _append_rows(str(tmp_path / "elsewhere"), 0)
    db = ProfileDatabase(tmp_path / "here")
    assert db.import_from(tmp_path / "elsewhere") == 50
    assert db.import_from(tmp_path / "elsewhere") == 0  # nothing new
    assert set(db.read()["source"]) == {f"imported from {tmp_path / 'elsewhere'}"}
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"hardware": ["hw"], "signature": ["s"]}), bad)
    with pytest.raises(ArtifactError, match=r"column 'op' \(string\) is missing"):
        db.import_from(bad)


def test_timing_and_real_runs_keep_freed_memory_instead_of_page_faulting_it_again():
    import subprocess
    import sys

    script = """
import sys, torch
from trainsim.workloads.allocator import use_steady_state_allocator
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
if len(sys.argv) > 1:
    assert use_steady_state_allocator()
x = torch.ones(64 << 20)  # 256 MB, touched
before = rss()
del x
print(before - rss())
"""
    default = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    steady = int(subprocess.run([sys.executable, "-c", script, "steady"], capture_output=True, text=True,
                                check=True).stdout)
    assert default > 200e6  # glibc unmaps the freed block: the next step faults its pages in again
    assert steady < 10e6  # kept for reuse, as CUDA's caching allocator keeps device memory
