"""Predicted against measured while a wrapped model trains: a Keras callback that writes
both into a TensorBoard run.

Pipeline position: below ``apply.planned_model``, whose ``fit`` adds ``PlanMonitor``
when the model was wrapped with ``apply.wrap(model, plan, logdir=DIR)``; anyone can
also pass it to ``fit(callbacks=[...])`` themselves. TensorBoard shows the run beside
the plan's report (``reports``). Per training step it writes, under DIR:

* ``measured/step_time_s`` and ``measured/samples_per_s`` -- wall time between the
  step's begin and end callbacks (Keras runs one step per callback pair with the
  default ``steps_per_execution=1``) and the batch over it;
* ``predicted/step_time_s`` and ``predicted/samples_per_s`` -- the plan's prediction
  (constant);
* ``measured/over_predicted`` -- their ratio;
* once, a Custom Scalars layout (``STEP_TIME_CHART``): one chart per training run with
  the measured and the predicted step time together, and one with samples/s (the
  Scalars tab draws a chart per tag, so it shows them apart).

At the end of each epoch and of training it also writes
``DIR/train/plugins/parallel_plan/training.json`` (``TRAINING_FILE``): the plan's name,
the steps measured, the median measured and the predicted step time and their ratio,
so that the "Parallel plan" dashboard (``reports.plugin``) lists training runs without
reading event files.

The first ``warmup_steps`` steps (tracing and compiling the step function) are not
written. Step times are measured on the host, so they include the framework's per-step
overhead the plan predicts only when it was calibrated (``plan analyze --measured``).
"""
from __future__ import annotations

import os
import time

import keras

from tfplan.planner.plan import Plan


# The Custom Scalars tab's charts: a title and the tags (a regular expression) drawn
# together, measured beside predicted
STEP_TIME_CHART = (("step time (s): measured and predicted", r"(measured|predicted)/step_time_s"),
                   ("samples/s: measured and predicted", r"(measured|predicted)/samples_per_s"))


def _layout_summary() -> bytes:
    """The Custom Scalars layout of ``STEP_TIME_CHART``, serialized."""
    from tensorboard.plugins.custom_scalar import layout_pb2, summary as custom_scalar
    layout = layout_pb2.Layout(category=[layout_pb2.Category(
        title="predicted vs measured", chart=[
            layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(
                tag=[tags])) for title, tags in STEP_TIME_CHART])])
    return custom_scalar.pb(layout).SerializeToString()


TRAINING_FILE = os.path.join("plugins", "parallel_plan", "training.json")  # under DIR/train


def training_summary(plan: Plan, step_times_s: list[float]) -> dict:
    """What ``TRAINING_FILE`` holds: the measured steps' median step time against the
    plan's prediction (the median: a few slow steps -- a checkpoint, a host hiccup --
    do not move it)."""
    import statistics
    from tfplan.core.schema import SCHEMA_VERSION
    measured = statistics.median(step_times_s) if step_times_s else None
    predicted = plan.predicted.step_time_s
    return {"schema_version": SCHEMA_VERSION, "plan": plan.name,
            "model": plan.model_name, "steps": len(step_times_s),
            "measured_step_time_s": measured, "predicted_step_time_s": predicted,
            "measured_over_predicted": measured / predicted if measured else None}


class PlanMonitor(keras.callbacks.Callback):
    """Writes the plan's predicted and the measured step time per training step."""

    def __init__(self, plan: Plan, logdir: str | os.PathLike, warmup_steps: int = 1) -> None:
        super().__init__()
        self.plan = plan
        self.logdir = os.fspath(logdir)
        self.warmup_steps = warmup_steps
        self._writer = None
        self._start = 0.0
        self._step = 0
        self.step_times_s: list[float] = []

    def _summary_writer(self):
        if self._writer is None:
            import tensorflow as tf
            self._writer = tf.summary.create_file_writer(os.path.join(self.logdir, "train"))
            with self._writer.as_default():
                tf.summary.experimental.write_raw_pb(_layout_summary(), step=0)
        return self._writer

    def on_train_batch_begin(self, batch: int, logs=None) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        import tensorflow as tf

        elapsed = time.perf_counter() - self._start
        self._step += 1
        if self._step <= self.warmup_steps:
            return
        self.step_times_s.append(elapsed)
        predicted = self.plan.predicted
        with self._summary_writer().as_default():
            step = self._step
            tf.summary.scalar("measured/step_time_s", elapsed, step=step)
            tf.summary.scalar("measured/samples_per_s", self.plan.global_batch / elapsed,
                              step=step)
            tf.summary.scalar("predicted/step_time_s", predicted.step_time_s, step=step)
            tf.summary.scalar("predicted/samples_per_s", predicted.samples_per_s, step=step)
            tf.summary.scalar("measured/over_predicted", elapsed / predicted.step_time_s,
                              step=step)

    def _write_training_summary(self) -> None:
        from tfplan.core.atomic import write_json
        path = os.path.join(self.logdir, "train", TRAINING_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, training_summary(self.plan, self.step_times_s))

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        if self.step_times_s:
            self._write_training_summary()

    def on_train_end(self, logs=None) -> None:
        if self._writer is not None:
            self._writer.flush()
        if self.step_times_s:
            self._write_training_summary()
