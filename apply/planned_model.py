"""``PlannedModel``: the Keras model ``apply.wrap`` returns, and what every mode shares.

Pipeline position: the last step of ``apply.wrap``; ``apply.data_parallel`` and
``apply.pipeline`` subclass it. A PlannedModel is a ``keras.Model`` (a
Functional over the re-created layers, with the same layer names and weight
order as the user's model, so weight files load either way) that adds:

* batch checks: every training batch must split evenly into
  ``dp * num_microbatches`` parts; ``fit``/``train_on_batch`` check array and
  ``tf.data`` inputs before training starts, and the train step checks again
  when it is traced (a PlanMismatchError either way, before any update); every
  batch's inputs must have the per-sample shape the plan was made for where the model
  leaves a dimension dynamic (``apply.input_shapes``: checked the same ways, in the
  train, test and predict steps);
* GPipe-style gradient accumulation (``num_microbatches > 1``, and always in
  placed models): the batch is split into equal micro-batches, each one's mean
  loss and gradients are computed, the gradients are averaged and applied in one
  optimizer update. Averaging equal-size micro-batch means gives the full-batch
  mean, so the loss and the update equal one step on the whole batch (for
  models without batch statistics such as BatchNormalization). All micro-batches
  live in one ``tf.function`` graph, so TensorFlow's executor overlaps stages
  that do not depend on each other; a placed model with a 1F1B or interleaved
  plan adds control dependencies that fix the planned order (``apply.schedule``);
* ``model.save(...)`` files that ``keras.models.load_model`` reads back as a
  plain Functional model once ``apply`` is imported (the subclasses are
  registered with Keras under the package name ``tfplan``; files saved by 0.1,
  under ``apply``, fail with a message that says how to convert them:
  ``apply.legacy_names``);
* weight files (``save_weights``, ``save``) whose optimizer state has one device's
  layout, so any plan of the model, or the plain model, loads them
  (``apply.checkpoint``), and ``fit`` that makes ``keras.callbacks.BackupAndRestore``
  safe across workers, exact mid-epoch and on SIGTERM (``apply.backup``);
* ``compile``/``compile_from_config`` that run the subclass's hooks (enter a
  strategy scope, place optimizer slots), so calling ``compile()`` on the
  wrapped model after ``wrap`` works as usual;
* for a model wrapped with ``logdir``, ``fit`` adds ``apply.monitor.PlanMonitor``
  (predicted against measured step times).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import keras
import tensorflow as tf

from tfplan import compat
from tfplan.apply.backup import OneProcessBackupHooks, planned_callbacks, release
from tfplan.apply.batch_stats import GLOBAL, install, stepping
from tfplan.apply.batches import (KERAS_DEFAULT_BATCH_SIZE, RUNTIME_BATCH_CHECK,
                                  concat_batches, leading_dim, nearest_multiples,
                                  split_microbatches)
from tfplan.apply.checkpoint import (CanonicalWeight, canonical_optimizer_io, plain_layout,
                                     save_atomically)
from tfplan.apply.input_shapes import RUNTIME_SHAPE_CHECK, InputShapeChecks, runtime_error
from tfplan.apply.joint_forward import joint_forward
from tfplan.apply.monitor import PlanMonitor
from tfplan.apply.placement import on_variable_device
from tfplan.core.errors import PlanMismatchError


class PlannedModel(InputShapeChecks, OneProcessBackupHooks, compat.functional_class()):
    """A Functional model trained according to a plan (see the module docstring)."""

    def __init__(self, inputs: Any, outputs: Any, name: str | None = None, *,
                 plan_name: str = "", num_microbatches: int = 1, num_replicas: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(inputs, outputs, name=name, **kwargs)
        self.plan_name = plan_name
        self.num_microbatches = int(num_microbatches)
        self.num_replicas = int(num_replicas)
        # how BatchNormalization's statistics are computed (apply.batch_stats); None: the
        # model has no BatchNormalization layer (or the plan was not applied to it)
        self.batch_norm: str | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        """A saved wrapped model (``model.save``) loads as a plain Functional model.

        Placement belongs to a process, not to a file: wrap the loaded model again.
        """
        return compat.functional_from_config(config, custom_objects)

    # --- hooks for the modes ----------------------------------------------------------
    def _compile_scope(self) -> Any:
        """Context that compile() and the optimizer's creation run in."""
        return contextlib.nullcontext()

    def _prepare_optimizer(self, optimizer: Any) -> Any:
        return optimizer

    def _after_compile(self) -> None:
        pass

    def _loss_and_gradients(self, x: Any, y: Any, sample_weight: Any,
                            variables: list[Any]) -> tuple[Any, Any, list[Any]]:
        """(y_pred, loss, gradients) for one micro-batch, with the trainer's own loss rules."""
        with tf.GradientTape() as tape:
            y_pred, loss, scaled = self._forward_loss(x, y, sample_weight)
        return y_pred, loss, tape.gradient(scaled, variables)

    def _apply_gradients(self, gradients: list[Any], variables: list[Any]) -> None:
        self.optimizer.apply_gradients(zip(gradients, variables))

    def _microbatch_gradients(self, gradients: list[Any], variables: list[Any]) -> list[Any]:
        """One micro-batch's gradients as they are accumulated (ZeRO-2 reduces them onto
        each weight's owner first: ``apply.zero``); here unchanged."""
        return gradients

    def _uses_microbatch_step(self) -> bool:
        return self.num_microbatches > 1 or self.batch_norm is not None

    def replica_models(self) -> tuple[Any, ...]:
        """This model and its other data-parallel copies that this process trains in one
        step (``apply.tensor_parallel``); the same layers, by name, in each."""
        return (self,)

    def wrap_operation(self, operation: Any, fn: Any) -> Any:
        """``fn`` (a call of ``operation``, one of this model's layers) as this model's
        forward pass runs it: on its device, recomputed, ... (subclasses)."""
        return fn

    def operation_device(self, operation: Any) -> str | None:
        """The device ``operation`` runs on; None where tf.distribute places it."""
        return None

    def set_batch_norm(self, mode: str) -> int:
        """Make the BatchNormalization layers of this model and its copies follow ``mode``
        (``apply.batch_stats``); returns how many layers each copy has."""
        counts = {install(model, mode) for model in self.replica_models()}
        count = counts.pop()
        self.batch_norm = mode if count else None
        return count

    def _gradients(self, tape: Any, target: Any, variables: list[Any]) -> list[Any]:
        """Gradients of ``target`` with respect to ``variables`` (recorded on ``tape``)."""
        return tape.gradient(target, variables)

    def _step_schedule(self) -> Any:
        """Context around one train step's micro-batches; yields None, or a function called
        with each micro-batch's index before it is traced (``apply.pipeline`` enforces a
        1F1B or interleaved order with it: ``apply.schedule``)."""
        return contextlib.nullcontext(None)

    # --- compile ------------------------------------------------------------------------
    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        with self._compile_scope():
            optimizer = self._prepare_optimizer(keras.optimizers.get(optimizer))
            super().compile(optimizer, *args, **kwargs)
        self._after_compile()

    def compile_from_config(self, config: dict[str, Any]) -> None:
        with self._compile_scope():
            config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)

    # --- files: the optimizer's state in one device's layout (apply.checkpoint) ----------
    def _checkpoint_layout(self) -> list[CanonicalWeight]:
        """Where each trainable weight of the user's model lives here (its copies and
        shards), in the user's order; ``apply.tensor_parallel`` overrides it."""
        return plain_layout(self.trainable_variables)

    def _checkpoint_extra_slots(self) -> dict[tuple[int, int], Any]:
        """Optimizer slots other processes keep ({(id(variable), k): value}); none here."""
        return {}

    def save_weights(self, filepath: Any, overwrite: bool = True,
                     max_shard_size: Any = None) -> None:
        """Keras' ``save_weights``, the optimizer's state in one device's layout (so any
        plan of this model, or the plain model, loads it), written to a temporary file
        renamed over ``filepath`` (never seen half-written)."""
        with canonical_optimizer_io(getattr(self, "optimizer", None), self._checkpoint_layout,
                                    self._checkpoint_extra_slots):
            if (not overwrite and os.path.exists(os.fspath(filepath))) or max_shard_size:
                super().save_weights(filepath, overwrite=overwrite,
                                     max_shard_size=max_shard_size)
                return
            save_atomically(lambda path: super(PlannedModel, self).save_weights(
                path, overwrite=True), filepath)

    def load_weights(self, filepath: Any, skip_mismatch: bool = False, **kwargs: Any) -> Any:
        """Keras' ``load_weights`` of a file from any plan of this model (or the plain
        model): the optimizer's state is split and assigned to every copy and shard."""
        with canonical_optimizer_io(getattr(self, "optimizer", None), self._checkpoint_layout):
            return super().load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)

    def save(self, filepath: Any, overwrite: bool = True, zipped: Any = None,
             **kwargs: Any) -> None:
        """Keras' ``save``, the optimizer's state in one device's layout."""
        with canonical_optimizer_io(getattr(self, "optimizer", None), self._checkpoint_layout,
                                    self._checkpoint_extra_slots):
            super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    # --- batch checks -------------------------------------------------------------------
    @property
    def batch_multiple(self) -> int:
        """Every training batch must be a multiple of this (``dp * num_microbatches``)."""
        return self.num_replicas * self.num_microbatches

    def _batch_error(self, size: int, what: str) -> PlanMismatchError:
        m = self.batch_multiple
        options = nearest_multiples(size, m)
        return PlanMismatchError(
            f"{what} has {size} samples, but plan {self.plan_name!r} splits every training "
            f"batch into {self.num_replicas} data-parallel replica(s) x "
            f"{self.num_microbatches} micro-batch(es), so the batch size must be a multiple "
            f"of {m}. Use a batch size of {options} (the plan was made for its global "
            "batch), or make a plan for this batch size.")

    def _check_batch(self, size: int | None, what: str) -> None:
        if size is not None and size % self.batch_multiple:
            raise self._batch_error(size, what)

    def test_step(self, data: Any) -> Any:
        with self._shape_checked(data, "A batch given to evaluate"):
            return super().test_step(data)

    def predict_step(self, data: Any) -> Any:
        with self._shape_checked(data, "A batch given to predict"):
            return super().predict_step(data)

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None,
            *args: Any, **kwargs: Any) -> Any:
        self._check_fit_input(x, batch_size, kwargs.get("validation_split", 0.0),
                              kwargs.get("steps_per_epoch"))
        monitor_dir = getattr(self, "plan_logdir", None)  # apply.wrap(..., logdir=)
        if monitor_dir is not None and getattr(self, "plan", None) is not None and not args:
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []),
                                   PlanMonitor(self.plan, monitor_dir)]
        if "callbacks" in kwargs:  # BackupAndRestore for any plan and worker (apply.backup)
            kwargs["callbacks"] = planned_callbacks(kwargs["callbacks"])
        self._initial_epoch = None  # Keras keeps a restored epoch after fit; this fit's own
        try:
            return super().fit(x, y, batch_size, *args, **kwargs)
        except tf.errors.InvalidArgumentError as e:  # the step's own check (unknown shapes)
            if RUNTIME_SHAPE_CHECK in str(e):
                raise runtime_error(self.plan_name, str(e)) from None
            if RUNTIME_BATCH_CHECK not in str(e):
                raise
            raise PlanMismatchError(
                f"A training batch from {type(x).__name__} input could not be split into "
                f"{self.num_microbatches} equal micro-batches per replica; no update was "
                f"applied for it. Plan {self.plan_name!r} needs batch sizes that are a "
                f"multiple of {self.batch_multiple}. TensorFlow said: "
                f"{str(e).splitlines()[0][:300]}") from None
        finally:
            release(kwargs.get("callbacks"))

    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Any = None, return_dict: bool = False) -> Any:
        """Keras' ``train_on_batch`` (the batch checked first), with the metrics' reset and
        the step in one compiled call (``_reset_and_step``): Keras resets each metric
        variable with an eager op before every call, a fixed cost that a loop of
        ``train_on_batch`` calls pays each time."""
        self._check_batch(leading_dim(x), "The batch given to train_on_batch")
        self._check_input_shapes(x, "The batch given to train_on_batch")
        compat.assert_compile_called(self, "train_on_batch")
        if class_weight is not None:
            if sample_weight is not None:
                raise ValueError("Arguments `sample_weight` and `class_weight` cannot be "
                                 "specified at the same time.")
            sample_weight = compat.class_weight_to_sample_weights(y, class_weight)
        compat.maybe_symbolic_build(self, data_batch=(x, y, sample_weight))
        logs = self._reset_and_step("train", (x, y, sample_weight))
        logs = compat.pythonify_logs(logs)
        return logs if return_dict else compat.flatten_metrics_in_order(self, logs)

    def _reset_and_step(self, kind: str, data: Any) -> Any:
        """Reset the metrics, then run the ``train``/``test`` step function on one
        PerReplica batch: the logs of that batch alone, as Keras' ``*_on_batch`` gives.

        Both run in one ``tf.function`` that calls the model's own step function
        (``self.train_function``: Keras' ``strategy.run(train_step)`` and its reduction of
        the per-replica logs, or a subclass's), so the logs are the step function's own;
        one compiled call instead of two saves a dispatch per batch. The resets come first
        because every op on a metric variable runs in program order in a ``tf.function``
        (automatic control dependencies). Rebuilt when the step function or the metrics'
        variables change (``compile`` clears the step functions)."""
        if kind == "train":
            self.make_train_function()
        else:
            self.make_test_function()
        step = getattr(self, f"{kind}_function")
        if self.run_eagerly:
            self.reset_metrics()
            return step([data])
        metrics = list(self.metrics)
        key = (id(step),) + tuple(id(v) for m in metrics for v in m.variables)
        cached = getattr(self, f"_one_batch_{kind}", None)
        if cached is None or cached.key != key:
            strategy = self.distribute_strategy

            def reset_and_step(batch: Any) -> Any:
                with strategy.scope():
                    for m in metrics:
                        m.reset_state()
                    return step([batch])

            cached = _OneBatchFunction(key, tf.function(reset_and_step, reduce_retracing=True))
            setattr(self, f"_one_batch_{kind}", cached)
        with self._runtime_shape_errors():  # a retrace for new shapes checks at run time
            return cached.function(data)


    def _check_fit_input(self, x: Any, batch_size: int | None, validation_split: float,
                         steps_per_epoch: int | None) -> None:
        self._check_input_shapes(x, "The data given to fit")
        if isinstance(x, tf.data.Dataset):
            self._check_batch(leading_dim(x.element_spec), "Each batch of the dataset")
            return
        n = leading_dim(x)
        if n is None:  # a generator or PyDataset: checked when the train step is traced
            return
        if validation_split:
            n = int(math.ceil(n * (1.0 - validation_split)))
        b = batch_size or KERAS_DEFAULT_BATCH_SIZE
        if b > n:
            b = n
        self._check_batch(b, f"fit(batch_size={batch_size})'s batch")
        if n % b and steps_per_epoch is None:
            self._check_batch(n % b, f"The last batch of fit() ({n} samples in batches of "
                                     f"{b})")

    # --- the micro-batched train step ---------------------------------------------------
    def _forward_loss(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        y_pred = self(x, training=True) if compat.call_has_training_arg(self) else self(x)
        loss = compat.compute_loss(self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                   training=True)
        return y_pred, loss, self._scale_loss(loss)

    def _scale_loss(self, loss: Any) -> Any:
        """``loss`` as the optimizer differentiates it (its loss scaling, if any)."""
        return self.optimizer.scale_loss(loss) if self.optimizer is not None else loss

    def _track_loss(self, loss: Any, x: Any) -> None:
        """Add one (micro-)batch's mean loss to the loss log, weighted by its samples."""
        compat.loss_tracker(self).update_state(
            compat.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(keras.tree.flatten(x)[0])[0])

    def train_step(self, data: Any) -> Any:
        with self._shape_checked(data, "A training batch"):  # apply.input_shapes
            return self._planned_train_step(data)

    def _planned_train_step(self, data: Any) -> Any:
        if not self._uses_microbatch_step():
            return super().train_step(data)
        with stepping(self.batch_norm) as stats:  # apply.batch_stats
            if stats is not None and stats.mode == GLOBAL:
                logs = self._joint_train_step(data, stats)
            else:
                logs = self._microbatch_train_step(data)
            if stats is not None:
                stats.update_moving()
        return logs

    def _joint_train_step(self, data: Any, stats: Any) -> Any:
        """One step with global batch statistics: every micro-batch of every copy runs
        layer by layer (``apply.joint_forward``), the mean of the micro-batches' losses is
        differentiated once (the statistics join them), one update."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        m = self.num_microbatches
        models = self.replica_models()
        variables = list(self.trainable_variables)
        parts = split_microbatches((x, y, sample_weight), m, self._batch_error)
        pieces = []  # (copy, its piece of micro-batch i), micro-batch-major
        for xi, _, _ in parts:
            if len(models) == 1:
                pieces.append((0, xi))
            else:
                split = split_microbatches((xi, None, None), len(models), self._batch_error)
                pieces += [(r, xr) for r, (xr, _, _) in enumerate(split)]
        with tf.GradientTape() as tape:
            outputs = joint_forward(models, pieces, stats)
            k = len(models)
            predictions, scaled_total = [], None
            for i, (xi, yi, swi) in enumerate(parts):
                mine = outputs[i * k:(i + 1) * k]
                y_pred = mine[0] if k == 1 else concat_batches(mine)
                loss = compat.compute_loss(self, x=xi, y=yi, y_pred=y_pred,
                                           sample_weight=swi, training=True)
                self._track_loss(loss, xi)
                scaled = self._scale_loss(loss)
                scaled_total = scaled if scaled_total is None else scaled_total + scaled
                predictions.append(y_pred)
            if m > 1:
                scaled_total = scaled_total / m  # the micro-batches' mean: the batch's loss
        if variables:
            self._apply_gradients(self._gradients(tape, scaled_total, variables), variables)
        y_pred = concat_batches(predictions)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _microbatch_train_step(self, data: Any) -> Any:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        m = self.num_microbatches
        variables = list(self.trainable_variables)
        parts = split_microbatches((x, y, sample_weight), m, self._batch_error)
        total: list[Any] | None = None
        predictions = []
        with self._step_schedule() as start_microbatch:  # in order: 0, 1, ... (apply.schedule)
            for i, (xi, yi, swi) in enumerate(parts):
                if start_microbatch is not None:
                    start_microbatch(i)
                y_pred, loss, grads = self._loss_and_gradients(xi, yi, swi, variables)
                self._track_loss(loss, xi)
                if m > 1:
                    grads = self._microbatch_gradients(grads, variables)
                total = grads if total is None else [
                    _accumulate(a, g, v) for a, g, v in zip(total, grads, variables)]
                predictions.append(y_pred)
        if variables:
            averaged = total if m == 1 else [_scale(g, 1.0 / m, v)
                                             for g, v in zip(total, variables)]
            self._apply_gradients(averaged, variables)
        y_pred = concat_batches(predictions)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class _OneBatchFunction:
    """A compiled reset-and-step function and the key it was made for (not tracked by
    Keras: a plain object, so the model's attribute tracking leaves it alone)."""

    def __init__(self, key: tuple[int, ...], function: Any) -> None:
        self.key, self.function = key, function


def _accumulate(a: Any, g: Any, variable: Any) -> Any:
    if a is None or g is None:
        return g if a is None else a
    with on_variable_device(variable):
        if isinstance(a, tf.IndexedSlices) and isinstance(g, tf.IndexedSlices):
            indices = tf.concat([a.indices, tf.cast(g.indices, a.indices.dtype)], 0)
            return tf.IndexedSlices(tf.concat([a.values, g.values], 0), indices, a.dense_shape)
        return tf.convert_to_tensor(a) + tf.convert_to_tensor(g)


def _scale(g: Any, factor: float, variable: Any) -> Any:
    if g is None:
        return None
    with on_variable_device(variable):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices,
                                    g.dense_shape)
        return g * tf.cast(factor, g.dtype)
