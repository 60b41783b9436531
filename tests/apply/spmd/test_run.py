"""apply.spmd.run: the run description a plan gives."""
from __future__ import annotations

import dataclasses

import pytest

from tfplan.apply.spmd.run import describe
from tests.apply import helpers

MLP_SPLITS = (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"), ("head", "row"))


def _mlp():
    return helpers.base_model("tiny_mlp")[1]


def test_dp2_x_tp2_mesh_groups_and_megatron_pairs():
    plan = helpers.tp_plan(_mlp(), [helpers.cpus(0, 1, 2, 3)], MLP_SPLITS, dp=2)
    run = describe(plan)
    assert run.replicas == (tuple(helpers.cpus(0, 1)), tuple(helpers.cpus(2, 3)))
    assert (run.dp, run.tp) == (2, 2)
    assert run.tp_group(1).devices == tuple(helpers.cpus(2, 3))
    assert run.dp_group(1).devices == tuple(helpers.cpus(1, 3))
    assert run.tp_group(0).key != run.tp_group(1).key != run.dp_group(0).key
    # each column split feeds the row split after it: no gather between them
    assert run.row_fed == frozenset({"dense_in", "narrow"})
    assert run.to_dict()["replicas"] == [helpers.cpus(0, 1), helpers.cpus(2, 3)]


def test_a_column_split_not_followed_by_a_row_split_is_gathered():
    splits = (("dense_in", "column"), ("hidden", "column"), ("head", "row"))
    plan = helpers.tp_plan(_mlp(), [helpers.cpus(0, 1)], splits)
    assert describe(plan).row_fed == frozenset({"hidden"})


def test_one_device_group_launches_nothing():
    plan = helpers.make_plan(_mlp(), [helpers.cpus(0, 1)])
    run = describe(plan)
    assert run.tp == 1 and run.tp_group(0).size == 1 and run.splits == ()


@pytest.mark.parametrize("change", [dict(cp=2, sequence_parallel=True), dict(ep=2, cp=2),
                                    dict(ep=2, zero_stage=3),
                                    dict(offload="optimizer+weights", zero_stage=3)])
def test_every_dimension_runs_on_one_host_and_across_workers(change):
    plan = helpers.make_plan(_mlp(), [helpers.cpus(0, 1)])
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, **change))
    workers = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(stage, devices=tuple(f"/job:worker/task:{i}/device:CPU:0"
                                                 for i in range(len(stage.devices))))
        for stage in plan.stages))
    run = describe(workers, task=1)  # one program per worker: worker 1 runs its own column
    assert run.local == frozenset({"/job:worker/task:1/device:CPU:0"})
    assert run.local_columns == ((1, 0),) and not run.every_column_here
    assert run.workers.devices == ("/job:worker/task:0/device:CPU:0",
                                   "/job:worker/task:1/device:CPU:0")
    assert describe(plan).every_column_here and describe(plan).workers is None


def test_a_pipeline_plans_chunks_columns_and_schedule():
    plan = helpers.tp_plan(_mlp(), [helpers.cpus(0, 1, 2, 3), helpers.cpus(4, 5, 6, 7)],
                           MLP_SPLITS, dp=2, num_microbatches=4)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  schedule="1f1b"))
    run = describe(plan)
    assert (run.chunks, run.pp, run.dp, run.tp, run.schedule) == (2, 2, 2, 2, "1f1b")
    assert run.column(1, 0) == ("/device:CPU:2", "/device:CPU:6")  # replica 1, rank 0
    assert run.loss_replicas[0] == tuple(helpers.cpus(4, 5))
    assert run.loss_dp_group(1).devices == tuple(helpers.cpus(5, 7))
    assert run.chunk_group("tp", "/device:CPU:6").devices == tuple(helpers.cpus(6, 7))
    assert dict(run.stage_of_entry) == {"dense_in": 0, "hidden": 0, "narrow": 1, "head": 1}
    assert len(run.all_devices) == 8
    for stage in (2, 3):
        zero = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                      zero_stage=stage))
        assert describe(zero).zero_stage == stage


def test_parallel_columns_inside_a_block_stay_cut_up_to_its_row_split():
    """SwiGLU's gate and up (both read the block's input) stay cut for the row split that
    ends their run; a run that another block's row split ends is gathered (only the column
    right before a row is read sliced there)."""
    from tfplan.apply.spmd.run import row_fed_columns

    splits = (("b/attn", "heads"), ("b/gate", "column"), ("b/up", "column"),
              ("b/down", "row"), ("c/up", "column"), ("c/x", "column"), ("d/down", "row"))
    assert row_fed_columns(splits) == frozenset({"b/gate", "b/up", "c/x"})
