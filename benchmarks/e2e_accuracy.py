"""End-to-end accuracy: predicted vs measured step time.

Part 1, this machine (gpt-small on local-cpu, one thread per process): for each layout (single, dp2, tp2, pp2
with 1F1B over 4 micro-batches, sp2 = tp2 with sequence parallelism, zero1 = dp2 with the distributed
optimizer, cp2 = context parallelism over 2 ranks, ring attention, fsdp2 = dp2 with FSDP2 fully sharded,
ZeRO-3; ep2 = dp2 with 4 experts per layer, top-2, split over the 2 ranks and predicted with the routing
histogram of its own real run; ep4 the same with 8 experts over 4 ranks, on a machine with 4 cores; etp2 = dp2
with the 4 experts' weights split over the 2 ranks) the layout's ops are timed again (`--remeasure`) and its
hardware's gloo model and system noise calibrated again (once per run); then the real step is measured
(trainsim/validation/ground_truth.py: 2 warm-up steps discarded, median of 5 measured steps, IQR as spread;
published at artifacts/ground_truth/local-cpu/...) and predicted by the pipeline (`trainsim compose`: trace,
profile on this CPU, calibrated gloo model, slowdown model; every missing artifact is built); then the ops are
timed once more and the step predicted again. A shared VM drifts, so the prediction compared is the mean of
the two, taken right before and right after the real steps.
Prints `figure e2e_error_pct_local_<layout> <|error|> %` (target: <= 5 % each) and
`figure e2e_input_drift_pct_local_<layout> <signed> %` (prediction after vs before: the machine's
drift over the measurement); the table also shows the error of each of the two predictions.

Part 2, published measurements: vTrain's 1440 Megatron-DeepSpeed iteration times on an 8x A100 node
(trainsim/validation/vtrain.py). The analytical kernel model's hardware-level parameters and the host
dispatch time per op are fitted on every 5th row (file order), the other 80 % are held out. Prints
`figure vtrain_single_mape_pct` and `figure vtrain_single_max_error_pct` on the held-out rows next to
vTrain's own MAPE on these single-node rows, 19.66 % (vTrain paper, arXiv:2312.12391).

Part 3, activation memory against the closed form of Korthikanti et al. 2022 (arXiv 2205.05198, Table 2): the
activation bytes per layer the trace stage counts (two traces of a GPT with unfused attention and dropout, 1 and
2 layers, bf16; trainsim/validation/activation_memory.py) against the formula, for Table 2's rows (tensor
parallelism 1/2/4, sequence parallelism, selective and full recomputation) at the layer shapes of the paper's
Table 3 models (22B, 175B, 530B, 1T; s = 2048, b = 1). Prints `figure memory_error_pct_korthikanti_max` (the
largest |traced - formula| / formula over cases and shapes; target <= 2 %). Fake tensors: about a minute.

Part 4, peak memory of the local layouts: the trace's peak per rank class against each rank's peak in a real
run of two steps (the CPU allocator's running total in torch.profiler's memory record, model building
included). Prints `figure memory_error_pct_local_max` (largest |error| over layouts and ranks; target <= 5 %).

    python benchmarks/e2e_accuracy.py [--skip-local] [--skip-vtrain] [--skip-korthikanti] [--skip-memory]
                                      [--reuse-ground-truth]
                                      [--layouts dp2 ...]
First run traces 576 distinct vTrain shapes (~25 min on 2 cores, cached under
artifacts/validation/traces); later runs take ~11-17 min (five fits, one per
host dispatch time of the grid). The NCCL calibration of a100-80g-vtrain is built first when missing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from figures import figure

from trainsim.config import compose_run
from trainsim.pipeline import build_point, compose_point
from trainsim.registry import STAGES
from trainsim.validation import activation_memory, vtrain
from trainsim.validation.ground_truth import (
    ROUTING_FILE,
    error_pct,
    read_ground_truth,
    write_ground_truth_artifact,
)

LOCAL = {
    "single": ["parallelism=single", "hardware.devices_per_node=1"],
    "dp2": ["parallelism=dp2"],
    "tp2": ["parallelism=tp2"],
    "pp2": ["parallelism=pp2"],
    "sp2": ["parallelism=tp2", "parallelism.sequence_parallel=true"],
    "zero1": ["parallelism=dp2", "parallelism.zero_stage=1"],
    "cp2": ["parallelism=cp2"],
    "fsdp2": ["parallelism=dp2", "parallelism.zero_stage=3"],
    "ep2": ["parallelism=dp2", "parallelism.ep=2", "model.num_experts=4", "model.moe_top_k=2"],
    "ep2-skew": ["parallelism=dp2", "parallelism.ep=2", "model.num_experts=4", "model.moe_top_k=2",
                 "model.moe_routing=zipf:1.5", "model.moe_force_routing=true"],
    "ep4": ["parallelism=dp2", "parallelism.dp=4", "parallelism.ep=4", "parallelism.global_batch_size=16",
            "model.num_experts=8", "model.moe_top_k=2"],
    "etp2": ["parallelism=dp2", "parallelism.etp=2", "model.num_experts=4", "model.moe_top_k=2"],
    "ep2-overlap": ["parallelism=dp2", "parallelism.ep=2", "model.num_experts=4", "model.moe_top_k=2",
                    "parallelism.moe_a2a_overlap=true"],
    "pp2-ep2-overlap": ["parallelism=dp2", "parallelism.pp=2", "parallelism.ep=2", "parallelism.global_batch_size=16",
                        "hardware.devices_per_node=4", "model.num_experts=4", "model.moe_top_k=2",
                        "parallelism.moe_a2a_overlap=true"],
    "pp2-v2-ep2-overlap": ["parallelism=dp2", "parallelism.pp=2", "parallelism.schedule=interleaved-1f1b",
                           "parallelism.virtual_stages=2", "parallelism.ep=2", "parallelism.global_batch_size=16",
                           "hardware.devices_per_node=4", "model.num_experts=4", "model.moe_top_k=2",
                           "parallelism.moe_a2a_overlap=true"],
}
"""Layouts of gpt-small; ep2 makes its MLPs 4 experts (top-2) split over 2 ranks, predicted with the routing of its
real run (the ground truth's routing histogram as model.moe_routing), ep4 8 experts over 4 ranks; ep2-skew forces
the real run to a Zipf routing (the hot expert takes a copy of every token) and predicts with the same plan; etp2
keeps all 4 experts on both ranks with each expert's weights split over them (expert tensor parallelism: the
tokens of both ranks gathered, uneven, before the experts and the outputs reduce-scattered after); ep2-overlap is ep2
with its all-to-alls hidden under the other micro-batch's compute (combined forward-backward passes), pp2-ep2-overlap
the same over two pipeline stages (1F1B), pp2-v2-ep2-overlap in interleaved 1F1B with two chunks per stage."""
LOCAL_RANKS = {"ep4": 4, "pp2-ep2-overlap": 4, "pp2-v2-ep2-overlap": 4}
"""Ranks of the layouts that need more than 2: one core each (more ranks than cores would time-slice them, which
the prediction does not model), so they are measured only on a machine with as many cores."""
FIGURE_NAMES = {"ep2-skew": "moe_imbalance_error_pct_local"}


def prediction_run(name: str, truth_dir: Path):
    """The point predicted for a layout: an MoE model routes as its real run did (a model.moe_routing input),
    unless the real run was forced to a plan."""
    routing = truth_dir / ROUTING_FILE
    forced = "model.moe_force_routing=true" in LOCAL[name]
    extra = [f"model.moe_routing={routing.resolve()}"] if routing.is_file() and not forced else []
    return compose_run(["model=gpt-small", *LOCAL[name], *extra])


def remeasure_profile(run) -> None:
    """Time the layout's ops again (`trainsim profile --remeasure`): the newest rows win."""
    from trainsim.profile.stage import write_profile_artifact

    trace = build_point(run, "trace").paths["trace"]  # traced where missing or made by other code
    profile = Path(STAGES["profile"].path(run.keys))
    write_profile_artifact(run.hardware, run.keys, trace, Path(STAGES["profile"].database_path(run.keys)), profile,
                           remeasure=True)


def recalibrate(run, calibrated: set[str]) -> None:
    """Calibrate the hardware's gloo model and system noise again, once per run and hardware."""
    if run.keys["hardware"] not in calibrated:
        build_point(run, "calibration", force_target=True)
        calibrated.add(run.keys["hardware"])


def bracketed_prediction(name: str, calibrated: set[str], truth_dir: Path) -> tuple[dict, dict, float, float]:
    """Measure the layout's ground truth between two timings of its ops and predict with each.

    A shared VM's speed drifts by 10-20 % over an hour and by up to 12 % within minutes, so the inputs
    are timed right before and right after the real steps and the two predictions averaged: a linear
    drift over the measurement cancels. Returns (truth, prediction before, step time after, drift %)."""
    run = compose_run(["model=gpt-small", *LOCAL[name]])
    remeasure_profile(run)
    recalibrate(run, calibrated)
    truth = write_ground_truth_artifact(run.hardware, run.model, run.parallelism, run.keys, truth_dir)
    run = prediction_run(name, truth_dir)
    before, _ = compose_point(run)
    remeasure_profile(run)
    after, _ = compose_point(run)
    return truth, before, after["step_time_s"], 100 * (after["step_time_s"] / before["step_time_s"] - 1)


def local_part(reuse: bool, layouts: list[str]) -> list[tuple[str, float, str]]:
    figures, calibrated = [], set()
    print(f"{'layout':>7} {'predicted s':>11} {'measured s':>10} {'IQR s':>7} {'error %':>8} {'before %':>8} "
          f"{'after %':>8} {'drift %':>8}  prediction before (critical path)")
    for name in layouts:
        run = compose_run(["model=gpt-small", *LOCAL[name]])
        truth_dir = Path(STAGES["ground_truth"].path(run.keys))
        if reuse and (truth_dir / "manifest.json").is_file():
            truth = read_ground_truth(truth_dir)
            predicted, _ = compose_point(prediction_run(name, truth_dir))
            after_s = predicted["step_time_s"]  # one prediction: the mean below is that prediction
        else:
            truth, predicted, after_s, drift = bracketed_prediction(name, calibrated, truth_dir)
            figures.append((f"e2e_input_drift_pct_local_{name}", drift, "%"))
        step_s = (predicted["step_time_s"] + after_s) / 2
        error = error_pct(step_s, truth)
        breakdown = ", ".join(f"{k} {v:.3f}" for k, v in predicted["critical_path"]["by_category"].items())
        if error is None:
            print(f"{name:>7} {step_s:>11.4f} {'not measured':>10}  ({truth['reason']})")
            continue
        print(f"{name:>7} {step_s:>11.4f} {truth['step_time_median_s']:>10.4f} {truth['step_time_spread_s']:>7.4f} "
              f"{error:>+8.2f} {error_pct(predicted['step_time_s'], truth):>+8.2f} {error_pct(after_s, truth):>+8.2f} "
              f"{100 * (after_s / predicted['step_time_s'] - 1):>+8.2f}  {breakdown}")
        figures.append((FIGURE_NAMES.get(name, f"e2e_error_pct_local_{name}"), abs(error), "%"))
    return figures


def vtrain_part() -> list[tuple[str, float, str]]:
    build_point(vtrain.base_run(), "calibration")  # built where missing
    build_point(vtrain.base_run(), "slowdown_model")  # decides the overlap slowdown a compose applies there
    result = vtrain.evaluate()
    table = result.table
    out = Path("artifacts/validation/vtrain")
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "predictions.csv", index_label="row")
    (out / "fit.json").write_text(json.dumps({"kernel_model": result.kernel_model, "fit_rows": "row % 5 == 0"},
                                             indent=2) + "\n")
    held = table[~table["fit"]]
    print(f"vTrain single node: {len(table)} rows, fitted on {int(table['fit'].sum())} (every {vtrain.FIT_EVERY}th), "
          f"{len(held)} held out; {result.seconds:.0f} s")
    print(f"fitted kernel model (hardware {vtrain.HARDWARE}): "
          + ", ".join(f"{k}={v:.3g}" for k, v in result.kernel_model.items()))
    print("fit-row MAPE by host dispatch time: "
          + ", ".join(f"{1e6 * h:.0f} us {m:.2f} %" for h, m in result.host_grid_mape_pct.items()))
    held = held.assign(layout=held.apply(lambda r: "pp" if r["pp"] > 1 and r["tp"] == 1 else
                                         ("tp" if r["tp"] > 1 and r["pp"] == 1 else
                                          ("tp+pp" if r["tp"] > 1 else "dp")), axis=1))
    print(f"{'group':>12} {'rows':>5} {'MAPE %':>7} {'max %':>7} {'bias %':>7}")
    for column in ("gpus", "layout", "tp", "hidden"):
        for value, group in held.groupby(column):
            e = group["error_pct"]
            print(f"{column + '=' + str(value):>12} {len(group):>5} {e.abs().mean():>7.2f} {e.abs().max():>7.2f} "
                  f"{e.mean():>+7.2f}")
    fit_err = vtrain.error_summary(table[table["fit"]])
    held_err = vtrain.error_summary(held)
    print(f"fit rows MAPE {fit_err['mape_pct']:.2f} %; held-out MAPE {held_err['mape_pct']:.2f} % "
          f"(the vTrain paper reports {vtrain.VTRAIN_PAPER_SINGLE_NODE_MAPE_PCT} % on its single-node runs)")
    return [("vtrain_single_mape_pct", held_err["mape_pct"], "%"),
            ("vtrain_single_max_error_pct", held_err["max_error_pct"], "%"),
            ("vtrain_paper_single_node_mape_pct", vtrain.VTRAIN_PAPER_SINGLE_NODE_MAPE_PCT, "%"),
            ("vtrain_benchmark_seconds", result.seconds, "s")]


# (name, shape) of the models of Korthikanti et al. 2022, Table 3: hidden size, heads; sequence 2048, micro-batch 1
KORTHIKANTI_SHAPES = {
    "22B": activation_memory.LayerShape(s=2048, b=1, h=6144, a=64),
    "175B": activation_memory.LayerShape(s=2048, b=1, h=12288, a=96),
    "530B": activation_memory.LayerShape(s=2048, b=1, h=20480, a=128),
    "1T": activation_memory.LayerShape(s=2048, b=1, h=25600, a=160),
}


def korthikanti_part() -> list[tuple[str, float, str]]:
    """Traced activation bytes per layer against Table 2 of Korthikanti et al. for each case and shape."""
    started, worst = time.perf_counter(), 0.0
    print(f"{'model':>5} {'case':>44} {'traced sbh':>11} {'formula sbh':>11} {'error %':>8}")
    for name, shape in KORTHIKANTI_SHAPES.items():
        for row in activation_memory.compare(shape):
            print(f"{name:>5} {row['case']:>44} {row['traced_sbh']:>11.3f} {row['formula_sbh']:>11.3f} "
                  f"{row['error_pct']:>+8.2f}")
            worst = max(worst, abs(row["error_pct"]))
    return [("memory_error_pct_korthikanti_max", worst, "%"),
            ("korthikanti_benchmark_seconds", time.perf_counter() - started, "s")]


def local_memory_part(layouts: list[str]) -> list[tuple[str, float, str]]:
    """Traced peak memory per rank (its class's) against the real run's: two steps of gpt-small per layout,
    each rank's peak the running total of torch.profiler's memory record (model built inside it)."""
    from trainsim.trace import trace_layout
    from trainsim.workloads.launch import measure_peak_memory

    worst = 0.0
    print(f"{'layout':>7} {'rank':>4} {'measured MiB':>12} {'traced MiB':>10} {'error %':>8}")
    for name in layouts:
        run = compose_run(["model=gpt-small", *LOCAL[name]], check="layout")
        trace = trace_layout(run.model, run.parallelism)
        traced = trace.memory.to_pandas().set_index("rank_class")["peak_bytes"]
        class_of = trace.rank_classes.to_pandas().set_index("rank")["rank_class"]
        for rank, measured in enumerate(measure_peak_memory(run.model, run.parallelism)):
            predicted = traced.loc[class_of[rank]]
            error = 100 * (predicted / measured - 1)
            print(f"{name:>7} {rank:>4} {measured / 2**20:>12.1f} {predicted / 2**20:>10.1f} {error:>+8.2f}")
            worst = max(worst, abs(error))
    return [("memory_error_pct_local_max", worst, "%")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument("--skip-vtrain", action="store_true")
    parser.add_argument("--skip-korthikanti", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    cores = os.cpu_count() or 1
    fitting = [name for name in LOCAL if LOCAL_RANKS.get(name, 2) <= cores]
    parser.add_argument("--layouts", nargs="+", choices=list(LOCAL), default=fitting,
                        help="local layouts to measure and predict (default: all that have a core per rank)")
    parser.add_argument("--reuse-ground-truth", action="store_true",
                        help="predict against ground-truth artifacts already measured instead of measuring anew")
    args = parser.parse_args()
    for name in sorted(set(LOCAL) - set(fitting) - set(args.layouts)):
        print(f"{name}: not measured, needs {LOCAL_RANKS[name]} cores (this machine has {cores})")
    start = time.perf_counter()
    figures = []
    if not args.skip_local:  # first: the real runs need a quiet machine
        figures += local_part(args.reuse_ground_truth, args.layouts)
    if not args.skip_memory:
        figures += local_memory_part(args.layouts)
    if not args.skip_vtrain:
        figures += vtrain_part()
    if not args.skip_korthikanti:
        figures += korthikanti_part()
    for name, value, unit in figures:
        figure(name, value, unit)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
