"""apply.spmd.input: a batch cut into the plan's parts, and a dataset cut per worker.

One process plays each worker in turn (``describe(plan, task=w)``): each worker's dataset
must hold exactly the parts of its columns, cut as the whole batch is cut, and the workers'
parts together must be every part of every batch once per replica (the last batch
smaller than the others included).
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfplan.apply.spmd.input import (KEY, cut, is_worker_rows, local_parts, parts_of, shards,
                                     worker_rows)
from tfplan.apply.spmd.run import describe
from tests.apply.helpers import base_model
from tests.apply.test_workers import worker_plan

ROWS, BATCH = 40, 16  # batches of 16, 16 and 8 rows


def _runs(name: str, kind: str, workers: int, cpus: int):
    module, model = base_model(name)
    plan = worker_plan(model, name, kind, workers=workers, cpus=cpus)
    return module, [describe(plan, task=w) for w in range(workers)]


def _flat(structure) -> list[np.ndarray]:
    return [np.asarray(t) for t in tf.nest.flatten(structure)]


@pytest.mark.parametrize("name,kind,workers,cpus,sequence", [
    ("tiny_transformer", "dp2xtp4", 2, 4, None),  # a replica per worker (padded: tp)
    ("tiny_mlp", "dp8+zero3", 4, 2, None),         # two replicas per worker
    ("tiny_transformer", "dp4xcp2", 2, 4, 8),      # replica q = r cp + c on worker q % 2
    ("tiny_mlp", "dp2xpp2xtp2", 2, 4, None),       # micro-batches: parts q m + k
])
def test_each_worker_reads_only_its_parts_cut_as_the_batch_is(name, kind, workers, cpus,
                                                              sequence):
    module, runs = _runs(name, kind, workers, cpus)
    x, y = module.sample_batch(ROWS)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    batches = list(dataset)
    seen = [[0] * runs[0].parts for _ in batches]
    for w, run in enumerate(runs):
        assert shards(run)
        mine = local_parts(run)
        elements = list(worker_rows(dataset, run, sequence))
        assert len(elements) == len(batches)
        for b, (element, batch) in enumerate(zip(elements, batches)):
            assert is_worker_rows(element)
            parts, flags, n = parts_of(element, run)
            whole, whole_flags, _ = cut(batch, run, sequence)
            assert int(n) == len(batch[0])
            for p in range(run.parts):
                if p not in mine:
                    assert parts[p] is None
                    continue
                seen[b][p] += 1
                for got, want in zip(_flat(parts[p]), _flat(whole[p])):
                    np.testing.assert_array_equal(got, want)
                if whole_flags[p] is not None:
                    np.testing.assert_array_equal(np.asarray(flags[p]), whole_flags[p])
            # nothing but this worker's parts: fewer than the batch's
            assert set(element[KEY]) <= {"n", "parts", "flags"}
            assert len(element[KEY]["parts"]) == len(mine) < run.parts
    assert all(count == 1 for row in seen for count in row)  # each part on one worker


def test_a_column_on_every_worker_reads_the_whole_batch_and_off_keeps_it():
    _, runs = _runs("tiny_mlp", "pp2", 2, 2)  # both stages of the one replica: both read all
    assert not any(shards(run) for run in runs)
    dataset = tf.data.Dataset.from_tensor_slices(np.zeros((8, 4), "float32")).batch(4)
    assert worker_rows(dataset, runs[0], None) is dataset
    _, runs = _runs("tiny_transformer", "dp2xtp4", 2, 4)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    off = dataset.with_options(options)
    assert worker_rows(off, runs[1], None) is off
