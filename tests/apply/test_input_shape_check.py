"""A wrapped model refuses batches of another shape than its plan was made for, where the
model leaves a dimension dynamic (``apply.input_shapes``): a plan made for sequences of
16 tokens trains on 16 and refuses 8, in fit, train_on_batch, evaluate and predict, for
arrays and for ``tf.data`` whose lengths are known only at run time."""
from __future__ import annotations

import dataclasses
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.core.errors import PlanMismatchError
from tfplan.planner.plan import Plan, load_plan, save_plan
from tfplan.profiler.static import profile_model
from tests.apply.helpers import cpus, make_plan

SEQ, VOCAB = 16, 20


def seq_model() -> keras.Model:
    """token_ids (batch, None) -> Embedding -> Dense -> mean over the sequence -> Dense."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    h = keras.layers.Embedding(VOCAB, 8, name="embed")(tokens)
    h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(tokens, keras.layers.Dense(2, name="head")(h), name="seq_model")


def planned(model: keras.Model, devices: list[str], seq: int | None = SEQ) -> Plan:
    """A hand-made plan whose input shapes are the profile's for sequences of ``seq``."""
    plan = make_plan(model, [devices], global_batch=4)
    if seq is None:
        return plan
    profile = profile_model(model, 1, optimizer="sgd", input_shapes={"token_ids": (seq,)})
    return dataclasses.replace(plan, model_input_shapes=profile.input_shapes)


def data(seq: int, n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.integers(0, VOCAB, (n, seq)).astype("int32"),
            rng.normal(size=(n, 2)).astype("float32"))


def wrapped(devices: list[str], seq: int | None = SEQ) -> keras.Model:
    model = seq_model()
    w = apply.wrap(model, planned(model, devices, seq))
    w.compile(optimizer="sgd", loss="mse")
    return w


def assert_names_the_fix(err: pytest.ExceptionInfo, received: str = "(batch, 8)") -> None:
    msg = str(err.value)
    for needle in ("'token_ids'", "(batch, 16)", received, "--input-shape token_ids=8"):
        assert needle in msg, msg


@pytest.mark.parametrize("devices", [cpus(0), cpus(0, 1)], ids=["single", "dp2"])
def test_fit_refuses_another_sequence_length_and_trains_on_the_planned_one(devices):
    model = wrapped(devices)
    x, y = data(8)
    with pytest.raises(PlanMismatchError) as err:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert_names_the_fix(err)
    with pytest.raises(PlanMismatchError) as err:
        model.train_on_batch(x[:4], y[:4])
    assert_names_the_fix(err)
    before = [w.copy() for w in model.get_weights()]
    x, y = data(SEQ)
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    model.train_on_batch(x[:4], y[:4])


def test_evaluate_and_predict_check_too():
    model = wrapped(cpus(0))
    x, y = data(8)
    with pytest.raises(PlanMismatchError) as err:
        model.evaluate(x, y, batch_size=4, verbose=0)
    assert_names_the_fix(err)
    with pytest.raises(PlanMismatchError) as err:
        model.predict(x, batch_size=4, verbose=0)
    assert_names_the_fix(err)
    x, y = data(SEQ)
    assert np.isfinite(model.evaluate(x, y, batch_size=4, verbose=0))
    assert model.predict(x, batch_size=4, verbose=0).shape == (8, 2)


def test_a_dataset_whose_length_is_known_only_at_run_time_is_checked_in_the_step():
    model = wrapped(cpus(0))
    spec = (tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None, 2), tf.float32))

    def dataset(seq: int) -> tf.data.Dataset:
        x, y = data(seq)
        return tf.data.Dataset.from_generator(lambda: iter([(x[:4], y[:4]), (x[4:], y[4:])]),
                                              output_signature=spec)

    with pytest.raises(PlanMismatchError) as err:
        model.fit(dataset(8), epochs=1, verbose=0)
    msg = str(err.value)
    assert_names_the_fix(err)
    history = model.fit(dataset(SEQ), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_a_plan_without_input_shapes_checks_nothing():
    model = wrapped(cpus(0), seq=None)
    x, y = data(8)
    assert np.isfinite(model.fit(x, y, batch_size=4, verbose=0).history["loss"][0])


def test_plan_files_carry_the_input_shapes_and_old_ones_load(tmp_path):
    model = seq_model()
    plan = planned(model, cpus(0))
    assert plan.model_input_shapes == (("token_ids", (SEQ,)),)
    save_plan(plan, tmp_path / "plan.json")
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["model"]["input_shapes"] == {"token_ids": [SEQ]}
    assert load_plan(tmp_path / "plan.json").model_input_shapes == plan.model_input_shapes
    del doc["model"]["input_shapes"]  # a plan written before input shapes were recorded
    assert Plan.from_dict(doc).model_input_shapes == ()


def test_a_keras_hub_backbone_is_checked_by_input_name():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        max_sequence_length=32)
    profile = profile_model(backbone, 1, optimizer="sgd", input_shapes={"*": (SEQ,)})
    plan = dataclasses.replace(make_plan(backbone, [cpus(0)], global_batch=4),
                               model_input_shapes=profile.input_shapes)
    model = apply.wrap(backbone, plan)
    model.compile(optimizer="sgd", loss="mse")

    def batch(seq: int) -> tuple[dict, np.ndarray]:
        x = {"token_ids": np.ones((4, seq), "int32"), "padding_mask": np.ones((4, seq), "int32")}
        return x, np.zeros((4, seq, 8), "float32")

    with pytest.raises(PlanMismatchError) as err:
        model.fit(*batch(8), batch_size=4, verbose=0)
    assert "(batch, 16)" in str(err.value) and "(batch, 8)" in str(err.value)
    assert "'padding_mask'" in str(err.value) or "'token_ids'" in str(err.value)
    assert np.isfinite(model.fit(*batch(SEQ), batch_size=4, verbose=0).history["loss"][0])
