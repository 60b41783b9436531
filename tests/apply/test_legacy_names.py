"""tfplan.apply.legacy_names: the wrapped models are registered with Keras as ``tfplan>...``;
a file saved under tf-parallel-planner 0.1's names (``apply>...``) fails with an error
that says what to change, and the change it names works."""
from __future__ import annotations

import json
import zipfile

import keras
import numpy as np
import pytest

from tfplan import apply, compat
from tfplan.apply import legacy_names
from tfplan.apply.cloning import to_functional
from tfplan.apply.legacy_names import LegacyModelFileError
from tfplan.apply.pipeline import wrap_placed
from tfplan.apply.placement import top_level_devices
from tfplan.core.errors import PlannerError
from tests.apply.helpers import base_model, cpus, make_plan


def test_wrapped_models_are_registered_under_tfplan_and_the_old_names_under_stubs():
    from tfplan.apply.data_parallel import DataParallelModel
    from tfplan.apply.pipeline import PlacedModel
    from tfplan.apply.tensor_parallel import TensorParallelModel

    classes = (DataParallelModel, PlacedModel, TensorParallelModel)  # the multi-worker
    # models 0.1 saved are gone (apply.spmd runs across workers): their stubs stay
    assert {c.__name__ for c in classes} < set(legacy_names.WRAPPED_MODEL_CLASSES)
    assert set(legacy_names.LEGACY_STUBS) == set(legacy_names.WRAPPED_MODEL_CLASSES)
    for cls in classes:
        assert keras.saving.get_registered_name(cls) == f"tfplan>{cls.__name__}"
        assert keras.saving.get_registered_object(f"tfplan>{cls.__name__}") is cls
        stub = keras.saving.get_registered_object(f"apply>{cls.__name__}")
        assert stub is legacy_names.LEGACY_STUBS[cls.__name__] and stub is not cls


def _rewrite_config(src: str, dst: str, old: str, new: str) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "config.json":
                text = data.decode()
                assert old in text
                data = text.replace(old, new).encode()
            zout.writestr(item, data)


def test_a_file_saved_under_the_0_1_names_fails_with_the_fix_and_the_fix_works(tmp_path):

    module, model = base_model("tiny_mlp")
    # the older placed engine (apply.pipeline, which runs each worker's part across
    # workers) saves its registered class; the SPMD engine's files are the user's plain
    # model (apply.spmd)
    plan = make_plan(model, [cpus(1), cpus(2)])
    wrapped = wrap_placed(to_functional(model), top_level_devices(plan), plan_name=plan.name,
                          num_microbatches=1)
    wrapped.compile(optimizer="adam", loss=module.loss)
    saved = str(tmp_path / "wrapped.keras")
    wrapped.save(saved)
    with zipfile.ZipFile(saved) as z:
        config = json.loads(z.read("config.json"))
    assert config["registered_name"] == "tfplan>PlacedModel"

    old = str(tmp_path / "saved_by_0.1.keras")
    _rewrite_config(saved, old, '"tfplan>', '"apply>')
    with pytest.raises(LegacyModelFileError) as raised:
        keras.models.load_model(old)
    message = str(raised.value)
    assert isinstance(raised.value, PlannerError)
    for part in ("tf-parallel-planner 0.1", "'apply>PlacedModel'", "'tfplan>PlacedModel'",
                 "config.json", "save it again with 0.2"):
        assert part in message

    fixed = str(tmp_path / "fixed.keras")  # what the message says to do
    _rewrite_config(old, fixed, '"apply>', '"tfplan>')
    loaded = keras.models.load_model(fixed)
    assert type(loaded) is compat.functional_class()
    x, _ = module.sample_batch(4)
    np.testing.assert_allclose(loaded.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
