"""A plan matches its model by structure, not by the layer names Keras generates.

Keras names unnamed layers per process (``dense``, then ``dense_1`` once another model
was built), so a plan made for a model is applied to the same model built later in
the same process (after a reference model, a second experiment) with other names:
apply.wrap maps the plan's layers to the model's by position (types, parameter counts,
output shapes) and places, splits and stages them as planned. A model of another
structure still gets PlanMismatchError naming the first differing layer.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest

from tfplan import apply
from tfplan.core.errors import PlanMismatchError
from tfplan.core.presets import parse_cluster
from tfplan.planner.plan import load_plan, save_plan
from tfplan.planner.search import search
from tfplan.profiler.signature import model_signature
from tfplan.profiler.static import profile_model
from tests.apply.helpers import (GLOBAL_BATCH, STEPS, assert_losses_match, fresh_optimizer,
                                 load_model_file, step_losses)

MODULE = load_model_file("unnamed_cnn")


def _plan(fix, tmp_path, global_batch=GLOBAL_BATCH):
    """Profile and search a fresh build of the unnamed CNN; the plan goes through
    plan.json as a plan from `plan analyze` would."""
    keras.utils.set_random_seed(0)
    planned = MODULE.build_model()
    profile = profile_model(planned, batch_size=1, optimizer="adam")
    plan = search(profile, parse_cluster("cpu:8"), global_batch, fix=fix).chosen
    save_plan(plan, tmp_path / "plan.json")
    return load_plan(tmp_path / "plan.json")


def _batches(steps=STEPS, batch=GLOBAL_BATCH):
    x, y = MODULE.sample_batch(steps * batch)
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(steps)]


def _short(device: str) -> str:
    return "/device:" + device.rsplit("/device:", 1)[-1]


# a large global batch makes tensor-parallel splits pay on cpu:8 (the batches trained
# are GLOBAL_BATCH: dp = 1 and one micro-batch split any batch)
@pytest.mark.parametrize("fix,global_batch", [
    ({"pp": 2}, GLOBAL_BATCH), ({"dp": 2}, GLOBAL_BATCH),
    ({"tp": 2, "dp": 1, "pp": 1, "num_microbatches": 1}, 4096)], ids=["pp2", "dp2", "tp2"])
def test_a_plan_applies_to_its_model_built_again_under_other_names(fix, global_batch,
                                                                   tmp_path):
    plan = _plan(fix, tmp_path, global_batch)
    assert plan.model_output_shapes[2] == (8,)  # the pooling's output, per sample
    MODULE.build_model()  # another model first: Keras's generated names move on
    keras.utils.set_random_seed(0)
    model = MODULE.build_model()
    planned_names = [n for n, _, _ in plan.model_signature]
    names = [n for n, _, _ in model_signature(model)]
    assert all(a != b for a, b in zip(planned_names, names)), (planned_names, names)
    assert any(n.startswith("global_average_pooling2d") for n in names)

    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=fresh_optimizer(MODULE), loss=MODULE.loss)
    expected = step_losses(reference, _batches())

    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(MODULE), loss=MODULE.loss)
    assert_losses_match(step_losses(wrapped, _batches()), expected)

    # every layer on its planned device (position i of the plan is layer i of the model)
    assert [n for n, _, _ in wrapped.plan.model_signature] == names
    assert wrapped.plan.strategy == plan.strategy
    devices = apply.variable_devices(wrapped)
    for (planned, _, params), name in zip(plan.model_signature, names):
        stage = next(s for s in plan.stages if planned in s.layers)
        if params == 0:
            continue
        (renamed,) = [s for s in wrapped.plan.stages if name in s.layers]
        assert renamed.devices == stage.devices
        got = sorted({_short(d) for path, ds in devices.items()
                      if path.split("/")[0] == name for d in ds})
        assert got and set(got) <= set(stage.devices), (name, got, stage.devices)
    if fix.get("tp"):
        splits = dict(plan.tp_splits)
        assert splits, "a tp=2 plan splits some layers"
        renamed = dict(wrapped.plan.tp_splits)
        for (planned, _, _), name in zip(plan.model_signature, names):
            assert splits.get(planned) == renamed.get(name)


def test_a_model_of_another_structure_names_the_first_differing_layer(tmp_path):
    plan = _plan({"dp": 2}, tmp_path)
    names = [n for n, _, _ in plan.model_signature]

    def model_with(units):  # the same layers but the hidden Dense is wider
        keras.utils.set_random_seed(0)
        inputs = keras.Input(shape=(8, 8, 3))
        x = keras.layers.Conv2D(6, 3, activation="relu")(inputs)
        x = keras.layers.Conv2D(8, 3, activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        x = keras.layers.Dense(units, activation="tanh", name="wide")(x)
        return keras.Model(inputs, keras.layers.Dense(2)(x))

    with pytest.raises(PlanMismatchError) as err:
        apply.wrap(model_with(32), plan)
    message = str(err.value)
    assert "layer 3" in message and repr(names[3]) in message and "'wide'" in message
    assert "(Dense, output (batch, 16), 144 params)" in message
    assert "(Dense, output (batch, 32), 288 params)" in message
    assert "Re-run `plan analyze`" in message

    # same types and parameter counts, another input size: the shapes differ first
    keras.utils.set_random_seed(0)
    with pytest.raises(PlanMismatchError) as err:
        apply.wrap(MODULE.build_model(size=12), plan)
    message = str(err.value)
    assert "layer 0" in message and "output (batch, 6, 6, 6)" in message
    assert "output (batch, 10, 10, 6)" in message

    # one layer fewer
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(8, 8, 3))
    x = keras.layers.Conv2D(6, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    short = keras.Model(inputs, keras.layers.Dense(16, activation="tanh")(x))
    with pytest.raises(PlanMismatchError, match=r"with 5 layers; the model has 4 \(the plan's "
                                                 r"layer 4, '.*' \(Dense\), has no counterpart"):
        apply.wrap(short, plan)


def test_renaming_and_plan_files_with_and_without_shapes(tmp_path):
    import dataclasses
    import json

    from tfplan.core.errors import SchemaError

    plan = _plan({"pp": 2}, tmp_path)
    names = [n for n, _, _ in plan.model_signature]
    other = [(f"x{i}", t, p) for i, (_, t, p) in enumerate(plan.model_signature)]
    renamed = plan.for_model(other, plan.model_output_shapes)
    assert [n for n, _, _ in renamed.model_signature] == [n for n, _, _ in other]
    assert [len(s.layers) for s in renamed.stages] == [len(s.layers) for s in plan.stages]
    assert renamed.device_of_layer() == {f"x{names.index(k)}": d
                                         for k, d in plan.device_of_layer().items()}
    assert plan.for_model(plan.model_signature) is plan  # same names: the plan itself
    split = dataclasses.replace(plan, tp_splits=((names[3], "column"), (names[4], "row")))
    assert split.for_model(other).tp_splits == (("x3", "column"), ("x4", "row"))

    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["model"]["output_shapes"][2] == [8]
    del doc["model"]["output_shapes"]  # a plan file written before shapes were recorded
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = load_plan(tmp_path / "old.json")
    assert old.model_output_shapes == ()
    assert old.for_model(other, ((1, 2, 3),) * len(other)).stages == renamed.stages
    doc["model"]["output_shapes"] = [[8]]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match="output_shapes has 1 entries"):
        load_plan(tmp_path / "bad.json")


def test_recomputation_follows_the_mapping(tmp_path):
    import dataclasses

    plan = _plan({"pp": 2}, tmp_path)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  recompute="full"))
    MODULE.build_model()  # names move on
    keras.utils.set_random_seed(0)
    model = MODULE.build_model()
    names = [n for n, _, _ in model_signature(model)]
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=fresh_optimizer(MODULE), loss=MODULE.loss)
    expected = step_losses(reference, _batches(3))
    wrapped = apply.wrap(model, plan)
    # every layer, by the model's names
    assert set(wrapped.run_description.recomputed) == set(names)
    wrapped.compile(optimizer=fresh_optimizer(MODULE), loss=MODULE.loss)
    assert_losses_match(step_losses(wrapped, _batches(3)), expected)
