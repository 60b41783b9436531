"""Data-parallel plans: one stage replicated on ``dp`` devices with MirroredStrategy.

Pipeline position: ``apply.wrap`` calls ``wrap_data_parallel`` for a plan with
one stage on several devices. Everything is TensorFlow's own machinery:

* variables: the model is re-created (``apply.cloning``) inside
  ``strategy.scope()``, so every variable is a ``MirroredVariable`` with one
  component on each replica's device; the weights are then copied in;
* the model remembers its strategy (Keras' TF trainer records the strategy
  that is current when a model is created, and ``fit``/``evaluate``/``predict``
  run every step with ``strategy.run`` and split each global batch across the
  replicas); optimizer slots are mirrored alongside their variables;
* gradients: each replica's loss is scaled by ``1/dp`` (Keras) and the
  optimizer all-reduces (sums) the gradients before one identical update on
  every replica, so a step equals one single-device step on the global batch.
  On CPU devices the reduction is ``ReductionToOneDevice``; on GPUs it is
  MirroredStrategy's default (NCCL);
* ``compile()`` after ``wrap``: Keras refuses an optimizer created outside the
  model's strategy ("Mixing different tf.distribute.Strategy objects"), so
  ``compile`` runs inside ``strategy.scope()`` and an optimizer object made
  outside it is re-created from its config inside (its settings carry over;
  the object you passed is not the one that trains: use ``model.optimizer``).
  An optimizer that already holds state for other variables is refused;
* ``train_on_batch``/``test_on_batch``/``predict_on_batch``: Keras' versions
  hand the whole batch to every replica (a train step is then correct but not
  data parallel); here the batch is split into one slice per replica
  (``experimental_distribute_values_from_function``; numpy arrays are sliced
  as numpy views and become tensors when the step is called, as in a
  hand-written ``strategy.run`` loop, where slicing a tensor copy eagerly
  costs a quarter of an MLP step) and handed to the same step functions
  ``fit`` uses, called with the metric resets in one compiled call. A test
  batch that does not split evenly is evaluated whole by every replica (Keras'
  own ``test_on_batch``; Keras' ``evaluate`` fails under MirroredStrategy when
  its first batch leaves a replica empty), a predict batch goes through
  ``predict``;
* ``num_microbatches > 1``: each replica accumulates gradients over its
  micro-batches before the all-reduce (``apply.planned_model``);
* recomputation (``recompute_layers``, from ``apply.recompute``): those layers
  run through ``tf.recompute_grad`` where each replica calls them, so each
  replica's backward pass re-runs their forward ops (as ``apply.pipeline``
  does for placed models).
"""
from __future__ import annotations

from typing import Any, Collection

import keras
import numpy as np
import tensorflow as tf

from tfplan import compat
from tfplan.apply.batches import leading_dim
from tfplan.apply.clipping import (all_reduced_and_clipped, clips_globally, keras_all_reduce_off,
                            optimizer_clipping_off)
from tfplan.apply.cloning import clone_graph, copy_weights
from tfplan.apply.planned_model import PlannedModel
from tfplan.apply.recompute import recompute_call
from tfplan.core.errors import PlannerError


@keras.saving.register_keras_serializable(package="tfplan")
@compat.overrides_run_through_graph
class DataParallelModel(PlannedModel):
    """A PlannedModel made inside a MirroredStrategy scope (see the module docstring)."""

    def __init__(self, inputs: Any, outputs: Any, name: str | None = None, *,
                 recompute_layers: Collection[str] = (), **kwargs: Any) -> None:
        super().__init__(inputs, outputs, name=name, **kwargs)
        self.recompute_layers = frozenset(recompute_layers)  # apply.recompute

    # --- forward --------------------------------------------------------------------------
    def _run_through_graph(self, inputs: Any, operation_fn: Any = lambda op: op,
                           call_fn: Any = None) -> Any:
        if call_fn is not None or not self.recompute_layers:  # call_fn: not a forward pass
            return super()._run_through_graph(inputs, operation_fn=operation_fn,
                                              call_fn=call_fn)

        return super()._run_through_graph(
            inputs, operation_fn=lambda op: self.wrap_operation(op, operation_fn(op)))

    def wrap_operation(self, operation: Any, fn: Any) -> Any:
        return recompute_call(fn) if getattr(operation, "name", None) in self.recompute_layers \
            else fn

    def _compile_scope(self) -> Any:
        return self.distribute_strategy.scope()

    # --- global_clipnorm: clip the all-reduced gradient (apply.clipping) ------------------
    def _uses_microbatch_step(self) -> bool:
        return super()._uses_microbatch_step() or (
            self.optimizer is not None and clips_globally(self.optimizer))

    def _apply_gradients(self, gradients: list[Any], variables: list[Any]) -> None:
        if not clips_globally(self.optimizer) or tf.distribute.in_cross_replica_context():
            super()._apply_gradients(gradients, variables)
            return
        gradients = all_reduced_and_clipped(self.optimizer, gradients)
        with keras_all_reduce_off(self.optimizer), optimizer_clipping_off(self.optimizer):
            super()._apply_gradients(gradients, variables)

    def _prepare_optimizer(self, optimizer: Any) -> Any:
        if optimizer is None:
            return optimizer
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if compat.optimizer_strategy(inner) is self.distribute_strategy:
            return optimizer
        if optimizer.built:
            raise PlannerError(
                f"compile() received optimizer {optimizer.name!r}, which was created outside "
                "this data-parallel model's tf.distribute strategy and already holds state "
                "for other variables. Pass a new optimizer (or its name, e.g. 'adam') to "
                "compile().")
        return type(optimizer).from_config(optimizer.get_config())  # inside the scope

    def _after_compile(self) -> None:
        if self.optimizer is not None and not self.optimizer.built:
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)

    def reset_metrics(self) -> None:
        """Reset every metric in one compiled call. Keras resets each metric variable with
        an eager assign, and on mirrored variables each is a cross-replica op (about 7 ms
        per ``train_on_batch`` on four logical CPUs, a sixth of an MLP step); one
        ``tf.function`` does them all. Rebuilt when the metrics' variables change."""
        metrics = list(self.metrics)
        key = tuple(id(v) for m in metrics for v in m.variables)
        if getattr(self, "_reset_key", None) != key:
            def reset() -> None:
                for m in metrics:
                    m.reset_state()
            with self.distribute_strategy.scope():
                self._reset_fn = tf.function(reset)
            self._reset_key = key
        self._reset_fn()

    # --- one-batch methods that split the batch across the replicas -----------------------
    def _splits_evenly(self, x: Any) -> bool:
        n = leading_dim(x)
        return n is not None and n % self.num_replicas == 0

    def _per_replica(self, data: Any) -> Any:
        """``data`` (a batch that splits evenly) as PerReplica values, one slice per replica."""
        n = leading_dim(data)
        data = keras.tree.map_structure(_sliceable, data)
        per = n // self.num_replicas

        def replica_slice(ctx: Any) -> Any:
            i = ctx.replica_id_in_sync_group
            return keras.tree.map_structure(lambda t: t[i * per:(i + 1) * per], data)

        return self.distribute_strategy.experimental_distribute_values_from_function(
            replica_slice)

    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Any = None, return_dict: bool = False) -> Any:
        compat.assert_compile_called(self, "train_on_batch")
        self._check_batch(leading_dim(x), "The batch given to train_on_batch")
        if class_weight is not None:
            sample_weight = compat.class_weight_to_sample_weights(y, class_weight)
        data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        compat.maybe_symbolic_build(self, data_batch=(x, y, sample_weight))
        logs = self._reset_and_step("train", self._per_replica(data))
        return self._one_batch_logs(logs, return_dict)

    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                      return_dict: bool = False) -> Any:
        compat.assert_compile_called(self, "test_on_batch")
        if not self._splits_evenly(x):  # Keras' way: every replica evaluates the whole batch
            return super().test_on_batch(x, y, sample_weight, return_dict)
        data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        compat.maybe_symbolic_build(self, data_batch=(x, y, sample_weight))
        logs = self._reset_and_step("test", self._per_replica(data))
        return self._one_batch_logs(logs, return_dict)

    def predict_on_batch(self, x: Any) -> Any:
        if not self._splits_evenly(x):  # prediction has no batch rule: let Keras split it
            return self.predict(x, batch_size=leading_dim(x), verbose=0)
        self.make_predict_function()
        outputs = self.predict_function([(self._per_replica(x),)])
        return keras.tree.map_structure(lambda t: t.numpy(), outputs)

    def _one_batch_logs(self, logs: Any, return_dict: bool) -> Any:
        logs = compat.pythonify_logs(logs)
        return logs if return_dict else compat.flatten_metrics_in_order(self, logs)


def _sliceable(leaf: Any) -> Any:
    """A numpy array stays one (its slices are views; the step call converts them, on
    each replica's device); a tensor stays a tensor; anything else becomes a tensor."""
    if isinstance(leaf, np.ndarray) or tf.is_tensor(leaf):
        return leaf
    return tf.convert_to_tensor(leaf)


def make_strategy(devices: tuple[str, ...]) -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over ``devices``; ReductionToOneDevice when they are CPUs."""
    if all(":CPU:" in d.upper() for d in devices):
        return tf.distribute.MirroredStrategy(
            devices=list(devices),
            cross_device_ops=tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0]))
    return tf.distribute.MirroredStrategy(devices=list(devices))


def wrap_data_parallel(view: Any, devices: tuple[str, ...], *, plan_name: str,
                       num_microbatches: int,
                       recompute_layers: Collection[str] = ()) -> DataParallelModel:
    """Clone ``view`` (an uncompiled Functional) inside a MirroredStrategy; copy its weights.

    ``recompute_layers``: names of ``view``'s top-level layers to run through
    ``tf.recompute_grad`` (``apply.recompute.recomputed_layers(plan, view)[0]``).
    """
    strategy = make_strategy(devices)
    with strategy.scope():
        clone = clone_graph(view)
        model = DataParallelModel(clone.inputs, clone.outputs, name=view.name,
                                  plan_name=plan_name, num_microbatches=num_microbatches,
                                  num_replicas=len(devices),
                                  recompute_layers=recompute_layers)
    copy_weights(view, model)
    return model
