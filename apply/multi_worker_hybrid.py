"""Hybrid plans across worker processes: data parallel between workers, placement within.

Pipeline position: ``apply.wrap`` calls ``wrap_multi_worker_hybrid`` for a plan whose
devices span several workers (``/job:worker/task:w/device:CPU:i``, a ``Wxcpu:N`` or
multi-node cluster, planned with the dp-outer layout) and whose every data-parallel
replica -- all its pipeline stages and tensor ranks -- lies on one worker, unless it is
plain data parallelism with one device per worker (``apply.multi_worker``). The workers
are started with ``TF_CONFIG`` set (``plan launch --workers W SCRIPT``), and
``apply.ensure_devices(plan)`` has made the MultiWorkerMirroredStrategy and this worker's
logical devices (``apply.workers.ensure_cluster``).

* Within a worker: its replicas (``ExecutionMode.replica_tasks``, ``apply.mode``:
  replica r's devices at ``stages[s].devices[r*tp:(r+1)*tp]``) are built exactly as on
  one host by ``apply.tensor_parallel`` (split layers sharded over their tp devices, pipeline
  stages on their devices, micro-batches, several local replicas summed by placed
  ``add_n``), from a local copy of the plan whose device names are this worker's
  (``/device:CPU:i``, which TensorFlow resolves to ``/job:worker/task:w``).
* Between workers: each training step runs the local step inside
  ``MultiWorkerMirroredStrategy.run`` (one replica per worker, on its first device),
  so Keras scales each worker's mean loss by ``1/W`` and the summed gradients are the
  whole global batch's mean gradient. The gradients of the local replicas are summed
  on the worker, then all-reduced across the workers (``ReplicaContext.all_reduce``,
  TensorFlow's collective ops: RING on CPUs), and the optimizer update runs outside
  ``strategy.run`` on each variable's device (Keras' optimizer would otherwise try a
  ``merge_call`` of its own). Every worker applies the same sum, so the copies stay
  equal.
* Data: every worker runs the same script on the same data and hands the *whole global
  batch* to the model; worker w trains on rows ``[w*B/W, (w+1)*B/W)`` of it (as
  ``apply.multi_worker`` does per replica), then its local replicas split that.
* Metrics: each worker updates its own metric variables with its rows; the step then
  all-reduces each metric variable's change in the step and adds the sum to the value
  before it, so every worker holds the metrics of the whole global batch (exact for
  Keras' metrics, whose states are sums: totals, counts, confusion counts).
* Keras' own ``fit``/``evaluate``/``predict``/``train_on_batch`` run: the wrapped model
  is not under a tf.distribute strategy outside the step (Keras' ``fit`` fails under
  MultiWorkerMirroredStrategy in Keras 3, DESIGN.md), so its loops, callbacks and
  validation work as on one host. ``evaluate`` and ``predict`` run on each worker's
  own copy over the whole data (the copies are equal), so every worker gets the full
  result. ``fit(shuffle=True)`` shuffles with Keras' seeded generator: set the same
  seed on every worker (``keras.utils.set_random_seed``), as for the model's weights.
* Files: ``save_weights`` is written by the chief (worker 0), then every worker waits
  for it; ``load_weights`` reads it on every worker.

* ZeRO-1 (``optimizer_sharding``): over every replica of the job, each weight's
  optimizer state on one of them (``apply.zero_workers``: owner update, local copies,
  an all-gather of each worker's updated weights). ZeRO-2 (``zero_stage == 2``) also
  accumulates each micro-batch's all-reduced gradient on its owner only
  (``apply.zero_workers.reduce_to_owner_workers``).

A replica that spans workers (pipeline stages or tp ranks on several workers) is not
run here but by ``apply.remote`` (worker 0 drives every device).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Collection

import keras
import tensorflow as tf

from tfplan.apply.clipping import clipped_over_one_copy, clips_globally, optimizer_clipping_off
from tfplan.apply.gradients import sum_gradients
from tfplan.apply.mode import ExecutionMode
from tfplan.apply.placement import build_optimizer_on_devices, tf_variable, top_level_devices
from tfplan.apply.tensor_parallel import TensorParallelModel, wrap_tensor_parallel
from tfplan.apply.workers import get_strategy, read_tf_config
from tfplan.apply.zero_workers import (JobWeight, apply_job_sharded, gather_slots, job_weights,
                                       owned_copies, reduce_to_owner_workers)
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan, Stage


def local_plan(plan: Plan, mode: ExecutionMode, task: int) -> Plan:
    """The part of ``plan`` worker ``task`` runs: its replicas, with local device names.
    ``mode``: the plan's ``apply.mode.execution_mode`` (a multi-worker hybrid)."""
    tasks = list(mode.replica_tasks)
    counts = {w: tasks.count(w) for w in set(tasks)}
    if len(set(counts.values())) != 1 or sorted(counts) != list(mode.worker_tasks):
        raise PlanMismatchError(
            f"Plan {plan.name!r} gives its workers different numbers of data-parallel "
            f"replicas ({dict(sorted(counts.items()))}); every worker needs the same share. "
            "Regenerate the plan.")
    tp = max(1, plan.strategy.tp)
    mine = [r for r, w in enumerate(tasks) if w == task]

    def local(name: str) -> str:
        spec = tf.DeviceSpec.from_string(name)
        return f"/device:{spec.device_type}:{spec.device_index}"

    stages = tuple(Stage(layers=stage.layers,
                         devices=tuple(local(d) for r in mine
                                       for d in stage.devices[r * tp:(r + 1) * tp]))
                   for stage in plan.stages)
    strategy = dataclasses.replace(plan.strategy, dp=len(mine))
    return dataclasses.replace(plan, stages=stages, strategy=strategy)


@keras.saving.register_keras_serializable(package="tfplan")
class MultiWorkerHybridModel(TensorParallelModel):
    """This worker's replicas of a hybrid plan, trained with every other worker's
    (see the module docstring). ``num_replicas`` is the plan's whole dp."""

    num_workers = 1
    task = 0
    zero_across_workers = False  # ZeRO-1 over every replica of the job (apply.zero_workers)
    zero2_across_workers = False  # ZeRO-2: micro-batch gradients reduced to their owners
    # (gradients, variables) from the replica step to the update; set with
    # object.__setattr__: Keras' attribute tracking would count a list of variables
    # stored on the model as more model variables (trainable_variables grew by them)
    _pending: Any = None
    _gathered_slots: Any = None  # other workers' ZeRO-1 slots while saving (save_weights)

    def _job_weights(self) -> list[JobWeight]:
        return job_weights(self.trainable_variables, 1 + len(self._others.models),
                           self.num_workers)

    def _after_compile(self) -> None:
        if self.zero_across_workers:  # slots for the copies this worker owns only
            build_optimizer_on_devices(self.optimizer,
                                       owned_copies(self._job_weights(), self.task))
            return
        super()._after_compile()

    @property
    def is_chief(self) -> bool:
        return self.task == 0

    # --- the step -----------------------------------------------------------------------
    def train_step(self, data: Any) -> Any:
        strategy = get_strategy()
        rows = keras.tree.map_structure(self._my_rows, data)
        strategy.run(self._replica_step, args=(rows,))
        gradients, variables = self._pending
        object.__setattr__(self, "_pending", None)
        if variables:  # the update, on each variable's device, outside strategy.run
            copies = 1 + len(self._others.models)  # global_clipnorm over one copy
            gradients = clipped_over_one_copy(self.optimizer, gradients, variables, copies)
            placed_update = super(TensorParallelModel, self)._apply_gradients
            with optimizer_clipping_off(self.optimizer):
                if self.zero_across_workers:  # ZeRO-1 over the job (apply.zero_workers)
                    apply_job_sharded(placed_update, self.optimizer, gradients,
                                      self._job_weights(), self.task, self.num_workers,
                                      strategy)
                else:
                    placed_update(gradients, variables)
        return self.get_metrics_result()

    def _my_rows(self, t: Any) -> Any:
        if t is None:
            return None
        n = t.shape[0]
        per = n // self.num_workers if n is not None else tf.shape(t)[0] // self.num_workers
        return t[self.task * per:(self.task + 1) * per]

    def _replica_step(self, data: Any) -> None:
        """The local step in this worker's replica context: loss, gradients summed over
        the local replicas and all-reduced over the workers (stashed for the update),
        metrics updated with the whole global batch."""
        ctx = tf.distribute.get_replica_context()
        metric_vars = [tf_variable(v) for m in self.metrics for v in m.variables]
        before = [v.read_value() for v in metric_vars]
        self._collecting = True
        try:
            TensorParallelModel.train_step(self, data)  # ends in _apply_gradients below
        finally:
            self._collecting = False
        deltas = [v.read_value() - b for v, b in zip(metric_vars, before)]
        if deltas:
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, deltas)
            for v, b, d in zip(metric_vars, before, summed):
                v.assign(b + d)

    def _microbatch_gradients(self, gradients: list[Any], variables: list[Any]) -> list[Any]:
        if not self.zero2_across_workers:
            return super()._microbatch_gradients(gradients, variables)
        if clips_globally(self.optimizer):
            raise PlannerError(
                f"Plan {self.plan_name!r} runs ZeRO-2 across workers with several "
                "micro-batches, where each worker holds only its own weights' gradients, "
                "but the optimizer clips by global_clipnorm (a norm over every gradient). "
                "Use clipnorm (per weight), or zero_stage 1.")
        # ZeRO-2: all-reduced now, kept by the owner only, accumulated there
        return reduce_to_owner_workers(gradients, self._job_weights(), self.task)

    def _apply_gradients(self, gradients: list[Any], variables: list[Any]) -> None:
        if not getattr(self, "_collecting", False):
            raise PlannerError("apply: a multi-worker hybrid model updates its weights only "
                               "inside its own train step (fit/train_on_batch).")
        if self.zero2_across_workers and self.num_microbatches > 1:  # reduced per micro-batch
            object.__setattr__(self, "_pending", (list(gradients), list(variables)))
            return
        dp = 1 + len(self._others.models)
        n = len(variables) // dp
        sums: list[Any] = []
        for i in range(n):  # the local replicas' sum, on replica 0's copy's device
            grads = [gradients[r * n + i] for r in range(dp)]
            if any(g is None for g in grads):
                sums.append(None)
                continue
            with tf.device(tf_variable(variables[i]).device):
                sums.append(sum_gradients(grads))  # IndexedSlices stay sparse (Adam treats them so)
        present = [s for s in sums if s is not None]
        reduced = iter(tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, present) if present else [])
        total = [None if s is None else next(reduced) for s in sums]
        object.__setattr__(self, "_pending", ([total[i] for _ in range(dp) for i in range(n)],
                                              list(variables)))

    # --- files --------------------------------------------------------------------------
    def save_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """The chief (worker 0) writes the file; every worker returns once it is written.
        ZeRO-1 across workers: first every worker's optimizer slots are gathered (the file
        holds the whole optimizer state, ``apply.checkpoint``)."""
        gathered = None
        optimizer = getattr(self, "optimizer", None)
        if self.zero_across_workers and optimizer is not None and optimizer.built:
            gathered = gather_slots(optimizer, self._job_weights(), self.task,
                                    self.num_workers, get_strategy())
        object.__setattr__(self, "_gathered_slots", gathered)
        try:
            if self.is_chief:
                super().save_weights(filepath, *args, **kwargs)
        finally:
            object.__setattr__(self, "_gathered_slots", None)
        barrier()

    def _checkpoint_extra_slots(self) -> dict[tuple[int, int], Any]:
        return self._gathered_slots or {}


    # --- BackupAndRestore across workers (apply.backup) ----------------------------------
    def _sync_workers(self) -> None:
        barrier()

    def _any_worker(self, flag: bool) -> bool:
        strategy = get_strategy()
        value = 1.0 if flag else 0.0
        flags = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(value))
        return bool(strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None).numpy() > 0)


def barrier() -> None:
    """Wait until every worker reaches this point (a collective sum of ones)."""
    strategy = get_strategy()
    ones = strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(1.0))
    strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)


def wrap_multi_worker_hybrid(view: Any, plan: Plan, mode: ExecutionMode, *,
                             recompute_layers: Collection[str] = ()) -> MultiWorkerHybridModel:
    """This worker's replicas of ``plan`` (``local_plan``), built by apply.tensor_parallel,
    as a MultiWorkerHybridModel that trains with the other workers. ``mode``: the plan's
    ``apply.mode.execution_mode``, a multi-worker hybrid."""
    workers, task = read_tf_config()
    strategy = get_strategy()
    if strategy.num_replicas_in_sync != len(workers):
        raise PlanMismatchError(
            f"Plan {plan.name!r} trains a hybrid across {len(workers)} workers with one "
            f"MultiWorkerMirroredStrategy replica each, but the strategy has "
            f"{strategy.num_replicas_in_sync}. Run each worker on CPUs (GPUs hidden) or "
            "re-plan.")
    zero = plan.strategy.optimizer_sharding  # over the whole job, not per worker
    mine = local_plan(plan, mode, task)
    mine = dataclasses.replace(mine, strategy=dataclasses.replace(
        mine.strategy, zero_stage=0))
    model = wrap_tensor_parallel(view, mine, top_level_devices(mine),
                                 recompute_layers=recompute_layers)
    model.__class__ = MultiWorkerHybridModel  # replica 0 of this worker drives the step
    model.zero_across_workers = zero
    model.zero2_across_workers = plan.strategy.zero_stage == 2  # (stage 3: apply.dimensions)
    model.num_workers, model.task = len(workers), task
    model.num_replicas = plan.strategy.dp  # batches split in dp x num_microbatches parts
    model.plan_name = plan.name
    return model
