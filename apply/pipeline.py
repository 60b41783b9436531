"""Single-device, pipeline and general-placement plans: every layer, its ops and its
optimizer state on one device.

Pipeline position: ``apply.wrap`` calls ``wrap_placed`` for a plan with one
data-parallel replica (``dp == 1``): one stage on one device (single device),
``pp`` stages with one device each (pipeline), or a general placement (each stage
is one device's layers, in any pattern, one micro-batch). Everything below goes by
``Plan.device_of_layer`` alone, so stages need not be runs of consecutive layers;
nothing orders independent branches, so TensorFlow's executor runs branches on
different devices at the same time. Placement is by hand with ``tf.device``,
TensorFlow's own placer doing the rest:

* variables: each layer is re-created and built under ``tf.device`` of its
  stage's device (``apply.cloning``), so its weights live there; a block (a custom
  layer with sub-layers) whole on its stage; a nested model whose layers span stages is
  re-created whole, its layers' weights moved to their stages and its operations run
  there (``apply.blocks.place_nested``);
* forward ops: ``PlacedModel._run_through_graph`` runs each operation of the
  functional graph under its device (``apply.placement.operation_devices``);
  the loss, the metrics and the micro-batch split run on the device of the
  stage that makes the model's output;
* backward ops: in a traced train step the gradients come from
  ``tf.gradients``, which colocates every gradient op with its forward op
  (``tf.GradientTape`` would leave them on the default device); a model run
  with ``run_eagerly=True`` falls back to the tape;
* gradient accumulation and optimizer updates: each variable's sum of
  micro-batch gradients and its ``optimizer.update_step`` run on its device;
* optimizer slots: built eagerly at ``compile()`` (or, failing that, on the
  first step, lifted out of the graph), each under its variable's device (under
  offload, its host's CPU, with the update math: ``apply.offload``);
* micro-batches: ``strategy.num_microbatches`` equal parts per step, gradients
  averaged before one update (``apply.planned_model``). TensorFlow's executor
  overlaps micro-batch ``i`` on stage ``s+1`` with micro-batch ``i+1`` on stage
  ``s``, since they do not depend on each other. Under GPipe nothing else orders
  them; a 1F1B or interleaved plan (``schedule=``, ``apply.schedule``) makes each
  stage's forward of a micro-batch wait for the backward passes the schedule puts
  before it (control dependencies), which bounds the micro-batches in flight;
* recomputation (``strategy.recompute``): the layers ``apply.recompute`` picks
  run through ``tf.recompute_grad`` where each layer is called.

Placed models are not compiled with XLA (``jit_compile``) when they span more
than one device: one XLA cluster runs on one device.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Collection, Mapping

import keras
import tensorflow as tf

from tfplan import compat
from tfplan.apply.cloning import clone_graph, copy_weights
from tfplan.apply.placement import (build_optimizer_on_devices, operation_devices,
                             updates_on_variable_devices)
from tfplan.apply.planned_model import PlannedModel
from tfplan.apply.recompute import recompute_call
from tfplan.apply.schedule import PipelineSchedule, active_trace, operation_stages, tracing


@keras.saving.register_keras_serializable(package="tfplan")
@compat.overrides_run_through_graph
class PlacedModel(PlannedModel):
    """A PlannedModel whose layers, ops and optimizer state sit on the plan's devices."""

    def __init__(self, inputs: Any, outputs: Any, name: str | None = None, *,
                 device_of_layer: Mapping[str, str] | None = None,
                 default_device: str = "", recompute_layers: Collection[str] = (),
                 schedule: PipelineSchedule | None = None, **kwargs: Any) -> None:
        super().__init__(inputs, outputs, name=name, **kwargs)
        self.recompute_layers = frozenset(recompute_layers)  # apply.recompute
        self.state_device = None  # optimizer state's device per variable (apply.offload)
        self.pipeline_schedule = schedule  # None: no order beyond the data flow (GPipe)
        self._op_stage = (operation_stages(self, dict(schedule.stage_of_layer))
                          if schedule is not None else {})
        device_of_layer = dict(device_of_layer or {})
        self._op_device = operation_devices(self, device_of_layer, default_device)
        self.stage_devices = tuple(dict.fromkeys(device_of_layer.values()))
        outputs_ops = [compat.producer(t) for t in self.outputs]
        self.output_device = self._op_device.get(id(outputs_ops[0]), default_device)

    # --- forward --------------------------------------------------------------------------
    def _run_through_graph(self, inputs: Any, operation_fn: Any = lambda op: op,
                           call_fn: Any = None) -> Any:
        if call_fn is not None:  # clone_model(wrapped, call_function=...): not a forward pass
            return super()._run_through_graph(inputs, operation_fn=operation_fn,
                                              call_fn=call_fn)
        trace = active_trace() if self._op_stage else None  # a 1F1B/interleaved train step
        return super()._run_through_graph(
            inputs, operation_fn=lambda op: self._placed(op, operation_fn(op), trace))

    def wrap_operation(self, operation: Any, fn: Any) -> Any:
        return self._placed(operation, fn, None)

    def operation_device(self, operation: Any) -> str | None:
        return self._op_device.get(id(operation))

    def _placed(self, op: Any, fn: Any, trace: Any) -> Any:
        """``fn`` (a call of ``op``) on ``op``'s device, recomputed if the plan says so,
        after the backward passes ``trace`` (1F1B/interleaved) makes it wait for."""
        if getattr(op, "name", None) in self.recompute_layers:
            fn = recompute_call(fn)
        device = self._op_device.get(id(op))
        if device is None:
            return fn
        stage = self._op_stage.get(id(op))

        def run(*args: Any, **kwargs: Any) -> Any:
            with tf.device(device):
                if trace is None or stage is None:
                    return fn(*args, **kwargs)
                with tf.control_dependencies(trace.control_inputs(stage)):
                    out = fn(*args, **kwargs)
                trace.record_forward(stage, op, keras.tree.flatten((args, kwargs)),
                                     keras.tree.flatten(out))
                return out
        return run

    # --- compile --------------------------------------------------------------------------
    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        if len(self.stage_devices) > 1 and kwargs.get("jit_compile") is True:
            warnings.warn("apply: a pipeline model spans several devices and one XLA "
                          "cluster runs on one device; compiling without jit_compile.",
                          stacklevel=2)
        if len(self.stage_devices) > 1:
            kwargs["jit_compile"] = False
        super().compile(optimizer, *args, **kwargs)

    def _after_compile(self) -> None:
        self._build_slots(list(self.trainable_variables))

    def _build_slots(self, variables: list[Any]) -> None:
        """Build the optimizer's slots for ``variables`` now: each on its variable's device,
        or its ``state_device`` (the host, under offload: ``apply.offload``)."""
        build_optimizer_on_devices(self.optimizer, variables, self.state_device)

    # --- train step -----------------------------------------------------------------------
    def _uses_microbatch_step(self) -> bool:
        return True  # always: it is the step that places gradients and updates

    def _step_schedule(self) -> Any:
        if self.pipeline_schedule is None or tf.executing_eagerly():
            return super()._step_schedule()  # run_eagerly: no graph to add edges to

        @contextlib.contextmanager
        def scheduled() -> Any:
            with tracing(self.pipeline_schedule) as trace:
                yield trace.start_microbatch
        return scheduled()

    def train_step(self, data: Any) -> Any:
        with tf.device(self.output_device):  # loss, metrics: where the output is
            return super().train_step(data)

    def test_step(self, data: Any) -> Any:
        with tf.device(self.output_device):
            return super().test_step(data)

    def _forward_loss(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        with tf.device(self.output_device):
            return super()._forward_loss(x, y, sample_weight)

    def _loss_and_gradients(self, x: Any, y: Any, sample_weight: Any,
                            variables: list[Any]) -> tuple[Any, Any, list[Any]]:
        if tf.executing_eagerly():  # run_eagerly=True: no graph for tf.gradients
            return super()._loss_and_gradients(x, y, sample_weight, variables)
        y_pred, loss, scaled = self._forward_loss(x, y, sample_weight)
        trace = active_trace()  # 1F1B / interleaved: also the gradients at stage boundaries
        received = trace.received_activations() if trace is not None else []
        grads = tf.gradients(scaled, [v.value for v in variables] + received,
                             unconnected_gradients=tf.UnconnectedGradients.NONE)
        n = len(variables)
        if trace is not None:
            trace.record_backward(variables, grads[:n], grads[n:])
        return y_pred, loss, grads[:n]

    def _gradients(self, tape: Any, target: Any, variables: list[Any]) -> list[Any]:
        if tf.executing_eagerly():
            return super()._gradients(tape, target, variables)
        # tf.gradients colocates each gradient op with its forward op (module docstring)
        return tf.gradients(target, [v.value for v in variables],
                            unconnected_gradients=tf.UnconnectedGradients.NONE)

    def _apply_gradients(self, gradients: list[Any], variables: list[Any]) -> None:
        self._build_slots(variables)  # no-op once built
        with updates_on_variable_devices(self.optimizer, self.state_device):
            super()._apply_gradients(gradients, variables)


def wrap_placed(view: Any, device_of_layer: Mapping[str, str], *, plan_name: str,
                num_microbatches: int, recompute_layers: Collection[str] = (),
                schedule: PipelineSchedule | None = None,
                weights_device: Callable[[str], str] | None = None,
                device_of_entry: Mapping[str, str] | None = None) -> PlacedModel:
    """Clone ``view`` (an uncompiled Functional) onto the devices; copy its weights.

    ``schedule`` (``apply.schedule.schedule_of(plan)``): a 1F1B or interleaved order to
    enforce; None trains without one (GPipe). ``weights_device``: where a layer planned
    on a device builds its weights (``apply.offload.weights_device``; None: there).
    ``device_of_entry`` (``plan.device_of_layer()``): where each layer inside a nested
    model goes (``apply.blocks.place_nested``; None: with its nested model)."""
    stages = tuple(dict.fromkeys(device_of_layer.values()))
    build = device_of_layer if weights_device is None else {
        name: weights_device(d) for name, d in device_of_layer.items()}
    clone = clone_graph(view, build, device_of_entry, weights_device)
    model = PlacedModel(clone.inputs, clone.outputs, name=view.name,
                        device_of_layer=device_of_layer, default_device=stages[0],
                        plan_name=plan_name, num_microbatches=num_microbatches,
                        num_replicas=1, recompute_layers=recompute_layers,
                        schedule=schedule)
    copy_weights(view, model)
    return model
