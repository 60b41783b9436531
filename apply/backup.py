"""``BackupAndRestore`` for wrapped models: one backup per job, any plan, preemption.

Pipeline position: under ``apply.planned_model`` and ``apply.spmd.model``, whose
``fit`` hands every ``keras.callbacks.BackupAndRestore`` in ``callbacks`` to
``planned_callbacks``, which puts a ``PlannedBackupAndRestore`` with the same settings
in its place. It writes the same files as Keras' callback (``latest.weights.h5``,
``training_metadata.json`` in ``backup_dir``), through the model's ``save_weights``
(``apply.checkpoint``: one device's layout, so a backup resumes under any plan of the
model), and adds:

* workers: the chief (worker 0) alone writes and deletes the files; every worker
  loads them; each save and the end of training wait for every worker (the model's
  ``_sync_workers``), so no worker reads a backup the chief is still writing. The
  metadata records the epoch, the batches done in it and the optimizer's step
  (``iterations``); a backup whose weights and metadata disagree (a process killed
  between the two renames) is refused with a PlannerError instead of resuming wrong;
* mid-epoch backups (``save_freq=N`` batches, or a preemption): the resumed ``fit``
  starts in that epoch and skips the batches already trained (the data must come in
  the same order: ``shuffle=False`` or a seeded order), so it continues exactly; Keras'
  own callback restarts the epoch and trains those batches twice;
* preemption: during ``fit``, SIGTERM (what a scheduler or ``plan launch`` sends)
  sets a flag; at the end of each batch every worker learns whether any worker got
  one (a collective sum over the workers, one scalar per batch), and then all of them
  save a backup of that same step and exit with code 0 (``SystemExit``), as
  tf.distribute's ``PreemptionCheckpointHandler`` does for its checkpoints.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from typing import Any, Sequence

import keras

from tfplan.core.atomic import copy_file, write_json
from tfplan.core.errors import PlannerError

PREEMPTED_EXIT_CODE = 0  # a preempted worker saved its backup: a clean exit


def release(callbacks: Sequence[Any] | None) -> None:
    """After ``fit``: the SIGTERM handlers of ``planned_callbacks``' callbacks are gone."""
    for c in callbacks or ():
        if isinstance(c, PlannedBackupAndRestore):
            c.release()


class OneProcessBackupHooks:
    """The hooks ``PlannedBackupAndRestore`` calls on its model, for a model that runs in
    one process (``apply.planned_model.PlannedModel``, ``apply.spmd.SpmdModel``); the
    multi-worker models override the first two."""

    def _sync_workers(self) -> None:
        """Wait for every worker of the job (one process: nothing to wait for)."""

    def _any_worker(self, flag: bool) -> bool:
        """True on every worker when ``flag`` is True on any (one process: ``flag``)."""
        return bool(flag)

    def _skip_first_batches(self, n: int) -> None:
        """The next ``n`` calls of ``fit``'s train function take their batch and do not
        train on it (a backup made ``n`` batches into the epoch resumes after them)."""
        import tensorflow as tf

        function = self.train_function
        per_call = max(1, int(self.steps_per_execution))
        left = [int(n) // per_call]

        def skipping(iterator: Any) -> Any:
            if left[0] <= 0:
                self.train_function = function
                return function(iterator)
            left[0] -= 1
            for _ in range(per_call):
                if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                    iterator.get_next()
                else:
                    next(iterator)
            return {}

        self.train_function = skipping


def planned_callbacks(callbacks: Sequence[Any] | None) -> list[Any] | None:
    """``callbacks`` with each plain ``keras.callbacks.BackupAndRestore`` replaced by a
    ``PlannedBackupAndRestore`` of the same settings (subclasses are left alone)."""
    if callbacks is None:
        return None
    return [PlannedBackupAndRestore.like(c) if type(c) is keras.callbacks.BackupAndRestore
            else c for c in callbacks]


class PlannedBackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras' BackupAndRestore for wrapped models (see the module docstring).

    The model provides ``is_chief`` (True when absent), ``_sync_workers()``,
    ``_any_worker(flag)`` and ``_skip_first_batches(n)`` (``OneProcessBackupHooks``, or a
    multi-worker model's own).
    """

    @classmethod
    def like(cls, original: keras.callbacks.BackupAndRestore) -> "PlannedBackupAndRestore":
        return cls(original.backup_dir, save_freq=original.save_freq,
                   double_checkpoint=original.double_checkpoint,
                   delete_checkpoint=original.delete_checkpoint)

    def __init__(self, backup_dir: str, save_freq: Any = "epoch",
                 double_checkpoint: bool = False, delete_checkpoint: bool = True) -> None:
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        self._epoch = 0  # the epoch being trained (or next, after an epoch's end)
        self._done = 0  # batches of it trained
        self._preempted = False
        self._previous_handler: Any = None

    # --- workers --------------------------------------------------------------------------
    @property
    def _chief(self) -> bool:
        return bool(getattr(self.model, "is_chief", True))

    def _sync(self) -> None:
        sync = getattr(self.model, "_sync_workers", None)
        if sync is not None:
            sync()

    # --- restore --------------------------------------------------------------------------
    def on_train_begin(self, logs: Any = None) -> None:
        self._install_handler()
        super().on_train_begin(logs)

    def _load_model(self) -> None:
        if not self.model.built:
            super()._load_model()  # Keras' error
            return
        self._sync()  # every worker starts from the same files
        optimizer = self.model.optimizer
        loaded = os.path.exists(self._weights_path)
        if loaded:
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            self.model.load_weights(self._weights_path)
        if not os.path.exists(self._training_metadata_path):
            if loaded and optimizer is not None and int(optimizer.iterations.numpy()):
                raise self._mismatch("no training_metadata.json beside it")
            return
        with open(self._training_metadata_path, encoding="utf-8") as f:
            meta = json.load(f)
        step = meta.get("iterations")
        if loaded and optimizer is not None and step is not None and \
                int(optimizer.iterations.numpy()) != int(step):
            raise self._mismatch(f"training_metadata.json says step {step}, the weights' "
                                 f"optimizer step {int(optimizer.iterations.numpy())}")
        self._epoch = self.model._initial_epoch = int(meta["epoch"])
        done = int(meta.get("batches_done", 0))
        if done:
            self.model._skip_first_batches(done)

    def _mismatch(self, what: str) -> PlannerError:
        return PlannerError(
            f"The backup in {self.backup_dir!r} is incomplete: {what} (a process was killed "
            "between writing the weights and the metadata). Resume from the previous backup "
            "(double_checkpoint=True keeps one: copy the .bkp files over) or delete the "
            "directory to start again.")

    # --- save -----------------------------------------------------------------------------
    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch, self._done = epoch, 0

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._epoch, self._done = epoch + 1, 0
        super().on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._done = batch + 1
        any_worker = getattr(self.model, "_any_worker", lambda flag: flag)
        if any_worker(self._preempted):  # every worker, the same answer
            self._save_model()
            self._restore_handler()
            raise SystemExit(PREEMPTED_EXIT_CODE)
        super().on_train_batch_end(batch, logs)

    def _save_model(self) -> None:
        chief = self._chief
        if chief:
            os.makedirs(self.backup_dir, exist_ok=True)
            if self.double_checkpoint:
                for path, prev in ((self._weights_path, self._prev_weights_path),
                                   (self._training_metadata_path,
                                    self._prev_training_metadata_path)):
                    if os.path.exists(path):
                        copy_file(path, prev)
        self._sync()  # the directory exists before anyone writes into it
        self.model.save_weights(self._weights_path, overwrite=True)  # the chief writes
        if chief:
            optimizer = self.model.optimizer
            write_json(self._training_metadata_path, {
                "epoch": self._epoch, "batch": self._done - 1 if self._done else 0,
                "batches_done": self._done,
                "iterations": None if optimizer is None else int(optimizer.iterations.numpy())})
        self._sync()

    # --- the end --------------------------------------------------------------------------
    def on_train_end(self, logs: Any = None) -> None:
        self._restore_handler()
        self._sync()
        if self._chief and self.delete_checkpoint and os.path.exists(self.backup_dir):
            shutil.rmtree(self.backup_dir)
        self._sync()

    # --- SIGTERM --------------------------------------------------------------------------
    def _install_handler(self) -> None:
        self._preempted = False
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._preempted = True

    def release(self) -> None:
        """Give SIGTERM back to the handler before ``fit`` (``fit`` calls it when training
        stops, also by an exception)."""
        self._restore_handler()

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
