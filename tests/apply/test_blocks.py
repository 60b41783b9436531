"""apply.wrap with plans whose stages list blocks and their sub-layers (``apply.blocks``):
tensor-parallel splits of a block's sub-layers swapped in place, blocks whole on a pipeline
stage, nested models (keras_hub backbones) placed across stages; 10 steps equal to one
device, every weight, shard and optimizer slot on its planned device.

Models: ``tests/apply/tiny_block.py`` (a user's composite layer ``x + down(up(x))`` used
twice) and ``tests/apply/tiny_hub.py`` (keras_hub GPT-2, Llama 3 and Gemma backbones with
random weights in a Functional model with fixed inputs and a Dense head). Runs on the 8
logical CPU devices of tests/conftest.py.
"""
from __future__ import annotations

import dataclasses
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.dimensions import split_refusal
from tfplan.apply.placement import devices_of
from tfplan.apply.sharded_base import Sharded
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.spmd.rank_layers import is_twin
from tfplan.core.errors import PlannerError
from tfplan.planner.plan import Plan
from tfplan.profiler.signature import (block_of, model_signature, own_weights,
                                       profiled_layer_paths)
from tests.apply import helpers
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, load_model_file, make_plan,
                                 step_losses, tp_plan)

STEPS = 10
pytest.importorskip("keras_hub")


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def _stage_of(plan: Plan, name: str, blocks: dict[str, str]) -> int:
    for k, stage in enumerate(plan.stages):
        if name in stage.layers:
            return k
    # a weightless sub-layer a block makes in its build (Keras names it anew in a clone)
    return _stage_of(plan, blocks[name.rsplit("/", 1)[0]], blocks)


def assert_placement(wrapped, plan: Plan) -> None:
    """Every weight of every replica on the device the plan names for its entry (a shard
    t of a split sub-layer, or rank t's projections of an attention block split whole, on
    its stage's tensor rank t, anything else on rank 0), every
    device of the plan used, and each Adam slot beside its variable."""
    tp = max(1, plan.strategy.tp)
    splits = dict(plan.tp_splits)
    if isinstance(wrapped, SpmdModel):  # each device's copy, its split layers the twins
        for copy in wrapped.device_models:  # (an attention block split in place by heads,
            heads = set()                     # its projections the twins)
            for name, layer in profiled_layer_paths(copy):
                if getattr(layer, "is_split_by_heads", False):
                    assert name in splits, name
                    heads.add(name)
                elif name.rpartition("/")[0] in heads:
                    assert is_twin(layer) or not layer.weights, name
                else:
                    assert is_twin(layer) == (name in splits), name
        helpers.assert_state_where_planned(wrapped, plan)
        return
    used = set()
    replicas = wrapped.replica_models() if hasattr(wrapped, "replica_models") else (wrapped,)
    for r, replica in enumerate(replicas):
        paths = profiled_layer_paths(replica)
        blocks = block_of(paths)
        for name, layer in paths:
            assert isinstance(layer, Sharded) == (name in splits), name
            if not own_weights(layer):
                continue
            stage = plan.stages[_stage_of(plan, name, blocks)]
            for v in own_weights(layer):
                if isinstance(v.value, tf.distribute.DistributedValues):  # MirroredStrategy
                    assert devices_of(v) == list(stage.devices), (name, v.path)
                    used.update(stage.devices)
                    continue
                match = re.search(r"_(\d+)$", v.name)
                rank = int(match.group(1)) if isinstance(layer, Sharded) and match else 0
                if hasattr(layer, "rank_layers"):  # an attention block split whole
                    rank = next((t for t, rank_layers in enumerate(layer.rank_layers())
                                 for sub in rank_layers if any(v is w for w in sub.weights)), 0)
                want = stage.devices[r * tp + rank]
                assert _short(v.value.device) == want, (r, name, v.path, v.value.device)
                used.add(want)
    assert used == set(plan.devices)
    optimizer = wrapped.optimizer
    variables = wrapped.trainable_variables
    for slots in (optimizer._momentums, optimizer._velocities):
        assert len(slots) == len(variables)
        for v, slot in zip(variables, slots):
            assert devices_of(slot) == devices_of(v), (slot.path, v.path)


# --- a user's block ----------------------------------------------------------------------------
BLOCK_SPLITS = (("block_0/up", "column"), ("block_0/down", "row"),
                ("block_1/up", "column"), ("block_1/down", "row"))
BLOCK_STAGES = [["embed", "block_0", "block_0/up", "block_0/down"],
                ["block_1", "block_1/up", "block_1/down", "head"]]


def _block_plan(case: str, model) -> Plan:
    if case == "single":
        return make_plan(model, [cpus(1)])
    if case == "dp2":
        return make_plan(model, [cpus(0, 1)])
    if case == "tp2":
        return tp_plan(model, [cpus(0, 1)], BLOCK_SPLITS)
    if case == "pp2":
        return make_plan(model, [cpus(2), cpus(3)], stage_layers=BLOCK_STAGES,
                         num_microbatches=2)
    if case == "pp2-tp2":  # stages cut in halves: BLOCK_STAGES
        plan = tp_plan(model, [cpus(0, 1), cpus(2, 3)], BLOCK_SPLITS)
        assert [list(s.layers) for s in plan.stages] == BLOCK_STAGES
        return plan
    assert case == "dp2-tp2"
    return tp_plan(model, [cpus(4, 5, 6, 7)], BLOCK_SPLITS, dp=2)


def test_the_block_and_its_sub_layers_are_entries():
    _, model = base_model("tiny_block")
    names = [n for n, _, _ in model_signature(model)]
    assert names == ["embed", "block_0", "block_0/up", "block_0/down", "block_1", "block_1/up",
                     "block_1/down", "head"]


@pytest.mark.parametrize("case", ["single", "dp2", "tp2", "pp2", "pp2-tp2", "dp2-tp2"])
def test_user_block_trains_like_one_device(case):
    module, model = base_model("tiny_block")
    plan = _block_plan(case, model)
    wrapped = apply.wrap(model, plan)
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    x = batches[0][0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)
    for got, want in zip(wrapped.get_weights(), model.get_weights()):  # read back unsplit
        np.testing.assert_array_equal(got, want)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches),
                        helpers.reference_losses("tiny_block", STEPS))
    assert_placement(wrapped, wrapped.plan)
    if plan.strategy.tp > 1:  # the twin sits where the Dense was, in the block's tracking
        block = wrapped.device_models[0].get_layer("block_0")
        assert is_twin(block.up) and is_twin(block.down)
        assert block._flatten_layers(include_self=False, recursive=False) == [block.up,
                                                                              block.down]


def test_row_sub_layer_reads_the_column_sub_layers_shards_in_place():
    module, model = base_model("tiny_block")
    wrapped = apply.wrap(model, tp_plan(model, [cpus(2, 3)], BLOCK_SPLITS))
    x, _ = module.sample_batch(GLOBAL_BATCH)
    graph = tf.function(lambda t: wrapped(t)).get_concrete_function(tf.constant(x)).graph
    ops = graph.get_operations()  # named <model>/block_0[_k]/down[_k]/MatMul, ...
    down = [op for op in ops if re.search(r"/block_0(_\d+)?/down(_\d+)?/", op.name)]
    assert sorted(_short(op.device) for op in down if op.type == "MatMul") == cpus(2, 3)
    assert not [op for op in down if op.type == "StridedSlice"]  # no slicing: in place
    # the block's own code (the residual add) on every tensor rank (Megatron: no hub)
    residual = [op for op in ops if re.search(r"/block_0(_\d+)?/add$", op.name)]
    assert residual and {_short(op.device) for op in residual} == set(cpus(2, 3))


def test_block_weight_files_are_the_users(tmp_path):
    module, model = base_model("tiny_block")
    wrapped = apply.wrap(model, tp_plan(model, [cpus(0, 1)], BLOCK_SPLITS))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, 2, GLOBAL_BATCH)
    step_losses(wrapped, batches)
    path = str(tmp_path / "tp.weights.h5")
    wrapped.save_weights(path)
    plain = keras.models.clone_model(model)
    plain.load_weights(path)
    x = batches[0][0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), plain.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
    model.save_weights(str(tmp_path / "plain.weights.h5"))
    wrapped.load_weights(str(tmp_path / "plain.weights.h5"))
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)


def test_splitting_a_block_itself_or_a_nested_models_layer_is_refused():
    _, model = base_model("tiny_block")
    with pytest.raises(PlannerError, match=r"'block_0' \(Residual\) by 'column'.*is a block"):
        apply.wrap(model, tp_plan(model, [cpus(0, 1)], (("block_0", "column"),)))
    inner = keras.Input((4,))
    trunk = keras.Model(inner, keras.layers.Dense(8, name="proj")(inner), name="trunk")
    x = keras.Input((4,))
    nested = keras.Model(x, keras.layers.Dense(2, name="out")(trunk(x)))
    with pytest.raises(PlannerError, match=r"'trunk/proj'.*nested model"):
        apply.wrap(nested, tp_plan(nested, [cpus(0, 1)], (("trunk/proj", "column"),)))
    assert split_refusal("gpt2/token_embedding", "ReversibleEmbedding", "Embedding", "",
                         "vocab").startswith("it is a layer of a nested model")
    assert "subclass of Embedding" in split_refusal(
        "block/emb", "ReversibleEmbedding", "Embedding", "block", "vocab")
    assert split_refusal("llama/transformer_layer_0/self_attention/query", "EinsumDense", "",
                         "llama/transformer_layer_0", "column") is None
    assert split_refusal("gpt2/transformer_layer_0/self_attention", "CachedMultiHeadAttention",
                         "MultiHeadAttention", "gpt2/transformer_layer_0", "heads") is None


@pytest.mark.parametrize("name, type_name, base_type, block, attention_heads", [
    *((*case, 0) for case in [
        ("dense", "Dense", "", ""), ("attention", "MultiHeadAttention", "", ""),
        ("emb", "Embedding", "", ""), ("emb", "ReversibleEmbedding", "", ""),
        ("m/dense", "Dense", "", ""), ("b", "MyBlock", "", "b"),
        ("b/q", "EinsumDense", "", "b"), ("b/attn", "CachedMultiHeadAttention",
                                          "MultiHeadAttention", "b"),
        ("b/mine", "MyDense", "Dense", "b"), ("m/b/fc", "Dense", "", "m/b"),
        ("b/gqa", "GroupedQueryAttention", "", "b"), ("b/conv", "Conv2D", "", "b")]),
    ("b/attn", "LlamaAttention", "", "b", 4),  # an attention block: heads, the block whole
    ("attn", "LlamaAttention", "", "attn", 4)])  # ... but not as an outermost block
def test_the_planner_offers_exactly_the_splits_apply_runs(name, type_name, base_type, block,
                                                          attention_heads):
    """profiler.comm (what the planner offers) and apply.dimensions.split_refusal (what
    apply runs) agree on every place and class."""
    from tfplan.profiler.comm import layer_comm
    from tfplan.profiler.model_profile import LayerProfile

    layer = LayerProfile(name=name, type=type_name, params=1, trainable_params=1,
                         param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4,
                         flops_fwd=1, flops_bwd=2, base_type=base_type, block=block,
                         attention_heads=attention_heads)
    offered = {s.split for s in layer_comm(layer, 4).tp_splits}
    runs = {split for split in ("column", "row", "heads", "vocab")
            if split_refusal(name, type_name, base_type, block, split,
                             attention_heads=attention_heads) is None}
    assert offered == runs
    if attention_heads:
        assert runs == ({"heads"} if name != block else set())


def test_a_planner_made_plan_for_the_blocks_trains():
    from tfplan.core.presets import parse_cluster
    from tfplan.planner.search import search
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source

    profile = profile_source(load_model_source(f"{helpers.HERE}/tiny_block.py"), batch_size=1)
    # a large global batch makes splitting pay on cpu:8
    plan = search(profile, parse_cluster("cpu:8"), 4096,
                  fix={"tp": 2, "dp": 1, "pp": 1, "num_microbatches": 1}).chosen
    module, model = base_model("tiny_block")
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, helpers.reference_losses("tiny_block", STEPS)[:3])
    assert_placement(wrapped, wrapped.plan)


# --- keras_hub backbones -----------------------------------------------------------------------
HUB = load_model_file("tiny_hub")
BLOCK_NAME = {"gpt2": "transformer_layer", "llama": "transformer_layer", "gemma": "decoder_block",
              "decoder": "transformer_layer"}
# Megatron's pattern inside each block, as far as apply runs it (module docstring of
# apply.blocks): GPT-2's attention by heads, Llama's and Gemma's projections column/row
HUB_SPLITS = {
    "gpt2": (("self_attention", "heads"), ("feedforward_intermediate_dense", "column"),
             ("feedforward_output_dense", "row")),
    "decoder": (("self_attention", "heads"), ("feedforward_intermediate_dense", "column"),
                ("feedforward_output_dense", "row")),
    "llama": (("self_attention/query", "column"), ("self_attention/key", "column"),
              ("self_attention/value", "column"), ("self_attention/attention_output", "row"),
              ("feedforward_gate_dense", "column"),
              ("feedforward_intermediate_dense", "column"),
              ("feedforward_output_dense", "row")),
    "gemma": (("attention/query", "column"), ("attention/key", "column"),
              ("attention/value", "column"), ("attention/attention_output", "row"),
              ("ffw_gating", "column"), ("ffw_gating_2", "column"), ("ffw_linear", "row")),
}
# Megatron's whole pattern: the attention block itself by heads (apply.sharded_attention_block)
HEADS_SPLITS = {
    "llama": (("self_attention", "heads"), ("feedforward_gate_dense", "column"),
              ("feedforward_intermediate_dense", "column"), ("feedforward_output_dense", "row")),
    "gemma": (("attention", "heads"), ("ffw_gating", "column"), ("ffw_gating_2", "column"),
              ("ffw_linear", "row")),
}
_HUB: dict[str, tuple] = {}


def hub(kind: str):
    """(model, batches, one-device losses) for backbone ``kind``, made once."""
    if kind not in _HUB:
        keras.utils.set_random_seed(0)
        model = HUB.build_model(kind)
        x, y = HUB.sample_batch(STEPS * GLOBAL_BATCH)
        batches = [({k: v[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH] for k, v in x.items()},
                    y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]) for i in range(STEPS)]
        reference = keras.models.clone_model(model)
        reference.set_weights(model.get_weights())
        reference.compile(optimizer=fresh_optimizer(HUB), loss=HUB.loss)
        _HUB[kind] = (model, batches, step_losses(reference, batches))
    return _HUB[kind]


def hub_plan(kind: str, case: str, model, table=None) -> Plan:
    names = [n for n, _, _ in model_signature(model)]
    prefix = "" if kind == "decoder" else f"{kind}/"  # top-level blocks, or a backbone's
    splits = tuple((f"{prefix}{BLOCK_NAME[kind]}_{i}/{sub}", split)
                   for i in range(2) for sub, split in (table or HUB_SPLITS)[kind])
    if case == "dp2":
        return make_plan(model, [cpus(0, 1)])
    if case == "tp2":
        return tp_plan(model, [cpus(0, 1)], splits)
    if case == "dp2-tp2":
        return tp_plan(model, [cpus(4, 5, 6, 7)], splits, dp=2)
    assert case == "pp2"  # the cut between the two blocks (inside the nested backbone)
    cut = names.index(f"{prefix}{BLOCK_NAME[kind]}_1")
    return make_plan(model, [cpus(2), cpus(3)], stage_layers=[names[:cut], names[cut:]],
                     num_microbatches=2)


def assert_trains_like_the_backbone(wrapped, model, plan, batches, reference) -> None:
    """Predicts and trains 10 steps like one device, every weight where the plan says,
    weights read back unsplit in the model's order."""
    x = batches[0][0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-4, atol=1e-5)
    wrapped.compile(optimizer=fresh_optimizer(HUB), loss=HUB.loss)
    assert_losses_match(step_losses(wrapped, batches), reference)
    assert_placement(wrapped, wrapped.plan)
    assert len(wrapped.get_weights()) == len(model.get_weights())
    for got, want in zip(wrapped.get_weights(), model.get_weights()):  # unsplit, in order
        assert got.shape == want.shape


# Every backbone's splits run by default (tp2: each kind splits its own layer classes);
# data parallelism, the pipeline cut and dp x tp do not depend on the kind's layer classes:
# by default once each on a nested backbone (llama dp2 and pp2, gpt2 dp2-tp2) and the
# pipeline once more over top-level blocks (decoder pp2); the other kinds with -m slow.
HUB_DEFAULT = {("gpt2", "tp2"), ("llama", "tp2"), ("gemma", "tp2"), ("decoder", "tp2"),
               ("llama", "dp2"), ("llama", "pp2"), ("decoder", "pp2"), ("gpt2", "dp2-tp2")}
HUB_CASES = [pytest.param(kind, case, id=f"{kind}-{case}",
                          marks=() if (kind, case) in HUB_DEFAULT else pytest.mark.slow)
             for kind in ("gpt2", "llama", "gemma", "decoder")
             for case in ("dp2", "tp2", "pp2", "dp2-tp2")]


@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # Llama's untied output table
@pytest.mark.parametrize("kind, case", HUB_CASES)
def test_keras_hub_backbone_trains_like_one_device(kind, case):
    model, batches, reference = hub(kind)
    plan = hub_plan(kind, case, model)
    wrapped = apply.wrap(model, plan)
    assert_trains_like_the_backbone(wrapped, model, plan, batches, reference)


@pytest.mark.parametrize("table", ["projections", "heads"])
def test_keras_hub_weight_files_load_both_ways(tmp_path, table):
    model, batches, _ = hub("llama")
    x = batches[0][0]
    plain_file = str(tmp_path / "plain.weights.h5")
    model.save_weights(plain_file)
    wrapped = apply.wrap(HUB.build_model("llama"), hub_plan(
        "llama", "tp2", model, HUB_SPLITS if table == "projections" else HEADS_SPLITS))
    # each weight, its shards joined unsplit
    assert [w.shape for w in wrapped.get_weights()] == [tuple(v.shape) for v in model.weights]
    wrapped.load_weights(plain_file)  # a keras_hub checkpoint into the split model
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-4, atol=1e-5)
    wrapped.compile(optimizer=fresh_optimizer(HUB), loss=HUB.loss)
    step_losses(wrapped, batches[:2])
    split_file = str(tmp_path / "split.weights.h5")
    wrapped.save_weights(split_file)
    plain = HUB.build_model("llama")  # other random weights, then the trained ones
    plain.load_weights(split_file)
    np.testing.assert_allclose(plain.predict_on_batch(x), wrapped.predict_on_batch(x),
                               rtol=1e-4, atol=1e-5)
    for got, want in zip(plain.get_weights(), wrapped.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_gpt2_split_attention_refuses_a_cache():
    model, batches, _ = hub("gpt2")
    wrapped = apply.wrap(model, hub_plan("gpt2", "tp2", model))
    backbone = wrapped.device_models[0].get_layer("gpt2")
    attention = backbone.get_layer("transformer_layer_0")._self_attention_layer
    assert is_twin(attention)  # rank 0's heads of GPT-2's CachedMultiHeadAttention
    h = tf.zeros((2, 8, 16))
    cache = tf.zeros((2, 2, 8, 4, 4))
    with pytest.raises(PlannerError, match="key/value cache"):
        attention(h, h, cache=cache, cache_update_index=0)


@pytest.mark.parametrize("case", ["single", "tp2"])
def test_selective_recomputation_reaches_the_attention_inside_blocks(case):
    """The planner prices selective recomputation for the attention layers inside blocks
    (GPT-2's CachedMultiHeadAttention); apply recomputes their cores, whole or split, and
    trains like one device."""
    model, batches, reference = hub("gpt2")
    plan = make_plan(model, [cpus(0)]) if case == "single" else hub_plan("gpt2", "tp2", model)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  recompute="selective"))
    wrapped = apply.wrap(model, plan)
    run = wrapped.run_description
    assert run.recompute == "selective" and len(run.recomputed) == 1  # the backbone
    from tfplan import compat
    from tfplan.apply.recompute import attention_layers
    for copy in wrapped.device_models:  # its two blocks' attention cores, in every copy
        cores = [layer for name in run.recomputed
                 for layer in attention_layers(copy.get_layer(name))]
        assert len(cores) == 2 and all(compat.attention_core_is_wrapped(c) for c in cores)
    wrapped.compile(optimizer=fresh_optimizer(HUB), loss=HUB.loss)
    assert_losses_match(step_losses(wrapped, batches), reference)


# --- attention blocks split by heads whole (apply.sharded_attention_block) ---------------------
@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # Llama's untied output table
@pytest.mark.parametrize("kind, case", [  # dp2-tp2 of the second attention class: -m slow
    pytest.param("llama", "tp2", id="llama-tp2"),
    pytest.param("llama", "dp2-tp2", id="llama-dp2-tp2"),
    pytest.param("gemma", "tp2", id="gemma-tp2"),
    pytest.param("gemma", "dp2-tp2", id="gemma-dp2-tp2", marks=pytest.mark.slow)])
def test_attention_blocks_split_by_heads_train_like_one_device(kind, case):
    """On the SPMD engine (apply.spmd.attention_block): each rank's copy of the block keeps
    its heads -- its projections' kernels cut along their heads axis, its head counts / tp
    -- and trains like one device; at tp=2 each device sends what the plan prices."""
    from tfplan.apply.spmd.rank_layers import RankHeadsProjection

    model, batches, reference = hub(kind)
    plan = hub_plan(kind, case, model, HEADS_SPLITS)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    for copy in wrapped.device_models:
        blocks = [layer for _, layer in profiled_layer_paths(copy)
                  if getattr(layer, "is_split_by_heads", False)]
        assert len(blocks) == 2
        for block in blocks:
            assert (block.num_query_heads, block.num_key_value_heads) == (2, 1)  # 4, 2 / tp
            projections = [layer for layer in block._flatten_layers(include_self=False)
                           if isinstance(layer, RankHeadsProjection)]
            assert sorted(p.role for p in projections) == ["input"] * 3 + ["output"]
            for p in projections:
                assert p.kernel.shape[p.heads_axis] in (1, 2), (p.name, p.kernel.shape)
    assert_trains_like_the_backbone(wrapped, model, plan, batches, reference)
    if case == "tp2":
        assert_sends_what_is_priced(wrapped, model, plan, batches[0])


def assert_sends_what_is_priced(wrapped, model, plan, batch) -> None:
    """Each device's tp bytes within 10% of the plan's (``planner.traffic``)."""
    from tfplan.apply.audit import audit_step
    from tfplan.planner.traffic import plan_sent_bytes
    from tfplan.profiler import profile_model

    measured = audit_step(wrapped, *batch, plan=plan).by_device()
    priced = dict(plan_sent_bytes(profile_model(model, batch_size=len(batch[1])), plan))
    for device in plan.devices:
        assert measured[device]["tp"] == pytest.approx(dict(priced[device])["tp"], rel=0.10)


def test_a_tp_that_does_not_divide_the_kv_heads_is_refused():
    model, _, _ = hub("llama")  # 4 query heads, 2 key/value heads
    splits = (("llama/transformer_layer_0/self_attention", "heads"),)
    with pytest.raises(PlannerError, match=r"self_attention' \(LlamaAttention\) by heads over "
                                           r"tp=4; it has 2 key/value heads"):
        apply.wrap(model, tp_plan(model, [cpus(0, 1, 2, 3)], splits))


class HeadsAttention(keras.layers.Layer):
    """A user's attention-like block: per-head projections; ``mix`` adds every head's query
    to each head's before the output projection (the heads no longer independent)."""

    def __init__(self, num_heads=4, head_dim=4, mix=False, **kwargs):
        super().__init__(**kwargs)
        self.num_heads, self.head_dim, self.mix = num_heads, head_dim, mix

    def build(self, shape):
        self.query = keras.layers.EinsumDense("bsd,dnh->bsnh", (None, self.num_heads,
                                                                self.head_dim),
                                              bias_axes="nh", name="query")
        self.query.build(shape)
        self.out = keras.layers.EinsumDense("bsnh,nhd->bsd", (None, shape[-1]), bias_axes="d",
                                            name="out")
        self.out.build((None, None, self.num_heads, self.head_dim))

    def call(self, x):
        q = keras.ops.tanh(self.query(x))
        if self.mix:
            q = q + keras.ops.sum(q, axis=2, keepdims=True)
        return self.out(q)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads,
                "head_dim": self.head_dim, "mix": self.mix}


class HoldsAttention(keras.layers.Layer):
    """A block holding a HeadsAttention: ``x + attn(x)``."""

    def __init__(self, mix=False, **kwargs):
        super().__init__(**kwargs)
        self.mix = mix
        self.attn = HeadsAttention(mix=mix, name="attn")

    def call(self, x):
        return x + self.attn(x)

    def get_config(self):
        return {**super().get_config(), "mix": self.mix}


@pytest.mark.parametrize("mix", [False, True])
def test_a_users_attention_block_splits_only_when_its_heads_are_independent(mix):
    keras.utils.set_random_seed(0)
    x = keras.Input((6, 16))
    model = keras.Model(x, keras.layers.Dense(2, name="head")(HoldsAttention(mix, name="b")(x)))
    plan = tp_plan(model, [cpus(0, 1)], (("b/attn", "heads"),))
    if mix:
        with pytest.raises(PlannerError, match=r"'b/attn' \(HeadsAttention\) by heads, but the "
                                               "sum of its ranks' outputs differs.*does not "
                                               "compute each head apart"):
            apply.wrap(model, plan)
        return
    wrapped = apply.wrap(model, plan)
    data = np.random.default_rng(0).normal(size=(4, 6, 16)).astype("float32")
    np.testing.assert_allclose(wrapped.predict_on_batch(data), model.predict_on_batch(data),
                               rtol=1e-5, atol=1e-6)
    wrapped.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    wrapped.train_on_batch(data, np.zeros((4, 6, 2), "float32"))
    assert_placement(wrapped, wrapped.plan)


@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # Llama's untied output table
def test_a_planner_made_plan_for_llama_trains():
    """The planner's plan for the tiny Llama at tp=2 (which may split its attention blocks
    whole by heads: ``LayerProfile.attention_heads``) trains like one device."""
    from tfplan.core.presets import parse_cluster
    from tfplan.planner.search import search
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source

    profile = profile_source(load_model_source(f"{helpers.HERE}/tiny_hub.py"), batch_size=1)
    plan = search(profile, parse_cluster("cpu:8"), 4096,
                  fix={"tp": 2, "dp": 1, "pp": 1, "num_microbatches": 1}).chosen
    model, batches, reference = hub("llama")
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(HUB), loss=HUB.loss)
    assert_losses_match(step_losses(wrapped, batches[:3]), reference[:3])
    assert_placement(wrapped, wrapped.plan)
