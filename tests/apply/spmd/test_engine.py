"""The SPMD engine (apply.spmd) through ``apply.wrap(build_model, plan)``: every device runs
its own part, trains like one device, keeps its state where the plan says, and sends what
the plan prices (no hub).

Each case builds the wrapped model from the model file's builder (seed 0), a one-device
reference from the wrapped model's own starting weights, and compares per-step losses
(1e-4 relative, float32). The communication audit (``apply.audit.audit_step``) measures
one step and is held to the issue's bar: each device's bytes within 10% of
``planner.traffic.plan_sent_bytes`` and no device above 1.25x its group's mean.
"""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply, compat
from tfplan.apply.audit import audit_step
from tfplan.apply.spmd import SpmdModel
from tfplan.core.errors import PlannerError
from tfplan.planner.traffic import plan_sent_bytes
from tfplan.profiler import profile_model
from tests.apply import helpers
from tests.apply.test_acceptance import SPLITS

CASES = {  # name: (devices, dp, micro-batches)
    "dp4": ((0, 1, 2, 3), 4, 1),
    "tp2": ((0, 1), 1, 1),
    "tp4": ((0, 1, 2, 3), 1, 1),
    "dp2xtp2": ((0, 1, 2, 3), 2, 1),
    "dp2-m2": ((0, 1), 2, 2),
}
SPLITS = {**SPLITS,
          "tiny_vit": (("attention", "heads"), ("mlp_up", "column"), ("mlp_down", "row")),
          "tiny_seq2seq": (("embed", "vocab"), ("transformer_encoder/attention", "heads"),
                           ("transformer_encoder/mlp_up", "column"),
                           ("transformer_encoder/mlp_down", "row"))}
STEPS, BATCH = 3, 16


def _wrapped(name: str, case: str, *, compile_kwargs: dict | None = None, zero: int = 0,
             optimizer=None, recompute: str = "none", offload: str = "none"):
    """(module, plan, wrapped, one-device reference with the wrapped model's weights);
    ``zero``: the plan's ZeRO stage; ``recompute``: its recomputation; ``optimizer``: a
    function making the optimizer (the model file's by default)."""
    module = helpers.load_model_file(name)
    devices, dp, m = CASES[case]
    keras.utils.set_random_seed(0)
    model = module.build_model()
    tp = len(devices) // dp
    plan = helpers.tp_plan(model, [helpers.cpus(*devices)],
                           _named(SPLITS[name], model) if tp > 1 else (),
                           dp=dp, num_microbatches=m, global_batch=BATCH, zero=zero)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(
        plan.strategy, recompute=recompute, offload=offload))
    return (module, plan, *wrapped_and_reference(module, plan, optimizer, compile_kwargs))


def wrapped_and_reference(module, plan, optimizer=None, compile_kwargs=None):
    """(the SPMD model of ``plan`` built from the module's builder, a one-device model with
    its starting weights), both compiled alike; ``optimizer``: a function making the
    optimizer (the model file's by default)."""
    wrapped = apply.wrap(module.build_model, plan)
    assert isinstance(wrapped, SpmdModel)
    reference = module.build_model()
    reference.set_weights(wrapped.get_weights())
    for target in (wrapped, reference):
        target.compile(optimizer=(optimizer or (lambda: helpers.fresh_optimizer(module)))(),
                       loss=module.loss, **(compile_kwargs or {}))
    return wrapped, reference


def _named(splits, model):
    """``splits`` with each path's first part renamed to the layer of ``model`` that Keras
    auto-named from it (an unnamed custom block: ``transformer_encoder_3``...)."""
    names = [layer.name for layer in model.layers]

    def own(path):
        top, _, rest = path.partition("/")
        found = top if top in names else next(n for n in names if n.startswith(top + "_"))
        return f"{found}/{rest}" if rest else found

    return tuple((own(path), split) for path, split in splits)


def _device(name: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


def _assert_state_on_its_devices(wrapped) -> None:
    """Every variable of the copy of device d on d; each optimizer slot beside its variable."""
    run = wrapped.run_description
    opt = wrapped.optimizer
    # the model trains the copies' weights only (not the host's template of weight files)
    assert {id(v) for v in wrapped.trainable_variables} == {
        id(v) for m in wrapped.device_models for v in m.trainable_variables}
    assert len(opt._momentums) == len(wrapped.trainable_variables)
    for model, device in zip(wrapped.device_models, run.devices):
        for v in model.variables:
            assert _device(v.value.device) == _device(device), (v.path, device)
        for v in model.trainable_variables:
            i = opt._get_variable_index(v)
            for slot in (opt._momentums[i], opt._velocities[i]):
                assert _device(slot.value.device) == _device(device), (slot.path, device)


# the MLP and the transformer under dp4, tp2 and dp2 x tp2 built, as users pass them:
# tests/apply/test_acceptance.py (the same engine since apply.wrap routes built models here)
@pytest.mark.parametrize("name, case", [
    ("tiny_transformer", "tp4"), ("tiny_vit", "dp2xtp2"), ("tiny_seq2seq", "dp4")])
def test_trains_like_one_device_with_state_on_its_devices(name, case):
    module, _, wrapped, reference = _wrapped(name, case)
    batches = helpers.batches_of(module, STEPS, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
    for got, want in zip(wrapped.get_weights(), reference.get_weights()):
        # Adam divides by sqrt(v): a weight whose gradients are ~0 moves by rounding noise
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-4)
    _assert_state_on_its_devices(wrapped)


@pytest.mark.parametrize("name, case", [("tiny_mlp", "dp4"), ("tiny_mlp", "tp2"),
                                        ("tiny_transformer", "dp2xtp2"),
                                        ("tiny_cnn", "dp2xtp2")])
def test_each_device_sends_what_the_plan_prices_and_no_device_is_a_hub(name, case):
    module, plan, wrapped, _ = _wrapped(name, case)
    x, y = module.sample_batch(BATCH)
    audit = audit_step(wrapped, x, y, plan=plan)
    measured = {d: sum(v for k, v in kinds.items() if k != "input")
                for d, kinds in audit.by_device().items()}
    keras.utils.set_random_seed(0)
    priced = {d: sum(v for _, v in kinds) for d, kinds in
              plan_sent_bytes(profile_model(module.build_model(), batch_size=BATCH), plan)}
    assert not audit.unsized
    for device in plan.devices:
        assert measured[device] == pytest.approx(priced[device], rel=0.10), device
    mean = sum(measured[d] for d in plan.devices) / len(plan.devices)
    assert max(measured[d] for d in plan.devices) <= 1.25 * mean


def test_a_row_split_cuts_unequal_slices_of_its_inputs():
    """5 inputs over tp=2: rank 0 reads 3, rank 1 reads 2 (the first slices one larger, as
    numpy.array_split cuts); the whole input is cut on each rank and its gradient's
    unequal slices all-gathered (padded to the larger); the CNN's stem (3 channels) too."""
    keras.utils.set_random_seed(0)
    x = keras.Input(shape=(4,))
    h = keras.layers.Dense(5, activation="tanh", name="wide")(x)
    model = keras.Model(x, keras.layers.Dense(3, name="narrow")(h))
    plan = helpers.tp_plan(model, [helpers.cpus(0, 1)], (("narrow", "row"),))

    def build():
        keras.utils.set_random_seed(0)
        x = keras.Input(shape=(4,))
        h = keras.layers.Dense(5, activation="tanh", name="wide")(x)
        return keras.Model(x, keras.layers.Dense(3, name="narrow")(h))

    wrapped = apply.wrap(build, plan)
    assert isinstance(wrapped, SpmdModel)
    assert [tuple(m.get_layer("narrow").kernel.shape) for m in wrapped.device_models] == \
        [(3, 3), (2, 3)]
    reference = build()
    reference.set_weights(wrapped.get_weights())
    for target in (wrapped, reference):
        target.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(16, 4)).astype("float32"),
                rng.normal(size=(16, 3)).astype("float32")) for _ in range(4)]
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
    for got, want in zip(wrapped.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # "wide" trained too


def test_a_split_the_spmd_engine_does_not_run_goes_to_the_older_engine():
    # the CNN's 8 filters split by column over tp = 3 (unequal slices): apply.tensor_parallel
    module = helpers.load_model_file("tiny_cnn")
    keras.utils.set_random_seed(0)
    model = module.build_model()
    plan = helpers.tp_plan(model, [helpers.cpus(0, 1, 2)], SPLITS["tiny_cnn"], cluster_size=6)
    wrapped = apply.wrap(module.build_model, plan)
    assert not isinstance(wrapped, SpmdModel)
    reference = module.build_model()
    reference.set_weights(wrapped.get_weights())
    for target in (wrapped, reference):
        target.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    batches = helpers.batches_of(module, 2, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))


class _Scaled(keras.layers.Layer):
    """A tutorial-style layer whose argument is a layer (no get_config, no **kwargs)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def call(self, x):
        return 2.0 * self.inner(x)


def test_custom_layers_without_get_config_train_built_or_from_the_builder():
    """keras.io's ViT layers (``def __init__(self, patch_size): super().__init__()``):
    from the builder each device builds its copy with the user's code; a built model's
    layers are re-created from the arguments Keras recorded for them (plain values), so
    the built model trains too. A layer whose argument is an object is refused before
    anything runs, naming the builder form."""
    module, plan, wrapped, reference = _wrapped("tiny_vit", "dp4")
    batches = helpers.batches_of(module, STEPS, BATCH)
    want = helpers.step_losses(reference, batches)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches), want)
    keras.utils.set_random_seed(0)
    start = module.build_model()  # its layers named by Keras' counters: its own plan
    built_wrapped = apply.wrap(start, helpers.tp_plan(start, [helpers.cpus(0, 1, 2, 3)], (),
                                                      dp=4, global_batch=BATCH))
    assert isinstance(built_wrapped, SpmdModel)
    assert [type(layer).__name__ for layer in built_wrapped.device_models[0].layers[1:3]] == \
        ["Patches", "PatchEncoder"]
    built_wrapped.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    plain = module.build_model()
    plain.set_weights(start.get_weights())
    plain.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    helpers.assert_losses_match(helpers.step_losses(built_wrapped, batches),
                                helpers.step_losses(plain, batches))
    x = keras.Input(shape=(4,))
    model = keras.Model(x, _Scaled(keras.layers.Dense(2))(x))
    with pytest.raises(PlannerError, match=r"apply\.wrap\(build_model, plan\)"):
        apply.wrap(model, helpers.make_plan(model, [helpers.cpus(0, 1)]))


@pytest.mark.parametrize("case", ["dp2-m2", "dp2xtp2"])
def test_masked_padding_and_metrics_are_one_devices(case):
    module, _, wrapped, reference = _wrapped("tiny_seq2seq", case,
                                             compile_kwargs={"metrics": ["accuracy"]})
    x, y = module.sample_batch(BATCH)  # each part holds another number of real tokens
    assert compat.get_keras_mask(reference(x)) is not None  # the loss skips the padding
    for _ in range(2):
        got = wrapped.train_on_batch(x, y, return_dict=True)
        want = reference.train_on_batch(x, y, return_dict=True)
        for key in ("loss", "accuracy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4), key
    if wrapped.run_description.tp == 1:  # (tp pads such batches: the uneven-dataset test)
        got = wrapped.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)  # 10 + 6
        want = reference.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
        assert got == pytest.approx(want, rel=1e-4)


def test_sample_weights_are_one_devices():
    module, _, wrapped, reference = _wrapped("tiny_mlp", "dp2xtp2")
    x, y = module.sample_batch(BATCH)
    weights = np.linspace(0.5, 2.0, BATCH).astype("float32")
    for _ in range(2):
        got = wrapped.train_on_batch(x, y, sample_weight=weights)
        want = reference.train_on_batch(x, y, sample_weight=weights)
        assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("name, case", [("tiny_mlp", "dp2-m2"), ("tiny_mlp", "dp2xtp2"),
                                        ("tiny_seq2seq", "tp2")])
def test_fit_on_a_dataset_with_an_uneven_last_batch_and_callbacks(name, case):
    # under tensor parallelism the last batch (8 of 16 rows) runs padded to 16
    module, _, wrapped, reference = _wrapped(name, case, compile_kwargs={"metrics": ["acc"]})
    x, y = module.sample_batch(40)  # batches of 16, 16 and 8 rows
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    seen = []
    logger = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(logs))
    got = wrapped.fit(data, epochs=2, verbose=0, callbacks=[logger]).history
    want = reference.fit(data, epochs=2, verbose=0).history
    for key in ("loss", "acc"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4)
    assert len(seen) == 2
    np.testing.assert_allclose(wrapped.predict(x, batch_size=16, verbose=0),
                               reference.predict(x, batch_size=16, verbose=0),
                               rtol=1e-4, atol=1e-5)
    assert wrapped.evaluate(x, y, batch_size=10, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=10, verbose=0), rel=1e-4)


def test_tensor_parallel_refuses_a_batch_larger_than_the_plans_before_any_collective():
    module, _, wrapped, _ = _wrapped("tiny_mlp", "tp2")
    x, y = module.sample_batch(BATCH + 2)
    with pytest.raises(PlannerError, match="at most the plan's global batch"):
        wrapped.train_on_batch(x, y)


def test_weight_files_and_saved_models_are_the_users_model(tmp_path):
    module, plan, wrapped, reference = _wrapped("tiny_transformer", "dp2xtp2")
    x, y = module.sample_batch(BATCH)
    wrapped.train_on_batch(x, y)
    path = str(tmp_path / "trained.weights.h5")
    wrapped.save_weights(path)
    plain = module.build_model()
    plain.load_weights(path)
    np.testing.assert_allclose(plain.predict_on_batch(x), wrapped.predict_on_batch(x),
                               rtol=1e-4, atol=1e-5)
    again = apply.wrap(module.build_model, plan)
    again.load_weights(path)
    for got, want in zip(again.get_weights(), wrapped.get_weights()):
        np.testing.assert_array_equal(got, want)
    saved = str(tmp_path / "trained.keras")
    wrapped.save(saved)
    loaded = keras.models.load_model(saved, compile=False)
    np.testing.assert_allclose(loaded.predict_on_batch(x), plain.predict_on_batch(x),
                               rtol=1e-6, atol=1e-6)


def test_global_clipnorm_is_the_one_device_norm():
    # the transformer: split weights, and an Embedding's sparse gradient (made dense by
    # one device's clipping, its duplicate rows summed, before Adam squares it)
    module, _, wrapped, reference = _wrapped("tiny_transformer", "dp2xtp2")
    for target in (wrapped, reference):
        target.compile(optimizer=keras.optimizers.Adam(1e-2, global_clipnorm=0.05),
                       loss=module.loss)
    batches = helpers.batches_of(module, STEPS, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("policy, case", [("mixed_bfloat16", "dp4"),
                                          ("mixed_bfloat16", "dp2xtp2"),
                                          ("mixed_float16", "dp2xtp2")], indirect=["policy"])
def test_mixed_precision_trains_like_one_device_at_the_same_policy(policy, case):
    module, _, wrapped, reference = _wrapped("tiny_mlp", case)
    if policy == "mixed_float16":  # Keras wraps the optimizer in a LossScaleOptimizer
        assert isinstance(wrapped.optimizer, keras.optimizers.LossScaleOptimizer)
    batches = helpers.batches_of(module, STEPS, BATCH)
    # 16-bit activations: the partial sums of a split layer round apart (bfloat16 keeps 8
    # bits of mantissa, float16 11)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches), rtol=2e-2)


@pytest.mark.parametrize("name, case, zero", [("tiny_transformer", "dp2xtp2", 0),
                                              ("tiny_mlp", "dp4", 1)])
def test_weight_files_hold_one_devices_optimizer_state(tmp_path, name, case, zero):
    module, plan, wrapped, reference = _wrapped(name, case, zero=zero)
    batches = helpers.batches_of(module, 3, BATCH)
    for x, y in batches[:2]:
        wrapped.train_on_batch(x, y)
        reference.train_on_batch(x, y)
    path = str(tmp_path / "trained.weights.h5")
    wrapped.save_weights(path)
    plain = module.build_model()
    plain.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(path)  # weights and Adam's moments, as one device holds them
    again = apply.wrap(module.build_model, plan)
    again.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    again.load_weights(path)
    x, y = batches[2]
    want = reference.train_on_batch(x, y)
    assert plain.train_on_batch(x, y) == pytest.approx(want, rel=1e-4)
    assert again.train_on_batch(x, y) == pytest.approx(want, rel=1e-4)
    for model in (plain, again):  # the third update moved both as it moved one device's
        for got, expected in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=5e-4)
