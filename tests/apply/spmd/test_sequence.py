"""Sequence parallelism on the SPMD engine (apply.spmd.layout, Korthikanti et al. 2022,
Sec. 4.2.2): the per-token layers between split layers run on each tensor rank's piece of
the sequence, the split layers all-gather (f-bar) and reduce-scatter (g-bar), and the
column outputs a row split or SwiGLU's product reads stay cut; trained like one device,
every weight and slot where planned, each device sending what the plan prices.

Runs on the 8 logical CPU devices of tests/conftest.py: the tiny transformer
(tests/apply/tiny_transformer.py) and the tiny Llama-style model (tests/apply/tiny_llama.py:
RMS-scaled LayerNormalization, grouped-query attention, SwiGLU).
"""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest

from tfplan import apply, compat
from tfplan.apply.audit import audit_step
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.spmd.layout import HiddenWhole, SequencePiece, SequenceWhole
from tfplan.core.errors import PlannerError
from tfplan.planner.traffic import gathered_outputs, plan_sent_bytes
from tfplan.profiler import profile_model
from tests.apply import helpers
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, step_losses, tp_plan)

pytestmark = pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")

STEPS_SP = 10
SPLITS = {
    "tiny_transformer": (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
                         ("mlp_down", "row"), ("logits", "column")),
    "tiny_llama": (("embed", "vocab"), ("attention", "heads"), ("mlp_gate", "column"),
                   ("mlp_up", "column"), ("mlp_down", "row"), ("logits", "column")),
}
# the replicated per-token layers that run on sequence pieces
PER_TOKEN = {"tiny_transformer": {"res_1", "ln_attention", "res_2", "ln_mlp"},
             "tiny_llama": {"norm_attention", "res_1", "norm_mlp", "res_2", "norm_out"}}
# name: (model file, devices of each stage (dp x tp per stage), dp)
CASES = {
    "transformer-tp2": ("tiny_transformer", [cpus(2, 3)], 1),
    "llama-tp2": ("tiny_llama", [cpus(0, 1)], 1),
    "transformer-dp2-tp2": ("tiny_transformer", [cpus(4, 5, 6, 7)], 2),
    "llama-dp2-tp2": ("tiny_llama", [cpus(0, 1, 2, 3)], 2),
    "transformer-pp2-tp2": ("tiny_transformer", [cpus(0, 1), cpus(2, 3)], 1),
    "llama-pp2-tp2": ("tiny_llama", [cpus(4, 5), cpus(6, 7)], 1),
}
SLOW = {"transformer-dp2-tp2", "llama-pp2-tp2"}  # the other model covers each by default


def sp_plan(model, devices, splits, *, dp=1, sequence_parallel=True, **kwargs):
    plan = tp_plan(model, devices, splits, dp=dp, **kwargs)
    return dataclasses.replace(plan, name=plan.name + " sp", strategy=dataclasses.replace(
        plan.strategy, sequence_parallel=sequence_parallel))


def _out(copy, name):
    """The output of layer ``name`` in the copy's graph (its last call: the re-wired one)."""
    return compat.inbound_nodes(copy.get_layer(name))[-1].outputs[0]


def _in(copy, name):
    return compat.inbound_nodes(copy.get_layer(name))[-1].input_tensors[0]


def _layout_layers(copy, kind):
    return [layer for layer in copy.layers if isinstance(layer, kind)]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in CASES])
def test_trains_like_one_device_on_pieces_sending_what_is_priced(case):
    name, devices, dp = CASES[case]
    module, model = base_model(name)
    plan = sp_plan(model, devices, SPLITS[name], dp=dp)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel) and wrapped.run_description.sequence_parallel
    tp, seq = plan.strategy.tp, module.SEQ
    for copy in wrapped.device_models:  # the per-token layers' activations: 1/tp of each
        for layer in PER_TOKEN[name]:
            assert _out(copy, layer).shape[1] == seq // tp, layer
        assert copy.outputs[0].shape[1] == seq  # the logits whole, for the loss
    batches = batches_of(module, STEPS_SP, GLOBAL_BATCH)
    x, y = batches[0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches), helpers.reference_losses(name, STEPS_SP))
    helpers.assert_state_where_planned(wrapped, plan)
    audit = audit_step(wrapped, x, y, plan=plan)
    measured = {d: sum(v for k, v in kinds.items() if k != "input")
                for d, kinds in audit.by_device().items()}
    keras.utils.set_random_seed(0)
    priced = {d: sum(v for _, v in kinds) for d, kinds in
              plan_sent_bytes(profile_model(module.build_model(), batch_size=GLOBAL_BATCH),
                              plan)}
    assert not audit.unsized
    for device in plan.devices:
        assert measured[device] == pytest.approx(priced[device], rel=0.10), device
    mean = sum(measured[d] for d in plan.devices) / len(plan.devices)
    assert max(measured[d] for d in plan.devices) <= 1.25 * mean


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_swiglu_runs_on_the_column_slices_and_only_the_logits_are_gathered(sequence_parallel):
    """gate and up stay cut into mlp_down (their product runs on the slices: Megatron-LM's
    SwiGLU); the logits, a model output, are all-gathered; the planner prices the same."""
    module, model = base_model("tiny_llama")
    plan = sp_plan(model, [cpus(0, 1)], SPLITS["tiny_llama"],
                   sequence_parallel=sequence_parallel)
    wrapped = apply.wrap(model, plan)
    copy = wrapped.device_models[0]
    assert _out(copy, "swiglu").shape[-1] == module.FFN // 2
    assert [layer.input.shape[-1] for layer in _layout_layers(copy, HiddenWhole)] == \
        [module.VOCAB // 2]
    profile = profile_model(model, batch_size=GLOBAL_BATCH)
    names = [layer.name for layer in profile.layers]
    splits = [dict(SPLITS["tiny_llama"]).get(n, "") for n in names]
    assert {names[i] for i in gathered_outputs(profile.layers, splits)} == {"logits"}
    # without a row split after them, the column outputs are gathered where they are read
    no_row = ["" if s == "row" else s for s in splits]
    assert {names[i] for i in gathered_outputs(profile.layers, no_row)} == {"swiglu", "logits"}


def _mixing_model():
    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(6,), dtype="int32")
    x = keras.layers.Embedding(10, 8, name="embed")(ids)
    x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.Dense(16, activation="relu", name="up")(x)
    x = keras.layers.Dense(8, name="down")(x)
    x = keras.layers.Add(name="res")([x, keras.layers.Conv1D(8, 3, padding="same",
                                                             name="conv")(x)])
    x = keras.layers.Flatten(name="flat")(x)  # mixes positions: reads the pieces gathered
    x = keras.layers.Dropout(0.0, name="drop")(x)  # [batch, features]: whole
    return keras.Model(ids, keras.layers.Dense(3, name="head")(x), name="mixing")


def test_layers_that_mix_positions_read_the_pieces_gathered():
    """The convolution over the sequence reads the row split's output gathered, and the
    residual Add cuts the convolution's whole output to the rank's piece; Flatten reads
    the Add's pieces gathered; ln, before the first split, has no piece among its inputs
    and runs whole; the function and training are one device's."""
    model = _mixing_model()
    plan = sp_plan(model, [cpus(0, 1)], (("up", "column"), ("down", "row")))
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    copy = wrapped.device_models[0]
    assert _out(copy, "ln").shape[1] == 6 and _out(copy, "res").shape[1] == 3
    assert _in(copy, "conv").shape[1] == 6 and _in(copy, "flat").shape[1] == 6
    assert len(_layout_layers(copy, SequencePiece)) == 1  # conv's output into res
    assert len(_layout_layers(copy, SequenceWhole)) == 2  # down's output into conv, res's
    x = np.random.default_rng(1).integers(0, 10, size=(16, 6)).astype("int32")
    y = np.random.default_rng(2).normal(size=(16, 3)).astype("float32")
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    for target in (reference, wrapped):
        target.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    batches = [(x, y)] * 3
    assert_losses_match(step_losses(wrapped, batches), step_losses(reference, batches))


@pytest.mark.parametrize("path", ["1f1b-m4", "zero1-dp2", "zero3-dp2", "recompute-full"])
def test_other_train_steps_with_sequence_parallelism(path):
    """A 1F1B pipeline of 4 micro-batches, ZeRO-1 and ZeRO-3 over dp2 and full
    recomputation with sequence parallelism: one device's losses, state where planned."""
    module, model = base_model("tiny_llama")
    kwargs: dict = {}
    devices = [cpus(0, 1)]
    if path == "1f1b-m4":
        devices, kwargs = [cpus(4, 5), cpus(6, 7)], dict(num_microbatches=4)
    elif path.startswith("zero"):
        devices, kwargs = [cpus(0, 1, 2, 3)], dict(dp=2, zero=int(path[4]))
    plan = sp_plan(model, devices, SPLITS["tiny_llama"], **kwargs)
    changes = {"1f1b-m4": dict(schedule="1f1b"), "recompute-full": dict(recompute="full")}
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  **changes.get(path, {})))
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS_SP, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, helpers.reference_losses("tiny_llama", STEPS_SP)[:3])
    if not path.startswith("zero"):
        helpers.assert_state_where_planned(wrapped, plan)


def test_a_sequence_that_does_not_divide_by_tp_is_refused_with_the_fix():
    model = _mixing_model()  # 6 tokens over tp=4
    plan = sp_plan(model, [cpus(0, 1, 2, 3)], (("up", "column"), ("down", "row")))
    with pytest.raises(PlannerError, match=r"sequence of 6 into tp=4 equal pieces.*"
                                           r"sequence_parallel to false"):
        apply.wrap(model, plan)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_smaller_batch_of_sequences_runs_padded_like_one_device(sequence_parallel):
    """Batches of 16 under a plan for 32: padded to 32, the padding rows' tokens weighing
    0 in the per-token loss (the flags shaped as the loss: [rows, 1])."""
    module, model = base_model("tiny_transformer")
    plan = sp_plan(model, [cpus(0, 1)], SPLITS["tiny_transformer"], global_batch=32,
                   sequence_parallel=sequence_parallel)
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS_SP, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, helpers.reference_losses("tiny_transformer", STEPS_SP)[:3])


def _masked_transformer():
    """Padding-masked tokens (Embedding mask_zero): causal attention over the mask, the
    loss over unmasked tokens only (no residual around attention, which clears its
    inputs' masks: the mask reaches the output)."""
    keras.utils.set_random_seed(2)
    ids = keras.Input(shape=(8,), dtype="int32", name="ids")
    x = keras.layers.Embedding(24, 16, mask_zero=True, name="embed")(ids)
    a = keras.layers.MultiHeadAttention(2, 8, name="attention")(x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization(name="ln_1")(a)
    h = keras.layers.Dense(32, activation="gelu", name="up")(x)
    h = keras.layers.Dense(16, name="down")(h)
    x = keras.layers.LayerNormalization(name="ln_2")(keras.layers.Add(name="res_2")([x, h]))
    return keras.Model(ids, keras.layers.Dense(24, name="logits")(x), name="masked")


def test_keras_masks_stay_whole_on_the_pieces():
    """The mask reaches attention and the loss as on one device while the per-token layers
    run on pieces; sequences padded on the right and on the left."""
    model = _masked_transformer()
    splits = (("embed", "vocab"), ("attention", "heads"), ("up", "column"), ("down", "row"),
              ("logits", "column"))
    plan = sp_plan(model, [cpus(0, 1, 2, 3)], splits, dp=2)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    assert _out(wrapped.device_models[0], "ln_1").shape[1] == 4
    rng = np.random.default_rng(3)
    x = rng.integers(1, 24, size=(3 * GLOBAL_BATCH, 9)).astype("int32")
    lengths = rng.integers(2, 10, size=len(x))
    right = np.arange(9)[None, :] >= lengths[:, None]
    left = np.arange(9)[None, :] < 9 - lengths[:, None]
    x[np.where(np.arange(len(x))[:, None] % 2 == 0, right, left)] = 0
    batches = [(x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH, :-1],
                x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH, 1:]) for i in range(3)]
    assert compat.get_keras_mask(model(batches[0][0])) is not None  # the loss skips padding
    np.testing.assert_allclose(wrapped.predict_on_batch(batches[0][0]),
                               model.predict_on_batch(batches[0][0]), rtol=1e-5, atol=1e-5)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    for target in (reference, wrapped):
        target.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    assert_losses_match(step_losses(wrapped, batches), step_losses(reference, batches))
