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


def test_a_stage_boundary_inside_a_nested_model_is_refused():
    model = _nested_model()
    plan = make_plan(model, [cpus(0), cpus(1)],
                     stage_layers=[["embed", "trunk/proj"], ["trunk/hidden", "head"]])
    with pytest.raises(PlannerError, match="splits nested model 'trunk'"):
        apply.wrap(model, plan)
