"""Optimizer-state offload (ZeRO-Offload): optimizer slots and update math on the host.

Pipeline position: ``apply.wrap`` calls ``offload_optimizer(wrapped, plan)`` for a plan
with ``strategy.offload == "optimizer"``, after the model is built and before it is
compiled; ``apply.dimensions`` names the modes that run it (the placed ones:
single device, pipeline, general placement, and the copies of ``apply.tensor_parallel``,
where a data-parallel plan with offload runs too). Ren et al., "ZeRO-Offload:
Democratizing Billion-Scale Model Training", USENIX ATC'21, Sec. 4: the fp32 optimizer
states and the parameter update live in CPU memory; each step the gradients go
device -> host, the update runs on the host, and the updated parameters go back.

How it is applied here (``apply.placement``'s ``state_device`` hooks):

* slots: each slot of a weight is built on its worker's host device,
  ``/job:.../device:CPU:0`` (``host_device``; ``/device:CPU:0`` on one host), not on
  the weight's device;
* gradients: each weight's gradient (its micro-batch sum, its sum over data-parallel
  copies, or under ZeRO-1 its owner's reduce) is computed on the devices as before,
  then copied to the host (a placed ``tf.identity``);
* update: the optimizer's ``update_step`` runs there, reading and writing the slots
  on the host; its write to the weight (``assign_sub`` of the step, or ``assign``)
  runs on the weight's device, so the step computed on the host is what travels back
  (the same bytes as the new weights ZeRO-Offload copies back, fp32 here);
* ZeRO-1 (``apply.zero``): the owner copy's slots are the ones offloaded, to its
  worker's host; the owner's new value is broadcast to the other copies as before;
* weights stay on their planned devices.

The update's arithmetic is the same on any device, so the losses are one device's.
``offload == "optimizer+weights"`` (weights on the host too, fetched for each layer's
use) is refused by ``apply.dimensions``.
"""
from __future__ import annotations

from typing import Any

from tfplan.apply.placement import tf_variable
from tfplan.planner.plan import Plan

OFFLOAD_MODES = ("optimizer",)  # the values of Strategy.offload applied here


def host_device(device: str) -> str:
    """The host CPU of ``device``'s worker: ``/job:worker/task:1/device:GPU:3`` ->
    ``/job:worker/task:1/device:CPU:0``; ``/device:CPU:5`` -> ``/device:CPU:0``."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def state_on_host(variable: Any) -> str:
    """Where the optimizer state of ``variable`` lives under offload: its host's CPU."""
    return host_device(tf_variable(variable).device)


def offload_optimizer(model: Any, plan: Plan) -> None:
    """Put the optimizer state and update of ``model`` (a PlacedModel: placed, pipeline,
    or tensor-parallel copies) on the host, as ``plan.strategy.offload`` says."""
    if plan.strategy.offload in OFFLOAD_MODES:
        model.state_device = state_on_host
