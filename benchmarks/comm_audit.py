"""What each device sends per training step under apply, measured, against the bytes the
plan prices (issue 25).

For the tiny MLP, CNN and transformer of tests/apply and hand-made plans on 8 logical CPUs
(modes ending in ``-sp``: sequence parallelism; modes with ``cp2``: context parallelism
over 2 chunks of each sequence; both the transformer only; modes with ``ep``: expert
parallelism, the tiny mixture-of-experts model ``tiny_moe`` only, which runs those alone),
``apply.audit.audit_step`` measures one step of ``apply.wrap(build_model, plan)`` (the
SPMD engine, ``apply.spmd``, where it runs the plan; ``--built`` wraps the built model
instead, which runs on the same engine since built models moved there, each device's copy
re-created from the layers' configs; the engine is printed per row) (the cross-
device copies TensorFlow placed and the collectives, per device and kind) and
``planner.traffic.plan_sent_bytes`` prices the same plan from the model's profile. Printed
per mode: each device's measured bytes (tp/pp/dp/other; the input batch's feeding is left
out), the priced bytes (ZeRO's gathers as kind zero), and the busiest device's share against its group's mean (the
issue's bar: at most 1.25x, measured within 10% of priced).

    .venv/bin/python benchmarks/comm_audit.py [--json] [--built] [--modes MODE ...]
                                              [--models MODEL ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODES = {  # name: (stage devices, dp, micro-batches, ZeRO stage[, schedule])
    "dp4": ([[0, 1, 2, 3]], 4, 1, 0),
    "pp2-m2": ([[0], [1]], 1, 2, 0),
    "tp2xpp2-m2-1f1b": ([[0, 1], [2, 3]], 1, 2, 0, "1f1b"),
    "dp2xtp2xpp2-m2-1f1b": ([[0, 1, 2, 3], [4, 5, 6, 7]], 2, 2, 0, "1f1b"),
    "tp2": ([[0, 1]], 1, 1, 0),
    "tp4": ([[0, 1, 2, 3]], 1, 1, 0),
    "dp2xtp2": ([[0, 1, 2, 3]], 2, 1, 0),
    "dp4-zero1": ([[0, 1, 2, 3]], 4, 1, 1),
    "dp4-m2-zero2": ([[0, 1, 2, 3]], 4, 2, 2),
    "dp2xtp2-zero1": ([[0, 1, 2, 3]], 2, 1, 1),
    "dp4-zero3": ([[0, 1, 2, 3]], 4, 1, 3),
    "dp2xtp2-zero3": ([[0, 1, 2, 3]], 2, 1, 3),
    "tp2-sp": ([[0, 1]], 1, 1, 0),
    "dp2xtp2-sp": ([[0, 1, 2, 3]], 2, 1, 0),
    "tp2xpp2-m2-1f1b-sp": ([[0, 1], [2, 3]], 1, 2, 0, "1f1b"),
    "cp2": ([[0, 1]], 1, 1, 0),
    "dp2xcp2": ([[0, 1, 2, 3]], 2, 1, 0),
    "cp2xtp2": ([[0, 1, 2, 3]], 1, 1, 0),
    "dp2xcp2-zero1": ([[0, 1, 2, 3]], 2, 1, 1),
    "ep4": ([[0, 1, 2, 3]], 4, 1, 0),
    "dp4xep2": ([[0, 1, 2, 3]], 4, 1, 0),
    "dp2xtp2xep2": ([[0, 1, 2, 3]], 2, 1, 0),
    "ep2xpp2-m2-1f1b": ([[0, 1], [2, 3]], 2, 2, 0, "1f1b"),
    "dp4xep2-zero1": ([[0, 1, 2, 3]], 4, 1, 1),
    "dp4xep2-zero3": ([[0, 1, 2, 3]], 4, 1, 3),
    "dp2xpp2-m2-1f1b-zero2": ([[0, 1], [2, 3]], 2, 2, 2, "1f1b"),
    "dp2xpp2-m2-1f1b-zero3": ([[0, 1], [2, 3]], 2, 2, 3, "1f1b"),
    "cp2xpp2-m2-1f1b": ([[0, 1], [2, 3]], 1, 2, 0, "1f1b"),
    "cp2xtp2-sp": ([[0, 1, 2, 3]], 1, 1, 0),
}
MODELS = ("tiny_mlp", "tiny_cnn", "tiny_transformer", "tiny_moe")
# the tiny MoE model's tensor-parallel splits (its MoE layer replicated over tp) and its
# stages under pp (the MoE layer on the second)
MOE_SPLITS = (("embed", "column"), ("head", "row"))
MOE_STAGES = [("embed",), ("moe", "residual", "pool", "head")]


def expert_degree(mode: str) -> int:
    """The ep of a mode's name (``ep4``, ``dp4xep2``: 4, 2); 1 without one."""
    import re

    found = re.search(r"ep(\d)", mode)
    return int(found.group(1)) if found else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--built", action="store_true",
                        help="wrap the built model (each device's copy re-created from its "
                             "layers' configs) instead of its builder")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES),
                        help="the modes to measure (default: all)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="the models to measure (default: all)")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    import dataclasses

    import keras

    from tfplan import apply
    from tfplan.apply.audit import audit_step
    from tfplan.planner.traffic import plan_sent_bytes
    from tfplan.profiler import profile_model
    from tests.apply.helpers import cpus, fresh_optimizer, load_model_file, make_plan
    from tests.apply.test_acceptance import SPLITS

    rows = []
    for model_name in args.models:
        module = load_model_file(model_name)
        for mode, (stages, dp, m, zero, *schedule) in ((k, MODES[k]) for k in args.modes):
            sp = mode.endswith("-sp")
            cp = 2 if "cp2" in mode else 1
            ep = expert_degree(mode)
            if (sp or cp > 1) and model_name != "tiny_transformer":
                continue  # no sequence to cut
            if (ep > 1) != (model_name == "tiny_moe"):
                continue  # experts to split: the MoE model, which runs those modes alone
            keras.utils.set_random_seed(0)
            model = module.build_model()
            staged = {"stage_layers": MOE_STAGES} if ep > 1 and len(stages) > 1 else {}
            plan = make_plan(model, [cpus(*s) for s in stages], num_microbatches=m,
                             global_batch=16, **staged)
            tp = len(stages[0]) // (dp * cp)
            splits = MOE_SPLITS if model_name == "tiny_moe" else SPLITS[model_name]
            plan = dataclasses.replace(
                plan, tp_splits=splits if tp > 1 else (),
                strategy=dataclasses.replace(plan.strategy, dp=dp, tp=tp, cp=cp, ep=ep,
                                             zero_stage=zero,
                                             microbatch_size=16 // (dp * m),
                                             sequence_parallel=sp,
                                             schedule=(schedule or [plan.strategy.schedule])[0]))
            keras.utils.set_random_seed(0)
            wrapped = apply.wrap(model if args.built else module.build_model, plan)
            wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
            x, y = module.sample_batch(16)
            audit = audit_step(wrapped, x, y, plan=plan)
            priced = {d: dict(k) for d, k in plan_sent_bytes(
                profile_model(model, batch_size=16), plan)}
            measured = audit.by_device()
            devices = list(plan.devices)
            sent = {d: sum(v for k, v in measured.get(d, {}).items() if k != "input")
                    for d in devices}
            mean = sum(sent.values()) / len(devices)
            rows.append({"model": model_name, "mode": mode, "engine": type(wrapped).__name__,
                         "measured": {d: {k: v for k, v in measured.get(d, {}).items() if v}
                                      for d in devices},
                         "priced": {d: {k: v for k, v in priced.get(d, {}).items() if v}
                                    for d in devices},
                         "busiest_over_mean": round(max(sent.values()) / mean, 2) if mean else 0,
                         "unsized": len(audit.unsized)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"{r['model']:17s} {r['mode']:13s} {r['engine']:18s} "
              f"busiest/mean {r['busiest_over_mean']:.2f}"
              f"  unsized copies {r['unsized']}")
        for d in r["measured"]:
            meas = sum(v for k, v in r["measured"][d].items() if k != "input")
            pr = sum(r["priced"][d].values())
            print(f"    {d:16s} measured {meas:>9,d} B {r['measured'][d]}  priced {pr:>9,d} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
