"""Multi-worker data parallel: one plan, several worker processes, MultiWorkerMirroredStrategy.

Pipeline position: ``apply.ensure_devices`` calls ``apply.workers.ensure_cluster``
for a plan whose devices span several workers (``/job:worker/task:w/device:CPU:i``,
made for a ``Wxcpu:N`` or ``NxPRESET`` cluster with ``num_nodes`` > 1), and
``apply.wrap`` calls ``wrap_multi_worker`` for such a plan when it is data
parallel (one stage on every device; ``apply.mode.Mode.MULTI_WORKER``). The worker processes are started with
``TF_CONFIG`` set (``plan launch --workers W SCRIPT``, ``planner.launch``).

* The strategy (``apply.workers``): ``tf.distribute.MultiWorkerMirroredStrategy`` built from
  ``TF_CONFIG`` (collectives over gRPC; RING on CPUs, NCCL or RING on GPUs as
  TensorFlow chooses). TensorFlow accepts it only before its runtime starts,
  so a training script calls ``apply.ensure_devices(plan)`` right after
  ``load_plan`` (``examples/train.py`` does), and ``wrap`` reuses it.
  One strategy per process.
* Devices: on CPU, one replica per worker (the strategy uses each worker's
  ``CPU:0``: plan with ``Wxcpu:1``, or ``Wxcpu:N`` with one device per worker;
  GPUs are hidden from a CPU plan; a plan with more devices per worker is a
  hybrid, ``apply.multi_worker_hybrid``, and ``ensure_cluster`` makes this
  worker's logical CPUs for it); on GPUs,
  every local GPU of each worker (the plan's ``devices_per_node`` must equal the
  visible GPUs).
* Data: every worker runs the same script on the same data (same seed), and
  hands the *whole global batch* to the model; the strategy gives global
  replica ``r`` of ``R`` its slice ``[r*B/R, (r+1)*B/R)`` of each batch. So a
  worker never needs to know how data is sharded, and one step equals one
  single-device step on the global batch: each replica's mean loss is scaled
  by ``1/R`` and the optimizer sums the gradients over all replicas of all
  workers (a collective all-reduce) before one identical update everywhere.
  ``fit(shuffle=True)`` shuffles arrays with the same seed on every worker.
* The step: Keras' own ``fit`` fails under this strategy in Keras 3
  (keras-team/keras#20585: its per-replica outputs cannot be reduced), so this
  model runs its own loops: ``strategy.run(train_step)`` (Keras' train step,
  or the micro-batched one of ``apply.planned_model``) inside a
  ``tf.function``, then the metrics are read in cross-replica context (Keras
  metric variables are summed on read across all replicas, so logs are exact
  global means). ``fit`` takes arrays or a ``tf.data.Dataset`` of global
  batches, ``epochs``, ``batch_size``, ``shuffle``, ``steps_per_epoch``,
  ``validation_data``, ``callbacks`` and ``verbose`` (progress bar on the chief
  only); ``evaluate`` and ``predict`` split each batch over the replicas (an
  uneven split is allowed there) and every worker gets the full result;
* Files: ``save_weights`` is written by the chief (worker 0) only, then all
  workers wait for each other; ``load_weights`` reads the file on every worker.
"""
from __future__ import annotations

from typing import Any, Collection

import keras
import numpy as np
import tensorflow as tf

from tfplan import compat
from tfplan.apply.backup import planned_callbacks, release
from tfplan.apply.batches import KERAS_DEFAULT_BATCH_SIZE, leading_dim
from tfplan.apply.cloning import clone_graph, copy_weights
from tfplan.apply.data_parallel import DataParallelModel
from tfplan.apply.workers import get_strategy
from tfplan.core.errors import PlanMismatchError, PlannerError

SHUFFLE_SEED = 1337  # fit(shuffle=True): the same order on every worker, per epoch


# --- the model ----------------------------------------------------------------------------

@keras.saving.register_keras_serializable(package="tfplan")
class MultiWorkerModel(DataParallelModel):
    """A DataParallelModel under MultiWorkerMirroredStrategy, with its own loops."""

    @property
    def is_chief(self) -> bool:
        return self.distribute_strategy.cluster_resolver.task_id in (0, None)

    # --- step functions: strategy.run, then metrics read across all replicas ----------
    def _make_function(self, step: Any, reduce_metrics: bool) -> Any:
        strategy = self.distribute_strategy

        @tf.function(reduce_retracing=True)
        def one_step(data: Any) -> Any:
            outputs = strategy.run(step, args=(data,))
            if reduce_metrics:
                return self.get_metrics_result()  # SyncOnRead sums over every replica
            return strategy.gather(outputs, axis=0)  # predictions, in replica order

        def function(batches: Any) -> Any:
            result = None
            for data in batches:
                result = one_step(data)
            return result

        return function

    def make_train_function(self, force: bool = False) -> Any:
        if self.train_function is None or force:
            self.train_function = self._make_function(self.train_step, True)
        return self.train_function

    def make_test_function(self, force: bool = False) -> Any:
        if self.test_function is None or force:
            self.test_function = self._make_function(self.test_step, True)
        return self.test_function

    def make_predict_function(self, force: bool = False) -> Any:
        if self.predict_function is None or force:
            self.predict_function = self._make_function(self.predict_step, False)
        return self.predict_function

    # --- slicing a global batch over the replicas of all workers -------------------------
    def _splits_evenly(self, x: Any) -> bool:  # evaluate/predict: any batch of >= R rows
        n = leading_dim(x)
        return n is not None and n >= self.num_replicas

    def _per_replica(self, data: Any) -> Any:
        """Global replica r gets rows [floor(r*n/R), floor((r+1)*n/R)) of the batch."""
        n = leading_dim(data)
        data = keras.tree.map_structure(tf.convert_to_tensor, data)
        bounds = [r * n // self.num_replicas for r in range(self.num_replicas + 1)]

        def replica_slice(ctx: Any) -> Any:
            r = ctx.replica_id_in_sync_group
            return keras.tree.map_structure(lambda t: t[bounds[r]:bounds[r + 1]], data)

        return self.distribute_strategy.experimental_distribute_values_from_function(
            replica_slice)

    def _small_batch_error(self, n: Any, what: str) -> PlanMismatchError:
        return PlanMismatchError(
            f"{what} has {n} samples; plan {self.plan_name!r} runs on {self.num_replicas} "
            f"replicas across workers, each needing at least one sample. Pass at least "
            f"{self.num_replicas} samples.")

    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                      return_dict: bool = False) -> Any:
        if not self._splits_evenly(x):
            raise self._small_batch_error(leading_dim(x), "The batch given to test_on_batch")
        return super().test_on_batch(x, y, sample_weight, return_dict)

    def predict_on_batch(self, x: Any) -> Any:
        if not self._splits_evenly(x):
            raise self._small_batch_error(leading_dim(x),
                                          "The batch given to predict_on_batch")
        return super().predict_on_batch(x)

    # --- fit / evaluate / predict ---------------------------------------------------------
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None,
            epochs: int = 1, verbose: Any = "auto", callbacks: Any = None,
            validation_data: Any = None, shuffle: bool = True, sample_weight: Any = None,
            initial_epoch: int = 0, steps_per_epoch: int | None = None,
            **unsupported: Any) -> Any:
        compat.assert_compile_called(self, "fit")
        _refuse(unsupported, "fit")
        self._check_fit_input(x, batch_size, 0.0, steps_per_epoch)
        verbose = 1 if verbose == "auto" else verbose
        steps = _num_batches(x, batch_size) if steps_per_epoch is None else steps_per_epoch
        callbacks = planned_callbacks(callbacks)  # BackupAndRestore across workers
        try:
            return self._fit_loop(x, y, sample_weight, batch_size, epochs, verbose, callbacks,
                                  validation_data, shuffle, initial_epoch, steps_per_epoch,
                                  steps)
        finally:
            release(callbacks)

    def _fit_loop(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None,
                  epochs: int, verbose: Any, callbacks: Any, validation_data: Any,
                  shuffle: bool, initial_epoch: int, steps_per_epoch: int | None,
                  steps: int | None) -> Any:
        callback_list = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=bool(verbose) and self.is_chief,
            verbose=verbose, epochs=epochs, steps=steps, model=self)
        self.make_train_function()
        self.stop_training = False
        self._initial_epoch, self._resume_skip = None, 0
        callback_list.on_train_begin()  # a BackupAndRestore sets the epoch (and skip) here
        initial_epoch = self._initial_epoch or initial_epoch
        logs: dict[str, Any] = {}
        for epoch in range(initial_epoch, epochs):
            self.reset_metrics()
            callback_list.on_epoch_begin(epoch)
            order = epoch if shuffle else None
            skip, self._resume_skip = self._resume_skip, 0
            for step, data in enumerate(_batches(x, y, sample_weight, batch_size, order)):
                if steps_per_epoch is not None and step >= steps_per_epoch:
                    break
                self._check_batch(leading_dim(data), "A training batch")
                callback_list.on_train_batch_begin(step)
                if step >= skip:  # trained before the backup it resumed from
                    logs = compat.pythonify_logs(
                        self.train_function([self._per_replica(data)]))
                callback_list.on_train_batch_end(step, logs)
                if self.stop_training:
                    break
            epoch_logs = dict(logs)
            if validation_data is not None:
                val = self.evaluate(*_unpack(validation_data), batch_size=batch_size,
                                    verbose=0, return_dict=True)
                epoch_logs.update({f"val_{k}": v for k, v in val.items()})
            callback_list.on_epoch_end(epoch, epoch_logs)
            if self.stop_training:
                break
        callback_list.on_train_end(logs)
        return self.history

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None,
                 callbacks: Any = None, return_dict: bool = False, **unsupported: Any) -> Any:
        compat.assert_compile_called(self, "evaluate")
        _refuse(unsupported, "evaluate")
        self.make_test_function()
        self.reset_metrics()
        logs: Any = None
        for i, data in enumerate(_batches(x, y, sample_weight, batch_size, None,
                                          min_rows=self.num_replicas)):
            if steps is not None and i >= steps:
                break
            if not self._splits_evenly(data):  # a dataset's small last batch
                raise self._small_batch_error(leading_dim(data), "A batch given to evaluate")
            logs = self.test_function([self._per_replica(data)])
        if logs is None:
            raise self._small_batch_error(leading_dim(x), "The data given to evaluate")
        logs = compat.pythonify_logs(logs)
        return logs if return_dict else compat.flatten_metrics_in_order(self, logs)

    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto",
                steps: int | None = None, callbacks: Any = None, **unsupported: Any) -> Any:
        _refuse(unsupported, "predict")
        self.make_predict_function()
        outputs = []
        for i, data in enumerate(_batches(x, None, None, batch_size, None,
                                          min_rows=self.num_replicas)):
            if steps is not None and i >= steps:
                break
            xb = data[0] if isinstance(data, tuple) else data
            if not self._splits_evenly(xb):
                raise self._small_batch_error(leading_dim(xb), "A batch given to predict")
            outputs.append(self.predict_function([(self._per_replica(xb),)]))
        if not outputs:
            raise self._small_batch_error(leading_dim(x), "The data given to predict")
        return keras.tree.map_structure(
            lambda *t: np.concatenate([np.asarray(a) for a in t], axis=0), *outputs)

    # --- files --------------------------------------------------------------------------
    def save_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """The chief (worker 0) writes the file; every worker returns once it is written."""
        if self.is_chief:
            super().save_weights(filepath, *args, **kwargs)
        self._barrier()

    # --- BackupAndRestore across workers (apply.backup) ----------------------------------
    def _sync_workers(self) -> None:
        self._barrier()

    def _any_worker(self, flag: bool) -> bool:
        strategy = self.distribute_strategy
        value = 1.0 if flag else 0.0
        flags = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(value))
        return bool(strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None).numpy() > 0)

    def _skip_first_batches(self, n: int) -> None:
        self._resume_skip = int(n)  # fit's own loop skips them

    def _barrier(self) -> None:
        strategy = self.distribute_strategy
        ones = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(1.0))
        strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)


def _refuse(unsupported: dict[str, Any], method: str) -> None:
    given = sorted(k for k, v in unsupported.items() if v not in (None, 0, 0.0, False))
    if given:
        raise PlannerError(
            f"{method}() of a multi-worker model does not support {given} (it runs its own "
            "loop: Keras' own fails under MultiWorkerMirroredStrategy, keras-team/keras#20585)."
            " Leave them out, or use a tf.data.Dataset and callbacks instead.")


def _unpack(data: Any) -> tuple[Any, ...]:
    if isinstance(data, tf.data.Dataset):
        return (data,)
    return tuple(data) if isinstance(data, (tuple, list)) else (data,)


def _num_batches(x: Any, batch_size: int | None) -> int | None:
    if isinstance(x, tf.data.Dataset):
        n = int(x.cardinality())
        return n if n >= 0 else None
    n = leading_dim(x)
    b = batch_size or KERAS_DEFAULT_BATCH_SIZE
    return None if n is None else -(-n // b)


def _batches(x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle_epoch: Any,
             min_rows: int = 1) -> Any:
    """Global batches (x, y, sample_weight) of arrays or of a tf.data.Dataset.

    ``shuffle_epoch``: None for data order, else the epoch whose permutation (the same
    on every worker) orders the arrays. A last batch of fewer than ``min_rows`` rows
    joins the batch before it (evaluate/predict need a sample per replica).
    """
    if isinstance(x, tf.data.Dataset):
        for element in x:
            yield element if isinstance(element, tuple) else (element,)
        return
    n = leading_dim(x)
    if n is None:
        raise PlannerError(
            f"A multi-worker model trains on arrays or a tf.data.Dataset; received "
            f"{type(x).__name__}. Pass numpy arrays or a dataset of global batches.")
    b = batch_size or KERAS_DEFAULT_BATCH_SIZE
    index = np.arange(n)
    if shuffle_epoch is not None:
        index = np.random.default_rng(SHUFFLE_SEED + shuffle_epoch).permutation(n)
    starts = list(range(0, n, b))
    if len(starts) > 1 and n - starts[-1] < min_rows:
        starts.pop()
    for i, start in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else n
        rows = index[start:stop]
        take = (lambda a: None if a is None else
                keras.tree.map_structure(lambda t: np.asarray(t)[rows], a))
        parts = (take(x), take(y), take(sample_weight))
        yield parts if sample_weight is not None else parts[:1] if y is None else parts[:2]


def wrap_multi_worker(view: Any, *, plan_name: str, dp: int, num_microbatches: int,
                      recompute_layers: Collection[str] = ()) -> MultiWorkerModel:
    """Clone ``view`` inside the process's MultiWorkerMirroredStrategy; copy its weights.

    Every worker builds the same model (same seed), so the copied weights agree; the
    strategy also broadcasts worker 0's initial values when the variables are made.
    """
    strategy = get_strategy()
    if strategy.num_replicas_in_sync != dp:
        raise PlanMismatchError(
            f"Plan {plan_name!r} has dp={dp}, but the workers started with TF_CONFIG have "
            f"{strategy.num_replicas_in_sync} replicas in all. Launch as many workers as the "
            "plan has, or re-plan.")
    with strategy.scope():
        clone = clone_graph(view)
        model = MultiWorkerModel(clone.inputs, clone.outputs, name=view.name,
                                 plan_name=plan_name, num_microbatches=num_microbatches,
                                 num_replicas=dp, recompute_layers=recompute_layers)
    copy_weights(view, model)
    return model
