"""The ``plan`` command: parse, call the library, render.

Pipeline position: the front door, on top of every layer. It imports only argparse at start-up (so
``plan --help`` is instant); the profiler (TensorFlow), the planner's search and
the reports are imported inside each command. One boundary, ``main``, maps the
typed errors of ``tfplan.core.errors`` to exit codes:

    0 success; 2 bad input (model, cluster, plan, arguments);
    3 no plan fits; 4 solver failure; 1 a bug in this tool (traceback shown).

Every command that prints a table also takes ``--json`` and then prints exactly
one JSON object on stdout and nothing else there.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Sequence

from tfplan.core.errors import PlannerError, SchemaError

PRECISION_CHOICES = ("float32", "mixed_float16", "mixed_bfloat16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plan",
        description="Profile a Keras model, plan how to split its training across devices, "
                    "and write a plan that `apply.wrap(model, plan)` trains with.")
    parser.add_argument("--version", action="version", version="%(prog)s 0.1.0")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    model_help = ("a .py file defining build_model() (optionally loss, optimizer, "
                  "sample_batch(batch_size)), or module:function such as "
                  "keras.applications:MobileNetV2")

    p = sub.add_parser("profile", help="per-layer params, bytes and FLOPs of a model",
                       description="Per-layer parameters, bytes and FLOPs (forward and backward) "
                                   "of a Keras model, built without allocating its weights.")
    p.add_argument("model", metavar="MODEL", help=model_help)
    p.add_argument("--batch-size", type=_positive_int, default=1,
                   help="samples the activation bytes and FLOPs are counted for (default 1)")
    _add_model_options(p)
    p.add_argument("--measure", action="store_true",
                   help="also run real training steps here, captured with the TensorFlow "
                        "profiler and read back with XProf: measured time per layer, step "
                        "time and peak memory (needs sample_batch in the model file)")
    p.add_argument("--steps", type=_positive_int, default=5,
                   help="profiled training steps with --measure (default 5)")
    p.add_argument("--logdir", default=os.path.join("out", "profile"), metavar="DIR",
                   help="where --measure writes its capture (TensorBoard's Profile tab "
                        "opens it; default out/profile)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_profile)

    a = sub.add_parser("analyze", help="profile, plan for a cluster, write plan.json",
                       description="Profile the model, rank the strategies for the cluster by "
                                   "predicted step time, write DIR/plan.json and a TensorBoard "
                                   "run under DIR/tensorboard.")
    a.add_argument("model", metavar="MODEL", help=model_help)
    a.add_argument("--cluster", required=True,
                   help="cpu:N (N logical CPU devices here), WORKERSxcpu:N such as 2xcpu:1 "
                        "(for plan launch), a preset such as 8xA100-80GB, "
                        "NODESxPRESET such as 64x8xA100-80GB, or a .yaml/.json cluster file "
                        "(`plan clusters` lists the presets)")
    a.add_argument("--global-batch", type=_global_batch, required=True,
                   help="samples per training step, over all devices")
    _add_model_options(a)
    a.add_argument("--fix", metavar="dp=D,tp=T,pp=P,cp=C,ep=E",
                   help="evaluate this one strategy instead of searching (reported even if it "
                        "does not fit; tp may span nodes); unnamed degrees are 1; ep (expert "
                        "parallelism, models with mixture-of-experts layers) must divide dp "
                        "and every such layer's experts, and alone restricts the search to it")
    a.add_argument("--microbatch-size", type=_positive_int, metavar="M",
                   help="what-if: samples per micro-batch (default: searched)")
    a.add_argument("--recompute", choices=("none", "selective", "full"),
                   help="what-if: activation recomputation (default: searched)")
    a.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"),
                   help="what-if: pipeline schedule (default: searched)")
    a.add_argument("--virtual-stages", type=_positive_int, metavar="V",
                   help="what-if: model chunks per pipeline device under --schedule "
                        "interleaved (default: searched, 2 or 4)")
    a.add_argument("--layout", choices=("tp-dp-pp", "tp-pp-dp"),
                   help="what-if: device order of a dp x pp hybrid, innermost first: "
                        "tp-dp-pp (Megatron-LM's: pipeline stages across nodes) or tp-pp-dp "
                        "(dp outermost, 'dp-outer': each replica's stages inside one node, "
                        "the all-reduce across nodes) (default: searched)")
    a.add_argument("--batch-norm", choices=("global", "local"), default="global",
                   help="BatchNormalization statistics: global (default: over every replica "
                        "and micro-batch of the step, equal to one device; costs small "
                        "all-reduces, and a barrier in pipelines) or local (per replica and "
                        "micro-batch, as GPipe: free, differs from one device)")
    a.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), metavar="N",
                   help="what-if: ZeRO stage over the data-parallel ranks: 0 none, 1 optimizer "
                        "state sharded, 2 gradients too, 3 weights too (FSDP) (default: "
                        "searched)")
    a.add_argument("--optimizer-sharding", action="store_true", default=None,
                   help="what-if: shard optimizer state over the data-parallel group (ZeRO-1; "
                        "the same as --zero-stage 1)")
    a.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="what-if: split the layers tensor parallelism replicates (norms, "
                        "dropout, residual adds) along the sequence (needs tp > 1; default: "
                        "searched)")
    a.add_argument("--offload", choices=("none", "optimizer", "optimizer+weights"),
                   help="what-if: keep the optimizer state (and the weights) in host memory "
                        "(default: searched where nothing else fits)")
    a.add_argument("--measured", metavar="FILE",
                   help="price each layer from its measured time on one device (the output "
                        "of `plan profile MODEL --measure --json`, same model) instead of "
                        "its FLOPs and bytes: calibrates the plan to this hardware")
    a.add_argument("--time-limit", type=float, default=10.0, metavar="SECONDS",
                   help="time limit for each ILP solve (default 10)")
    a.add_argument("--out", default="out", metavar="DIR",
                   help="where plan.json, profile.json, candidates.json, manifest.json and the "
                        "TensorBoard run go, replaced all at once (default out)")
    a.add_argument("--wide", action="store_true",
                   help="every column of the candidate table (dp, tp, pp, micro-batches, the "
                        "step time's parts, capacity, samples/s); default: the few that fit "
                        "80 columns")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=cmd_analyze)

    h = sub.add_parser("profile-hardware", help="measure this host's devices; write a cluster",
                       description="Measure achieved matmul FLOP/s per precision, memory "
                                   "bandwidth, point-to-point and all-reduce time (TensorFlow's "
                                   "own collectives, fitted to latency + bytes/bandwidth) on "
                                   "this host's devices, and turn them into a cluster file "
                                   "`plan analyze --cluster FILE` can use instead of a preset.")
    h.add_argument("--devices", metavar="LIST",
                   help="cpu:N (N logical CPU devices) or a comma-separated list such as "
                        "GPU:0,GPU:1 (default: every GPU, else every logical CPU)")
    h.add_argument("--quick", action="store_true",
                   help="small sizes, a few seconds (less accurate)")
    h.add_argument("--out", metavar="FILE",
                   help="write the measured cluster here (JSON, for --cluster FILE)")
    h.add_argument("--json", action="store_true", help="print one JSON object")
    h.set_defaults(func=cmd_profile_hardware)

    c = sub.add_parser("clusters", help="list the cluster presets",
                       description="List the named cluster presets and their datasheet figures.")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_clusters)
    _add_launch_parser(sub)
    _add_report_parser(sub)
    _add_audit_parser(sub)
    return parser


def _add_report_parser(sub: Any) -> None:
    r = sub.add_parser("report", help="show what `plan analyze --out DIR` found; export HTML",
                       description="Print the chosen plan, the ranked candidates and the "
                                   "per-layer profile that `plan analyze --out DIR` wrote; "
                                   "--html FILE also writes them, with the pictures of the "
                                   "plan, as one self-contained HTML page.")
    r.add_argument("dir", metavar="DIR", help="an analysis directory (plan analyze --out)")
    r.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    r.add_argument("--wide", action="store_true",
                   help="every column of the candidate table (default: the few that fit "
                        "80 columns)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace, ui: "UI") -> int:
    from tfplan.reports.report import (TRAFFIC_HEADER, html_report, load_analysis,
                                       summary_lines, traffic_rows)
    from tfplan.reports.tables import PROFILE_HEADER, profile_rows

    html_path = None
    if args.html:  # before reading anything: an unwritable --html fails first
        from tfplan.core.atomic import check_writable_file
        html_path = check_writable_file(args.html, "--html")
    a = load_analysis(args.dir)
    if html_path:
        from tfplan.core.atomic import write_text
        write_text(html_path, html_report(a))
    if args.json:
        ui.print_json({"plan": _with_mfu(a.chosen),
                       "candidates": [_with_mfu(c) for c in a.candidates],
                       "summary": summary_lines(a), "html": html_path, "run_id": a.run_id})
        return 0
    for line in summary_lines(a):
        ui.note(line)
    candidate_tables(ui, "Candidates", a.candidates, a.chosen, wide=args.wide)
    traffic = traffic_rows(a.chosen)
    if traffic:
        ui.table("Bytes each device sends per step, by kind (priced by planner.traffic; "
                 "`plan audit` measures them)", TRAFFIC_HEADER, traffic)
    ui.table(f"{a.profile.model_name}: per-layer profile at batch size {a.profile.batch_size}",
             PROFILE_HEADER, profile_rows(a.profile))
    if html_path:
        ui.note(f"Wrote {html_path}")
    return 0


def _add_audit_parser(sub: Any) -> None:
    au = sub.add_parser(
        "audit", help="measure what each device sends in one step of a plan, vs priced",
        description="Wrap MODEL's builder with PLAN (apply.wrap), run one training step on "
                    "the model file's sample_batch(global batch) on this host's devices "
                    "(logical CPUs stand in for a plan's CPU devices), and print the bytes "
                    "each device sent by kind (apply.audit: copies at their size, "
                    "collectives at their ring volume) beside the plan's priced bytes "
                    "(planner.traffic). Exit 1 when a device is outside --tolerance or the "
                    "busiest sends more than 1.25x the mean.")
    au.add_argument("model", metavar="MODEL", help="a .py file defining build_model(), loss, "
                    "optimizer and sample_batch(batch_size)")
    au.add_argument("--plan", required=True, metavar="PLAN_JSON",
                    help="the plan (plan analyze --out DIR writes DIR/plan.json)")
    au.add_argument("--tolerance", type=float, default=0.10,
                    help="relative difference allowed per device (default 0.10)")
    au.add_argument("--json", action="store_true", help="print one JSON object")
    au.set_defaults(func=cmd_audit)


def cmd_audit(args: argparse.Namespace, ui: "UI") -> int:
    from tfplan.planner.plan import load_plan
    from tfplan.profiler.loader import ModelLoadError, load_model_source

    plan = load_plan(args.plan)
    source = load_model_source(args.model)
    if source.sample_batch is None or source.loss is None:
        raise ModelLoadError(f"plan audit runs a training step of {args.model}, which needs "
                             "loss and sample_batch(batch_size) in the model file; add them "
                             "(examples/mlp.py shows both).")
    with ui.status(f"Wrapping {source.name} with plan {plan.name!r} and auditing one step"):
        doc = _audit(source, plan, args.tolerance)
    if args.json:
        ui.print_json(doc)
        return 0 if doc["within_tolerance"] else 1
    rows = [(d, f"{r['measured_bytes']:,}", f"{r['priced_bytes']:,}", f"{r['ratio']:.3f}",
             " ".join(f"{k} {v:,}" for k, v in r["measured"].items()) or "-")
            for d, r in doc["devices"].items()]
    ui.table(f"Plan {plan.name!r} on {doc['engine']}: bytes sent per device in one step "
             "(input feeding left out)", ("device", "measured", "priced", "ratio", "by kind"),
             rows, left_columns=1)
    verdict = "within" if doc["within_tolerance"] else "OUTSIDE"
    ui.note(f"busiest / mean {doc['busiest_over_mean']:.2f}; {verdict} the bar "
            f"(every device within {args.tolerance:.0%} of priced, busiest <= 1.25x mean)"
            + (f"; {len(doc['unsized'])} copies of unknown size not counted"
               if doc["unsized"] else ""))
    return 0 if doc["within_tolerance"] else 1


def _audit(source: Any, plan: Any, tolerance: float) -> dict:
    from tfplan import apply
    from tfplan.apply.audit import audit_step, compare
    from tfplan.planner.traffic import plan_sent_bytes
    from tfplan.profiler import profile_model

    wrapped = apply.wrap(source.build_model, plan)
    optimizer = source.optimizer or "adam"
    if not isinstance(optimizer, str):
        optimizer = type(optimizer).from_config(optimizer.get_config())  # a fresh one
    wrapped.compile(optimizer=optimizer, loss=source.loss)
    x, y = source.sample_batch(plan.global_batch)[:2]
    audit = audit_step(wrapped, x, y, plan=wrapped.plan)
    priced = plan_sent_bytes(profile_model(source.build_model(), batch_size=plan.global_batch),
                             wrapped.plan)
    doc = compare(audit, priced, wrapped.plan.devices, tolerance)
    return {"plan": plan.name, "engine": type(wrapped).__name__, **doc}


def _add_launch_parser(sub: Any) -> None:
    lp = sub.add_parser(
        "launch", help="run a training script on N local worker processes (multi-worker)",
        description="Start N local worker processes of SCRIPT ARGS... on 127.0.0.1, each "
                    "with its TF_CONFIG (and PLAN_FILE with --plan); their output is "
                    "prefixed [worker i]; the first worker to fail stops the others (with "
                    "--restarts N, a worker killed by a signal restarts the whole job, "
                    "which resumes from its BackupAndRestore backup). A "
                    "--plan must be made for N workers (its devices /job:worker/task:0.."
                    "N-1, e.g. --cluster Nxcpu:K); with N > 1 a one-host plan is refused. With "
                    "--emit, print the TF_CONFIG of each host (tf-config) or a Kubeflow "
                    "TFJob manifest (tfjob) instead of starting anything. Options after "
                    "SCRIPT belong to the script.",
        epilog="example: plan analyze examples/mlp.py --cluster 2xcpu:1 --fix dp=2 "
               "--global-batch 32 && plan launch --workers 2 examples/train.py --plan "
               "out/plan.json")
    lp.add_argument("--workers", type=_worker_count, required=True, metavar="N",
                    help="number of worker processes (the plan's workers)")
    lp.add_argument("--plan", metavar="PLAN",
                    help="plan.json; each worker gets PLAN_FILE=<its absolute path>")
    lp.add_argument("--restarts", type=_restart_count, default=0, metavar="N",
                    help="start the whole job again when a worker is killed by a signal "
                         "(not when it exits with an error), at most N times; the script's "
                         "keras.callbacks.BackupAndRestore resumes from its last backup "
                         "(default 0)")
    lp.add_argument("--emit", choices=("tf-config", "tfjob"),
                    help="print the per-host TF_CONFIG JSON or a TFJob YAML; start nothing")
    lp.add_argument("--hosts", metavar="H1,H2",
                    help="--emit tf-config: one host (or host:port) per worker "
                         "(default 127.0.0.1 with ports PORT, PORT+1, ...)")
    lp.add_argument("--port", type=_port, default=12345,
                    help="--emit tf-config: port for hosts given without one (default 12345)")
    lp.add_argument("--image", default=None,
                    help="--emit tfjob: container image (default tensorflow/tensorflow:2.21.0)")
    lp.add_argument("--name", default="plan-train", help="--emit tfjob: job name")
    lp.add_argument("script", nargs="?", metavar="SCRIPT",
                    help="the training script every worker runs (.py or an executable)")
    lp.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                    help="arguments for SCRIPT")
    lp.set_defaults(func=cmd_launch)


def cmd_launch(args: argparse.Namespace, ui: "UI") -> int:
    from tfplan.planner import launch

    launch.check_workers(args.workers)
    if args.emit == "tf-config":
        hosts = args.hosts.split(",") if args.hosts else None
        ui.print_json(launch.tf_configs(args.workers, hosts, args.port))
        return 0
    if args.emit == "tfjob":
        import yaml

        command = (["python", args.script, *args.script_args] if args.script
                   else ["python", "train.py"])
        manifest = launch.tfjob_manifest(args.workers, command, name=args.name,
                                         image=args.image or launch.DEFAULT_IMAGE,
                                         plan=args.plan)
        sys.stdout.write(yaml.safe_dump(manifest, sort_keys=False))
        return 0
    return launch.launch_local(args.script, args.script_args, args.workers, plan=args.plan,
                               restarts=args.restarts)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=PRECISION_CHOICES,
                   help="dtype policy to count bytes for (default: the model's own)")
    p.add_argument("--optimizer", metavar="NAME",
                   help="optimizer whose state to count, e.g. adam, sgd (default: the model "
                        "file's optimizer, else adam)")
    p.add_argument("--input-shape", action="append", dest="input_shape",
                   metavar="NAME=D1[,D2,...]",
                   help="the dimensions after the batch one of model input NAME, for inputs "
                        "with dynamic (None) dimensions such as a sequence length, e.g. "
                        "--input-shape token_ids=512 (repeat it per input; '*=D1,...' sets "
                        "every input still dynamic with that many dimensions; default: the "
                        "model file's sample_batch)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}")
    return value


MAX_WORKERS = 1024  # --emit tf-config prints every worker's address list: n**2 lines


def _worker_count(text: str) -> int:
    """An integer at most MAX_WORKERS (below 1: ``launch.check_workers`` says so)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of workers, received {text!r}")
    if value > MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_WORKERS} workers, received "
                                         f"{text!r}")
    return value


def _restart_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of restarts, received "
                                         f"{text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more restarts, received {text!r}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in 1..65535, received {text!r}")
    return value


MAX_GLOBAL_BATCH = 10**13  # far beyond any training run; the search's divisor scans stay fast


def _global_batch(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_GLOBAL_BATCH:
        raise argparse.ArgumentTypeError(
            f"a global batch of {value:.3g} samples is beyond what this planner prices "
            f"(at most {MAX_GLOBAL_BATCH:.0e}); the largest training runs use about 1e7 "
            "samples (tokens) per step")
    return value


MAX_INPUT_DIM = 2**31 - 1  # TensorFlow's int32 shape arithmetic on several kernels


def parse_input_shapes(values: Sequence[str] | None) -> dict[str, tuple[int, ...]] | None:
    """['token_ids=16', '*=8,4'] -> {'token_ids': (16,), '*': (8, 4)} (--input-shape).

    PlannerError for a value that is not NAME=D1[,D2,...] with whole numbers >= 1, or a
    NAME given twice; whether NAME is one of the model's inputs and the dimensions fit it
    is checked when the model is loaded (``profiler.input_shapes``)."""
    if not values:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for value in values:
        name, sep, dims_text = value.partition("=")
        name = name.strip()
        parts = [d.strip() for d in dims_text.split(",")]
        if not sep or not name or not all(re.fullmatch(r"[+-]?[0-9]+", d) for d in parts):
            raise PlannerError(
                f"--input-shape {value!r}: expected NAME=D1[,D2,...], a model input's name "
                "and its dimensions after the batch one as whole numbers, e.g. --input-shape "
                "token_ids=512 or --input-shape image=224,224,3 ('*=512' for every dynamic "
                "input of that rank).")
        dims = tuple(int(d) for d in parts)
        if any(d < 1 for d in dims):
            raise PlannerError(
                f"--input-shape {value!r} has a dimension below 1; every dimension must be a "
                f"whole number >= 1, e.g. --input-shape {name}="
                + ",".join(str(max(d, 1)) for d in dims) + ".")
        if any(d > MAX_INPUT_DIM for d in dims):
            raise PlannerError(
                f"--input-shape {value!r} has a dimension above {MAX_INPUT_DIM:,}, beyond "
                "what one tensor dimension holds here; give the size you train with.")
        if name in shapes:
            raise PlannerError(
                f"--input-shape gives {name!r} twice ({name}="
                + ",".join(map(str, shapes[name])) + f" and {value.strip()}); give each input "
                "at most once.")
        shapes[name] = dims
    return shapes


def parse_fix(text: str | None) -> dict[str, int] | None:
    """'dp=2,pp=2' -> {'dp': 2, 'pp': 2}."""
    if text is None:
        return None
    fixed: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("dp", "tp", "pp", "cp", "ep") or not value.isdigit() \
                or int(value) < 1:
            raise PlannerError(
                f"--fix {text!r}: each part must be dp=N, tp=N, pp=N, cp=N or ep=N with N >= 1 "
                f"(received {part.strip()!r}); e.g. --fix dp=2,pp=2.")
        if key in fixed:
            raise PlannerError(
                f"--fix {text!r} gives {key} twice ({key}={fixed[key]} and {key}={value}); "
                f"give each of dp, tp, pp, cp, ep at most once, e.g. --fix {key}={value}.")
        fixed[key] = int(value)
    return fixed


# --- commands -------------------------------------------------------------------

def _quiet_tensorflow() -> None:
    from tfplan.profiler.tf_runtime import import_tensorflow
    import_tensorflow()


def _profile(args: argparse.Namespace, batch_size: int, status, progress):
    _quiet_tensorflow()
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source

    with status(f"Loading {args.model}"):
        source = load_model_source(args.model)
    with progress(f"Profiling {source.name} (batch {batch_size})") as report:
        return profile_source(source, batch_size=batch_size, precision=args.precision,
                              optimizer=args.optimizer, progress=report,
                              input_shapes=getattr(args, "input_shapes", None))


def cmd_profile(args: argparse.Namespace, ui: "UI") -> int:
    if args.measure:
        from tfplan.core.atomic import check_writable_dir
        check_writable_dir(args.logdir, "--logdir")  # before the slow profile
        # TensorFlow's default CPU allocator keeps no memory counter; its BFC allocator
        # does, and must be chosen before the runtime starts (profiler.peak_memory).
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    _check_optimizer_arg(args)
    args.input_shapes = parse_input_shapes(args.input_shape)
    profile = _profile(args, args.batch_size, ui.status, ui.progress)
    measured = _measure(args, ui, profile.input_shapes) if args.measure else None
    if args.json:
        from tfplan.profiler.comm import profile_comm

        doc = profile.to_dict()
        for layer_doc, comm in zip(doc["layers"], profile_comm(profile)):
            layer_doc["comm"] = comm.to_dict()
        if measured is not None:
            doc["measured"] = measured.to_dict()
        ui.print_json(doc)
        return 0
    from tfplan.reports.tables import PROFILE_HEADER, profile_rows
    ui.table(f"{profile.model_name}: per-layer profile at batch size {profile.batch_size} "
             f"({profile.precision}, optimizer {profile.optimizer})",
             PROFILE_HEADER, profile_rows(profile))
    moe = _moe_rows(profile)
    if moe:
        ui.table("mixtures of experts (profiler.moe): forward FLOPs as routed (T tokens x "
                 "top-k choices) and as the layer is written", MOE_HEADER, moe,
                 left_columns=1)
    for w in profile.warnings:
        ui.note(f"warning: {w}")
    if profile.not_counted:
        ui.note("* not counted (no FLOP formula): " + "; ".join(profile.not_counted))
    for name, why in profile.opaque_blocks:
        ui.note(f"not seen into (kept whole, replicated under tensor parallelism): {name}: {why}")
    if measured is not None:
        from tfplan.reports.tables import MEASURED_HEADER, measured_rows, measured_summary
        ui.table(f"{measured.model_name}: measured on {measured.device}, batch size "
                 f"{measured.batch_size}, mean of {measured.steps} profiled steps",
                 MEASURED_HEADER, measured_rows(measured), left_columns=1)
        for line in measured_summary(measured):
            ui.note(line)
    return 0


MOE_HEADER = ("layer", "experts", "top-k", "capacity", "tokens", "expert params",
              "routed fwd FLOPs", "as written", "all-to-all bytes")


def _moe_rows(profile) -> list[tuple[str, ...]]:
    """One row per mixture-of-experts entry of ``profile`` (``LayerProfile.is_moe``):
    experts, top-k, capacity factor ("-": none), tokens routed, the stacked expert
    parameters, the routed experts' forward FLOPs, what the layer as written runs in its
    experts ("=": the routed work), and the bytes one all-to-all direction carries."""
    from tfplan.core.units import fmt_bytes, fmt_count

    return [(l.name, str(l.moe_experts), str(l.moe_top_k),
             f"{l.moe_capacity_factor:g}" if l.moe_capacity_factor else "-",
             f"{l.moe_tokens:,}", f"{l.moe_expert_params:,}",
             fmt_count(l.moe_expert_flops_fwd),
             fmt_count(l.moe_executed_flops_fwd) if l.moe_executed_flops_fwd else "=",
             fmt_bytes(l.moe_dispatch_bytes))
            for l in profile.layers if l.is_moe]


def _measure(args: argparse.Namespace, ui: "UI", input_shapes: Sequence[Any] = ()):
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.measure import measure_source

    source = load_model_source(args.model)
    if args.input_shapes and source.sample_batch is not None:  # measured on sample_batch
        from tfplan.profiler.input_shapes import check_sample_batch
        try:
            batch = source.sample_batch(args.batch_size)
        except Exception:  # noqa: BLE001  (measure_source reports the user's error)
            batch = None
        if batch is not None:
            check_sample_batch(input_shapes, batch,
                               "--measure trains on the model file's sample_batch")
    with ui.status(f"Measuring {args.steps} training steps of {source.name}"):
        return measure_source(source, args.batch_size, logdir=os.path.abspath(args.logdir),
                              steps=args.steps, optimizer=args.optimizer)


def _read_measured(path: str):
    """A MeasuredProfile from ``plan profile --measure --json`` output (or a bare one)."""
    from tfplan.core.errors import SchemaError
    from tfplan.profiler.measured_profile import MeasuredProfile
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise PlannerError(f"--measured {path!r}: cannot read it ({e.strerror}). Make it with "
                           "plan profile MODEL --measure --json > measured.json.") from e
    except json.JSONDecodeError as e:
        raise PlannerError(f"--measured {path!r} is not JSON ({e}). Make it with "
                           "plan profile MODEL --measure --json > measured.json.") from e
    if isinstance(doc, dict) and "measured" in doc:
        doc = doc["measured"]
    if not isinstance(doc, dict) or "layers" not in doc or "step_time_s" not in doc:
        raise SchemaError(f"--measured {path!r} holds no measurement (no 'measured' object "
                          "with layer times). Make it with plan profile MODEL --measure "
                          "--json > measured.json.")
    from tfplan.core.schema import decode
    return decode(MeasuredProfile.from_dict, doc, f"--measured {path!r}")


def cmd_analyze(args: argparse.Namespace, ui: "UI") -> int:
    from tfplan.core.presets import parse_cluster
    from tfplan.planner.search import search

    fix = parse_fix(args.fix)
    knobs = {"microbatch_size": args.microbatch_size, "recompute": args.recompute,
             "schedule": args.schedule, "optimizer_sharding": args.optimizer_sharding,
             "zero_stage": args.zero_stage, "sequence_parallel": args.sequence_parallel,
             "offload": args.offload,
             "virtual_stages": args.virtual_stages, "layout": args.layout}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if knobs:  # with --fix: evaluate that strategy; without: search under these settings
        fix = {**(fix or {}), **knobs}
    args.input_shapes = parse_input_shapes(args.input_shape)  # before the slow profile, too
    cluster = parse_cluster(args.cluster)  # before the slow profile: fail fast on a typo
    _check_before_profiling(args, fix, cluster)
    from tfplan.core.atomic import check_writable_dir
    out_dir = check_writable_dir(args.out, "--out")  # before the slow profile, too
    measured = _read_measured(args.measured) if args.measured else None
    profile = _profile(args, 1, ui.status, ui.progress)
    if measured is not None:
        from tfplan.profiler.calibrate import with_measured_times
        profile = with_measured_times(profile, measured)
    with ui.status(f"Planning for {cluster.name} ({cluster.num_devices} devices)"):
        result = search(profile, cluster, args.global_batch, fix=fix,
                        time_limit_s=args.time_limit, batch_norm=args.batch_norm)

    _quiet_tensorflow()
    from tfplan.reports.analysis_dir import write_analysis_dir

    with ui.status("Writing the analysis and its TensorBoard run"):
        # all files replaced at once: the previous set or the new one, never a mix
        written = write_analysis_dir(out_dir, profile, result.chosen, result.candidates,
                                     trace_files=measured.trace_files if measured else (),
                                     model_source=args.model)
    plan_path, logdir = written.plan_path, written.logdir

    warnings = [*profile.warnings, *input_warnings(result.chosen, args.global_batch),
                *split_warnings(result.chosen, profile)]
    from tfplan.planner.batch_stats import describe
    batch_statistics = describe(result.chosen, profile)
    if args.json:
        ui.print_json({"plan": _with_mfu(result.chosen),
                       "candidates": [_with_mfu(c) for c in result.candidates],
                       "profile": {"model_name": profile.model_name,
                                   "fingerprint": profile.fingerprint,
                                   "totals": profile.totals()},
                       "warnings": warnings, "not_counted": list(profile.not_counted),
                       "opaque_blocks": [{"layer": n, "why": why}
                                         for n, why in profile.opaque_blocks],
                       "batch_statistics": batch_statistics,
                       "apply_refuses": apply_gaps(result.chosen),
                       "files": {"plan": plan_path, "tensorboard": logdir},
                       "run_id": written.run_id})
        return 0
    from tfplan.reports.tables import fmt_bytes, fmt_count
    t = profile.totals()
    ui.note(f"Model {profile.model_name}: {t['params']:,} params ({fmt_bytes(t['param_bytes'])}), "
            f"{fmt_count(t['flops_fwd'])}FLOP forward + {fmt_count(t['flops_bwd'])}FLOP "
            f"backward per sample, optimizer {profile.optimizer}.")
    if profile.input_shapes:
        ui.note("Planned for inputs " + ", ".join(
            f"{name} (batch, {', '.join(str(d) for d in dims)})"
            for name, dims in profile.input_shapes) + ": apply refuses batches of other shapes "
            "where the model leaves a dimension open.")
    candidate_tables(ui, f"Strategies for {cluster.name}, global batch {args.global_batch}",
                     result.candidates, result.chosen, wide=args.wide)
    ui.note(f"Chosen: {result.chosen.name}. {result.chosen.reason}")
    layout = _layout_note(result.chosen)
    if layout:
        ui.note(layout)
    if batch_statistics is not None:
        ui.note(batch_statistics["text"][0].upper() + batch_statistics["text"][1:] + ".")
    for line in warning_lines(warnings, profile.not_counted, profile.opaque_blocks):
        ui.note(line)
    gaps = apply_gaps(result.chosen)
    if gaps:
        ui.note("apply cannot train this plan yet: " + "; ".join(gaps) + ". It is priced "
                "for comparison; apply.auto plans only what apply runs, or re-plan with "
                "--fix and the dimensions apply runs.")
    ui.note(f"Wrote {plan_path}")
    for line in next_steps(result.chosen, args.model, plan_path, logdir, out_dir):
        # a command stays on one line (the terminal wraps it), so that it can be copied
        ui.note(line, wrap=not line.startswith("    "))
    return 0


def _with_mfu(plan: Any) -> dict[str, Any]:
    """``plan.to_dict()`` plus ``peak_tflops_per_device`` (the device's peak at the plan's
    precision) and ``mfu`` (model FLOPs utilisation: model_tflops_per_device over it)."""
    from tfplan.reports.tables import mfu, peak_flops_per_s
    return {**plan.to_dict(), "peak_tflops_per_device": peak_flops_per_s(plan) / 1e12,
            "mfu": mfu(plan)}


# Terminal labels of the candidate columns, on two lines where the header is the widest cell
_HEADER_LABELS = {"step time": "step\ntime", "TFLOP/s/dev": "TFLOP/s\n/device",
                  "peak mem / device": "peak mem\n/ device", "micro-batches": "micro-\nbatches"}


def candidate_tables(ui: "UI", title: str, candidates: Sequence[Any], chosen: Any,
                     wide: bool = False) -> None:
    """The ranked candidates: the ones that fit by predicted step time (the chosen one
    marked '*' wherever it ranks), then the ones that do not fit, in a table of their own.
    Default columns fit 80 columns; ``wide``: all of them. Numbers are never cut."""
    from tfplan.reports.tables import (CANDIDATE_HEADER, SHORT_HEADER, TEXT_COLUMNS,
                                       candidate_rows, ranked_candidates)
    header = CANDIDATE_HEADER if wide else SHORT_HEADER
    labels = [_HEADER_LABELS.get(h, h) for h in header]
    fitting, not_fitting = ranked_candidates(candidates)
    if fitting:
        ui.table(f"{title}: the {len(fitting)} that fit, ranked by predicted step time "
                 "(* = chosen)", labels, candidate_rows(fitting, chosen, header),
                 text_columns=[header.index(c) for c in TEXT_COLUMNS])
    if not_fitting:
        ui.table(f"{title}: {len(not_fitting)} that do NOT fit in memory, by predicted step "
                 "time" + (" (* = the requested one)" if not chosen.predicted.fits else ""),
                 labels, candidate_rows(not_fitting, chosen, header,
                                        first_rank=len(fitting) + 1),
                 text_columns=[header.index(c) for c in TEXT_COLUMNS])


def apply_gaps(plan: Any) -> list[str]:
    """What in ``plan`` ``apply.wrap`` would refuse (``apply.dimensions.unapplied``), as
    sentences; empty when it trains it."""
    from tfplan.apply.dimensions import unapplied
    from tfplan.apply.mode import execution_mode
    from tfplan.core.errors import PlannerError
    try:
        mode = execution_mode(plan)
    except PlannerError as e:
        return [str(e)]
    return unapplied(plan, mode)


def next_steps(plan: Any, model: str, plan_path: str, logdir: str, out_dir: str) -> list[str]:
    """The lines that end ``plan analyze``'s text: how to train with the plan, how to
    open the report."""
    from tfplan.planner.launch import plan_workers
    model_arg = model if model.endswith(".py") else "MODEL.py"
    train = f"examples/train.py --model {model_arg} --plan {plan_path}"
    workers = plan_workers(plan)
    lines = ["Next steps:",
             "  Train with the plan: in your script (from tfplan import apply),",
             f"    model = apply.wrap(model, \"{plan_path}\")"]
    if len(workers) > 1:
        lines += [f"  in each of its {len(workers)} worker processes; the example trainer "
                  "on all of them:",
                  f"    plan launch --workers {len(workers)} {train}"]
    else:
        lines += ["  or with the example trainer:", f"    python {train}"]
    lines += ["  See the analysis: the Parallel plan dashboard in TensorBoard,",
              f"    tensorboard --logdir {logdir}",
              "  or as one HTML page:",
              f"    plan report {out_dir} --html {os.path.join(out_dir, 'report.html')}"]
    return lines


# Beyond these, an input is almost surely a typo (a few extra zeros): said, not refused.
MAX_STEP_TIME_S = 86400.0  # one step longer than a day
MAX_SANE_MICROBATCHES = 4096  # Megatron-LM's largest runs use a few hundred per step


def input_warnings(plan: Any, global_batch: int) -> list[str]:
    """What is absurd about the request, judged by the chosen plan's prediction."""
    from tfplan.reports.tables import fmt_seconds
    out = []
    step_s, m = plan.predicted.step_time_s, plan.strategy.num_microbatches
    if step_s > MAX_STEP_TIME_S:
        out.append(f"one step of global batch {global_batch:,} is predicted to take "
                   f"{step_s / 86400:,.1f} days on these devices ({fmt_seconds(step_s)}): "
                   "check --global-batch (samples per step, over all devices) and --cluster")
    if m > MAX_SANE_MICROBATCHES:
        out.append(f"the chosen plan runs {m:,} micro-batches of {plan.strategy.microbatch_size:,} "
                   f"per step (more than {MAX_SANE_MICROBATCHES:,}): check --global-batch, or "
                   "fix a larger --microbatch-size")
    return out


def split_warnings(plan: Any, profile: Any) -> list[str]:
    """What the chosen plan's tensor parallelism does not split."""
    from tfplan.profiler.comm import layer_comm

    s = plan.strategy
    if s.tp == 1 or plan.tp_splits:
        return []
    if any(layer_comm(l, 0).tp_splits for l in profile.layers):
        why = ("splitting any layer is predicted to cost more in all-reduces than it saves "
               "at this size")
    else:
        why = ("no layer of this model has a tensor-parallel split (Dense, EinsumDense, Conv, "
               "attention, Embedding, also inside blocks)")
    return [f"tp={s.tp} splits no layer: {why}, so each of the {s.tp} devices of a group "
            "computes the whole model (priced so)"]


def warning_lines(warnings: Sequence[str], not_counted: Sequence[str],
                  opaque: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The text block under ``plan analyze``'s table: the warnings, then the ops whose
    FLOPs are missing from the profile (and so from every predicted time), then the layers
    the planner cannot see into (kept whole)."""
    lines = []
    if warnings:
        lines.append("Warnings:")
        lines += [f"  - {w}" for w in warnings]
    if not_counted:
        lines.append("Not counted (no FLOP formula; predicted times leave them out):")
        lines += [f"  - {n}" for n in not_counted]
    if opaque:
        lines.append("Not seen into (kept whole, replicated under tensor parallelism):")
        lines += [f"  - {name}: {why}" for name, why in opaque]
    return lines


def _check_before_profiling(args: argparse.Namespace, fix: dict[str, Any] | None,
                            cluster: Any) -> None:
    """The checks of ``plan analyze``'s arguments that need no profile: they fail in
    a second instead of after minutes of profiling."""
    from tfplan.core.errors import InfeasiblePlanError
    from tfplan.planner.search import check_microbatch_size

    _check_optimizer_arg(args)
    fix = fix or {}
    b = args.global_batch
    dp, tp, pp, cp = fix.get("dp", 1), fix.get("tp", 1), fix.get("pp", 1), fix.get("cp", 1)
    if dp * cp * tp * pp > cluster.num_devices:
        raise InfeasiblePlanError(f"--fix asks for dp*cp*tp*pp = {dp * cp * tp * pp} devices; "
                                  f"cluster {cluster.name!r} has {cluster.num_devices}. Use a "
                                  "bigger cluster or smaller degrees.")
    if fix.get("zero_stage") is not None and fix.get("optimizer_sharding") is not None and \
            (fix["zero_stage"] >= 1) != fix["optimizer_sharding"]:
        raise PlannerError(f"--optimizer-sharding is ZeRO stage 1, but --zero-stage "
                           f"{fix['zero_stage']} was given too; give one of them.")
    if b % dp:
        raise PlannerError(f"--fix dp={dp} does not divide the global batch {b}; choose a dp "
                           "that divides it (or change --global-batch).")
    if "dp" in fix and dp % fix.get("ep", 1):
        raise PlannerError(f"--fix ep={fix['ep']} does not divide dp={dp}: expert parallelism "
                           "splits the experts over ranks of the data-parallel group. Choose an "
                           "ep that divides dp.")
    if args.microbatch_size is not None:
        check_microbatch_size(args.microbatch_size, b, dp)
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        raise PlannerError(f"--time-limit {args.time_limit!r}; expected a positive number of "
                           "seconds, e.g. --time-limit 10.")


def _check_optimizer_arg(args: argparse.Namespace) -> None:
    """--optimizer NAME must name an optimizer the profiler knows (an error otherwise)."""
    if getattr(args, "optimizer", None) is not None:
        from tfplan.profiler.optimizer_slots import check_optimizer_name
        check_optimizer_name(args.optimizer)


def _layout_note(plan: Any) -> str | None:
    """Where a dp x pp hybrid's replicas and stages sit (None when the layouts agree)."""
    s = plan.strategy
    if s.dp == 1 or s.pp == 1:
        return None
    if s.layout == "tp-pp-dp":
        return (f"Layout: {s.layout} (dp outermost): replica r's {s.pp} stages on devices "
                f"[r*{s.tp * s.pp}, (r+1)*{s.tp * s.pp}), the gradient all-reduce across them.")
    return (f"Layout: {s.layout} (Megatron-LM's): each stage's {s.dp} replicas side by side, "
            "the pipeline outermost.")


def cmd_profile_hardware(args: argparse.Namespace, ui: "UI") -> int:
    from tfplan.core.atomic import check_writable_file, write_json
    if args.out:
        check_writable_file(args.out, "--out")  # before TensorFlow starts and measures
    _quiet_tensorflow()
    from tfplan.profiler.hardware import devices_from_arg, run_profile_hardware
    from tfplan.profiler.hw_cluster import summary_rows

    devices = devices_from_arg(args.devices)
    with ui.progress("Measuring hardware") as progress:
        hw, cluster = run_profile_hardware(devices, args.quick, progress)
    if args.out:
        write_json(args.out, cluster.to_dict())
    if args.json:
        ui.print_json({"hardware": hw.to_dict(), "cluster": cluster.to_dict()})
        return 0
    ui.table(f"Measured hardware: {cluster.name}", ("what", "measured", "detail"),
             summary_rows(hw, cluster), left_columns=2, wrap_last=True)
    for note in hw.notes:
        ui.note(f"note: {note}")
    if args.out:
        ui.note(f"Wrote {os.path.abspath(args.out)}: use it with plan analyze --cluster "
                f"{args.out}")
    return 0


def cmd_clusters(args: argparse.Namespace, ui: "UI") -> int:
    from tfplan.core.presets import known_presets, parse_cluster

    clusters = [parse_cluster(name) for name in known_presets()]
    if args.json:
        ui.print_json({"presets": [c.to_dict() for c in clusters]})
        return 0
    from tfplan.reports.tables import fmt_bytes
    rows = []
    for c in clusters:
        d = c.device
        peaks = ", ".join(f"{p} {v / 1e12:g}" for p, v in d.peak_flops_per_s)
        rows.append((c.name, str(c.devices_per_node), fmt_bytes(d.memory_bytes), peaks,
                     f"{c.intra_node_link.bandwidth_bytes_per_s / 1e9:g} GB/s",
                     f"{c.inter_node_link.bandwidth_bytes_per_s / 1e9:g} GB/s"
                     if c.inter_node_link else "-"))
    ui.table("Cluster presets (use NODESxPRESET for several nodes, cpu:N for logical CPUs)",
             ("preset", "devices/node", "memory/device", "peak TFLOP/s", "intra-node/device",
              "inter-node/device"), rows, text_columns=(3,))
    return 0


# --- rendering ------------------------------------------------------------------

class UI:
    """Terminal output: tables on stdout, progress and notes on stderr."""

    def __init__(self, json_mode: bool) -> None:
        self.json_mode = json_mode
        self._console = None
        self._err = None

    def _consoles(self):
        if self._console is None:
            from rich.console import Console
            # Piped output is not cut to 80 columns: tables stay one line per row.
            # COLUMNS, where set, is the width either way (rich reads it).
            piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS", "").isdigit()
            self._console = Console(soft_wrap=False, width=220 if piped else None)
            self._err = Console(stderr=True)
        return self._console, self._err

    def status(self, text: str):
        """A spinner on stderr while slow work runs (silent when stderr is not a terminal)."""
        import contextlib
        _, err = self._consoles()
        if not err.is_terminal:
            return contextlib.nullcontext()
        return err.status(text + " ...")

    def progress(self, title: str):
        """A context manager yielding ``callback(stage, done, total)`` that draws a progress
        bar on stderr (a no-op when stderr is not a terminal)."""
        import contextlib

        _, err = self._consoles()

        @contextlib.contextmanager
        def bar():
            if not err.is_terminal:
                yield lambda stage, done, total: None
                return
            from rich.progress import Progress
            with Progress(console=err, transient=True) as prog:
                tasks: dict[str, Any] = {}

                def update(stage: str, done: int, total: int) -> None:
                    if stage not in tasks:
                        tasks[stage] = prog.add_task(f"{title}: {stage}", total=total)
                    prog.update(tasks[stage], completed=done, total=total)
                yield update
        return bar()

    def print_json(self, obj: Any) -> None:
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")

    def table(self, title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
              left_columns: int = 2, wrap_last: bool = False,
              text_columns: Sequence[int] | None = None) -> None:
        """``text_columns``: the columns that hold text (left-aligned; they wrap, folding a
        word longer than the column); every other column is a number, right-aligned and
        never cut or wrapped. Without it: the first ``left_columns`` and (``wrap_last``)
        the last are the text columns. A table whose numbers need more than the console's
        width is printed wider rather than cut."""
        from rich.measure import Measurement
        from rich.table import Table
        out, _ = self._consoles()
        if text_columns is None:
            text_columns = list(range(min(left_columns, len(header))))
            if wrap_last and header:
                text_columns.append(len(header) - 1)
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(header):
            text = i in text_columns
            cells = [str(row[i]) for row in rows] + str(h).split("\n")
            table.add_column(h, justify="left" if text else "right", no_wrap=not text,
                             overflow="fold", min_width=None if text else max(map(len, cells)))
        for row in rows:
            style = "bold" if row and row[0] in ("*", "TOTAL") else None
            table.add_row(*row, style=style)
        need = Measurement.get(out, out.options.update_width(100_000), table).minimum
        if need <= out.width:
            out.print(table)
            return
        width = out.width
        out.width = need  # wider than the terminal: it wraps the lines, nothing is cut
        try:
            out.print(table)
        finally:
            out.width = width

    def note(self, text: str, wrap: bool = True) -> None:
        out, _ = self._consoles()
        out.print(text, highlight=False, markup=False, soft_wrap=not wrap)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    ui = UI(json_mode=getattr(args, "json", False))
    try:
        return args.func(args, ui)
    except PlannerError as e:
        kind = "invalid file" if isinstance(e, SchemaError) else type(e).__name__
        sys.stderr.write(f"plan {args.command}: error ({kind}): {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
