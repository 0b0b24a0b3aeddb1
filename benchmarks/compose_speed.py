"""Compose speed: one GPT-175B training step replayed for 128, 1,024 and 8,192 GPUs on this machine.

Echo (arXiv 2412.12487) needs 83 s for 128 GPUs, 719 s for 1,024 and
4,977 s for 8,192 (GPT 3D parallel). Each figure here is the wall time, in a fresh process, of reading the
trace and profile tables from Parquet and `compose_step` (classes, templates, step graph, replays until the
overlap slowdown is stable), i.e. "including loading the inputs"; writing the outputs is printed apart.
Global batch 1,536 sequences of 2,048 tokens (GPT-3), micro-batch 1, 1F1B, full recompute, bf16, so the
micro-batches per pipeline are 768 / 192 / 24. Kernel times: the analytical backend for a100-80g-dgx;
communication: the NCCL model uncalibrated (datasheet rates); overlap slowdown: the trained model of
artifacts/models/a100-80g-dgx when present, else a constant s = 0.2 stand-in (same code path and iterations).

Prints `figure compose_seconds_gpt175b_<N>gpu <seconds> s` and scaling tables over GPUs, micro-batches
and layers. Targets on 2 cores: <= 1 s, <= 5 s, <= 30 s.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

LAYOUTS = [(128, "pp8-tp8-dp2"), (1024, "pp16-tp8-dp8"), (8192, "pp16-tp8-dp64")]
ECHO_SECONDS = {128: 83.0, 1024: 719.0, 8192: 4977.0}
HARDWARE = "a100-80g-dgx"
MODELS_DIR = Path("artifacts/models") / HARDWARE


def prepare(workdir: Path, parallelism: str, overrides: tuple[str, ...] = ()) -> Path:
    """Trace the layout and price its kernels analytically; write graph/rank_classes/profile Parquet."""
    from trainsim.config import compose_run
    from trainsim.profile.analytical import predict_rows
    from trainsim.profile.stage import distinct_ops
    from trainsim.trace import trace_layout

    run = compose_run(["model=gpt-175b", f"parallelism={parallelism}", f"hardware={HARDWARE}", *overrides],
                      check="layout")
    out = workdir / "-".join([parallelism, *overrides]).replace("=", "_").replace(".", "_")
    out.mkdir(parents=True, exist_ok=True)
    result = trace_layout(run.model, run.parallelism)
    pq.write_table(result.graph, out / "graph.parquet")
    pq.write_table(result.rank_classes, out / "rank_classes.parquet")
    ops = distinct_ops(result.graph.to_pandas())
    pq.write_table(pa.table({"signature": ops["signature"], "median_s": predict_rows(ops, run.hardware)}),
                   out / "kernels.parquet")
    return out


def _models(hw):
    from trainsim.timeline.costs import ConstantSlowdown
    from trainsim.timeline.stage import comm_model, slowdown_model

    slowdown = slowdown_model(hw, MODELS_DIR) if (MODELS_DIR / "manifest.json").is_file() else None
    return comm_model(hw, None), slowdown or ConstantSlowdown(0.2, name="constant s = 0.2 (stand-in)")


def measure(inputs: Path, parallelism: str, overrides: list[str], global_batch: int) -> dict:
    """One composition, timed from reading the inputs to the finished timeline (run in a fresh process)."""
    from trainsim.config import compose_run
    from trainsim.timeline import compose_step
    from trainsim.timeline.chrome import write_chrome_trace
    from trainsim.timeline.outputs import class_table, summary

    run = compose_run(["model=gpt-175b", f"parallelism={parallelism}", f"hardware={HARDWARE}", *overrides],
                      check="layout")
    par = dataclasses.replace(run.parallelism, global_batch_size=global_batch or run.parallelism.global_batch_size)
    comm, slowdown = _models(run.hardware)
    start = time.perf_counter()
    graph = pq.read_table(inputs / "graph.parquet").to_pandas()
    rank_classes = pq.read_table(inputs / "rank_classes.parquet").to_pandas()
    profile = pq.read_table(inputs / "kernels.parquet").to_pandas()
    times = dict(zip(profile["signature"], profile["median_s"]))
    t = compose_step(graph, rank_classes, par, run.hardware, times, comm, slowdown)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = summary(t, class_table(t, None, run.hardware.memory_capacity_bytes), world_size=par.world_size,
                         num_microbatches=par.num_microbatches)
        (Path(tmp) / "summary.json").write_text(json.dumps(result))
        write_chrome_trace(t, Path(tmp) / "trace.json")
    return {"seconds": seconds, "outputs_seconds": time.perf_counter() - start, "step_s": t.step_time_s,
            "classes": t.classes.count, "kernels": t.num_ops, "nodes": t.graph.num_nodes,
            "microbatches": par.num_microbatches, "iterations": t.iterations, "gpus": par.world_size,
            "comm": t.models["comm"], "slowdown": t.models["slowdown"]}


def fresh(inputs: Path, parallelism: str, overrides: tuple[str, ...] = (), global_batch: int = 0) -> dict:
    args = [sys.executable, __file__, "--one", str(inputs), parallelism, str(global_batch), *overrides]
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout.splitlines()[-1])


def _row(label: str, r: dict) -> str:
    return (f"{label:>22} {r['gpus']:>6} {r['classes']:>7} {r['microbatches']:>6} {r['kernels']:>12,} "
            f"{r['nodes']:>9,} {r['iterations']:>5} {r['seconds']:>8.2f} {r['outputs_seconds']:>8.2f} "
            f"{r['step_s']:>9.2f}")


HEADER = (f"{'point':>22} {'GPUs':>6} {'classes':>7} {'m':>6} {'kernels':>12} {'nodes':>9} {'iter':>5} "
          f"{'compose':>8} {'outputs':>8} {'step s':>9}")


def main() -> None:
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs = {parallelism: prepare(work, parallelism) for _, parallelism in LAYOUTS}
        print("GPT-175B, one step, 3D parallel (each point a fresh process; seconds on this machine)")
        print(HEADER)
        for gpus, parallelism in LAYOUTS:
            r = fresh(inputs[parallelism], parallelism)
            print(_row(parallelism, r))
            figures.append((gpus, r))
        print(f"models: comm = {figures[0][1]['comm']}; slowdown = {figures[0][1]['slowdown']}")
        print("\nmicro-batches (pp16-tp8-dp8, 1,024 GPUs; global batch varied)")
        print(HEADER)
        for global_batch in (192, 768, 1536, 6144):
            print(_row(f"global batch {global_batch}", fresh(inputs["pp16-tp8-dp8"], "pp16-tp8-dp8",
                                                             global_batch=global_batch)))
        print("\nlayers (pp16-tp8-dp8, 192 micro-batches)")
        print(HEADER)
        for layers in (48, 96, 192):
            override = (f"model.num_layers={layers}",)
            data = inputs["pp16-tp8-dp8"] if layers == 96 else prepare(work, "pp16-tp8-dp8", override)
            print(_row(f"{layers} layers", fresh(data, "pp16-tp8-dp8", override)))
    print()
    for gpus, r in figures:
        print(f"figure compose_seconds_gpt175b_{gpus}gpu {r['seconds']:.2f} s")
    for gpus, r in figures:
        print(f"figure compose_speedup_vs_echo_{gpus}gpu {ECHO_SECONDS[gpus] / r['seconds']:.0f} x "
              f"(Echo {ECHO_SECONDS[gpus]:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "--one":
        print(json.dumps(measure(Path(sys.argv[2]), sys.argv[3], sys.argv[5:], int(sys.argv[4]))))
    else:
        main()
