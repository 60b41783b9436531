"""Checkpoints that survive faults and plan changes (apply.checkpoint): Keras'
``BackupAndRestore`` under every one-host mode, a backup from one plan resumed under
another, weight files of wrapped models loaded into the plain model and optimizer.

The ground truth is the plain model trained on one device without interruption (4
epochs of 4 steps, ``shuffle=False``); every interrupted run fails in epoch 3 (an
exception from a callback), after 2 epochs were backed up, and resumes under another
plan: its final weights must equal the ground truth within 1e-4, with the epoch and
the optimizer's step counters restored.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import keras
import numpy as np
import pytest

from tfplan import apply
from tfplan.core.errors import PlannerError
from tests.apply.helpers import base_model, cpus, make_plan, tp_plan

EPOCHS, BATCH, SAMPLES = 4, 16, 64
STEPS_PER_EPOCH = SAMPLES // BATCH
FAIL_AT = 2  # zero-based: the third epoch
MLP_SPLITS = (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"), ("head", "row"))
TRANSFORMER_SPLITS = (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
                      ("mlp_down", "row"), ("logits", "column"))


def _tp(model, stage_devices, splits, *, dp=1, zero=False, num_microbatches=1):
    return tp_plan(model, stage_devices, splits, dp=dp, zero=zero,
                   num_microbatches=num_microbatches, global_batch=BATCH)


# every one-host mode (apply.mode): single device, data parallel, pipeline, tensor
# parallel, data x tensor parallel, ZeRO-1
PLANS = {
    "single": lambda m: make_plan(m, [cpus(0)]),
    "dp4": lambda m: make_plan(m, [cpus(0, 1, 2, 3)]),
    "pp2": lambda m: make_plan(m, [cpus(0), cpus(1)], num_microbatches=2),
    "tp2": lambda m: _tp(m, [cpus(2, 3)], MLP_SPLITS),
    "dp2xtp2": lambda m: _tp(m, [cpus(4, 5, 6, 7)], MLP_SPLITS, dp=2),
    "zero-dp2": lambda m: _tp(m, [cpus(0, 1)], (), dp=2, zero=True),
}


class FailAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"failing in epoch {epoch}")


def _data(module):
    return module.sample_batch(SAMPLES)


def _fresh(name: str):
    module, model = base_model(name)
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return module, copy


def _optimizer():
    return keras.optimizers.Adam(learning_rate=1e-2)


def _fit(model, module, epochs, callbacks):
    x, y = _data(module)
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks)


_REFERENCE: dict[tuple[str, int], object] = {}


def reference(name: str = "tiny_mlp", epochs: int = EPOCHS):
    """The plain model trained on one device, uninterrupted, for ``epochs`` epochs."""
    if (name, epochs) not in _REFERENCE:
        module, model = _fresh(name)
        model.compile(_optimizer(), loss=module.loss)
        _fit(model, module, epochs, [])
        _REFERENCE[(name, epochs)] = model
    return _REFERENCE[(name, epochs)]


def wrapped(plan_key: str, name: str = "tiny_mlp", plans=PLANS):
    module, model = _fresh(name)
    w = apply.wrap(model, plans[plan_key](model))
    w.compile(_optimizer(), loss=module.loss)
    return module, w


def interrupted(plan_key: str, backup_dir, name: str = "tiny_mlp", plans=PLANS) -> None:
    """Train under ``plan_key`` with a backup per epoch until a callback fails in epoch 3."""
    module, w = wrapped(plan_key, name, plans)
    with pytest.raises(RuntimeError, match="failing in epoch 2"):
        _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(backup_dir)),
                                 FailAtEpoch(FAIL_AT)])
    assert int(w.optimizer.iterations.numpy()) == FAIL_AT * STEPS_PER_EPOCH


def resumed(plan_key: str, backup_dir, name: str = "tiny_mlp", plans=PLANS):
    """A fresh model under ``plan_key`` that resumes from ``backup_dir`` to the end."""
    module, w = wrapped(plan_key, name, plans)
    history = _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(backup_dir))])
    assert len(history.history["loss"]) == EPOCHS - FAIL_AT  # epochs 3 and 4 only
    assert int(w.optimizer.iterations.numpy()) == EPOCHS * STEPS_PER_EPOCH
    return w


def assert_weights_close(model, ref, atol=1e-4) -> None:
    got, want = model.get_weights(), ref.get_weights()
    assert len(got) == len(want)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, atol=atol, rtol=0)


# every one-host mode writes a backup that another mode resumes, and reads one
PAIRS = [("single", "tp2"), ("tp2", "dp2xtp2"), ("dp2xtp2", "zero-dp2"), ("zero-dp2", "pp2"),
         ("pp2", "dp4"), ("dp4", "zero-dp2")]


@pytest.mark.parametrize("written, read", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_a_backup_resumes_under_another_plan(written, read, tmp_path):
    interrupted(written, tmp_path / "backup")
    w = resumed(read, tmp_path / "backup")
    assert_weights_close(w, reference())
    assert not os.path.exists(tmp_path / "backup")  # deleted when training ends (Keras)


def _with(plan, **fields):
    return dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, **fields))


def _cp2(model):
    plan = make_plan(model, [cpus(0, 1)])
    return _with(plan, dp=1, cp=2, microbatch_size=BATCH)


# the dimensions issue 14 added: ZeRO-2, ZeRO-3 and offloading (on the MLP), sequence and
# context parallelism (on the transformer, whose attention they split)
NEWER_PLANS = {
    "zero2-dp2": lambda m: _with(_tp(m, [cpus(0, 1)], (), dp=2, zero=True), zero_stage=2),
    "zero3-dp2": lambda m: _with(_tp(m, [cpus(2, 3)], (), dp=2, zero=True), zero_stage=3),
    "offload-dp2": lambda m: _with(make_plan(m, [cpus(4, 5)]), offload="optimizer"),
    "single": PLANS["single"],
    "tp2-sp": lambda m: _with(_tp(m, [cpus(2, 3)], TRANSFORMER_SPLITS), sequence_parallel=True),
    "cp2": _cp2,
}
NEWER_PAIRS = [("tiny_mlp", "zero2-dp2", "zero3-dp2"), ("tiny_mlp", "zero3-dp2", "offload-dp2"),
               ("tiny_mlp", "offload-dp2", "zero2-dp2"), ("tiny_transformer", "tp2-sp", "cp2"),
               ("tiny_transformer", "cp2", "single")]


@pytest.mark.parametrize("name, written, read", NEWER_PAIRS,
                         ids=[f"{n}:{a}->{b}" for n, a, b in NEWER_PAIRS])
def test_a_backup_resumes_under_the_newer_dimensions(name, written, read, tmp_path):
    """BackupAndRestore under ZeRO-2/3, offloading, sequence and context parallelism: a
    backup written under one resumes under another, equal to one device uninterrupted."""
    interrupted(written, tmp_path / "backup", name, NEWER_PLANS)
    w = resumed(read, tmp_path / "backup", name, NEWER_PLANS)
    assert_weights_close(w, reference(name))


@pytest.mark.slow  # PAIRS cover it by default: dp4 -> zero-dp2, zero-dp2 -> pp2, cp2 -> single
def test_dp4_backup_resumes_under_pp2_and_under_one_device(tmp_path):
    """The acceptance test of issue 13: 2 epochs under dp=4, a failure in epoch 3,
    resumed under pp=2 and (from a copy of the same backup) under one device: the final
    weights equal the one-device uninterrupted 4-epoch run within 1e-4."""
    interrupted("dp4", tmp_path / "backup")
    shutil.copytree(tmp_path / "backup", tmp_path / "copy")
    for plan_key, directory in (("pp2", "backup"), ("single", "copy")):
        w = resumed(plan_key, tmp_path / directory)
        assert_weights_close(w, reference())


def _plain_with_backup(path, name="tiny_mlp"):
    module, plain = _fresh(name)
    plain.compile(_optimizer(), loss=module.loss)
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(str(path))
    return plain


@pytest.mark.parametrize("plan_key", ["dp2xtp2", "zero-dp2", "dp4"])
def test_a_wrapped_models_file_loads_into_the_plain_model_and_optimizer(plan_key, tmp_path):
    """The file holds the weights and the optimizer state in one device's layout: a plain
    model with a plain Adam reads it and holds the state of 2 one-device epochs."""
    module, w = wrapped(plan_key)
    _fit(w, module, FAIL_AT, [])
    w.save_weights(str(tmp_path / "w.weights.h5"))
    plain = _plain_with_backup(tmp_path / "w.weights.h5")
    ref = reference(epochs=FAIL_AT)
    assert_weights_close(plain, ref)
    got, want = plain.optimizer.variables, ref.optimizer.variables
    assert [v.path.split("/", 1)[1] for v in got] == [v.path.split("/", 1)[1] for v in want]
    assert int(got[0].numpy()) == FAIL_AT * STEPS_PER_EPOCH  # iterations
    for g, r in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g.numpy(), r.numpy(), atol=1e-5, rtol=1e-3)
    # and back: the plain model's file into the wrapped model, every copy and shard
    plain.save_weights(str(tmp_path / "plain.weights.h5"))
    _, again = wrapped(plan_key)
    again.load_weights(str(tmp_path / "plain.weights.h5"))
    assert int(again.optimizer.iterations.numpy()) == FAIL_AT * STEPS_PER_EPOCH
    again.save_weights(str(tmp_path / "again.weights.h5"))
    for g, r in zip(_plain_with_backup(tmp_path / "again.weights.h5").optimizer.variables,
                    plain.optimizer.variables):
        np.testing.assert_array_equal(g.numpy(), r.numpy())


def test_split_attention_and_embedding_slots_join_as_their_weights(tmp_path):
    """tp=2 of the tiny transformer (vocab, heads, column and row splits): its file's
    optimizer state is the one-device optimizer's, slot by slot."""
    plans = {"tp2": lambda m: _tp(m, [cpus(2, 3)], TRANSFORMER_SPLITS)}
    module, w = wrapped("tp2", "tiny_transformer", plans)
    _fit(w, module, 1, [])
    w.save_weights(str(tmp_path / "w.weights.h5"))
    plain = _plain_with_backup(tmp_path / "w.weights.h5", "tiny_transformer")
    ref = reference("tiny_transformer", 1)
    got, want = plain.optimizer.variables, ref.optimizer.variables
    assert [tuple(v.shape) for v in got] == [tuple(v.shape) for v in want]
    for g, r in zip(got, want):
        np.testing.assert_allclose(g.numpy(), r.numpy(), atol=1e-5, rtol=1e-3)


def test_a_backup_is_replaced_whole(tmp_path, monkeypatch):
    """save_weights writes a temporary file and renames it: no temporary file is left,
    and a failing save leaves the previous file as it was."""
    module, w = wrapped("tp2")
    path = tmp_path / "b.weights.h5"
    w.save_weights(str(path))
    before = path.read_bytes()
    assert os.listdir(tmp_path) == ["b.weights.h5"]

    class Broken(Exception):
        pass

    def broken(self, store):
        raise Broken()

    w.optimizer.build(w.trainable_variables)
    with monkeypatch.context() as patch:  # every Dense fails to write its weights
        patch.setattr(keras.layers.Dense, "save_own_variables", broken)
        with pytest.raises(Broken):
            w.save_weights(str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["b.weights.h5"]


class FailAtBatch(keras.callbacks.Callback):
    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError(f"failing at batch {batch} of epoch {self.epoch}")


def test_a_mid_epoch_backup_resumes_after_the_batches_it_trained(tmp_path):
    """save_freq=3 batches: the last backup before a failure at batch 3 of epoch 3 is one
    batch into it (after 9 batches in all); the resumed fit (another plan) skips that
    batch instead of training it twice, as Keras' own callback would."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    module, w = wrapped("dp4")
    with pytest.raises(RuntimeError, match="failing at batch 3"):
        _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=3),
                                 FailAtBatch(FAIL_AT, 3)])
    assert signal.getsignal(signal.SIGTERM) is before  # fit gave SIGTERM back
    with open(tmp_path / "training_metadata.json") as f:
        meta = json.load(f)
    assert meta == {"epoch": 2, "batch": 0, "batches_done": 1, "iterations": 9}
    module, w = wrapped("tp2")
    history = _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(tmp_path),
                                                                        save_freq=3)])
    assert len(history.history["loss"]) == EPOCHS - FAIL_AT
    assert int(w.optimizer.iterations.numpy()) == EPOCHS * STEPS_PER_EPOCH
    assert_weights_close(w, reference())


def test_weights_and_metadata_that_disagree_are_refused(tmp_path):
    """A process killed between writing the weights and the metadata leaves them a save
    apart: the resume refuses them (a PlannerError) instead of training on wrong."""
    interrupted("zero-dp2", tmp_path)
    path = tmp_path / "training_metadata.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps(dict(meta, epoch=1, iterations=4)))
    module, w = wrapped("single")
    with pytest.raises(PlannerError, match="step 4, the weights' optimizer step 8"):
        _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(tmp_path))])
    path.unlink()
    module, w = wrapped("single")
    with pytest.raises(PlannerError, match="no training_metadata.json"):
        _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(tmp_path))])


def test_a_saved_wrapped_model_loads_with_the_one_device_optimizer_state(tmp_path):
    """model.save of a dp2 x tp2 model: keras.models.load_model gives the plain model, its
    optimizer holding the state of one device's 2 epochs; a second fit of the resumed
    model starts at its own initial epoch, not at the restored one."""
    module, w = wrapped("dp2xtp2")
    _fit(w, module, FAIL_AT, [])
    w.save(str(tmp_path / "m.keras"))
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    ref = reference(epochs=FAIL_AT)
    assert_weights_close(loaded, ref)
    got, want = loaded.optimizer.variables, ref.optimizer.variables
    assert len(got) == len(want)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g.numpy(), r.numpy(), atol=1e-5, rtol=1e-3)
    interrupted("single", tmp_path / "backup")
    w = resumed("pp2", tmp_path / "backup")
    assert len(_fit(w, module, 1, []).history["loss"]) == 1
