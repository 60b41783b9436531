"""BackupAndRestore on the SPMD engine: its backups hold one device's weights and optimizer
state (apply.spmd.optimizer_state), so a job resumes under another plan, on either engine,
mid-epoch too (apply.backup's planned callback), and ends as if never interrupted."""
from __future__ import annotations

import keras
import pytest

from tfplan import apply
from tests.apply.helpers import base_model
from tests.apply.test_backup_restore import (EPOCHS, FAIL_AT, PLANS, STEPS_PER_EPOCH,
                                             FailAtBatch, _fit, _optimizer,
                                             assert_weights_close, reference, wrapped)


def _spmd(key):
    module, base = base_model("tiny_mlp")
    w = apply.wrap(module.build_model, PLANS[key](base))
    w.set_weights(base.get_weights())
    w.compile(_optimizer(), loss=module.loss)
    return module, w


def test_a_mid_epoch_backup_of_the_spmd_engine_resumes_under_another_plan_and_engine(tmp_path):
    module, w = _spmd("dp2xtp2")
    assert type(w).__name__ == "SpmdModel"
    with pytest.raises(RuntimeError, match="failing at batch 3"):
        _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=3),
                                 FailAtBatch(FAIL_AT, 3)])
    module, w = _spmd("zero-dp2")  # ZeRO-1 shards take the state back
    history = _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(tmp_path),
                                                                        save_freq=3)])
    assert len(history.history["loss"]) == EPOCHS - FAIL_AT
    assert int(w.optimizer.iterations.numpy()) == EPOCHS * STEPS_PER_EPOCH
    assert_weights_close(w, reference())


def test_a_backup_of_the_older_engine_resumes_on_the_spmd_engine(tmp_path):
    module, old = wrapped("dp4")  # a built model: the older engine
    with pytest.raises(RuntimeError, match="failing at batch 3"):
        _fit(old, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(tmp_path),
                                                                    save_freq=3),
                                   FailAtBatch(FAIL_AT, 3)])
    module, w = _spmd("tp2")
    _fit(w, module, EPOCHS, [keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=3)])
    assert_weights_close(w, reference())
