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
and layers. Targets on 2 cores: <= 1 s, <= 5 s, <= 30 s. Then two points where ranks stop being alike:
`compose_seconds_straggler_8192gpu` (the 8,192-GPU layout with one rank 20 % slower; target <= 5 s) and
`compose_seconds_moe_skewed_8192gpu` (DeepSeek-V3 at 8,192 GPUs with Zipf-skewed routing, 1,024 rank
classes; target <= 30 s; its trace time is printed as `trace_seconds_moe_skewed_8192gpu`; `--skip-moe`
leaves it out, `--only moe-skewed` runs only it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from figures import figure

LAYOUTS = [(128, "pp8-tp8-dp2"), (1024, "pp16-tp8-dp8"), (8192, "pp16-tp8-dp64")]
ECHO_SECONDS = {128: 83.0, 1024: 719.0, 8192: 4977.0}
HARDWARE = "a100-80g-dgx"
STRAGGLER = "+hardware.stragglers=[{ranks:[1000],factor:1.2}]"
MOE_SKEWED = ("model=deepseek-v3", "parallelism=ep64-pp16-dp128", "hardware=h800-dgx", "parallelism.dp=512",
              "hardware.num_nodes=1024", "model.moe_routing=zipf:1.0")
"""DeepSeek-V3's layout (PP16, EP64, ZeRO-1) widened to 8,192 GPUs: 30 micro-batches of global batch 15,360;
Zipf-skewed routing gives every expert-parallel rank of every stage its own token counts (1,024 classes)."""


def gpt(parallelism: str, *overrides: str) -> tuple[str, ...]:
    return ("model=gpt-175b", f"parallelism={parallelism}", f"hardware={HARDWARE}", *overrides)


def prepare(workdir: Path, config: tuple[str, ...]) -> tuple[Path, float]:
    """Trace the point and price its kernels analytically; write graph/rank_classes/profile Parquet.
    Returns the folder and the trace's seconds."""
    from trainsim.config import compose_run
    from trainsim.profile.analytical import predict_rows
    from trainsim.profile.stage import distinct_ops
    from trainsim.trace import trace_layout

    run = compose_run(list(config), check="layout")
    out = workdir / "-".join(config).replace("=", "_").replace(".", "_").replace(":", "_")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = trace_layout(run.model, run.parallelism)
    seconds = time.perf_counter() - start
    pq.write_table(result.graph, out / "graph.parquet")
    pq.write_table(result.rank_classes, out / "rank_classes.parquet")
    ops = distinct_ops(result.graph.to_pandas())
    pq.write_table(pa.table({"signature": ops["signature"], "median_s": predict_rows(ops, run.hardware)}),
                   out / "kernels.parquet")
    return out, seconds


def _models(hw):
    from trainsim.timeline.costs import ConstantSlowdown
    from trainsim.timeline.stage import comm_model, slowdown_model

    models_dir = Path("artifacts/models") / hw.name
    slowdown = slowdown_model(hw, models_dir) if (models_dir / "manifest.json").is_file() else None
    return comm_model(hw, None), slowdown or ConstantSlowdown(0.2, name="constant s = 0.2 (stand-in)")


def measure(inputs: Path, config: list[str], global_batch: int) -> dict:
    """One composition, timed from reading the inputs to the finished timeline (run in a fresh process)."""
    from trainsim.config import compose_run
    from trainsim.timeline import compose_step
    from trainsim.timeline.chrome import write_chrome_trace
    from trainsim.timeline.outputs import class_table, summary

    run = compose_run(config, check="layout")
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


def fresh(inputs: Path, config: tuple[str, ...], global_batch: int = 0) -> dict:
    args = [sys.executable, __file__, "--one", str(inputs), str(global_batch), *config]
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout.splitlines()[-1])


def _row(label: str, r: dict) -> str:
    return (f"{label:>22} {r['gpus']:>6} {r['classes']:>7} {r['microbatches']:>6} {r['kernels']:>12,} "
            f"{r['nodes']:>9,} {r['iterations']:>5} {r['seconds']:>8.2f} {r['outputs_seconds']:>8.2f} "
            f"{r['step_s']:>9.2f}")


HEADER = (f"{'point':>22} {'GPUs':>6} {'classes':>7} {'m':>6} {'kernels':>12} {'nodes':>9} {'iter':>5} "
          f"{'compose':>8} {'outputs':>8} {'step s':>9}")


def _moe_skewed(work: Path, figures: list) -> None:
    """The DeepSeek-V3 point: its trace (figure trace_seconds_moe_skewed_8192gpu) and its compose."""
    print("\nDeepSeek-V3 on 8,192 H800 (PP16 EP64 DP512, ZeRO-1), Zipf 1.0 routing: a class per stage and "
          "expert-parallel rank")
    data, trace_s = prepare(work, MOE_SKEWED)
    print(HEADER)
    figures.append(("compose_seconds_moe_skewed_8192gpu", fresh(data, MOE_SKEWED)))
    print(_row("deepseek-v3 zipf:1.0", figures[-1][1]))
    figures.append(("trace_seconds_moe_skewed_8192gpu", {"seconds": trace_s}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-moe", action="store_true", help="leave out the DeepSeek-V3 point (its trace is long)")
    parser.add_argument("--only", choices=["moe-skewed"],
                        help="run only this point (moe-skewed: the DeepSeek-V3 trace and compose figures)")
    args = parser.parse_args()
    figures = []
    if args.only == "moe-skewed":
        with tempfile.TemporaryDirectory() as tmp:
            _moe_skewed(Path(tmp), figures)
        print()
        for name, r in figures:
            figure(name, r['seconds'], "s")
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs = {parallelism: prepare(work, gpt(parallelism))[0] for _, parallelism in LAYOUTS}
        print("GPT-175B, one step, 3D parallel (each point a fresh process; seconds on this machine)")
        print(HEADER)
        for gpus, parallelism in LAYOUTS:
            r = fresh(inputs[parallelism], gpt(parallelism))
            print(_row(parallelism, r))
            figures.append((f"compose_seconds_gpt175b_{gpus}gpu", r))
        print(f"models: comm = {figures[0][1]['comm']}; slowdown = {figures[0][1]['slowdown']}")
        print("\nmicro-batches (pp16-tp8-dp8, 1,024 GPUs; global batch varied)")
        print(HEADER)
        for global_batch in (192, 768, 1536, 6144):
            print(_row(f"global batch {global_batch}", fresh(inputs["pp16-tp8-dp8"], gpt("pp16-tp8-dp8"),
                                                             global_batch=global_batch)))
        print("\nlayers (pp16-tp8-dp8, 192 micro-batches)")
        print(HEADER)
        for layers in (48, 96, 192):
            config = gpt("pp16-tp8-dp8", f"model.num_layers={layers}")
            data = inputs["pp16-tp8-dp8"] if layers == 96 else prepare(work, config)[0]
            print(_row(f"{layers} layers", fresh(data, config)))
        print("\none slow rank (pp16-tp8-dp64, 8,192 GPUs; rank 1,000 computes 20 % slower): its class, its tp peers, "
              "its dp peers and everyone else per stage")
        print(HEADER)
        figures.append(("compose_seconds_straggler_8192gpu",
                        fresh(inputs["pp16-tp8-dp64"], gpt("pp16-tp8-dp64", STRAGGLER))))
        print(_row("one straggler", figures[-1][1]))
        if not args.skip_moe:
            _moe_skewed(work, figures)
    print()
    for name, r in figures:
        figure(name, r['seconds'], "s")
    for _, r in figures[:len(LAYOUTS)]:
        gpus = r["gpus"]
        figure(f"compose_speedup_vs_echo_{gpus}gpu", ECHO_SECONDS[gpus] / r['seconds'], "x", ".0f")
        print(f"  (Echo {ECHO_SECONDS[gpus]:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--one":
        print(json.dumps(measure(Path(sys.argv[2]), sys.argv[4:], int(sys.argv[3]))))
    else:
        main()
