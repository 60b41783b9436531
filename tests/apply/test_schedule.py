"""apply.schedule: 1F1B and interleaved plans train in their planned order.

The order is checked on the traced train-step graph, by its edges alone (no timing):
for each stage and micro-batch j, which micro-batches' backward passes on that stage
every one of j's forward ops on the stage must wait for. From that comes the most
micro-batches a stage can hold activations for, whatever order TensorFlow's executor
picks: p - s on stage s of p under 1F1B (Narayanan et al., SC'21, Sec. 2.2.1), all m
under GPipe. Losses equal one device's; every variable and optimizer slot stays on its
planned device.
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import keras
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.pipeline import wrap_placed
from tfplan.apply.schedule import (PipelineSchedule, Slot, device_order, forward_waits,
                            schedule_of)
from tfplan.apply.placement import top_level_devices
from tfplan.core.errors import PlannerError
from tfplan.planner.plan import Stage
from tfplan.profiler.signature import model_signature
from tfplan.reports.images import _order as drawn_order
from tests.apply.helpers import (assert_losses_match, assert_state_where_planned, base_model,
                                 batches_of, cpus, fresh_optimizer, make_plan, step_losses)

LOSS_STEPS = 10
BATCH = 16


# --- the orders (pure) -----------------------------------------------------------------------

@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 3), (3, 7)])
def test_1f1b_order_is_the_one_reports_draw(pp, m):
    for d in range(pp):
        got = [(s.kind, s.microbatch) for s in device_order("1f1b", d, pp, 1, m)]
        assert got == [(kind, i) for kind, _, i in drawn_order("1f1b", d, pp, m)]
        assert [(s.kind, s.microbatch) for s in device_order("gpipe", d, pp, 1, m)] == \
            [(kind, i) for kind, _, i in drawn_order("gpipe", d, pp, m)]


def _schedule(kind, pp, m, v=1):
    return PipelineSchedule(kind=kind, pp=pp, virtual_stages=v, num_microbatches=m,
                            stage_of_layer=())


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 2)])
def test_1f1b_forward_j_on_stage_s_waits_for_backward_j_minus_p_minus_s(pp, m):
    waits = _schedule("1f1b", pp, m).forward_waits()
    for s in range(pp):
        for j in range(m):
            # waits for backward slots 0 .. j - (pp - s): that many, none if negative
            assert waits[(j, s)] == max(0, j - (pp - s) + 1), (s, j)
    assert _schedule("1f1b", pp, m).max_in_flight() == tuple(
        min(pp - s, m) for s in range(pp))
    assert set(_schedule("gpipe", pp, m).forward_waits().values()) == {0}


def test_interleaved_order_is_megatrons():
    # pp = 2, v = 2, m = 4, device 0 (chunks 0 and 2): 2 (pp - 1) + (v - 1) pp = 4 warm-up
    # forwards (micro-batches 0, 1 through chunk 0, then chunk 2), then 1F1B, backwards
    # through chunk 2 before chunk 0 (Narayanan et al., SC'21, Fig. 4; Megatron-LM)
    got = [f"{s.kind}{s.microbatch}.{s.stage}" for s in device_order("interleaved", 0, 2, 2, 4)]
    assert got == ["F0.0", "F1.0", "F0.2", "F1.2", "F2.0", "B0.2", "F3.0", "B1.2",
                   "F2.2", "B0.0", "F3.2", "B1.0", "B2.2", "B3.2", "B2.0", "B3.0"]
    got = [f"{s.kind}{s.microbatch}.{s.stage}" for s in device_order("interleaved", 1, 2, 2, 4)]
    assert got == ["F0.1", "F1.1", "F0.3", "B0.3", "F1.3", "B1.3", "F2.1", "B0.1",
                   "F3.1", "B1.1", "F2.3", "B2.3", "F3.3", "B3.3", "B2.1", "B3.1"]


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (4, 3, 8), (2, 4, 6),
                                    (3, 2, 9)])
def test_interleaved_waits_point_at_earlier_microbatches(pp, v, m):
    schedule = _schedule("interleaved", pp, m, v)
    waits = schedule.forward_waits()  # raises on a wait for a later micro-batch (a cycle)
    assert len(waits) == pp * v * m
    orders = schedule.device_orders()
    for d, order in enumerate(orders):
        backwards = [s for s in order if s.kind == "B"]
        for slot in order:
            if slot.kind == "F":
                assert all(b.microbatch < slot.microbatch
                           for b in backwards[:waits[(slot.microbatch, slot.stage)]])
        assert sorted((s.microbatch, s.stage) for s in backwards) == sorted(
            (j, c * pp + d) for j in range(m) for c in range(v))


def test_no_interleaved_order_deadlocks_and_a_deadlocking_order_is_refused():
    for pp in range(2, 7):
        for v in range(2, 5):
            for m in range(1, 3 * pp + 1):
                _schedule("interleaved", pp, m, v).forward_waits()  # raises on a cycle
    # backward of micro-batch 0 before its own forward on the same device: refused
    bad = [[Slot("F", 0, 0), Slot("B", 1, 0), Slot("F", 1, 0), Slot("B", 0, 0)]]
    with pytest.raises(PlannerError, match="deadlock"):
        forward_waits(bad, "hand-made")
    assert forward_waits([bad[0][:1] + bad[0][3:] + bad[0][2:3]]) == {(0, 0): 0, (1, 0): 1}


# --- the order in the traced graph -----------------------------------------------------------

def _pipeline_plan(model, pp, m, schedule):
    plan = make_plan(model, [[d] for d in cpus(*range(1, pp + 1))], global_batch=BATCH,
                     num_microbatches=m)
    return replace(plan, name=f"test {schedule} pp={pp} m={m}",
                   strategy=replace(plan.strategy, schedule=schedule))


def _interleaved_plan(model, pp=2, v=2, m=4):
    layers = [row[0] for row in model_signature(model)]
    k = pp * v
    bounds = [round(i * len(layers) / k) for i in range(k + 1)]
    devices = cpus(*range(1, pp + 1))
    plan = make_plan(model, [[d] for d in devices], global_batch=BATCH, num_microbatches=m)
    stages = tuple(Stage(layers=tuple(layers[bounds[i]:bounds[i + 1]]),
                         devices=(devices[i % pp],)) for i in range(k))
    return replace(plan, name=f"test interleaved pp={pp} v={v} m={m}", stages=stages,
                   strategy=replace(plan.strategy, schedule="interleaved", virtual_stages=v))


def _wrapped(name, plan):
    module, model = base_model(name)
    wrapped = wrap_placed(model, top_level_devices(plan), plan_name=plan.name,
                          num_microbatches=plan.strategy.num_microbatches,
                          schedule=schedule_of(plan))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    return module, wrapped


def _step_graph(module, wrapped):
    x, y = batches_of(module, 1, BATCH)[0]
    step = tf.function(lambda x, y: wrapped.train_step((x, y)))
    return step.get_concrete_function(tf.constant(x), tf.constant(y)).graph


def _ancestors(op, memo):
    if op.name not in memo:
        out = set()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            out.add(parent.name)
            out |= _ancestors(parent, memo)
        memo[op.name] = out
    return memo[op.name]


def _grad_scope(op):
    """Which tf.gradients call made ``op`` (gradients, gradients_1, ...: the micro-batch)."""
    head = op.name.split("/", 1)[0]
    if head == "gradients":
        return 0
    suffix = head[len("gradients_"):]
    return int(suffix) if head.startswith("gradients_") and suffix.isdigit() else None


def _finished_before(graph, m, stage_of):
    """``{(j, k): {(i, k'), ...}}``: the backward slots (micro-batch i, stage k' on stage k's
    device) that the graph's data and control edges make finish before any forward op of
    micro-batch j on stage k. ``stage_of(op)``: an op's stage (None: not a stage's op)."""
    ops = graph.get_operations()
    by_name = {op.name: op for op in ops}
    splits = [op for op in ops if op.type in ("Split", "SplitV") and len(op.outputs) == m]
    assert splits, "the micro-batch split is missing from the train step"
    gradient_consumers = set()  # accumulation and updates: downstream of some gradient
    todo = [c for op in ops if _grad_scope(op) is not None for t in op.outputs
            for c in t.consumers() if _grad_scope(c) is None]
    while todo:
        op = todo.pop()
        if op.name not in gradient_consumers:
            gradient_consumers.add(op.name)
            todo += [c for t in op.outputs for c in t.consumers()]
    forward: dict = {}  # (j, k) -> forward ops: data-descendants of piece j, not backward
    for j in range(m):
        seen: set = set()
        todo = [c for s in splits for c in s.outputs[j].consumers()]
        while todo:
            op = todo.pop()
            if op.name in seen or _grad_scope(op) is not None:
                continue
            seen.add(op.name)
            todo += [c for t in op.outputs for c in t.consumers()]
            if op.name not in gradient_consumers and stage_of(op) is not None:
                forward.setdefault((j, stage_of(op)), []).append(op)
    memo: dict = {}
    live = set()  # gradient ops something uses (not e.g. the unused gradient of the input)
    for name in gradient_consumers:
        live |= _ancestors(by_name[name], memo)
    backward: dict = {}  # (i, k) -> its backward ops
    for op in ops:
        if _grad_scope(op) is not None and op.name in live and stage_of(op) is not None:
            backward.setdefault((_grad_scope(op), stage_of(op)), set()).add(op.name)
    device = {k: ops_[0].device for (_, k), ops_ in forward.items()}
    out = {}
    for (j, k), mine in forward.items():
        surely = set.intersection(*(_ancestors(op, memo) for op in mine))
        out[(j, k)] = {slot for slot, names in backward.items()
                       if device[slot[1]] == device[k] and names <= surely}
    return out


def _in_flight(graph, devices, m, plan):
    """Per stage device, the most micro-batches whose forward on it may have started while
    their backward on it has not finished, going by the graph's edges alone (the ops of
    the plan's layers; not the micro-batch split or the loss)."""
    in_layer = _layer_stage(plan)

    def stage_of(op):
        if op.device in devices and in_layer(op) is not None:
            return devices.index(op.device)
        return None
    done = _finished_before(graph, m, stage_of)
    return [max(j + 1 - len({i for i, _ in done[(j, s)] if i <= j}) for j in range(m))
            for s in range(len(devices))]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_1f1b_graph_bounds_microbatches_in_flight_to_p_minus_s(pp, m):
    _, model = base_model("tiny_mlp")
    devices = cpus(*range(1, pp + 1))
    plan = _pipeline_plan(model, pp, m, "1f1b")
    module, wrapped = _wrapped("tiny_mlp", plan)
    assert _in_flight(_step_graph(module, wrapped), devices, m, plan) == [
        pp - s for s in range(pp)]
    module, gpipe = _wrapped("tiny_mlp", _pipeline_plan(model, pp, m, "gpipe"))
    assert _in_flight(_step_graph(module, gpipe), devices, m, plan) == [m] * pp  # no bound


# --- results and placement -------------------------------------------------------------------

_REFERENCE: dict = {}


def _reference(name):
    if name not in _REFERENCE:
        module, model = base_model(name)
        copy = keras.models.clone_model(model)
        copy.set_weights(model.get_weights())
        copy.compile(optimizer=fresh_optimizer(module), loss=module.loss)
        _REFERENCE[name] = step_losses(copy, batches_of(module, LOSS_STEPS, BATCH))
    return _REFERENCE[name]


@pytest.mark.parametrize("schedule, name", [
    ("1f1b", "tiny_mlp"),
    # 1F1B on the transformer: by default in test_zero3 (dp2 x pp2) and across workers
    # (test_workers' dp2xpp2); the interleaved order on it here
    pytest.param("1f1b", "tiny_transformer", marks=pytest.mark.slow),
    ("interleaved", "tiny_mlp"), ("interleaved", "tiny_transformer")],
    ids=["1f1b-tiny_mlp", "1f1b-tiny_transformer", "interleaved-tiny_mlp",
         "interleaved-tiny_transformer"])
def test_scheduled_pipeline_trains_like_one_device_with_state_in_place(name, schedule):
    module, model = base_model(name)
    plan = (_pipeline_plan(model, 2, 4, "1f1b") if schedule == "1f1b"
            else _interleaved_plan(model, pp=2, v=2, m=4))
    wrapped = apply.wrap(model, plan)  # the SPMD engine (apply.spmd.pipeline)
    assert wrapped.run_description.schedule == schedule_of(plan).kind
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches_of(module, LOSS_STEPS, BATCH)),
                        _reference(name))
    assert_state_where_planned(wrapped, wrapped.plan)


def _layer_stage(plan):
    """An op's stage from its layer's name scope (``model_call/layer[_n]/...``)."""
    stage_of_layer = {name: k for k, stage in enumerate(plan.stages) for name in stage.layers}

    def stage_of(op):
        parts = op.name.split("/")
        parts = parts[2:] if _grad_scope(op) is not None else parts[1:]
        while parts:
            scope = parts.pop(0)
            while scope:
                if scope in stage_of_layer:
                    return stage_of_layer[scope]
                head, _, tail = scope.rpartition("_")
                scope = head if tail.isdigit() else ""
        return None
    return stage_of


def test_interleaved_graph_has_the_waits_of_the_order():
    module, model = base_model("tiny_mlp")
    plan = _interleaved_plan(model, pp=2, v=2, m=4)  # one layer per chunk
    schedule = schedule_of(plan)
    waits = schedule.forward_waits()
    backward_slots = [[(s.microbatch, s.stage) for s in order if s.kind == "B"]
                      for order in schedule.device_orders()]
    _, wrapped = _wrapped("tiny_mlp", plan)
    done = _finished_before(_step_graph(module, wrapped), 4, _layer_stage(plan))
    assert set(done) == set(waits)
    for (j, k), n in waits.items():
        assert set(backward_slots[k % 2][:n]) <= done[(j, k)], (j, k)
    assert sum(waits.values()) > 0
    # the same plan without the order: no forward waits for a backward on its device
    unordered = wrap_placed(model, top_level_devices(plan), plan_name=plan.name,
                            num_microbatches=4)
    unordered.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    done = _finished_before(_step_graph(module, unordered), 4, _layer_stage(plan))
    assert set(done) == set(waits) and not any(done.values())


# --- with data and tensor parallelism (apply.tensor_parallel) --------------------------------

@pytest.mark.parametrize("tp", [1, 2])
def test_1f1b_with_dp_or_tp_trains_like_one_device_in_order(tp):
    from tests.apply.helpers import tp_plan
    from tests.apply.test_tensor_parallel import SPLITS

    module, model = base_model("tiny_mlp")
    if tp == 1:  # dp = 2 replicas of a 2-stage pipeline
        plan = make_plan(model, [cpus(0, 1), cpus(2, 3)], global_batch=BATCH,
                         num_microbatches=4)
    else:  # 2 stages, each tensor parallel over 2 devices (rank 0 runs the rest)
        plan = tp_plan(model, [cpus(0, 1), cpus(2, 3)], SPLITS["tiny_mlp"],
                       num_microbatches=4, global_batch=BATCH)
    plan = replace(plan, strategy=replace(plan.strategy, schedule="1f1b"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    # the SPMD engine traces each column's slots in 1F1B order (its bound on the
    # micro-batches in flight: tests/apply/spmd/test_pipeline.py)
    assert wrapped.run_description.schedule == "1f1b"
    assert_losses_match(step_losses(wrapped, batches_of(module, LOSS_STEPS, BATCH)),
                        _reference("tiny_mlp"))
