"""Offload (ZeRO-Offload): optimizer state and update math, and optionally the weights, on
the host.

Pipeline position: ``apply.wrap`` calls ``offload_state(wrapped, plan)`` for a plan with
``strategy.offload`` other than ``"none"``, after the model is built and before it is
compiled, and builds the weights on the host (``weights_device``, given to
``apply.pipeline.wrap_placed`` and used by ``apply.tensor_parallel``) for
``"optimizer+weights"``; ``apply.dimensions`` names the modes that run it (the placed
ones: single device, pipeline, general placement, and the copies of
``apply.tensor_parallel``, where a data-parallel plan with offload runs too). Ren et
al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC'21, Sec. 4:
the fp32 optimizer states and the parameter update live in CPU memory; each step the
gradients go device -> host, the update runs on the host, and the updated parameters
go back.

``"optimizer"``, through ``apply.placement``'s ``state_device`` hooks:

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

``"optimizer+weights"`` (weights too, as ZeRO-Infinity's parameter offload, Rajbhandari
et al., SC'21, without its prefetching): each layer is built on its device's host, so
its weights live there, while its ops still run on its planned device
(``PlacedModel`` places ops by the plan, not by where variables live): each use reads
the weight on the host and TensorFlow copies it to the device (a fetch per use, the
recomputation's too); the gradients flow back to the host through the reads'
gradients, and the whole update runs there, nothing copied back. Not with tensor
parallelism (``apply.sharded_layers`` builds each shard on its rank; refused).

The update's arithmetic is the same on any device, so the losses are one device's. A
model with offload is not compiled with XLA: one XLA cluster runs on one device.
"""
from __future__ import annotations

from typing import Any

from tfplan.apply.placement import tf_variable
from tfplan.planner.plan import Plan

OFFLOAD_MODES = ("optimizer", "optimizer+weights")  # Strategy.offload values applied here
WEIGHTS = "optimizer+weights"


def host_device(device: str) -> str:
    """The host CPU of ``device``'s worker: ``/job:worker/task:1/device:GPU:3`` ->
    ``/job:worker/task:1/device:CPU:0``; ``/device:CPU:5`` -> ``/device:CPU:0``."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def state_on_host(variable: Any) -> str:
    """Where the optimizer state of ``variable`` lives under offload: its host's CPU."""
    return host_device(tf_variable(variable).device)


def weights_device(plan: Plan) -> Any:
    """The function from a layer's planned device to the device its weights are built
    on: the host under ``"optimizer+weights"``, else None (where the layer runs)."""
    return host_device if plan.strategy.offload == WEIGHTS else None


def offload_state(model: Any, plan: Plan) -> None:
    """Put the optimizer state and update of ``model`` (a PlacedModel: placed, pipeline,
    or tensor-parallel copies) on the host, as ``plan.strategy.offload`` says."""
    if plan.strategy.offload not in OFFLOAD_MODES:
        return
    model.state_device = state_on_host
    hosts = [host_device(d) for d in plan.devices]
    # the hosts join the devices the model spans: PlacedModel.compile then turns XLA off
    model.stage_devices = tuple(dict.fromkeys([*model.stage_devices, *hosts]))
