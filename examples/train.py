"""Train a model file with a plan: the one-line ``apply.wrap`` in a real script.

Pipeline position: the end of the pipeline, after ``plan analyze`` wrote a
plan.json. It loads the plan, makes its devices exist (``apply.ensure_devices``,
before any model is built), builds the model from a model file (``build_model``,
``loss``, ``optimizer``, ``sample_batch``), wraps it, and trains ``--steps``
steps on batches of the plan's global batch, printing each step's loss. The model
file's ``sample_batch`` may give one array or a dict, list or tuple of arrays for
``x`` (a multi-input model) and ``y`` (a multi-output one); each step takes the same
rows of every array.
Without ``--plan`` it trains on one device: the single-device reference whose
losses a plan must reproduce.

``--auto`` plans inside the script instead (``apply.auto``: profile, search for
the devices this process sees, wrap), with no other change to the training
code; ``--cpus N`` gives the process N logical CPU devices to plan for (on a
machine without GPUs; before TensorFlow starts). With ``PLAN_FILE=plan.json``
in the environment, ``--auto`` loads that plan instead of searching (and its
global batch is the default). Under ``plan launch --workers W`` (TF_CONFIG set),
``--plan`` trains a multi-worker plan on every worker, and ``--auto`` plans the
multi-worker job (``--cpus N`` logical CPUs per worker). Auto is not the default:
without ``--plan`` or
``--auto`` the script stays the single-device reference, whatever the
environment says.

    python examples/train.py --plan out/plan.json [--model examples/mlp.py]
                             [--steps 5] [--seed 0] [--global-batch N] [--json]
    python examples/train.py --auto [--cpus 4] [--model ...] [--global-batch N] ...

``--json`` prints one JSON object: ``losses`` (one per step), ``plan`` (its
name, or null), ``global_batch`` and ``devices`` ({variable path: [device, ...]}
for every model variable and optimizer slot: one device per copy, so a
mirrored variable lists one per replica). Exit codes: 0 success, 2 bad input (model, plan, devices).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tfplan.core.errors import ModelLoadError, PlannerError  # noqa: E402

DEFAULT_MODEL = os.path.join(ROOT, "examples", "mlp.py")
DEFAULT_GLOBAL_BATCH = 32  # without a plan and without --global-batch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a model file as a plan says, as "
                                            "apply.auto plans it (--auto), or on one "
                                            "device.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plan", help="plan.json from `plan analyze` (omit: one device)")
    mode.add_argument("--auto", action="store_true",
                      help="plan for this process's devices with apply.auto (PLAN_FILE in the "
                           "environment: load that plan instead of searching)")
    p.add_argument("--cpus", type=int, default=None,
                   help="with --auto: give this process N logical CPU devices to plan for "
                        "(default: the devices TensorFlow finds; ignored with GPUs)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model file defining build_model(), loss, optimizer, "
                        "sample_batch(batch_size) (default: examples/mlp.py)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--seed", type=int, default=0, help="keras.utils.set_random_seed (default 0)")
    p.add_argument("--global-batch", type=int, default=None,
                   help=f"batch size per step (default: the plan's; {DEFAULT_GLOBAL_BATCH} "
                        "without a plan)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _load_source(path: str) -> Any:
    """The model file (build_model, loss, optimizer, sample_batch) and a builder for it."""
    from tfplan.profiler.loader import build, load_model_source

    source = load_model_source(path)
    return source, (lambda: build(source))


def _optimizer(spec: Any) -> Any:
    import keras

    if spec is None:
        return "adam"
    if isinstance(spec, (str, keras.optimizers.Optimizer)):
        return spec
    if callable(spec):  # a no-argument factory
        return spec()
    return spec


def rows(data: Any, part: slice) -> Any:
    """The rows ``part`` of every array in ``data``: one array, or a dict, list or tuple
    of them (a multi-input model's ``x``, a multi-output model's ``y``), nested as given;
    None stays None."""
    if data is None:
        return None
    if isinstance(data, dict):
        return {k: rows(v, part) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(rows(v, part) for v in data)
    return data[part]


def train(args: argparse.Namespace) -> dict[str, Any]:
    from tfplan import apply
    from tfplan.planner.plan import load_plan

    plan = load_plan(args.plan) if args.plan else None
    if plan is not None:
        apply.ensure_devices(plan)  # before TensorFlow's runtime starts
    if args.cpus is not None and not args.auto:
        raise PlannerError(f"--cpus {args.cpus} is for --auto (the devices it plans for); a "
                           "--plan makes its own devices, and without either the script trains "
                           "on one device.")
    if args.auto:
        apply.auto_devices(args.cpus)  # before TensorFlow's runtime starts
        plan_file = os.environ.get("PLAN_FILE")
        auto_batch = args.global_batch or (load_plan(plan_file).global_batch if plan_file
                                           else DEFAULT_GLOBAL_BATCH)

    import keras

    keras.utils.set_random_seed(args.seed)
    source, build_model = _load_source(args.model)
    if getattr(source, "loss", None) is None:
        raise ModelLoadError(f"Model file {args.model} defines no `loss`; add e.g. "
                             "loss = 'mse' next to build_model().")
    if getattr(source, "sample_batch", None) is None:
        raise ModelLoadError(f"Model file {args.model} defines no sample_batch(batch_size); "
                             "add one returning a deterministic (x, y) numpy batch.")
    model = build_model()
    if plan is not None:
        model = apply.wrap(model, plan)
    elif args.auto:
        model = apply.auto(model, global_batch=auto_batch, optimizer=_optimizer(source.optimizer))
        plan = model.plan
    model.compile(optimizer=_optimizer(source.optimizer), loss=source.loss)

    batch = args.global_batch or (plan.global_batch if plan else DEFAULT_GLOBAL_BATCH)
    if args.steps < 1 or batch < 1:
        raise PlannerError(f"--steps and --global-batch must be at least 1; received "
                           f"{args.steps} and {batch}.")
    x, y = source.sample_batch(batch * args.steps)
    losses = []
    for step in range(args.steps):
        part = slice(step * batch, (step + 1) * batch)
        logs = model.train_on_batch(rows(x, part), rows(y, part), return_dict=True)
        losses.append(float(logs["loss"]))
        if not args.json:
            print(f"step {step + 1}/{args.steps}: loss {losses[-1]:.6f}", flush=True)
    return {"losses": losses, "plan": plan.name if plan else None, "global_batch": batch,
            "devices": apply.variable_devices(model)}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tfplan.profiler.tf_runtime import import_tensorflow

    import_tensorflow()  # without TensorFlow's start-up noise on stderr
    try:
        result = train(args)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
