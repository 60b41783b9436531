"""Calibrating a static profile with measured layer times.

Pipeline position: ``plan analyze MODEL --measured FILE`` reads a measurement of the
same model on one device (``plan profile MODEL --measure --json > FILE``, a
``MeasuredProfile``) and calls ``with_measured_times``; the planner's cost model then
prices each layer from its measured time (``planner.cost_model.layer_fwd_bwd_time_s``)
instead of its FLOPs and bytes, and everything else -- communication, pipeline
bubbles, memory, cores shared between devices -- as before. This is how a plan is
calibrated to hardware whose kernels the roofline does not capture (thin matmuls and
small convolutions on a CPU run far below the square-matmul peak). Like
``profiler.model_profile`` this module imports no TensorFlow.

What is charged where:

* each layer's measured forward and backward seconds (XProf, mean over the profiled
  steps) go to that layer, for ``measured.batch_size`` samples;
* the step's unattributed op time that is not the optimizer update (the loss and its
  gradient, ops between layers) goes to the model's last layer's forward: it runs
  once per micro-batch, where the output is. The optimizer update is left to the cost
  model (it prices it per device from the bytes each holds);
* the step's time outside the device kernels -- the measured step without the
  profiler minus the kernels' time with it (``step_time_unprofiled_s -
  step_time_s``, never below 0) plus the idle gaps between kernels
  (``idle_time_s``) -- is the framework's per-step overhead (Python and dispatch of
  ``train_step``, feeding the batch): ``ModelProfile.measured_step_overhead_s``,
  added once per step (``Breakdown.overhead_s``);
* the measurement must be of the same model: the same layer names, every one of them.
"""
from __future__ import annotations

import dataclasses

from tfplan.core.errors import PlannerError
from tfplan.profiler.measured_profile import MeasuredProfile
from tfplan.profiler.model_profile import ModelProfile

#: Name scopes of optimizer updates in a measured step (Keras 3 optimizers name their
#: update ops after the optimizer class; ``apply_gradients`` in tf.distribute).
OPTIMIZER_SCOPES = ("adam", "adamw", "sgd", "rmsprop", "adagrad", "adadelta", "adamax",
                    "nadam", "ftrl", "lion", "adafactor", "lamb", "loss_scale_optimizer",
                    "optimizer", "apply_gradients", "assignaddvariableop")


def non_optimizer_unattributed_s(measured: MeasuredProfile, optimizer: str) -> float:
    """Seconds per step of measured ops outside every layer that are not the optimizer's
    update (``OPTIMIZER_SCOPES`` and the profile's optimizer name)."""
    names = set(OPTIMIZER_SCOPES) | {optimizer.lower()}
    return sum(t for scope, t in measured.unattributed
               if not any(n in scope.lower() for n in names))


def with_measured_times(profile: ModelProfile, measured: MeasuredProfile) -> ModelProfile:
    """``profile`` with every layer's ``measured_fwd_s``/``measured_bwd_s`` (for
    ``measured.batch_size`` samples on ``measured.device``) and the non-optimizer
    unattributed time charged to the last layer (see the module docstring).

    Raises PlannerError naming the first layer the measurement lacks or the first it
    has that the profile does not, and when the models differ by name.
    """
    if measured.model_name != profile.model_name:
        raise PlannerError(
            f"The measurement is of model {measured.model_name!r} but the profile is of "
            f"{profile.model_name!r}; measure this model: plan profile MODEL --measure "
            "--json > measured.json.")
    times = {l.name: l for l in measured.layers}
    names = [l.name for l in profile.layers]
    missing = [n for n in names if n not in times]
    extra = [n for n in times if n not in set(names)]
    if missing or extra:
        what = (f"has no time for layer {missing[0]!r}" if missing
                else f"has layer {extra[0]!r}, which the profile does not")
        raise PlannerError(
            f"The measurement of {measured.model_name!r} {what}; it must be of the same "
            "model. Re-measure it: plan profile MODEL --measure --json > measured.json.")
    other_s = non_optimizer_unattributed_s(measured, profile.optimizer)
    last = profile.layers[-1].name
    layers = tuple(dataclasses.replace(
        l, measured_fwd_s=times[l.name].time_fwd_s + (other_s if l.name == last else 0.0),
        measured_bwd_s=times[l.name].time_bwd_s) for l in profile.layers)
    overhead_s = max(0.0, measured.step_time_unprofiled_s - measured.step_time_s) \
        + measured.idle_time_s
    return dataclasses.replace(profile, layers=layers, measured_device=measured.device,
                               measured_batch_size=measured.batch_size,
                               measured_step_overhead_s=overhead_s)
