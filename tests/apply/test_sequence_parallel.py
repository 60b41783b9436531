"""Sequence parallelism in the older tensor-parallel engine (apply.sequence_parallel,
Korthikanti et al. 2022, Sec. 4.2.2), which runs what the SPMD engine does not: pieces of
unequal length (a sequence that does not divide by tp, with splits the SPMD engine does
not run). Plans the SPMD engine runs are tested in tests/apply/spmd/test_sequence.py.

Runs on the 8 logical CPU devices of tests/conftest.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.sequence_parallel import reduce_scatter
from tfplan.apply.tensor_parallel import TensorParallelModel
from tests.apply import helpers
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, step_losses, tp_plan)
from tests.apply.test_tensor_parallel import _short, assert_placement

pytestmark = pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")

STEPS_SP = 10
SPLITS = {"tiny_transformer": (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
                               ("mlp_down", "row"), ("logits", "column"))}


def sp_plan(model, devices, splits, *, dp=1, sequence_parallel=True, **kwargs):
    plan = tp_plan(model, devices, splits, dp=dp, **kwargs)
    return dataclasses.replace(plan, name=plan.name + " sp", strategy=dataclasses.replace(
        plan.strategy, sequence_parallel=sequence_parallel))


def graph_ops(wrapped, x):
    graph = tf.function(lambda t: wrapped(t)).get_concrete_function(tf.constant(x)).graph
    return graph.get_operations()


def test_reduce_scatter_is_the_sum_cut_by_sequence():
    rng = np.random.default_rng(0)
    partials = [tf.constant(rng.normal(size=(2, 7, 3)).astype("float32")) for _ in range(3)]
    pieces = reduce_scatter(partials, cpus(0, 1, 2))
    assert [p.shape[1] for p in pieces] == [3, 2, 2]
    assert [_short(p.device) for p in pieces] == cpus(0, 1, 2)
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in pieces], axis=1),
                                  tf.add_n(partials).numpy())


def test_sequence_parallel_off_runs_replicated_layers_whole_on_every_rank():
    """Without sequence parallelism the SPMD engine (apply.spmd) runs an unsplit layer
    between split ones on every tensor-parallel rank, whole (Megatron)."""
    from tfplan.apply.spmd import SpmdModel

    module, model = base_model("tiny_transformer")
    plan = sp_plan(model, [cpus(0, 1)], SPLITS["tiny_transformer"], sequence_parallel=False)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    x, _ = module.sample_batch(GLOBAL_BATCH)
    ln = [op for op in graph_ops(wrapped, x) if "/ln_attention" in op.name and op.device]
    assert {_short(op.device) for op in ln} == set(cpus(0, 1))


def test_uneven_sequence_pieces_train_the_same():
    """tp = 3 over a sequence of 8: pieces of 3, 3 and 2 tokens (4 heads 2/1/1)."""
    module, model = base_model("tiny_transformer")
    plan = sp_plan(model, [cpus(0, 1, 2)], SPLITS["tiny_transformer"], cluster_size=6)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, TensorParallelModel)  # 64 units do not divide by 3
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS_SP, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, helpers.reference_losses("tiny_transformer", STEPS_SP)[:3])
    assert_placement(wrapped, plan)
