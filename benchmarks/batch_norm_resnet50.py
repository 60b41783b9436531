"""Benchmark: keras.applications ResNet50 (53 BatchNormalization layers) trained under a
dp=4 plan with global and with local batch statistics, against one device.

Pipeline position: outside the pipeline; it measures what issue 13's "batch statistics,
decided and visible" is about, as figures from one run. ResNet50 (``weights=None``,
``--size`` x ``--size`` images, 10 classes, SGD), the same starting weights and batches
(``--batch`` samples, shifted per step) for every run, on 4 logical CPU devices:

* one device: the reference losses;
* dp=4, ``batch_norm: global``: the relative difference of each step's loss from the
  reference (expected within 1e-4: ``apply.batch_stats``), the largest weight difference
  after the steps, and the step time against one device's;
* dp=4, ``batch_norm: local``: the same differences (per-replica statistics: expected
  far from the reference).

In float32 a ResNet50 at random weights is chaotic: run twice on one device it is
bitwise repeatable, but the one-device model with only its moments computed as sums
(the same formula, other round-off: a one-device plan) already differs by 4e-5 in the
second loss and 15% in some BatchNormalization betas after two steps; under dp=4 the
convolutions also run on 4-sample pieces (other kernels, other round-off) and the
betas differ by 6% after one step. In float64 (the default here) the same runs agree
to 1e-11, which is what shows the rule is exact. Prints one line per run and a JSON
line at the end. Usage:
    python benchmarks/batch_norm_resnet50.py [--size 32] [--batch 16] [--steps 3]
        [--dtype float64|float32] [--lr 1e-3] [--modes global,local]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32, help="image side (default 32)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="SGD learning rate (default 1e-3; at 1e-2 this ResNet50 diverges "
                             "from random weights and amplifies round-off between runs)")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"),
                        help="floatx (default float64: exact arithmetic up to 1e-15 shows "
                             "the rule; in float32 this 50-layer net at random weights "
                             "amplifies round-off, see the module docstring)")
    parser.add_argument("--modes", default="global,local",
                        help="batch_norm rules to run under dp=4 (default global,local)")
    args = parser.parse_args()

    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    import keras
    import numpy as np

    keras.config.set_floatx(args.dtype)
    from tfplan import apply
    from tests.apply.helpers import cpus, make_plan

    keras.utils.set_random_seed(0)
    base = keras.applications.ResNet50(weights=None, input_shape=(args.size, args.size, 3),
                                       classes=10)
    weights = base.get_weights()
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(args.batch, args.size, args.size, 3)).astype(args.dtype) + i,
                rng.integers(0, 10, size=(args.batch,))) for i in range(args.steps)]

    def run(model):
        model.compile(optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
        model.train_on_batch(*batches[0])  # compile; then reset the weights
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
        started = time.perf_counter()
        losses = [float(model.train_on_batch(x, y, return_dict=True)["loss"])
                  for x, y in batches]
        return losses, (time.perf_counter() - started) / args.steps, model.get_weights()

    def fresh():
        model = keras.models.clone_model(base)
        model.set_weights(weights)
        return model

    ref_losses, ref_s, ref_weights = run(fresh())
    print(f"one device: losses {[round(v, 5) for v in ref_losses]}, {ref_s * 1e3:.0f} ms/step")
    out = {"one_device": {"losses": ref_losses, "step_s": ref_s}}
    plan = make_plan(base, [cpus(0, 1, 2, 3)], global_batch=args.batch)
    bn = sum(isinstance(l, keras.layers.BatchNormalization) for l in base.layers)
    for mode in args.modes.split(","):
        p = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                   batch_norm=mode))
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = apply.wrap(fresh(), p)
        losses, step_s, w = run(wrapped)
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
        wdiff = max(float(np.max(np.abs(a - b))) for a, b in zip(w, ref_weights))
        print(f"dp=4 {mode}: losses {[round(v, 5) for v in losses]}, max relative loss "
              f"difference {max(rel):.2e}, max weight difference {wdiff:.2e}, "
              f"{step_s * 1e3:.0f} ms/step ({step_s / ref_s:.2f}x one device)")
        out[f"dp4_{mode}"] = {"losses": losses, "max_rel_loss_diff": max(rel),
                              "max_weight_diff": wdiff, "step_s": step_s}
    print(json.dumps({"model": "ResNet50", "batch_norm_layers": bn, "size": args.size,
                      "batch": args.batch, "lr": args.lr, **out}))


if __name__ == "__main__":
    main()
