"""Context parallelism: the sequence cut over cp copies of the model, attention over the
group's keys and values; training equals one device, every copy on its planned device,
the causal mask right across chunks, and models or batches it cannot run refused. On the
SPMD engine (apply.spmd.context) for sequences of a static length; the older engine
(apply.context_parallel) runs lengths known only as they run."""
from __future__ import annotations

import dataclasses
from collections import Counter

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply, compat
from tfplan.apply.audit import audit_step
from tfplan.apply.context_parallel import ContextParallelModel
from tfplan.apply.spmd import SpmdModel
from tfplan.planner.traffic import plan_sent_bytes
from tfplan.profiler import profile_model
from tests.apply import helpers
from tfplan.apply.dimensions import unapplied
from tfplan.apply.mode import Mode, execution_mode
from tfplan.core.errors import PlanMismatchError, PlannerError
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, make_plan, reference_losses,
                                 step_losses, tp_plan)

STEPS = 10


def cp_plan(model, devices, *, dp: int = 1, cp: int = 2, num_microbatches: int = 1,
            recompute: str = "none"):
    """A hand-made plan: one stage on dp * cp devices, devices[r * cp + c]."""
    plan = make_plan(model, [devices], num_microbatches=num_microbatches)
    strategy = dataclasses.replace(plan.strategy, dp=dp, cp=cp, recompute=recompute,
                                   microbatch_size=GLOBAL_BATCH // (dp * num_microbatches))
    return dataclasses.replace(plan, strategy=strategy,
                               name=f"test dp={dp} cp={cp} m={num_microbatches}")


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def assert_placement(wrapped, plan) -> None:
    """Copy p's every variable on ``devices[p]``; each Adam slot with its variable."""
    if isinstance(wrapped, SpmdModel):
        assert len(wrapped.device_models) == plan.strategy.dp * plan.strategy.cp
        helpers.assert_state_where_planned(wrapped, plan)
        return
    devices = plan.stages[0].devices
    copies = wrapped.replica_models()
    assert len(copies) == plan.strategy.dp * plan.strategy.cp
    for p, copy in enumerate(copies):
        for v in copy.weights:
            assert _short(v.value.device) == devices[p], (p, v.path)
    variables = wrapped.trainable_variables
    assert len(variables) == len(copies) * len(wrapped.weights)
    for slots in (wrapped.optimizer._momentums, wrapped.optimizer._velocities):
        for v, slot in zip(variables, slots):
            assert _short(slot.value.device) == _short(v.value.device), (slot.path, v.path)


def assert_copies_equal(wrapped) -> None:
    """Every copy updated with the same summed gradients: equal up to float rounding (each
    copy's update runs on its own device; one CI run of dp2 x cp2 differed in the last bit,
    2e-7 relative, in 10 of 256 elements after 10 Adam steps)."""
    copies = getattr(wrapped, "device_models", None) or wrapped.replica_models()
    for copy in copies[1:]:
        for mine, theirs in zip(copies[0].weights, copy.weights):
            np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dp, cp, m, devices", [
    (1, 2, 1, cpus(2, 3)),
    (2, 2, 1, cpus(4, 5, 6, 7)),  # replica r, rank c on devices[r * cp + c]
    (1, 4, 2, cpus(0, 1, 2, 3)),  # chunks of 2 positions, 2 micro-batches
])
def test_trains_like_one_device_with_copies_on_their_devices(dp, cp, m, devices):
    module, model = base_model("tiny_transformer")
    plan = cp_plan(model, devices, dp=dp, cp=cp, num_microbatches=m)
    assert execution_mode(plan).mode is Mode.CONTEXT_PARALLEL
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel) and wrapped.run_description.cp == cp
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    assert_losses_match(step_losses(wrapped, batches),
                        reference_losses("tiny_transformer", STEPS))
    assert_placement(wrapped, plan)
    assert_copies_equal(wrapped)  # every copy got the sum of all dp * cp gradients
    # the trained weights, read back as the user's model's, compute what the CP forward does
    plain = keras.models.clone_model(model)
    plain.set_weights(wrapped.get_weights())
    x = batches[0][0]
    np.testing.assert_allclose(wrapped.predict(x, batch_size=GLOBAL_BATCH, verbose=0),
                               plain.predict_on_batch(x), rtol=1e-5, atol=1e-5)


def _forward_ops(wrapped, x) -> list:
    graph = tf.function(lambda t: wrapped(t)).get_concrete_function(tf.constant(x)).graph
    return graph.get_operations()


def test_each_rank_computes_its_chunk_and_gathers_every_chunks_keys_and_values():
    module, model = base_model("tiny_transformer")
    plan = cp_plan(model, cpus(4, 5, 6, 7), cp=4)
    wrapped = apply.wrap(model, plan)
    x, y = module.sample_batch(GLOBAL_BATCH)
    ops = _forward_ops(wrapped, x)
    math = Counter(_short(op.device) for op in ops
                   if op.type in ("MatMul", "BatchMatMulV2", "Einsum", "Softmax"))
    assert set(math) == set(cpus(4, 5, 6, 7)) and len(set(math.values())) == 1, math
    # each rank all-gathers the group's keys and values (one collective each) on its device
    gathers = Counter(_short(op.device) for op in ops
                      if op.type == "CollectiveGatherV2" and "_cp" in op.name)
    assert gathers == {d: 2 for d in cpus(4, 5, 6, 7)}, gathers
    # and sends what the plan prices for them (forward gathers, backward reduce-scatters)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    audit = audit_step(wrapped, x, y, plan=plan)
    keras.utils.set_random_seed(0)
    priced = dict(plan_sent_bytes(profile_model(module.build_model(),
                                                batch_size=GLOBAL_BATCH), plan))
    for device in plan.devices:
        assert audit.by_device()[device]["cp"] == pytest.approx(dict(priced[device])["cp"],
                                                                rel=0.10), device


def test_causal_mask_across_chunks():
    """Outputs equal one device's (a chunk's queries see every earlier chunk's keys), and a
    position never sees a later one, across the chunk boundary too."""
    module, model = base_model("tiny_transformer")  # no position embedding: only the mask
    wrapped = apply.wrap(model, cp_plan(model, cpus(0, 1)))  # orders the positions
    x, _ = module.sample_batch(GLOBAL_BATCH)
    want = model.predict_on_batch(x)
    got = wrapped.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    half = x.shape[1] // 2
    later = x.copy()
    later[:, half + 1:] = (later[:, half + 1:] + 5) % 24  # chunk 1 after its first position
    moved = wrapped.predict(later, batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(moved[:, :half + 1], got[:, :half + 1], rtol=1e-6, atol=1e-6)
    earlier = x.copy()
    earlier[:, 0] = (earlier[:, 0] + 5) % 24  # chunk 0's first token: every position sees it
    moved = wrapped.predict(earlier, batch_size=GLOBAL_BATCH, verbose=0)
    assert np.abs(moved[:, half:] - got[:, half:]).max(axis=(1, 2)).min() > 1e-4
    np.testing.assert_allclose(moved, model.predict_on_batch(earlier), rtol=1e-5, atol=1e-5)


def _bidirectional(seq=None):
    keras.utils.set_random_seed(1)
    ids = keras.Input(shape=(seq,), dtype="int32", name="ids")
    x = keras.layers.Embedding(24, 16, name="embed")(ids)
    a = keras.layers.MultiHeadAttention(2, 8, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="ln")(keras.layers.Add(name="res")([x, a]))
    return keras.Model(ids, keras.layers.Dense(24, name="logits")(x), name="bidirectional")


def test_attention_without_causal_mask_sees_every_chunk():
    model = _bidirectional()  # any sequence length: a multiple of cp at run time
    x = np.random.default_rng(0).integers(0, 24, size=(4, 12)).astype("int32")
    wrapped = apply.wrap(model, cp_plan(model, cpus(1, 2, 3), cp=3))
    assert isinstance(wrapped, ContextParallelModel)  # lengths known as they run: older
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(PlanMismatchError, match=r"sequences of 7 positions.*cp=3"):
        wrapped.predict_on_batch(x[:, :7])
    wrapped.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    with pytest.raises(PlanMismatchError, match=r"multiple of 3"):
        wrapped.train_on_batch(x[:, :8], x[:, :8])
    ragged = tf.data.Dataset.from_generator(  # lengths unknown until the step runs
        lambda: iter([(x[:, :8], x[:, :8])]),
        output_signature=(tf.TensorSpec((None, None), tf.int32),) * 2)
    with pytest.raises(PlanMismatchError, match=r"not a multiple of cp=3"):
        wrapped.fit(ragged, verbose=0)


def test_attention_over_a_static_length_without_causal_mask_runs_spmd():
    model = _bidirectional(seq=12)
    x = np.random.default_rng(0).integers(0, 24, size=(4, 12)).astype("int32")
    wrapped = apply.wrap(model, cp_plan(model, cpus(1, 2, 3), cp=3))
    assert isinstance(wrapped, SpmdModel)
    assert [tuple(copy.inputs[0].shape) for copy in wrapped.device_models] == [(None, 4)] * 3
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)


def _padded_transformer():
    """Causal attention over a padding mask that reaches the output (Keras drops it at a
    residual Add after MultiHeadAttention, which clears its inputs' masks)."""
    keras.utils.set_random_seed(2)
    ids = keras.Input(shape=(8,), dtype="int32", name="ids")
    x = keras.layers.Embedding(24, 16, mask_zero=True, name="embed")(ids)
    a = keras.layers.MultiHeadAttention(2, 8, name="attention")(x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization(name="ln")(a)
    return keras.Model(ids, keras.layers.Dense(24, name="logits")(x), name="padded")


def _padded_batches(steps: int):
    """Half the sequences padded on the left (chunk 1 must not see chunk 0's padding),
    half on the right (some chunks all padding)."""
    rng = np.random.default_rng(3)
    x = rng.integers(1, 24, size=(steps * GLOBAL_BATCH, 9)).astype("int32")
    lengths = rng.integers(2, 10, size=len(x))
    right = np.arange(9)[None, :] >= lengths[:, None]
    left = np.arange(9)[None, :] < 9 - lengths[:, None]
    x[np.where(np.arange(len(x))[:, None] % 2 == 0, right, left)] = 0
    return [(x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH, :-1],
             x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH, 1:]) for i in range(steps)]


def test_padding_mask_across_chunks_trains_like_one_device():
    """Embedding(mask_zero=True): padded keys masked on every rank, the chunks' losses
    weighted by their unmasked positions (chunks hold different numbers of them)."""
    model = _padded_transformer()
    batches = _padded_batches(5)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    want = step_losses(reference, batches)
    wrapped = apply.wrap(model, cp_plan(model, cpus(4, 5, 6, 7), dp=2, cp=2))
    x = batches[0][0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    assert_losses_match(step_losses(wrapped, batches), want)
    np.testing.assert_allclose(wrapped.evaluate(x, batches[0][1], verbose=0),
                               reference.evaluate(x, batches[0][1], verbose=0), rtol=1e-4)


def test_recomputed_attention_trains_the_same():
    module, model = base_model("tiny_transformer")
    wrapped = apply.wrap(model, cp_plan(model, cpus(0, 1), recompute="selective"))
    # selective: the attention core alone (apply.recompute), inside each rank's attention
    assert all(compat.attention_core_is_wrapped(copy.get_layer("attention"))
               for copy in wrapped.device_models)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, reference_losses("tiny_transformer", STEPS)[:3])


def test_fit_evaluate_and_weight_files(tmp_path):
    module, model = base_model("tiny_transformer")
    wrapped = apply.wrap(model, cp_plan(model, cpus(2, 3)))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss, metrics=["accuracy"])
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=fresh_optimizer(module), loss=module.loss,
                      metrics=["accuracy"])
    x, y = module.sample_batch(4 * GLOBAL_BATCH)
    got = wrapped.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0).history
    want = reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0).history
    assert_losses_match(got["loss"], want["loss"])
    assert got["accuracy"] == want["accuracy"]
    np.testing.assert_allclose(wrapped.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                               reference.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
                               rtol=1e-4)
    path = str(tmp_path / "cp.weights.h5")
    wrapped.save_weights(path)
    plain = keras.models.clone_model(model)
    plain.load_weights(path)  # one copy, the user's layout
    np.testing.assert_allclose(plain.predict_on_batch(x), reference.predict_on_batch(x),
                               rtol=1e-4, atol=1e-5)


def test_execution_mode_and_dimensions():
    _, model = base_model("tiny_transformer")
    plan = cp_plan(model, cpus(0, 1, 2, 3), dp=2, cp=2)
    assert execution_mode(plan).mode is Mode.CONTEXT_PARALLEL
    assert unapplied(plan, execution_mode(plan)) == []
    zero = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, zero_stage=1))
    assert unapplied(zero, execution_mode(zero)) == []  # the SPMD engine runs cp with ZeRO
    staged = make_plan(model, [cpus(0, 1), cpus(2, 3)])
    staged = dataclasses.replace(staged, strategy=dataclasses.replace(staged.strategy, dp=1, cp=2))
    assert unapplied(staged, execution_mode(staged)) == []  # the SPMD engine runs cp x pp
    workers = [f"/job:worker/task:{w}/device:CPU:{i}" for w in range(2) for i in range(2)]
    spread = cp_plan(model, workers, dp=2, cp=2)
    spread = dataclasses.replace(spread, cluster=dataclasses.replace(
        spread.cluster, num_nodes=2, devices_per_node=2,
        inter_node_link=spread.cluster.intra_node_link))
    assert unapplied(spread, execution_mode(spread)) == []  # one program per worker
    staged = make_plan(model, [workers[:2], workers[2:]])  # stages on both workers: one
    staged = dataclasses.replace(staged, cluster=spread.cluster, strategy=dataclasses.replace(
        staged.strategy, dp=1, cp=2))  # program per worker, the activations crossing
    assert unapplied(staged, execution_mode(staged)) == []
    eight = [f"/job:worker/task:{w}/device:CPU:{i}" for w in range(2) for i in range(4)]
    zero = make_plan(model, [eight[:4], eight[4:]])  # ZeRO there: one program per worker
    zero = dataclasses.replace(zero, cluster=dataclasses.replace(
        spread.cluster, devices_per_node=4), strategy=dataclasses.replace(
        zero.strategy, dp=2, cp=2, zero_stage=1))
    assert unapplied(zero, execution_mode(zero)) == []


# --- refusals ---------------------------------------------------------------------------------
def _sequence_model(kind: str):
    ids = keras.Input(shape=(8,), dtype="int32")
    x = keras.layers.Embedding(24, 8, name="embed")(ids)
    if kind == "flatten":
        x = keras.layers.Dense(3, name="head")(keras.layers.Flatten(name="flat")(x))
    elif kind == "conv":
        x = keras.layers.Conv1D(8, 3, padding="causal", name="conv")(x)
    elif kind == "pool":
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    elif kind == "dense_over_sequence":
        x = keras.layers.Dense(8, name="mix")(keras.layers.Permute((2, 1), name="swap")(x))
    elif kind == "gqa":
        x = keras.layers.GroupQueryAttention(8, 2, 1, name="gqa")(x, x)
    elif kind == "attention_mask":
        mask = keras.Input(shape=(8, 8), dtype="bool")
        a = keras.layers.MultiHeadAttention(2, 4, name="attention")(x, x, attention_mask=mask)
        return keras.Model([ids, mask], a)
    return keras.Model(ids, x)


@pytest.mark.parametrize("kind, match", [
    ("flatten", r"layer 'flat' \(Flatten\) is not known to act on each position alone"),
    ("conv", r"layer 'conv' \(Conv1D\)"),
    ("pool", r"layer 'pool' \(GlobalAveragePooling1D\)"),
    ("dense_over_sequence", r"layer 'swap' \(Permute\)"),
    ("gqa", r"layer 'gqa' \(GroupedQueryAttention\) is not run context-parallel yet"),
    ("attention_mask", r"layer 'attention'.*called with attention_mask"),
])
def test_models_that_mix_positions_are_refused(kind, match):
    model = _sequence_model(kind)
    with pytest.raises(PlannerError, match=match):
        apply.wrap(model, cp_plan(model, cpus(0, 1)))


def test_output_without_the_sequence_axis_is_refused():
    ids = keras.Input(shape=(8,), dtype="int32")
    x = keras.layers.Embedding(24, 8, name="embed")(ids)
    model = keras.Model(ids, keras.layers.Dense(2, name="head")(x[:, 0]))
    with pytest.raises(PlannerError, match=r"not known to act on each position alone"):
        apply.wrap(model, cp_plan(model, cpus(0, 1)))


def test_sequence_not_divisible_by_cp_is_refused():
    model = _bidirectional(seq=6)
    with pytest.raises(PlannerError, match=r"sequences of 6 positions.*cp=4.*multiple of 4"):
        apply.wrap(model, cp_plan(model, cpus(0, 1, 2, 3), cp=4))


def test_a_loss_that_is_not_a_mean_over_positions_is_refused_at_compile():
    module, model = base_model("tiny_transformer")
    wrapped = apply.wrap(model, cp_plan(model, cpus(0, 1)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    with pytest.raises(PlannerError, match=r"reduction 'sum'.*sum_over_batch_size"):
        wrapped.compile(optimizer="adam", loss=loss)


SPLITS = (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
          ("mlp_down", "row"), ("logits", "column"))


@pytest.mark.parametrize("dp, tp, zero", [  # cp x tp by default: the sequence-parallel
    pytest.param(1, 2, 0, marks=pytest.mark.slow),  # case below
    pytest.param(2, 2, 0, marks=pytest.mark.slow),
    pytest.param(2, 1, 1, marks=pytest.mark.slow), (2, 1, 3)])
def test_cp_with_tensor_parallelism_and_zero_trains_like_one_device(dp, tp, zero):
    """Attention split by heads gathers its heads' keys and values over the cp group; ZeRO
    shards over every dp x cp replica; each device sends what the plan prices."""
    module, model = base_model("tiny_transformer")
    devices = cpus(*range(dp * 2 * tp))
    plan = tp_plan(model, [devices], SPLITS if tp > 1 else (), dp=dp * 2, zero=zero)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(
        plan.strategy, dp=dp, cp=2, microbatch_size=GLOBAL_BATCH // dp))
    assert unapplied(plan, execution_mode(plan)) == []
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    assert_losses_match(step_losses(wrapped, batches),
                        reference_losses("tiny_transformer", STEPS))
    if not zero:
        helpers.assert_state_where_planned(wrapped, plan)
    x, y = batches[0]
    audit = audit_step(wrapped, x, y, plan=plan)
    keras.utils.set_random_seed(0)
    priced = plan_sent_bytes(profile_model(module.build_model(), batch_size=GLOBAL_BATCH),
                             plan)
    measured = audit.by_device()
    for device, kinds in priced:
        for kind, nbytes in kinds:
            assert measured[device][kind] == pytest.approx(nbytes, rel=0.10, abs=64), (
                device, kind)


@pytest.mark.parametrize("shape", ["cp2xpp2-1f1b", "cp2xtp2-sp"])
def test_cp_with_pipeline_stages_or_sequence_parallelism_trains_like_one_device(shape):
    """cp x pp (1F1B, 2 micro-batches: each stage's copies run their chunk of every
    sequence) and cp x tp with sequence parallelism (each rank holds 1/tp of its 1/cp
    chunk between the split layers) on the SPMD engine: like one device, each device
    sending what the plan prices."""
    module, model = base_model("tiny_transformer")
    if shape.startswith("cp2xpp2"):
        plan = tp_plan(model, [cpus(0, 1), cpus(2, 3)], (), dp=2, num_microbatches=2)
        change = dict(dp=1, cp=2, microbatch_size=GLOBAL_BATCH // 2, schedule="1f1b")
    else:
        plan = tp_plan(model, [cpus(0, 1, 2, 3)], SPLITS, dp=2)
        change = dict(dp=1, cp=2, microbatch_size=GLOBAL_BATCH, sequence_parallel=True)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, **change))
    assert unapplied(plan, execution_mode(plan)) == []
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel) and wrapped.run_description.cp == 2
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, 5, GLOBAL_BATCH)
    assert_losses_match(step_losses(wrapped, batches), reference_losses("tiny_transformer", 5))
    x, y = batches[0]
    measured = audit_step(wrapped, x, y, plan=plan).by_device()
    keras.utils.set_random_seed(0)
    priced = plan_sent_bytes(profile_model(module.build_model(), batch_size=GLOBAL_BATCH),
                             plan)
    for device, kinds in priced:
        assert dict(kinds)["cp"] > 0 or device not in plan.stages[0].devices
        for kind, nbytes in kinds:
            assert measured[device][kind] == pytest.approx(nbytes, rel=0.10, abs=64), (
                device, kind)
