"""A model with a nested sub-model: plans name its layers ``outer/inner``."""
from __future__ import annotations

import keras
import numpy as np
import pytest

from tfplan import apply
from tfplan.core.errors import PlannerError
from tfplan.profiler.signature import model_signature
from tests.apply.helpers import cpus, make_plan


def _nested_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    inner_in = keras.Input((8,))
    trunk = keras.Model(inner_in, keras.layers.Dense(8, activation="relu", name="hidden")(
        keras.layers.Dense(8, activation="relu", name="proj")(inner_in)), name="trunk")
    x = keras.Input((4,))
    h = keras.layers.Dense(8, name="embed")(x)
    return keras.Model(x, keras.layers.Dense(2, name="head")(trunk(h)), name="nested")


def test_nested_model_layers_are_named_outer_inner_and_placed_together():
    model = _nested_model()
    names = [n for n, _, _ in model_signature(model)]
    assert "trunk/proj" in names and "trunk/hidden" in names
    plan = make_plan(model, [cpus(0), cpus(1)],
                     stage_layers=[["embed"], ["trunk/proj", "trunk/hidden", "head"]])
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((16, 4), "float32"), np.zeros((16, 2), "float32")
    wrapped.train_on_batch(x, y)
    devices = apply.variable_devices(wrapped)
    trunk_devices = {d for path, ds in devices.items()
                     if path.split("/")[0] in ("proj", "hidden") for d in ds}
    assert trunk_devices and all(d.endswith("CPU:1") for d in trunk_devices), devices
    assert all(d.endswith("CPU:0") for d in devices["embed/kernel"]), devices


def test_a_stage_boundary_inside_a_nested_model_places_its_layers_on_their_stages():
    model = _nested_model()
    plan = make_plan(model, [cpus(0), cpus(1)],
                     stage_layers=[["embed", "trunk/proj"], ["trunk/hidden", "head"]])
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer="sgd", loss="mse")
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 2)).astype(
            "float32")
        np.testing.assert_allclose(wrapped.train_on_batch(x, y), reference.train_on_batch(x, y),
                                   rtol=1e-5)
    trunk = wrapped.device_models[0].get_layer("trunk")  # the one copy (apply.spmd)
    for name, device in (("proj", "CPU:0"), ("hidden", "CPU:1")):
        for v in trunk.get_layer(name).weights:
            assert v.value.device.endswith(device), (v.path, v.value.device)
    # the nested model keeps its class and weight-file layout: the user's model loads it
    for got, want in zip(wrapped.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_stage_boundary_inside_a_block_is_refused():
    from tests.apply.helpers import load_model_file

    model = load_model_file("tiny_block").build_model()
    plan = make_plan(model, [cpus(0), cpus(1)],
                     stage_layers=[["embed", "block_0", "block_0/up"],
                                   ["block_0/down", "block_1", "block_1/up", "block_1/down",
                                    "head"]])
    with pytest.raises(PlannerError, match="block 'block_0'.*whole on one stage"):
        apply.wrap(model, plan)
