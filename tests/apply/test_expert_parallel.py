"""Expert parallelism (``apply.spmd.experts``; ``apply.expert_parallel``, the older engine):
every replica holds 1/ep of the mixture-of-experts layers' experts; tokens travel to their
experts' replica and back.

The tiny MoE model (``tiny_moe``: 8 experts, top 2, no capacity limit, no aux loss) trains
10 steps on the SPMD engine with ep=4 (dp=4), ep=2 x dp=4 (also with ``global_clipnorm``),
ep=2 x pp=2 (dp=2, 1F1B) and dp2 x tp2 x ep2 like one device (losses and final weights
within 1e-4), every expert shard and its optimizer slots on its replica's device, each
device's all-to-all bytes within 10% of the plan's; ZeRO-1 (dp4 x ep2, dp2 x ep2, with
the weights offloaded), ZeRO-2 (dp4 x ep2, 2 micro-batches) and ZeRO-3 (dp4 x ep2)
likewise, each expert shard's state cut over the replicas of its ep rank, with a weight
file round trip; ep groups across worker processes: tests/apply/test_workers.py (one
program per worker). A MixtureOfExperts inside a custom block (``tiny_moe_block``) and keras_hub's
Mixtral MoE blocks inside a MixtralBackbone (``tiny_mixtral``) train like one device under
ep=2. Weight files (with the optimizer state) and saved models move between the plain model
and ep plans both ways; what is not run is refused; a capacity factor or an aux loss under
a split batch is a warning, and the aux losses of every replica are in the loss (ours and
Mixtral's).
"""
from __future__ import annotations

import dataclasses

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.apply.helpers import (base_model, batches_of, cpus, fresh_optimizer,  # noqa: E402
                                 load_model_file, make_plan, single_device_copy,
                                 step_losses, tp_plan)

STEPS, BATCH = 10, 16
_REFERENCE: dict = {}


def ep_plan(model, stage_devices, ep: int, zero_stage: int = 0, **kwargs):
    plan = make_plan(model, stage_devices, global_batch=BATCH, **kwargs)
    strategy = dataclasses.replace(plan.strategy, ep=ep, zero_stage=zero_stage)
    return dataclasses.replace(plan, strategy=strategy,
                               name=f"{plan.name} ep={ep}"
                               + (f" ZeRO-{zero_stage}" if zero_stage else ""))


CLIP_NORM = 0.5  # "+clip": SGD with global_clipnorm, below the model's gradient norms


def optimizer(module, clip: bool = False):
    import keras

    if clip:  # Adam would hide a wrong clip: its steps ignore the gradients' scale
        return keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=CLIP_NORM)
    return fresh_optimizer(module)


def reference(clip: bool = False):
    """(losses, final weights) of one device, 10 steps."""
    if clip not in _REFERENCE:
        module, copy = single_device_copy("tiny_moe")
        copy.compile(optimizer=optimizer(module, clip), loss=module.loss)
        losses = step_losses(copy, batches_of(module, STEPS, BATCH))
        _REFERENCE[clip] = losses, copy.get_weights()
    return _REFERENCE[clip]


def wrapped(plan, clip: bool = False):
    from tfplan import apply

    module, model = base_model("tiny_moe")
    w = apply.wrap(model, plan)
    w.compile(optimizer=optimizer(module, clip), loss=module.loss)
    return module, w


def batches(module, steps: int) -> list:
    """``steps`` batches of BATCH samples (inputs as arrays or a dict of arrays)."""
    x, y = module.sample_batch(steps * BATCH)
    return [(_rows(x, i * BATCH, (i + 1) * BATCH), y[i * BATCH:(i + 1) * BATCH])
            for i in range(steps)]


def _rows(x, lo: int, hi: int):
    return {k: v[lo:hi] for k, v in x.items()} if isinstance(x, dict) else x[lo:hi]


def _short(device: str) -> str:
    return device.split("device:")[-1]


def copies_of(w) -> list:
    """Each replica's model: the SPMD engine's device copies (tp = 1), or the older
    engine's replicas."""
    return list(w.device_models) if hasattr(w, "device_models") else w.replica_models()


def assert_experts_placed(w, plan) -> None:
    """Replica r's twin holds experts (r % ep) * E/ep ..; its variables and their optimizer
    slots are on replica r's device of the MoE layer's stage; on the SPMD engine it
    exchanges tokens over the plan's ep group of that device."""
    from tfplan.apply.checkpoint import slot_variables
    from tfplan.apply.expert_parallel import ExpertParallelMoE
    from tfplan.apply.placement import tf_variable

    s = plan.strategy
    stage = next(st for st in plan.stages if "moe" in st.layers)
    slots = slot_variables(w.optimizer)
    for r, replica in enumerate(copies_of(w)):
        twin = replica.get_layer("moe")
        assert isinstance(twin, ExpertParallelMoE) and twin.ep_rank == r % s.ep
        want = _short(stage.devices[r])
        exchange = getattr(twin, "_exchange", None)
        if exchange is not None:  # SPMD: the ep group of its replica's device
            group = exchange.fn.group
            assert group.kind == "ep" and group.size == s.ep
            assert _short(group.devices[r % s.ep]) == want
        else:
            assert [t.ep_rank for t in twin.peers()] == list(range(s.ep))
        for v in twin.weights:
            if len(v.shape) > 1 and v is not twin.router_kernel:
                assert v.shape[0] == 8 // s.ep, v.path
            assert _short(tf_variable(v).device) == want, (r, v.path)
            mine = [slot for (key, _), slot in slots.items() if key == id(v)]
            assert mine  # Adam: momentum and velocity; SGD: momentum
            for slot in mine:
                assert _short(tf_variable(slot).device) == want, (r, slot.path)


def assert_sends_what_is_priced(w, plan, module) -> None:
    """The communication audit of one step: on every device the plan prices all-to-alls
    for, its ep bytes within 10% of the plan's; every device's total within 10% (or 64 B:
    the loss scalars the plan leaves out)."""
    import keras

    from tfplan.apply.audit import audit_step
    from tfplan.planner.traffic import plan_sent_bytes
    from tfplan.profiler import profile_model

    (x, y), = batches(module, 1)
    measured = audit_step(w, x, y, plan=plan).by_device()
    keras.utils.set_random_seed(0)
    priced = dict(plan_sent_bytes(profile_model(module.build_model(), batch_size=BATCH), plan))
    assert any(dict(kinds).get("ep", 0) > 0 for kinds in priced.values())
    for device, kinds in priced.items():
        kinds = dict(kinds)
        got = measured[device]
        if kinds.get("ep", 0) > 0:
            assert got["ep"] == pytest.approx(kinds["ep"], rel=0.10), device
        else:
            assert got.get("ep", 0) == 0, device
        total = sum(v for k, v in got.items() if k not in ("input", "host"))
        assert total == pytest.approx(sum(kinds.values()), rel=0.10, abs=64), device


@pytest.mark.parametrize("kind", ["ep4", "dp4xep2", "ep2xpp2", "dp4xep2+clip",
                                  "dp2xtp2xep2"])
def test_expert_parallel_trains_like_one_device(kind):
    """On the SPMD engine (apply.spmd.experts: all-to-alls over the ep groups): ep4;
    dp4 x ep2 (two copies of each expert); ep2 x pp2 (the MoE layer on stage 1, 2
    micro-batches in 1F1B order); dp4 x ep2 with global_clipnorm (the norm over one copy
    of the model: each expert once); dp2 x tp2 x ep2 (the MoE layer replicated over tp,
    each tensor rank routing through its own ep group). Each device sends what the plan
    prices."""
    import numpy as np

    from tfplan.apply.mode import execution_mode
    from tfplan.apply.spmd import SpmdModel

    _, model = base_model("tiny_moe")
    clip = kind.endswith("+clip")
    if kind == "dp2xtp2xep2":
        plan = tp_plan(model, [cpus(0, 1, 2, 3)], (("embed", "column"), ("head", "row")),
                       dp=2)
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, ep=2))
    elif kind == "ep4":
        plan = ep_plan(model, [cpus(0, 1, 2, 3)], ep=4)
    elif kind.startswith("dp4xep2"):
        plan = ep_plan(model, [cpus(0, 1, 2, 3)], ep=2)
    else:  # two pipeline stages, the MoE layer on the second; 2 micro-batches
        plan = ep_plan(model, [cpus(0, 1), cpus(2, 3)], ep=2, num_microbatches=2,
                       stage_layers=[("embed",), ("moe", "residual", "pool", "head")])
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                      schedule="1f1b"))
    assert execution_mode(plan).mode == "tensor_parallel"
    module, w = wrapped(plan, clip)
    assert isinstance(w, SpmdModel)
    losses, weights = reference(clip)
    np.testing.assert_allclose(step_losses(w, batches_of(module, STEPS, BATCH)), losses,
                               rtol=1e-4)
    for got, want in zip(w.get_weights(), weights, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if plan.strategy.tp == 1:
        assert_experts_placed(w, plan)
    if kind in ("ep4", "ep2xpp2", "dp2xtp2xep2"):
        assert_sends_what_is_priced(w, plan, module)


def test_the_clip_case_clips():
    """The +clip case's first gradient norm is above CLIP_NORM, so a norm that missed some
    experts' shards would scale the update differently."""
    import tensorflow as tf

    module, copy = single_device_copy("tiny_moe")
    (x, y), = batches_of(module, 1, BATCH)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(copy(x) - y))
    grads = tape.gradient(loss, copy.trainable_variables)
    assert float(tf.linalg.global_norm(grads)) > 2 * CLIP_NORM


def zero_plan(kind: str):
    """dp4 x ep2 (each expert shard on 2 replicas, its state cut between them) or dp2 x ep2
    (one copy of each shard, its state whole), ZeRO-1, or ZeRO-2 over 2 micro-batches;
    dp2 x tp2 x ep2 ZeRO-1 (the MoE layer replicated over tp)."""
    _, model = base_model("tiny_moe")
    stage = int(kind.rpartition("+zero")[2][0])
    if kind.startswith("dp2xtp2"):
        plan = tp_plan(model, [cpus(0, 1, 2, 3)], (("embed", "column"), ("head", "row")),
                       dp=2, zero=stage)
        return dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, ep=2))
    dp = 4 if kind.startswith("dp4") else 2
    offload = kind.endswith("+offload")  # on devices apart from the host (CPU:0)
    plan = ep_plan(model, [cpus(*range(int(offload), dp + int(offload)))], ep=2,
                   zero_stage=stage, num_microbatches=2 if stage == 2 else 1)
    if offload:
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(
            plan.strategy, offload="optimizer+weights"))
    return plan


def assert_shards_where_planned(w, plan) -> None:
    """ZeRO on the SPMD engine: each device's optimizer state is its shards' -- an expert
    shard's cut over the dp/ep replicas of its ep rank (replica q holding piece q // ep),
    every other weight's over all dp replicas -- its Adam slots beside them on its device;
    no copy's weight has a slot."""
    from tfplan.apply.spmd import SpmdModel

    assert isinstance(w, SpmdModel)
    run, zero, opt = w.run_description, w._zero, w.optimizer
    experts = w._copies.expert_weights
    assert experts
    for q, replica in enumerate(run.replicas):
        for t, device in enumerate(replica):
            for v, shard, kind, cut in zip(zero.weights[q][t], zero.shards[q][t],
                                           zero.kinds[q][t], zero.cuts[q][t]):
                expert = id(v) in experts
                assert kind == ("edp" if expert else "dp"), v.path
                pieces = run.dp // run.ep if expert else run.dp
                size = int(np.prod(v.shape))  # 1/pieces of it each, up to a row's padding
                assert cut.dp == pieces and tuple(shard.shape) == cut.shard_shape, v.path
                assert size <= pieces * int(np.prod(shard.shape)) < size + pieces * cut.width
                i = opt._get_variable_index(shard)
                for slot in (opt._momentums[i], opt._velocities[i]):
                    assert _short(slot.value.device) == _short(device), (slot.path, device)
    assert len(opt._momentums) == len(zero.variables)


@pytest.mark.parametrize("kind", ["dp4xep2+zero1", "dp4xep2+zero2", "dp2xep2+zero1",
                                  "dp2xtp2xep2+zero1", "dp4xep2+zero3",
                                  "dp2xep2+zero1+offload"])
def test_zero_with_expert_parallelism_trains_like_one_device(kind):
    """ZeRO-1 (ZeRO-2: each of 2 micro-batches' gradients reduce-scattered; ZeRO-3: each
    layer gathered from its shards, an expert shard's over the replicas of its ep rank)
    with ep=2 on the SPMD engine: 10 steps like one device; the expert shards' state cut
    over the replicas of their ep rank (dp2 x ep2: one each, uncut), the rest over dp; with
    tp=2 too, and with the weights and optimizer state offloaded to the host. Each device
    sends what the plan prices (ZeRO's gathers of the experts over their dp/ep replicas
    included)."""
    plan = zero_plan(kind)
    module, w = wrapped(plan)
    assert w.run_description.zero_stage == plan.strategy.zero_stage
    losses, weights = reference()
    np.testing.assert_allclose(step_losses(w, batches_of(module, STEPS, BATCH)), losses,
                               rtol=1e-4)
    for got, want in zip(w.get_weights(), weights, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if kind.endswith("+offload"):  # the state on the host, not beside the shards
        assert {_short(s.value.device) for s in w.optimizer.variables} == {"CPU:0"}
    else:
        assert_shards_where_planned(w, plan)
    if kind in ("dp4xep2+zero1", "dp2xtp2xep2+zero1", "dp4xep2+zero3",
                "dp2xep2+zero1+offload"):
        assert_sends_what_is_priced(w, plan, module)


def into_plain_model(w, tmp_path):
    """A one-device copy of tiny_moe with ``w``'s weight file loaded (weights and Adam
    state), its weights checked equal to ``w``'s."""
    w.save_weights(str(tmp_path / "ep.weights.h5"))
    _, plain = single_device_copy("tiny_moe")
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(str(tmp_path / "ep.weights.h5"))
    for got, want in zip(plain.get_weights(), w.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    return plain


def test_an_ep_zero_weight_file_moves_to_the_plain_model_and_back(tmp_path):
    """dp4 x ep2 ZeRO-1 after 3 steps: its file (weights and Adam state, one device's
    layout, each shard's slots read from its owner) loads into the plain model, which
    trains on like the wrapped model; the plain model's file loads into dp2 x ep2 ZeRO-2
    (slots into each owner), which trains on like the plain model."""
    module, w = wrapped(zero_plan("dp4xep2+zero1"))
    data = batches_of(module, 7, BATCH)
    step_losses(w, data[:3])
    plain = into_plain_model(w, tmp_path)
    np.testing.assert_allclose(step_losses(plain, data[3:5]), step_losses(w, data[3:5]),
                               rtol=1e-4)
    plain.save_weights(str(tmp_path / "plain.weights.h5"))
    _, other = wrapped(zero_plan("dp2xep2+zero2"))
    other.load_weights(str(tmp_path / "plain.weights.h5"))
    for got, want in zip(other.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(step_losses(other, data[5:]), step_losses(plain, data[5:]),
                               rtol=1e-4)


def test_weight_files_move_between_the_plain_model_and_an_ep_plan(tmp_path):
    """An ep=4 model's file (weights and Adam state after 3 steps) loads into the plain
    model, which then trains on like one device; the plain model's file loads into a
    dp4 x ep2 model, whose shards (replica 3's too) take their slices; its saved model
    (model.save) loads as the plain model."""
    import keras
    import numpy as np

    _, model = base_model("tiny_moe")
    module, w = wrapped(ep_plan(model, [cpus(0, 1, 2, 3)], ep=4))
    batches = batches_of(module, 5, BATCH)
    step_losses(w, batches[:3])
    plain = into_plain_model(w, tmp_path)
    np.testing.assert_allclose(step_losses(plain, batches[3:]), step_losses(w, batches[3:]),
                               rtol=1e-4)
    plain.save_weights(str(tmp_path / "plain.weights.h5"))
    module, other = wrapped(ep_plan(model, [cpus(4, 5, 6, 7)], ep=2))
    other.load_weights(str(tmp_path / "plain.weights.h5"))
    for got, want in zip(other.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    full = plain.get_layer("moe").expert_in_kernel.numpy()
    shard = copies_of(other)[3].get_layer("moe").expert_in_kernel.numpy()
    np.testing.assert_allclose(shard, full[4:], rtol=1e-6)  # rank 1 of group 1
    more = batches_of(module, 7, BATCH)[5:]
    np.testing.assert_allclose(step_losses(other, more), step_losses(plain, more), rtol=1e-4)
    other.save(str(tmp_path / "ep.keras"))  # a saved model loads as the user's layers
    loaded = keras.models.load_model(str(tmp_path / "ep.keras"))
    assert type(loaded.get_layer("moe")) is type(plain.get_layer("moe"))
    for got, want in zip(loaded.get_weights(), other.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_aux_losses_of_every_replica_are_in_the_loss_with_a_warning():
    """aux_loss_weight > 0 under dp2 x ep2: wrap warns that the loss is per group of
    tokens; the first step's loss is the MSE plus the weight times the mean of each
    replica's load-balancing loss; training runs."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfplan import apply
    from tfplan.layers import routing

    module = load_model_file("tiny_moe")
    keras.utils.set_random_seed(1)
    model = module.build_model(aux_loss_weight=0.5)
    plan = ep_plan(model, [cpus(0, 1)], ep=2)
    with pytest.warns(UserWarning, match="GShard's groups"):
        w = apply.wrap(model, plan)
    w.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    (x, y), = batches_of(module, 1, BATCH)
    embed = keras.Model(model.inputs, model.get_layer("embed").output)
    moe = model.get_layer("moe")
    aux = []
    for part in np.split(x, 2):
        flat = tf.reshape(embed(part), [-1, module.WIDTH])
        aux.append(float(routing.load_balancing_loss(moe.route(flat), moe.num_experts)))
    mse = float(np.mean((np.asarray(model(x)) - y) ** 2))
    losses = step_losses(w, [(x, y)] * 3)
    np.testing.assert_allclose(losses[0], mse + 0.5 * np.mean(aux), rtol=1e-4)
    assert np.all(np.isfinite(losses))


def test_a_capacity_factor_under_a_split_batch_is_a_warning():
    import keras

    from tfplan import apply

    module = load_model_file("tiny_moe")
    keras.utils.set_random_seed(2)
    model = module.build_model(capacity_factor=1.25)
    with pytest.warns(UserWarning, match="capacity"):
        apply.wrap(model, ep_plan(model, [cpus(0, 1, 2, 3)], ep=4))


def test_what_expert_parallelism_does_not_run_is_refused():
    import keras

    from tfplan import apply
    from tfplan.apply.dimensions import unapplied_dimensions
    from tfplan.apply.expert_parallel import ExpertParallelError

    _, model = base_model("tiny_moe")
    s = ep_plan(model, [cpus(0, 1)], ep=2).strategy
    for change in ({"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3}, {"tp": 2},
                   {"tp": 2, "zero_stage": 1}, {"offload": "optimizer"}, {"cp": 2}):
        assert unapplied_dimensions(dataclasses.replace(s, **change)) == []  # apply.spmd
    from tfplan.apply.dimensions import unapplied
    from tfplan.apply.mode import execution_mode

    workers = [f"/job:worker/task:{w}/device:CPU:{i}" for w in range(2) for i in range(2)]
    spread = ep_plan(model, [workers], ep=2, zero_stage=3)  # one program per worker
    spread = dataclasses.replace(spread, cluster=dataclasses.replace(
        spread.cluster, num_nodes=2, devices_per_node=2,
        inter_node_link=spread.cluster.intra_node_link))
    assert unapplied(spread, execution_mode(spread)) == []
    # a replica's pipeline stages on both workers: one program per worker too
    staged = ep_plan(model, [workers[:2], workers[2:]], ep=2, zero_stage=3)
    staged = dataclasses.replace(staged, cluster=spread.cluster)
    assert unapplied(staged, execution_mode(staged)) == []
    _, mlp = base_model("tiny_mlp")
    with pytest.raises(ExpertParallelError, match="no tfplan.layers.MixtureOfExperts"):
        apply.wrap(mlp, ep_plan(mlp, [cpus(0, 1)], ep=2))
    module = load_model_file("tiny_moe")
    keras.utils.set_random_seed(3)
    six = module.build_model(num_experts=6)
    with pytest.raises(ExpertParallelError, match="num_experts=6 .*multiple of ep"):
        apply.wrap(six, ep_plan(six, [cpus(0, 1, 2, 3)], ep=4))
    from tfplan.layers import MixtureOfExperts

    tokens = keras.Input((4, 16))
    inner = keras.Model(tokens, MixtureOfExperts(4, 2, 8, aux_loss_weight=0.0)(tokens),
                        name="inner")
    x = keras.Input((4, 6))
    nested = keras.Model(x, keras.layers.Dense(3)(inner(keras.layers.Dense(16)(x))))
    with pytest.raises(ExpertParallelError, match="nested model 'inner'"):
        apply.wrap(nested, ep_plan(nested, [cpus(0, 1)], ep=2))


@pytest.mark.parametrize("name", ["tiny_moe_block", "tiny_mixtral"])
def test_experts_inside_blocks_train_like_one_device(name, tmp_path):
    """ep=2 (dp=2) on the SPMD engine: a MixtureOfExperts inside a custom block, and
    keras_hub's Mixtral MoE block inside each MixtralTransformerDecoder of a MixtralBackbone
    (a nested model; a padding mask; routed twin, same weights), swapped in place; losses
    and weights as one device, every shard and its slots on its replica's device, the
    weight file loads into the user's model; Mixtral's all-to-all bytes as priced."""
    import keras
    import numpy as np

    from tfplan import apply
    from tfplan.apply.checkpoint import slot_variables
    from tfplan.apply.expert_group import ExpertShards
    from tfplan.apply.placement import tf_variable

    module = load_model_file(name)

    def fresh():
        keras.utils.set_random_seed(0)
        model = module.build_model()
        model.compile(optimizer=fresh_optimizer(module), loss=module.loss)
        return model

    model = fresh()
    plan = ep_plan(model, [cpus(0, 1)], ep=2)
    w = apply.wrap(model, plan)
    assert isinstance(w, apply.spmd.SpmdModel)
    w.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    data = batches(module, 3)
    np.testing.assert_allclose(step_losses(w, data), step_losses(model, data), rtol=1e-4)
    for got, want in zip(w.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    slots = slot_variables(w.optimizer)
    for r, replica in enumerate(copies_of(w)):
        shards = [layer for layer in replica._flatten_layers(recursive=True)
                  if isinstance(layer, ExpertShards)]
        assert len(shards) == {"tiny_moe_block": 2, "tiny_mixtral": 1}[name]
        assert {t.ep_rank for t in shards} == {r % 2}
        for twin in shards:
            for v in twin.shard_variables():
                assert v.shape[0] == 2, v.path  # 4 experts over ep=2
                for x in (v, slots[(id(v), 0)], slots[(id(v), 1)]):
                    assert _short(tf_variable(x).device) == f"CPU:{r}", (r, x.path)
    w.save_weights(str(tmp_path / "ep.weights.h5"))
    plain = fresh()
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(str(tmp_path / "ep.weights.h5"))
    for got, want in zip(plain.get_weights(), w.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    if name == "tiny_mixtral":  # the block's E T-row buffer, as the planner prices it
        assert_sends_what_is_priced(w, plan, module)
    more = batches(module, 4)[3:]
    np.testing.assert_allclose(step_losses(plain, more), step_losses(w, more), rtol=1e-4)


@pytest.mark.parametrize("name,coefficient", [("tiny_mixtral", "router_aux_loss_coef"),
                                              ("tiny_qwen_moe", "router_aux_loss_coefficient")])
def test_hub_router_aux_loss_under_ep_is_in_the_loss_with_a_warning(name, coefficient):
    """A keras_hub MoE block's router aux loss (Mixtral's router_aux_loss_coef, Qwen-MoE's
    router_aux_loss_coefficient, 0.02) under dp2 x ep2: a warning; the first loss is the
    MSE plus the mean over the two replicas of their blocks' aux losses (the user's blocks
    on each half of the batch, with its padding mask)."""
    import keras
    import numpy as np

    from tfplan import apply

    module = load_model_file(name)
    keras.utils.set_random_seed(4)
    model = module.build_model(**{coefficient: 0.02})
    with pytest.warns(UserWarning, match="GShard's groups"):
        w = apply.wrap(model, ep_plan(model, [cpus(0, 1)], ep=2))
    w.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    (x, y), = batches(module, 1)
    aux = []
    for lo in (0, BATCH // 2):
        model(_rows(x, lo, lo + BATCH // 2), training=True)
        aux.append(sum(float(v) for v in model.losses))
    assert len(model.losses) == 1 and min(aux) > 0
    mse = float(np.mean((np.asarray(model(x)) - y) ** 2))
    np.testing.assert_allclose(step_losses(w, [(x, y)])[0], mse + np.mean(aux), rtol=1e-4)


def test_an_ep_plan_never_runs_under_a_strategy():
    """ep > 1 runs as tensor_parallel copies on one host even with tp = pp = 1 (not
    MirroredStrategy), and across workers one program per worker (apply.spmd.experts: the
    all-to-alls span the workers, tests/apply/test_workers.py)."""
    from tfplan.apply.mode import Processes, execution_mode
    from tests.apply.test_workers import CPUS, WORKERS, dev

    _, model = base_model("tiny_moe")
    plain = make_plan(model, [cpus(0, 1)], global_batch=BATCH)
    assert execution_mode(plain).mode == "data_parallel"
    assert execution_mode(ep_plan(model, [cpus(0, 1)], ep=2)).mode == "tensor_parallel"
    inside = ep_plan(model, [[dev(w, i) for w in range(WORKERS) for i in range(CPUS)]], ep=2)
    inside = dataclasses.replace(inside, cluster=dataclasses.replace(
        inside.cluster, num_nodes=WORKERS, devices_per_node=CPUS,
        inter_node_link=inside.cluster.intra_node_link))
    mode = execution_mode(inside)
    assert (mode.mode, mode.processes) == ("tensor_parallel", Processes.PER_WORKER)




def _attention_moe():
    """Tokens through causal attention and a MixtureOfExperts (residuals), logits per token:
    a model context parallelism can cut (every layer but attention per token)."""
    import keras

    from tfplan.layers import MixtureOfExperts

    keras.utils.set_random_seed(5)
    ids = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(32, 16, name="embed")(ids)
    a = keras.layers.MultiHeadAttention(2, 8, name="attention")(x, x, use_causal_mask=True)
    x = keras.layers.Add(name="res1")([x, a])
    m = MixtureOfExperts(num_experts=4, top_k=2, expert_hidden=16, aux_loss_weight=0.0,
                         name="moe")(x)
    x = keras.layers.Add(name="res2")([x, m])
    return keras.Model(ids, keras.layers.Dense(32, name="logits")(x))


@pytest.mark.parametrize("zero", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_expert_with_context_parallelism_trains_like_one_device(zero):
    """dp2 x cp2 x ep2: each context rank's tokens go to the experts of its dp ranks (an ep
    group per context rank), an expert's gradients summed over every replica holding it,
    context ranks included (the edp group); ZeRO-3's expert shards cut over those. Like
    one device; without ZeRO each device sends what the plan prices."""
    import keras

    from tfplan import apply
    from tfplan.apply.audit import audit_step
    from tfplan.planner.traffic import plan_sent_bytes
    from tfplan.profiler import profile_model

    plan = make_plan(_attention_moe(), [cpus(0, 1, 2, 3)], global_batch=8)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(
        plan.strategy, dp=2, cp=2, ep=2, microbatch_size=4, zero_stage=zero))
    w = apply.wrap(_attention_moe, plan)
    assert [w.run_description.ep_rank(q) for q in range(4)] == [0, 0, 1, 1]
    one = _attention_moe()
    one.set_weights(w.get_weights())
    for target in (w, one):
        target.compile(optimizer=keras.optimizers.Adam(1e-2),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 32, (8, 8)).astype("int32"),
             rng.integers(0, 32, (8, 8)).astype("int32")) for _ in range(4)]
    np.testing.assert_allclose(step_losses(w, data), step_losses(one, data), rtol=1e-4)
    for got, want in zip(w.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if zero:
        return
    measured = audit_step(w, *data[0], plan=plan).by_device()
    priced = plan_sent_bytes(profile_model(_attention_moe(), batch_size=8), plan)
    for device, kinds in priced:
        for kind, nbytes in kinds:
            assert measured[device][kind] == pytest.approx(nbytes, rel=0.10, abs=64), (
                device, kind)
