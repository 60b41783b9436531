"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) as each device's order of forward and
backward passes, and their enforcement in a traced train step by control dependencies.

Pipeline position: ``apply.wrap`` turns the plan into a ``PipelineSchedule``
(``schedule_of``) and hands it to ``apply.pipeline.wrap_placed`` (and to each
tensor-parallel replica, ``apply.tensor_parallel``). The placed model's train step
(``apply.planned_model``) traces its micro-batches in order inside ``tracing``;
``apply.pipeline.PlacedModel`` asks the active ``ScheduleTrace`` which control
inputs each layer call needs and tells it which tensors finish each backward pass.

How it works:

* Orders (pure Python, ``planner.pipeline_order``: shared with ``reports.images``).
  Model chunk (stage) ``k`` of ``plan.stages`` runs on pipeline device ``k % pp``;
  ``device_order`` lists device ``d``'s slots with ``w`` warm-up forwards: GPipe w = all
  forwards; 1F1B / PipeDream-Flush (Narayanan et al., SC'21, Sec. 2.2.1) w = pp - d - 1;
  interleaved 1F1B (Sec. 2.2.2) w = 2 (pp - d - 1) + (v - 1) pp, at most m v.
* The rule. A device's forward slot number ``f`` (counting its forwards from 0) may
  start only after its first ``max(0, f - w)`` backward slots have finished
  (``forward_waits``). For 1F1B that is: on stage s of p, micro-batch j's forward
  waits for the backward of micro-batches 0 .. j - (p - s), so at most p - s
  micro-batches hold activations on stage s (``max_in_flight``). Only these
  forward-after-backward edges are added: they are what bounds activation memory; the
  order among a device's forwards (and among its backwards) is left to the data flow.
* No cycles. A backward pass of micro-batch j needs all of j's forwards (data), so a
  forward waiting for a backward of the same or a later micro-batch would deadlock.
  Every wait is checked to point at earlier micro-batches (``forward_waits`` raises
  ``PlannerError`` otherwise); then each edge goes from a lower micro-batch to a higher
  one and the graph is acyclic. Tracing micro-batches in order (0, 1, ...) makes every
  awaited backward exist before the forward that waits for it is traced.
* In the graph (``ScheduleTrace``). A slot's backward (micro-batch j, stage k) is the
  gradients w.r.t. stage k's variables and w.r.t. the activations stage k received
  from other stages (extra ``xs`` of the micro-batch's ``tf.gradients``: the same
  gradients, so the same losses and weights as GPipe). Per device a chain of
  ``NoOp`` markers stands for "its first n backward slots are done"; each layer call of
  micro-batch j on stage k runs under ``tf.control_dependencies`` on the marker its
  forward slot waits for. Data-parallel replicas of a pipeline (``apply.tensor_parallel``)
  share the step's trace: a stage's forward in any replica waits for that backward slot
  of every replica (they meet at the gradient sum anyway).
* Not ordered: ``run_eagerly=True`` (no graph; the tape computes the gradients), and
  pipelines across worker processes.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from tfplan.apply.placement import operation_values
from tfplan.core.errors import PlannerError
from tfplan.planner.pipeline_order import Slot, device_order  # noqa: F401 (re-exported)

SCHEDULED = ("1f1b", "interleaved")  # the schedules whose order is enforced


@dataclass(frozen=True)
class PipelineSchedule:
    """What ``apply`` needs of a plan's pipeline schedule (no TF objects)."""

    kind: str  # "gpipe", "1f1b" or "interleaved"
    pp: int
    virtual_stages: int
    num_microbatches: int
    stage_of_layer: tuple[tuple[str, int], ...]  # top-level layer name, stage index

    def device_orders(self) -> tuple[tuple[Slot, ...], ...]:
        return tuple(device_order(self.kind, d, self.pp, self.virtual_stages,
                                  self.num_microbatches) for d in range(self.pp))

    def forward_waits(self) -> dict[tuple[int, int], int]:
        """``{(micro-batch, stage): n}``: that forward waits for the first n backward slots
        of its device (see the module docstring); PlannerError if that would deadlock."""
        return forward_waits(self.device_orders(),
                             f"{self.kind!r} (pp={self.pp}, v={self.virtual_stages}, "
                             f"m={self.num_microbatches})")

    def max_in_flight(self) -> tuple[int, ...]:
        """Per device, the most (micro-batch, chunk) forwards started whose backward has not
        finished, under the order (1F1B: p - d on device d)."""
        out = []
        for order in self.device_orders():
            started = finished = peak = 0
            for slot in order:
                if slot.kind == "F":
                    started += 1
                    peak = max(peak, started - finished)
                else:
                    finished += 1
            out.append(peak)
        return tuple(out)


def forward_waits(orders: Sequence[Sequence[Slot]],
                  label: str = "") -> dict[tuple[int, int], int]:
    """``{(micro-batch, stage): n}`` for devices' ``orders``: each forward waits for the
    backward slots before it on its device, the first n; PlannerError where one of those is
    of the same or a later micro-batch (its backward needs this forward: a cycle)."""
    waits: dict[tuple[int, int], int] = {}
    for order in orders:
        backwards: list[Slot] = []
        for slot in order:
            if slot.kind == "B":
                backwards.append(slot)
                continue
            waits[(slot.microbatch, slot.stage)] = len(backwards)
            late = [b for b in backwards if b.microbatch >= slot.microbatch]
            if late:
                raise PlannerError(
                    f"Pipeline schedule {label} puts the backward of micro-batch "
                    f"{late[0].microbatch} (stage {late[0].stage}) before the forward of "
                    f"micro-batch {slot.microbatch} (stage {slot.stage}), which it needs: a "
                    "deadlock. Re-plan with --schedule 1f1b or gpipe.")
    return waits


def schedule_of(plan: Any) -> PipelineSchedule | None:
    """The plan's schedule when it is one ``apply`` enforces (1F1B, interleaved), else None
    (GPipe and gradient accumulation need no extra order)."""
    s = plan.strategy
    if s.schedule not in SCHEDULED or s.pp < 2:
        return None
    stage_of_layer: dict[str, int] = {}
    spanning: set[str] = set()
    entries = {name for stage in plan.stages for name in stage.layers}
    for k, stage in enumerate(plan.stages):
        for name in stage.layers:
            top = name.split("/", 1)[0]  # apply places top level
            if stage_of_layer.setdefault(top, k) != k and top not in entries:
                spanning.add(top)  # a nested model on several stages
    if spanning:
        import warnings

        warnings.warn(
            f"Plan {plan.name!r} has a {s.schedule} schedule, but nested model(s) "
            f"{sorted(spanning)} run on several of its stages, and the schedule orders "
            "whole top-level layers; the micro-batches run in GPipe order (all forwards, "
            "then all backwards). Build the model from the nested model's layers to keep "
            f"{s.schedule}.", stacklevel=3)
        return None
    schedule = PipelineSchedule(kind=s.schedule, pp=s.pp, virtual_stages=s.virtual_stages,
                                num_microbatches=s.num_microbatches,
                                stage_of_layer=tuple(stage_of_layer.items()))
    schedule.forward_waits()  # refuse a deadlocking order now, not at the first step
    return schedule


def operation_stages(functional: Any, stage_of_layer: Mapping[str, int]) -> dict[int, int]:
    """``{id(operation): stage}``: a planned layer its stage, any other operation the stage
    of the operation that produced its first input (as ``apply.placement`` places them)."""
    return operation_values(functional, stage_of_layer, 0)


# --- enforcement in a traced train step ------------------------------------------------------

_ACTIVE: contextvars.ContextVar["ScheduleTrace | None"] = contextvars.ContextVar(
    "apply_schedule_trace", default=None)


def active_trace() -> "ScheduleTrace | None":
    """The schedule trace of the train step being traced, if any."""
    return _ACTIVE.get()


@contextlib.contextmanager
def tracing(schedule: PipelineSchedule) -> Iterator["ScheduleTrace"]:
    """Around one traced train step: every placed model run inside follows ``schedule``."""
    trace = ScheduleTrace(schedule)
    token = _ACTIVE.set(trace)
    try:
        yield trace
    finally:
        _ACTIVE.reset(token)


class ScheduleTrace:
    """The markers and recorded tensors of one traced train step (TF graph objects)."""

    def __init__(self, schedule: PipelineSchedule) -> None:
        self.schedule = schedule
        self.waits = schedule.forward_waits()
        self.backward_slots = [[s for s in order if s.kind == "B"]
                               for order in schedule.device_orders()]
        self.microbatch: int | None = None
        self._chain: list[list[Any]] = [[] for _ in range(schedule.pp)]
        self._stage_of_tensor: dict[Any, int] = {}  # tensor.ref() -> producing stage
        self._received: dict[Any, tuple[Any, set[int]]] = {}  # ref -> (tensor, consumers)
        self._stage_of_variable: dict[int, int] = {}
        self._backward: dict[tuple[int, int], list[Any]] = {}  # (mb, stage) -> ops

    def start_microbatch(self, microbatch: int) -> None:
        self.microbatch = microbatch
        self._stage_of_tensor, self._received = {}, {}

    # forward ----------------------------------------------------------------------------
    def control_inputs(self, stage: int) -> list[Any]:
        """The marker the current micro-batch's forward on ``stage`` waits for ([] if none).
        Call under the stage's ``tf.device``: a new marker is created there."""
        import tensorflow as tf

        if self.microbatch is None:
            return []
        n = self.waits.get((self.microbatch, stage), 0)
        if n == 0:
            return []
        chain = self._chain[stage % self.schedule.pp]
        while len(chain) < n:
            slot = self.backward_slots[stage % self.schedule.pp][len(chain)]
            deps = chain[-1:] + self._backward.get((slot.microbatch, slot.stage), [])
            with tf.control_dependencies(deps):
                chain.append(tf.no_op(name=f"pipeline_backward_mb{slot.microbatch}"
                                           f"_stage{slot.stage}_done"))
        return [chain[n - 1]]

    def record_forward(self, stage: int, operation: Any, inputs: Sequence[Any],
                       outputs: Sequence[Any]) -> None:
        """Note a layer call's tensors: which stage made each output, which inputs came
        from another stage, which stage owns the layer's variables."""
        import tensorflow as tf

        for t in inputs:
            if isinstance(t, tf.Tensor) and t.dtype.is_floating:
                producer = self._stage_of_tensor.get(t.ref())
                if producer is not None and producer != stage:
                    self._received.setdefault(t.ref(), (t, set()))[1].add(stage)
        for t in outputs:
            if isinstance(t, tf.Tensor):
                self._stage_of_tensor.setdefault(t.ref(), stage)
        for v in getattr(operation, "trainable_variables", ()):
            self._stage_of_variable.setdefault(id(v), stage)

    # backward ---------------------------------------------------------------------------
    def received_activations(self) -> list[Any]:
        """The current micro-batch's tensors that crossed stages (extra gradient ``xs``)."""
        return [t for t, _ in self._received.values()]

    def record_backward(self, variables: Sequence[Any], variable_grads: Sequence[Any],
                        activation_grads: Sequence[Any]) -> None:
        """What finishes the current micro-batch's backward on each stage: the gradients
        of its variables and of the activations it received (else of those it sent)."""
        done: dict[int, list[Any]] = {}
        for v, g in zip(variables, variable_grads):
            k = self._stage_of_variable.get(id(v))
            if k is not None and g is not None:
                done.setdefault(k, []).append(g.op)
        sent: dict[int, list[Any]] = {}
        for (t, consumers), g in zip(self._received.values(), activation_grads):
            if g is None:
                continue
            for k in consumers:
                done.setdefault(k, []).append(g.op)
            sent.setdefault(self._stage_of_tensor[t.ref()], []).append(g.op)
        for k, ops in sent.items():
            done.setdefault(k, ops)  # a stage without weights or received activations
        for k, ops in done.items():
            self._backward[(self.microbatch, k)] = ops
