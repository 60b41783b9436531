"""apply.wrap runs an interleaved-pipeline plan (model chunk k on pipeline device k % pp):
each layer on its chunk's device, losses equal to one device, in the interleaved order
(apply.schedule; its order in the graph: tests/apply/test_schedule.py), without a
warning."""
from __future__ import annotations

import warnings
from dataclasses import replace

from tfplan import apply
from tfplan.apply.schedule import schedule_of
from tfplan.apply.mode import execution_mode
from tfplan.planner.plan import Stage
from tfplan.planner.validate import validate_plan
from tfplan.profiler.signature import model_signature
from tests.apply.helpers import (GLOBAL_BATCH, STEPS, assert_losses_match,
                                 assert_state_where_planned, base_model,
                                 batches_of, cpus, fresh_optimizer, make_plan,
                                 reference_losses, step_losses)

NAME = "tiny_mlp"


def _interleaved_plan(model):
    devices = cpus(2, 5)
    layers = [row[0] for row in model_signature(model)]
    chunks = [layers[:1], layers[1:2], layers[2:3], layers[3:]]  # 4 chunks, 2 devices
    plan = make_plan(model, [[d] for d in devices], global_batch=GLOBAL_BATCH,
                     num_microbatches=2, stage_layers=[layers[:2], layers[2:]])
    stages = tuple(Stage(layers=tuple(c), devices=(devices[k % 2],))
                   for k, c in enumerate(chunks))
    return replace(plan, name="test interleaved pp=2 v=2", stages=stages,
                   strategy=replace(plan.strategy, schedule="interleaved", virtual_stages=2))


def test_interleaved_plan_places_chunks_round_robin_and_trains_like_one_device():
    module, model = base_model(NAME)
    plan = _interleaved_plan(model)
    validate_plan(plan, model_signature(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the schedule is applied: nothing to warn about
        assert execution_mode(plan).mode == "pipeline"
        wrapped = apply.wrap(model, plan)
    run = wrapped.run_description  # the SPMD engine (apply.spmd.pipeline)
    assert run.schedule == schedule_of(plan).kind == "interleaved"
    assert (run.pp, run.virtual_stages, run.chunks) == (2, 2, 4)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)),
                        reference_losses(NAME))
    assert_state_where_planned(wrapped, wrapped.plan)
    where = plan.device_of_layer()
    layers = [row[0] for row in model_signature(model)]
    assert where[layers[0]] == where[layers[2]] != where[layers[1]] == where[layers[3]]
