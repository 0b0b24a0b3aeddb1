"""`trainsim` command line: inspect configs, trace a layout, run the real step, search layouts, emit dvc.yaml."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console

from trainsim.errors import ArtifactError, ConfigError, TraceError
from trainsim.progress import status, tracked
from trainsim.tables import SEARCH_FIELDS, Field, Rows, breakdown_rows, memory_rows, print_json, search_rows, show


def _cmd_config(args, console: Console) -> int:
    import yaml

    from trainsim.config import compose_run

    run = compose_run(args.overrides)
    par, hw = run.parallelism, run.hardware
    plain = {group: run.group(group) for group in ("hardware", "model", "parallelism", "framework")}
    if args.json:
        print_json({**plain, "keys": run.keys})
        return 0
    sys.stdout.write(yaml.safe_dump(plain, sort_keys=False))
    sys.stdout.write(f"# framework {run.framework.name}: {run.framework.description} (written into the groups "
                     "above where it decides a field)\n"
                     f"# artifact keys: {run.keys}\n"
                     f"# world size {par.world_size} = dp {par.dp} x tp {par.tp} x pp {par.pp}; "
                     f"{par.num_microbatches} micro-batch(es) of {par.micro_batch_size} per step; "
                     f"{hw.num_nodes} node(s) x {hw.devices_per_node} devices\n")
    return 0


def _cmd_trace(args, console: Console) -> int:
    from trainsim.config import compose_run
    from trainsim.registry import STAGES
    from trainsim.trace.stage import write_trace_artifact

    run = compose_run(args.overrides, check="run" if args.check_hardware else "layout")
    output = Path(args.output or STAGES["trace"].path(run.keys))
    with tracked(f"tracing {run.model.name} on {run.parallelism.name}", run.parallelism.pp) as bar:
        result = write_trace_artifact(run.model, run.parallelism, run.keys, output, progress=bar)
    graph = result.graph.to_pandas()
    console.print(f"{run.parallelism.world_size} ranks in {run.parallelism.pp} class(es); "
                  f"{len(graph)} events ({(graph['kind'] != 'compute').sum()} communication) "
                  f"traced in {sum(result.seconds_per_class):.2f} s -> {output}")
    show(console, memory_rows(result.memory.to_pylist(), run.hardware.memory_capacity_bytes, run.hardware.name))
    return 0


def _cmd_run(args, console: Console) -> int:
    from trainsim.config import compose_run
    from trainsim.workloads.launch import run_real_step

    run = compose_run(args.overrides)
    if run.hardware.device_kind != "cpu":
        raise ConfigError(f"trainsim run executes on this machine; hardware '{run.hardware.name}' is not local "
                          "(use hardware=local-cpu)")
    with console.status(f"running {args.steps} real step(s) on {run.parallelism.world_size} process(es)"):
        ranks = run_real_step(run.model, run.parallelism, steps=args.steps, warmup=args.warmup,
                              threads_per_rank=run.hardware.threads_per_device)
    for r in ranks:
        console.print(f"rank {r.rank}: " + ", ".join(f"{s:.4f}" for s in r.step_seconds) + " s")
    slowest = [max(r.step_seconds[i] for r in ranks) for i in range(args.steps)]
    console.print(f"step time (slowest rank, median of {args.steps}): {sorted(slowest)[len(slowest) // 2]:.4f} s")
    return 0


def _profile_database(run):
    from trainsim.profile.database import ProfileDatabase
    from trainsim.registry import STAGES

    return ProfileDatabase(Path(STAGES["profile"].database_path(run.keys)))


def _cmd_profile_fit(args, console: Console) -> int:
    import yaml

    from trainsim.config import compose_run
    from trainsim.config.choices import MEASURED_BACKENDS
    from trainsim.profile.analytical import evaluate_fit, fitted_kernel_model, op_dtype

    run = compose_run(args.overrides)
    db = _profile_database(run)
    rows = db.read()
    rows = rows[(rows["hardware"] == run.key("hardware")) & rows["backend"].isin((*MEASURED_BACKENDS, "kineto"))]
    if rows.empty:  # measured here, or imported from a GPU run's profiler traces
        raise ConfigError(f"no measured kernels for hardware '{run.key('hardware')}' in {db.path}; run the pipeline "
                          "(profile stage) on that hardware first, or import a database")
    report = evaluate_fit(rows, args.train_fraction, args.seed)
    dtype = rows["input_dtypes"].map(op_dtype).mode().iloc[0]
    console.print(f"fitted on {report.train_ops} signatures, held out {report.test_ops}: median error "
                  f"{report.median_error_pct:.1f} %, p90 {report.p90_error_pct:.1f} %")
    sys.stdout.write(f"# paste into conf/hardware/{run.choices['hardware']}.yaml\n")
    sys.stdout.write(yaml.safe_dump(fitted_kernel_model(report.rates, run.hardware, dtype), sort_keys=False))
    return 0


TRACE_SUFFIXES = (".json", ".json.gz")


def _cmd_profile_import(args, console: Console) -> int:
    from trainsim.config import compose_run

    # positionals: Hydra overrides (key=value that is not a file) and sources
    overrides = [a for a in args.inputs if "=" in a and not Path(a).exists()]
    sources = [a for a in args.inputs if a not in overrides]
    if args.hardware:
        overrides.insert(0, f"hardware={args.hardware}")
    if not sources:
        raise ConfigError("profile-import needs a source: Kineto trace files (*.json, *.json.gz) or a "
                          "kernels.parquet database measured elsewhere")
    run = compose_run(overrides)
    db = _profile_database(run)
    traces = [s for s in sources if s.endswith(TRACE_SUFFIXES)]
    for source in (s for s in sources if s not in traces):
        added = db.import_from(Path(source), hardware=None if args.all_hardware else run.key("hardware"))
        console.print(f"imported {added} new row(s) from {source} into {db.path}")
    if traces:
        _import_kineto(traces, run, db, args, console)
    return 0


def _import_kineto(traces: list[str], run, db, args, console: Console) -> None:
    from trainsim.profile.kineto import import_traces

    with console.status(f"importing {len(traces)} profiler trace(s) for {run.key('hardware')}"):
        report = import_traces(traces, run.hardware, db.path, run.key("hardware"),
                               allow_device_mismatch=args.allow_device_mismatch, fit=not args.no_fit,
                               train_fraction=args.train_fraction, seed=args.seed)
    fields = [Field(name) for name in ("file", "device", "kernels", "imported kernels", "NCCL kernels",
                                       "skipped kernels", "op instances", "signatures")]
    cells = [[Path(f.path).name, f.device_name or "(not recorded)", str(f.kernels),
              "already imported" if f.already_imported else str(f.imported_kernels),
              str(f.nccl_kernels), str(f.skipped_total), str(f.op_instances), str(f.signatures)] for f in report.files]
    show(console, Rows(f"Kineto traces -> {report.database} (hardware '{report.hardware}')", fields, cells, cells))
    for f in report.files:
        if f.nccl_kernels:
            by = ", ".join(f"{n} {c}" for c, n in sorted(f.nccl_by_collective.items()))
            console.print(f"{Path(f.path).name}: {f.nccl_kernels} NCCL kernel(s), {f.nccl_time_s * 1e3:.2f} ms "
                          f"({by}): communication, not put in the compute database", highlight=False)
        for reason, n in sorted(f.skipped.items(), key=lambda kv: -kv[1]):
            ops = f.skipped_ops.get(reason, {})
            top = ", ".join(f"{op} {k}" for op, k in sorted(ops.items(), key=lambda kv: -kv[1])[:3])
            console.print(f"  skipped {n} kernel(s): {reason}" + (f" (e.g. {top})" if top else ""), highlight=False)
        for what, n in sorted({**f.other_events, **f.malformed_events}.items()):
            console.print(f"  not imported: {n} {what} event(s)", highlight=False)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    console.print(f"appended {report.appended} row(s) (one per op signature) -> {report.part or 'nothing new'}",
                  highlight=False)
    fit = report.fit
    if fit is None:
        return
    if fit.note and not fit.rates:
        console.print(f"compute model: {fit.note}", highlight=False)
        return
    console.print(f"compute model refitted on {fit.rows} measured row(s) of '{report.hardware}' "
                  "(backends cpu, cuda, kineto):", highlight=False)
    for name, value in fit.rates.items():
        if isinstance(value, list) and all(isinstance(v, list) and len(v) == 2 for v in value):
            value = ", ".join(f"{k} {v:.3g}" for k, v in value) or "none"
        console.print(f"  {name}: {value:.4g}" if isinstance(value, float) else f"  {name}: {value}",
                      highlight=False)
    if fit.median_error_pct is not None:
        console.print(f"held-out error (fit on {fit.train_ops} signatures, tested on {fit.test_ops}): median "
                      f"{fit.median_error_pct:.1f} %, p90 {fit.p90_error_pct:.1f} %", highlight=False)
    else:
        console.print(f"held-out error: {fit.note}", highlight=False)


def _inputs_lines(inputs: dict) -> list[str]:
    """What the prediction used, one line per input, then the warnings."""
    cal, kernels, slowdown = inputs["calibration"], inputs["kernels"], inputs["slowdown"]
    lines = []
    if cal["calibrated"]:
        errors = ", ".join(f"{name} {e['heldout_mape_pct_large']} %" for name, e in cal["collectives"].items())
        lines.append(f"calibration: {'; '.join(cal['sources'])} (held-out error, messages >= 1 MiB: {errors})")
    counts = ", ".join(f"{n} {backend}" for backend, n in kernels.get("backends", {}).items())
    model = f"kernel model: {kernels['kernel_model']}" if "kernel_model" in kernels else ""
    lines.append("kernels: " + "; ".join(part for part in (counts, model) if part))
    if "choice" in slowdown:
        lines.append(slowdown["choice"])
    if "artifact" in slowdown:
        lines.append(f"slowdown model: trained on {', '.join(slowdown['files']) or slowdown['source']} "
                     f"({slowdown['rows']} kernels; CV duration error {slowdown['cv_duration_mape_pct']} %)")
    return lines + [f"[yellow]warning:[/yellow] {w}" for w in inputs["warnings"]]


def _money(usd: float) -> str:
    return f"${usd / 1e6:,.2f} M" if usd >= 1e6 else f"${usd:,.2f}" if usd >= 1 else f"${usd:.3g}"


def _efficiency_lines(figures: dict, intervals: dict | None = None) -> list[str]:
    """The step, then the whole run, in the numbers the field compares (report/efficiency.py); with `intervals`
    (name -> (low, high) at 80 %) the main ones carry theirs."""
    from trainsim.report.efficiency import token_count

    def within(name: str, text) -> str:
        if not intervals or name not in intervals:
            return ""
        low, high = intervals[name]
        return f" (80 %: {text(low)}-{text(high)})"

    rates = [f"{figures['tokens_per_s']:,.0f} tokens/s{within('tokens_per_s', lambda v: f'{v:,.0f}')} "
             f"({figures['tokens_per_s_per_gpu']:,.0f} per GPU)",
             f"{figures['model_tflops_per_s_per_gpu']:.1f} model TFLOP/s per GPU"]
    if figures["mfu_pct"] is not None:
        rates.append(f"MFU {figures['mfu_pct']:.1f} %{within('mfu_pct', lambda v: f'{v:.1f}')}, "
                     f"HFU {figures['hfu_pct']:.1f} %")
    if figures["cost_per_step_usd"] is not None:
        rates.append(f"{_money(figures['cost_per_step_usd'])} per step, "
                     f"{_money(figures['cost_per_million_tokens_usd'])} per million tokens")
    lines = ["throughput: " + "; ".join(rates)]
    if figures["training_tokens"] is None:
        return lines + ["(add train.tokens=3e11 for the days, GPU-hours and cost of a whole run)"]
    run = [f"{figures['training_steps']:,} steps",
           f"{figures['training_days']:,.1f} days{within('training_days', lambda v: f'{v:,.1f}')}",
           f"{figures['training_gpu_hours']:,.0f} GPU-hours"]
    if figures["training_cost_usd"] is not None:
        run.append(_money(figures["training_cost_usd"]) + within("training_cost_usd", _money))
    if figures["training_energy_mwh"] is not None:
        run.append(f"{figures['training_energy_mwh']:,.0f} MWh at the GPUs' maximum power")
    return lines + [f"training on {token_count(figures['training_tokens'])} tokens: " + ", ".join(run)]


def _cmd_compose(args, console: Console) -> int:
    from trainsim.api import predict

    with status("composing (building missing traces, profiles, calibration, slowdown model first)"):
        result = predict(*args.overrides, build_missing=not args.quick, output=args.output)
    print_compose(result, console, as_json=args.json)
    return 0


def _print_json_and_warnings(document: dict, warnings: list[str]) -> None:
    """`--json`: the document alone on stdout, its warnings also on stderr where a person sees them."""
    print_json(document)
    for warning in warnings:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {warning}", highlight=False)


def compose_document(result) -> dict:
    """`trainsim compose --json`: the step time, where it goes, memory, throughput and what it was made from."""
    breakdown = breakdown_rows(result.step_time_s, result.summary["classes"])
    return {"step_time_s": result.step_time_s, "step_time_interval_s": result.interval.as_dict()["intervals_s"],
            "uncertainty": result.interval.parts, "intervals_80": result.intervals,
            "oom": result.oom, "classes": breakdown.records(),
            "memory": result.memory.to_dict(orient="records"), "efficiency": result.efficiency,
            "inputs": result.inputs, "warnings": result.warnings, "artifact_dir": str(result.artifact_dir)}


def print_compose(result, console: Console, as_json: bool = False) -> None:
    """What `trainsim compose` prints for a Prediction: a table per rank class that fits `console`'s width,
    throughput, inputs and warnings; or (`as_json`) one JSON document, the warnings repeated on stderr."""
    if as_json:
        _print_json_and_warnings(compose_document(result), result.warnings)
        return
    summary = result.summary
    show(console, breakdown_rows(result.step_time_s, summary["classes"]))
    console.print(f"step time: {result.interval.describe()}; 95 %: {_seconds_range(result.interval.at(95))} "
                  f"({_interval_basis(result.interval.parts)})", highlight=False)
    console.print(critical_path_line(result.critical_path), highlight=False)
    for line in [*_efficiency_lines(result.efficiency, result.intervals), *_inputs_lines(result.inputs)]:
        console.print(line, highlight=False)
    console.print(f"{summary['num_nodes']} nodes in {summary['simulate_s']:.2f} s -> {result.artifact_dir} "
                  f"(open {result.artifact_dir}/trace.json in https://ui.perfetto.dev)", highlight=False)


def critical_path_line(critical_path: dict) -> str:
    """What the step's critical path is made of, largest first: compute, host-bound time (the GPU waiting for the
    host to issue kernels, hardware.host_dispatch_s) and each group kind's exposed communication."""
    names = {"compute": "compute", "host": "host-bound"}
    parts = sorted(critical_path.get("by_category", {}).items(), key=lambda kv: -kv[1])
    return "critical path: " + ", ".join(f"{names.get(k, k.replace('comm.', 'exposed '))} {v:.4g} s"
                                         for k, v in parts if v > 0)


def _seconds_range(bounds: tuple[float, float]) -> str:
    return f"{bounds[0]:.3g}-{bounds[1]:.3g} s"


def _interval_basis(parts: list[dict]) -> str:
    """What the interval was built from: each part's level and measured spread, largest part first."""
    ordered = sorted(parts, key=lambda p: -p["seconds"])
    return "from " + ", ".join(f"{p['component']} {p['level'].replace('_', ' ')} +-{p['spread_pct']:.0f} %"
                               + (f" bias {p['bias_pct']:+.0f} %" if abs(p["bias_pct"]) >= 1 else "")
                               for p in ordered)


def _cmd_import_model(args, console: Console) -> int:
    from trainsim.config.hf_import import DEFAULT_SEQ_LENGTH, import_hf_config
    from trainsim.config.imported_models import model_yaml

    seq_length = args.seq_length or DEFAULT_SEQ_LENGTH
    imported = import_hf_config(args.config_json, name=args.name, seq_length=seq_length)
    note = (f"the training sequence length given to `trainsim import-model --seq-length {seq_length}`"
            if args.seq_length else "")
    text = model_yaml(imported, seq_length_note=note)
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    output = Path(args.output or f"conf/model/{imported.fields['name']}.yaml")
    if output.exists() and not args.force:
        raise ConfigError(f"{output} exists; pass --force to overwrite it, or -o another file")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    approximations = imported.fields["approximations"]
    console.print(f"wrote {output}: {imported.model_type} model {imported.fields['name']}, sequence length "
                  f"{seq_length}{'' if args.seq_length else ' (the default: set it with --seq-length)'}; "
                  f"{len(imported.ignored)} key(s) left out as irrelevant to step time, "
                  f"{len(approximations)} approximation(s)", highlight=False)
    for line in approximations:
        console.print(f"  approximated: {line}", highlight=False)
    console.print(f"use it: trainsim compose model={imported.fields['name']}", highlight=False)
    return 0


def _search_setup(args):
    """The run, the search space of the command line, and the hardware's calibration (built when missing
    unless --quick)."""
    from trainsim.config import compose_run
    from trainsim.pipeline import artifact_paths, build_point, exists
    from trainsim.search.layouts import SearchSpace

    run = compose_run(args.overrides, check="layout")
    space = SearchSpace(micro_batch_sizes=tuple(args.micro_batch_sizes), schedules=tuple(args.schedules),
                        recompute=tuple(args.recompute), min_world_size=args.min_gpus, cp_sizes=tuple(args.cp_sizes),
                        zero_stages=tuple(args.zero_stages), ep_sizes=tuple(args.ep_sizes),
                        etp_sizes=tuple(args.etp_sizes))
    calibration = artifact_paths(run.keys)["calibration"]
    if not args.quick and not exists(calibration):
        with status(f"calibrating the collectives of {run.hardware.name} (cached in {calibration})"):
            build_point(run, "calibration")
    return run, space, calibration


def _cmd_plan(args, console: Console) -> int:
    from trainsim.search.plan import CHOICES, PAGE_FILE, answer, make_plan, odds_line, plan_dir, write_plan_artifact

    run, space, calibration = _search_setup(args)
    with status(f"searching the layouts of {run.model.name} on {args.gpus} x {run.hardware.name}, then "
                "composing the chosen one in full (missing inputs built first)"):
        plan = make_plan(run, args.gpus, space, by=args.by, within_days=args.within_days, confidence=args.confidence,
                         jobs=args.jobs or os.cpu_count() or 1, calibration_dir=calibration)
    output = Path(args.output) if args.output else plan_dir(run, args.gpus)
    write_plan_artifact(plan, output)
    a = answer(plan)
    if args.json:
        _print_json_and_warnings({**a, "output": str(output / PAGE_FILE)}, a["warnings"])
        return 0
    deadline = f" within {args.within_days:g} days" if args.within_days else ""
    console.print(f"{a['layout']} on {a['world_size']} GPUs ({CHOICES[args.by]}"
                  f"{deadline} of {len(plan.search.table)} layouts): {plan.prediction.interval.describe()} per step"
                  + (" [red](OOM in the full trace)[/red]" if a["oom"] else ""), highlight=False)
    for line in [odds_line(a, args.by), *_efficiency_lines(plan.prediction.efficiency, plan.prediction.intervals),
                 *_inputs_lines(plan.prediction.inputs)]:
        console.print(line, highlight=False)
    console.print(f"reproduce: trainsim compose {' '.join(plan.overrides)}", highlight=False)
    console.print(f"-> {output}/{PAGE_FILE} (the answer, where the time goes, memory, the alternatives)",
                  highlight=False)
    return 0


def _cmd_search(args, console: Console) -> int:
    import pandas as pd

    from trainsim.search.output import search_dir, write_search_artifact
    from trainsim.search.run import STATUS_OK, cost_column, search_layouts

    run, space, calibration = _search_setup(args)
    with status(f"searching layouts of {run.model.name} on {args.gpus} x {run.hardware.name}"):
        result = search_layouts(run, args.gpus, space, jobs=args.jobs or os.cpu_count() or 1,
                                calibration_dir=calibration)
    output = Path(args.output) if args.output else search_dir(run, args.gpus)
    write_search_artifact(run, args.gpus, space, result, output, top=args.top)
    table = result.table
    ok = table[table["status"] == STATUS_OK]
    columns = ("layout", "step_time_s", "tokens_per_s", "mfu_pct", "peak_memory_gib", cost_column(table),
               *(c for c in ("training_days", "training_cost_usd") if ok[c].notna().any()))  # with train.tokens
    shown = pd.concat([ok.nsmallest(args.top, "step_time_s"), ok[ok["pareto"]]]).drop_duplicates("layout")
    view = search_rows(f"{len(table)} layouts ({len(ok)} fit in memory); fastest {min(args.top, len(ok))} "
                       f"and the Pareto front (time vs {SEARCH_FIELDS[cost_column(table)].header})",
                       shown.to_dict(orient="records"), columns)
    if args.json:
        _print_json_and_warnings({"layouts": len(table), "fit_in_memory": len(ok), "shown": view.records(),
                                  "inputs": result.inputs, "output": str(output)}, result.inputs["warnings"])
        return 0
    show(console, view)
    for line in _inputs_lines(result.inputs):
        console.print(line, highlight=False)
    console.print(f"estimates: {len(table) / result.estimate_s:.0f} layouts/s on {result.jobs} process(es); "
                  f"slices traced and profiled in {result.slices_s:.1f} s -> {output} "
                  f"(search.html; simulate the chosen ones fully: snakemake --config sweep_file={output}/sweep.yaml)")
    return 0


def _cmd_dvc_yaml(args, console: Console) -> int:
    from trainsim.registry import render_dvc_yaml

    text = render_dvc_yaml()
    if args.check:
        current = Path("dvc.yaml").read_text() if Path("dvc.yaml").exists() else ""
        if current != text:
            console.print("dvc.yaml is out of date with src/trainsim/registry.py; run `trainsim dvc-yaml > dvc.yaml`")
            return 1
        return 0
    sys.stdout.write(text)
    return 0


def _cmd_import_layout(args, console: Console) -> int:
    import shlex

    gpus = args.gpus or (args.nodes * args.gpus_per_node if args.nodes else None)
    name = args.name or (Path(args.output).stem if args.output and not args.overrides else "")  # as presets: the stem
    if args.megatron is not None:
        from trainsim.config.megatron_layout import import_megatron

        layout = import_megatron(args.megatron, gpus, name=name, allow_unknown=args.allow_unknown)
    else:
        from trainsim.config.torchtitan_layout import import_torchtitan

        layout = import_torchtitan(Path(args.torchtitan), gpus, name=name, allow_unknown=args.allow_unknown,
                                   num_layers=args.num_layers)
    err = Console(stderr=True)
    for title, items in (("model arguments, not imported by import-layout (they belong to conf/model)",
                          layout.model_arguments), ("not known to import-layout, left out", layout.unknown),
                         ("note", layout.notes)):
        if items:
            err.print(f"{title}: {'; '.join(items)}", highlight=False, markup=False)
    text = " ".join(shlex.quote(o) for o in layout.overrides()) + "\n" if args.overrides else layout.yaml_text()
    if args.output:
        Path(args.output).write_text(text)
        err.print(f"wrote {args.output}", highlight=False, markup=False)
    else:
        sys.stdout.write(text)
    return 0


def _add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The layout search's arguments (search and plan)."""
    p.add_argument("overrides", nargs="*", help="Hydra overrides: model, hardware, parallelism.global_batch_size, "
                                                "train.tokens ...")
    p.add_argument("--gpus", type=int, required=True, help="GPU budget (also halvings of it down to one node)")
    p.add_argument("--min-gpus", type=int, default=0, help="smallest world size tried (default: one node)")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved-1f1b"])
    p.add_argument("--recompute", nargs="+", default=["none", "selective", "full"])
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[1],
                   help="context-parallel degrees to try, e.g. 1 2 4 8 for long sequences (default: 1, none)")
    p.add_argument("--zero-stages", type=int, nargs="+", default=[],
                   help="state sharding to try: 0 replicated, 1 distributed optimizer, 2 3 FSDP "
                        "(default: the config's parallelism.zero_stage)")
    p.add_argument("--ep-sizes", type=int, nargs="+", default=[],
                   help="expert-parallel degrees to try for a mixture of experts (default: every divisor of "
                        "model.num_experts)")
    p.add_argument("--etp-sizes", type=int, nargs="+", default=[],
                   help="expert-tensor-parallel degrees to try (default: 1 and each layout's tp)")
    p.add_argument("--jobs", type=int, default=0, help="processes (default: all cores)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--quick", action="store_true",
                   help="do not build a missing calibration (the output warns that datasheet rates stood in)")


JSON_HELP = "print one JSON document on stdout instead of tables (progress and warnings go to stderr)"
EXAMPLES = {
    "trainsim": ("trainsim config model=gpt-13b parallelism=tp2",
                 "trainsim compose model=gpt-175b parallelism=pp16-tp8-dp8 hardware=a100-80g-dgx",
                 "trainsim search model=gpt-175b hardware=a100-80g-dgx parallelism=pp16-tp8-dp8 --gpus 1024"),
    "config": ("trainsim config model=gpt-13b parallelism=tp2",
               "trainsim config model=llama3-70b hardware=h100-sxm-dgx parallelism=tp8-sp-pp8-dp4"),
    "trace": ("trainsim trace model=gpt-175b parallelism=pp12-tp8-dp1 hardware=h800-dgx",
              "trainsim trace model=gpt-tiny parallelism=dp2 hardware=local-cpu --check-hardware"),
    "run": ("trainsim run model=gpt-tiny parallelism=dp2 hardware=local-cpu --steps 5",),
    "profile-fit": ("trainsim profile-fit hardware=local-cpu",
                    "trainsim profile-fit hardware=local-cpu --train-fraction 0.7 --seed 1"),
    "profile-import": ("trainsim profile-import --hardware a100-80g-dgx run/rank0.json.gz run/rank1.json.gz",
                       "trainsim profile-import other/kernels.parquet hardware=a100-80g-dgx"),
    "compose": ("trainsim compose model=gpt-175b parallelism=pp16-tp8-dp8 hardware=a100-80g-dgx",
                "trainsim compose model=gpt-tiny parallelism=dp2 --quick",
                "trainsim compose model=hf:tests/config/fixtures/hf/llama3-8b/config.json model.seq_length=8192 "
                "hardware=h100-sxm-dgx parallelism=pp8-tp4-dp2"),
    "search": ("trainsim search model=gpt-175b hardware=a100-80g-dgx parallelism=pp16-tp8-dp8 --gpus 1024",
               "trainsim search model=mixtral-8x7b hardware=h100-sxm-dgx parallelism=ep8-pp4-dp16 --gpus 64 "
               "--ep-sizes 1 2 4 8"),
    "plan": ("trainsim plan model=gpt-175b hardware=a100-80g-dgx parallelism=pp16-tp8-dp8 --gpus 1024 "
             "train.tokens=3e11",
             "trainsim plan model=llama3-70b hardware=h100-sxm-dgx parallelism=tp8-sp-pp8-dp4 --gpus 4096 "
             "train.tokens=15e12 --by cost --within-days 90"),
    "dvc-yaml": ("trainsim dvc-yaml > dvc.yaml", "trainsim dvc-yaml --check"),
    "import-layout": ("trainsim import-layout --gpus 64 --megatron '--tensor-model-parallel-size 4 "
                      "--pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 5 --sequence-parallel "
                      "--use-distributed-optimizer --bf16 --micro-batch-size 1 --global-batch-size 128' "
                      "-o conf/parallelism/mine.yaml",
                      "trainsim import-layout --torchtitan llama3_70b.toml --gpus 256 --overrides"),
    "import-model": ("trainsim import-model gpt-oss-120b/config.json",
                     "trainsim import-model ~/hf/Qwen3-235B-A22B/config.json --name qwen3-235b-a22b --seq-length 4096",
                     "trainsim import-model config.json -o -"),
}
"""Real command lines each verb's --help ends with (tests/cli/test_cli.py wants some for every verb)."""


def _add_examples(parser: argparse.ArgumentParser, name: str) -> None:
    """Append the examples of `name` to its --help, line by line (argparse would rewrap them)."""
    if name in EXAMPLES:
        parser.epilog = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="print the composed config and its artifact keys")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt-13b parallelism.tp=4")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("trace", help="trace a layout ex-situ and show memory per rank class")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--output", help="artifact directory (default: the registry path under artifacts/)")
    p.add_argument("--check-hardware", action="store_true",
                   help="also require the layout to fit the hardware's device count")
    p.set_defaults(func=_cmd_trace)
    p = sub.add_parser("run", help="run the reference training step for real (gloo, one process per rank)")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("profile-fit", help="fit the analytical kernel model to measured kernels, report held-out error")
    p.add_argument("overrides", nargs="*", help="selects the hardware, e.g. hardware=local-cpu")
    p.add_argument("--train-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_profile_fit)
    p = sub.add_parser("profile-import", help="import torch.profiler (Kineto) traces of a GPU run, or merge a "
                                              "profile database measured elsewhere")
    p.add_argument("inputs", nargs="+", metavar="source|override",
                   help="Kineto trace files (*.json, *.json.gz: kernels with their CPU ops, then the compute model "
                        "is refitted), or a kernels.parquet directory / Parquet file (merged as is); and Hydra "
                        "overrides selecting the hardware, e.g. hardware=a100-80g-dgx")
    p.add_argument("--hardware", help="hardware config the traces were recorded on (same as hardware=NAME)")
    p.add_argument("--all-hardware", action="store_true",
                   help="Parquet source: import rows of every hardware in it")
    p.add_argument("--allow-device-mismatch", action="store_true",
                   help="import a trace whose deviceProperties name another GPU than hardware.device_name")
    p.add_argument("--no-fit", action="store_true", help="do not refit the compute model after importing traces")
    p.add_argument("--train-fraction", type=float, default=0.5, help="refit: share of signatures fitted on")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_profile_import)
    p = sub.add_parser("compose", help="predict one step: compose its timeline (missing inputs built first)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt-175b parallelism=pp12-tp8-dp1")
    p.add_argument("--output", help="artifact directory (default: the registry path under artifacts/)")
    p.add_argument("--quick", action="store_true",
                   help="do not build a missing calibration or slowdown model (a minute or two each); the output "
                        "warns about what stood in")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_compose)
    p = sub.add_parser("search", help="search the parallel layouts of a model on a GPU budget")
    _add_search_arguments(p)
    p.add_argument("--top", type=int, default=5, help="fastest layouts shown and written to sweep.yaml")
    p.add_argument("--output", help="artifact directory (default artifacts/search/{hardware}/{model}/{gpus}gpu)")
    p.set_defaults(func=_cmd_search)
    p = sub.add_parser("plan", help="days and dollars to train a model on N GPUs: search, compose the chosen "
                                    "layout in full, one page")
    _add_search_arguments(p)
    p.add_argument("--by", choices=("time", "cost"), default="time",
                   help="choose the fastest layout that fits (default) or the cheapest per token")
    p.add_argument("--within-days", type=float, default=0.0, metavar="DAYS",
                   help="only layouts that train train.tokens within DAYS (with --by cost: how many GPUs, and "
                        "which layout, to finish in time at the least cost)")
    p.add_argument("--confidence", type=float, default=0.0, metavar="P",
                   help="with --within-days: only layouts that meet the deadline with chance P (e.g. 0.9), by the "
                        "error measured on runs no fit saw (default: the estimate alone meets it)")
    p.add_argument("--output", help="artifact directory (default artifacts/plans/{hardware}/{model}/{gpus}gpu)")
    p.set_defaults(func=_cmd_plan)
    p = sub.add_parser("import-layout", help="turn Megatron-LM launch arguments or a torchtitan TOML job into a "
                                             "conf/parallelism file (or Hydra overrides)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--megatron", metavar="ARGUMENTS",
                        help="Megatron-LM / Megatron-Bridge arguments as one quoted string")
    source.add_argument("--torchtitan", metavar="JOB.toml", help="a torchtitan TOML job config")
    p.add_argument("--gpus", type=int, help="world size (Megatron derives dp from it; torchtitan's "
                                            "data_parallel_shard_degree -1 too); default: a torchrun launcher's")
    p.add_argument("--nodes", type=int, help="world size as nodes x --gpus-per-node")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--name", default="",
                   help="the layout's name (default: the -o file's stem, else from its degrees, e.g. tp8-sp-pp4-dp2)")
    p.add_argument("--num-layers", type=int,
                   help="torchtitan: the model's layers, for pipeline_parallel_layers_per_stage")
    p.add_argument("-o", "--output", help="write the YAML (or overrides) to this file instead of stdout")
    p.add_argument("--overrides", action="store_true",
                   help="print Hydra overrides (parallelism.tp=8 ...) instead of YAML")
    p.add_argument("--allow-unknown", action="store_true",
                   help="import despite unknown arguments (listed on stderr and in the file)")
    p.set_defaults(func=_cmd_import_layout)
    p = sub.add_parser("import-model", help="write a conf/model YAML from a Hugging Face config.json (every key "
                                            "mapped, ignored with its reason, noted as an approximation or refused)")
    p.add_argument("config_json", help="the model's config.json")
    p.add_argument("--name", default="", help="model name (default: the config.json's folder name)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="training sequence length (config.json states the model's limit only; default "
                        "trainsim.config.hf_import.DEFAULT_SEQ_LENGTH)")
    p.add_argument("-o", "--output", help="YAML file to write (default conf/model/NAME.yaml; '-' = stdout)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(func=_cmd_import_model)
    p = sub.add_parser("dvc-yaml", help="print dvc.yaml generated from the stage registry")
    p.add_argument("--check", action="store_true", help="exit 1 if ./dvc.yaml differs")
    p.set_defaults(func=_cmd_dvc_yaml)
    for name, command in [("trainsim", parser), *sub.choices.items()]:
        _add_examples(command, name)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with positionals also after options (`--gpus 64 train.tokens=3e11`, `--hardware X a.json`),
    which argparse alone leaves over."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    positional = "inputs" if args.command == "profile-import" else "overrides"
    if extra and hasattr(args, positional) and not any(e.startswith("-") for e in extra):
        setattr(args, positional, getattr(args, positional) + extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    try:
        return args.func(args, console)
    except (ConfigError, TraceError, ArtifactError) as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
