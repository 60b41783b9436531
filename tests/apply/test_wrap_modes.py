"""apply.wrap in each mode trains exactly like one device, with state where the plan says.

Runs on the 8 logical CPU devices of tests/conftest.py with hand-made plans
(tests/apply/helpers.py) for a small MLP and a small CNN with a residual Add.
"""
from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.spmd import SpmdModel
from tests.apply.helpers import (GLOBAL_BATCH, STEPS, assert_losses_match,
                                 assert_state_where_planned, base_model, batches_of, cpus,
                                 fresh_optimizer, make_plan, reference_losses, step_losses)

CASES = {
    "mlp-single": ("tiny_mlp", [cpus(5)], 1),
    "mlp-dp4": ("tiny_mlp", [cpus(0, 1, 2, 3)], 1),
    "mlp-pp2-m2": ("tiny_mlp", [cpus(1), cpus(2)], 2),
    "mlp-pp3-m4": ("tiny_mlp", [cpus(1), cpus(2), cpus(3)], 4),
    "cnn-dp4": ("tiny_cnn", [cpus(4, 5, 6, 7)], 1),
    "cnn-pp2": ("tiny_cnn", [cpus(6), cpus(7)], 1),
    "cnn-pp3-m2": ("tiny_cnn", [cpus(1), cpus(2), cpus(3)], 2),
}


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type}:{spec.device_index}"


@pytest.mark.parametrize("case", list(CASES))
def test_losses_placement_and_keras_api(case, tmp_path):
    name, devices, m = CASES[case]
    module, model = base_model(name)
    plan = make_plan(model, devices, num_microbatches=m, global_batch=GLOBAL_BATCH)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)  # every mode here runs SPMD (apply.spmd)
    # compile AFTER wrap, with an optimizer object made outside any strategy scope
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    assert_losses_match(step_losses(wrapped, batches), reference_losses(name))
    assert_state_where_planned(wrapped, wrapped.plan)

    # evaluate / predict / save_weights -> load_weights, against a plain model
    x, y = batches[0]
    path = str(tmp_path / "trained.weights.h5")
    wrapped.save_weights(path)
    plain = keras.models.clone_model(model)
    plain.load_weights(path)  # a wrapped model's weights load into the user's architecture
    plain.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    expected = plain.predict_on_batch(x)
    np.testing.assert_allclose(wrapped.predict(x, batch_size=GLOBAL_BATCH, verbose=0),
                               expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(wrapped.predict_on_batch(x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(wrapped.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                               plain.evaluate(x, y, verbose=0), rtol=1e-5)
    again = apply.wrap(model, plan)  # untrained weights
    again.load_weights(path)
    np.testing.assert_allclose(again.predict_on_batch(x), expected, rtol=1e-5, atol=1e-6)


class _BatchLosses(keras.callbacks.Callback):
    """Per-batch losses from Keras' running mean: loss_k = k*mean_k - (k-1)*mean_(k-1)."""

    def __init__(self):
        super().__init__()
        self.means: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.means.append(float(logs["loss"]))

    @property
    def losses(self) -> list[float]:
        means = [0.0] + self.means
        return [(k + 1) * means[k + 1] - k * means[k] for k in range(len(self.means))]


@pytest.mark.parametrize("case", ["mlp-dp4", "cnn-pp3-m2"])
def test_fit_matches_single_device(case):
    name, devices, m = CASES[case]
    module, model = base_model(name)
    wrapped = apply.wrap(model, make_plan(model, devices, num_microbatches=m))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    x, y = module.sample_batch(STEPS * GLOBAL_BATCH)
    record = _BatchLosses()
    wrapped.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
                callbacks=[record])
    assert_losses_match(record.losses, reference_losses(name), rtol=2e-4)


@pytest.mark.parametrize("case", ["mlp-dp4", "mlp-pp2-m2"])
def test_wrapping_a_compiled_model_compiles_the_wrapped_one(case):
    name, devices, m = CASES[case]
    module, model = base_model(name)
    compiled = keras.models.clone_model(model)
    compiled.set_weights(model.get_weights())
    compiled.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    wrapped = apply.wrap(compiled, make_plan(model, devices, num_microbatches=m))
    assert wrapped.compiled
    losses = step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)[:2])
    assert_losses_match(losses, reference_losses(name)[:2])
    assert compiled.optimizer.iterations.numpy() == 0  # the user's model is untouched


def test_sequential_model_is_converted():
    module, functional = base_model("tiny_mlp")
    seq = keras.Sequential([keras.Input(shape=(12,))]
                           + [keras.layers.Dense.from_config(layer.get_config())
                              for layer in functional.layers[1:]], name="tiny_seq")
    seq.set_weights(functional.get_weights())
    wrapped = apply.wrap(seq, make_plan(seq, [cpus(2), cpus(3)], num_microbatches=2))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)[:2])
    assert_losses_match(losses, reference_losses("tiny_mlp")[:2])
    assert [layer.name for layer in wrapped.device_models[0].layers[1:]] == [
        layer.name for layer in seq.layers]


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_cnn"])
def test_pipeline_ops_forward_backward_and_updates_run_on_stage_devices(name):
    module, model = base_model(name)
    plan = make_plan(model, [cpus(1), cpus(2), cpus(3)], num_microbatches=2)
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    x, y = module.sample_batch(GLOBAL_BATCH)
    graph = tf.function(lambda x, y: wrapped.train_step((x, y))).get_concrete_function(
        tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype)).graph
    layer_device = plan.device_of_layer()
    seen = set()
    for op in graph.get_operations():
        segments = op.name.split("/")
        layers = [n for n in layer_device
                  if any(re.fullmatch(re.escape(n) + r"(_\d+)?", s) for s in segments)]
        if layers and op.type not in ("ReadVariableOp", "Placeholder", "NoOp"):
            assert _short(op.device) == layer_device[layers[-1]], (op.name, op.device)
            seen.add(("grad" if segments[0].startswith("gradient") else "fwd", layers[-1]))
        if op.type in ("MatMul", "Conv2D", "Conv2DBackpropFilter", "BiasAddGrad",
                       "AssignSubVariableOp", "AssignAddVariableOp"):
            assert op.device, f"{op.type} {op.name} has no device"
    weighted = {layer.name for layer in wrapped.device_models[0].layers if layer.weights}
    assert {("fwd", n) for n in weighted} <= seen and {("grad", n) for n in weighted} <= seen


def test_logdir_gets_plan_and_placement(tmp_path):
    import json

    _, model = base_model("tiny_mlp")
    plan = make_plan(model, [cpus(1), cpus(2)])
    apply.wrap(model, str(_save(plan, tmp_path / "plan.json")), logdir=tmp_path / "run")
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert placement["dense_in/kernel"] == ["/device:CPU:1"]
    assert placement["head/bias"] == ["/device:CPU:2"]
    assert (tmp_path / "run" / "plan.json").exists()


def test_saved_wrapped_model_loads_as_a_plain_functional(tmp_path):
    module, model = base_model("tiny_mlp")
    wrapped = apply.wrap(model, make_plan(model, [cpus(1), cpus(2)]))
    wrapped.compile(optimizer="adam", loss=module.loss)
    path = str(tmp_path / "wrapped.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded).__name__ == "Functional" and loaded.compiled
    x, _ = module.sample_batch(4)
    np.testing.assert_allclose(loaded.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)


def _save(plan, path):
    from tfplan.planner.plan import save_plan

    save_plan(plan, path)
    return path
