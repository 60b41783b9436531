"""Blocks in the planner: custom layers with sub-layers (keras_hub's transformer blocks),
whose sub-layers the profile lists as ``block/sub`` entries after the block's own entry.

The profile is ``gpt_profile``'s GPT with each transformer layer turned into one block:
its own entry (type ``DecoderBlock``, the two residual adds) followed by its sub-layers
``ln1``, ``attention`` (keras_hub's ``CachedMultiHeadAttention``, a subclass of
``MultiHeadAttention``), ``ln2``, ``fc`` and ``proj``. The block's own code reads its
sub-layers' outputs and feeds others (the residual sums), so its entries feed each other
both ways: the tests check that stages never cut a block, that tensor parallelism splits
the sub-layers as it splits the same layers written at the top level, and what is refused.
"""
from __future__ import annotations

import dataclasses

import pytest

from tfplan.core.errors import PlanMismatchError, PlannerError, SchemaError
from tfplan.core.presets import parse_cluster
from tfplan.planner.graph import pipeline_units, topological_layers
from tfplan.planner.search import search
from tfplan.planner.validate import validate_plan
from tfplan.profiler.comm import layer_comm
from tfplan.profiler.model_profile import Edge, ModelProfile
from tests.planner.gpt_profile import gpt_profile

LAYERS, HIDDEN, HEADS, SEQ = 4, 1024, 16, 1024
SUBS = {"ln1": "ln1_{i}", "attention": "attn_{i}", "ln2": "ln2_{i}", "fc": "fc_{i}",
        "proj": "proj_{i}"}


def blocked_gpt(layers: int = LAYERS) -> ModelProfile:
    """``gpt_profile`` with transformer layer i as block ``block_i`` (see the module doc)."""
    flat = gpt_profile(layers, HIDDEN, HEADS, seq=SEQ)
    by = {l.name: l for l in flat.layers}
    act = by["res1_0"].activation_bytes
    out = [by["wte"]]
    edges = [e for e in flat.edges if e.dst == "wte"]
    prev = "wte"
    for i in range(layers):
        blk = f"block_{i}"
        res1, res2 = by[f"res1_{i}"], by[f"res2_{i}"]
        own = dataclasses.replace(
            res1, name=blk, type="DecoderBlock", block=blk, inputs=(prev,),
            flops_fwd=res1.flops_fwd + res2.flops_fwd, flops_bwd=res1.flops_bwd + res2.flops_bwd,
            memory_traffic_bytes_fwd=res1.memory_traffic_bytes_fwd + res2.memory_traffic_bytes_fwd,
            memory_traffic_bytes_bwd=res1.memory_traffic_bytes_bwd + res2.memory_traffic_bytes_bwd,
            input_bytes=res1.input_bytes + res2.input_bytes)
        out.append(own)
        feeds = {"ln1": blk, "attention": f"{blk}/ln1", "ln2": blk, "fc": f"{blk}/ln2",
                 "proj": f"{blk}/fc"}
        for sub, flat_name in SUBS.items():
            layer = dataclasses.replace(by[flat_name.format(i=i)], name=f"{blk}/{sub}",
                                        block=blk, inputs=(feeds[sub],))
            if sub == "attention":
                layer = dataclasses.replace(layer, type="CachedMultiHeadAttention",
                                            base_type="MultiHeadAttention")
            out.append(layer)
        edges += [Edge(prev, blk, act), Edge(blk, f"{blk}/ln1", act),
                  Edge(f"{blk}/ln1", f"{blk}/attention", act),
                  Edge(f"{blk}/attention", blk, act),  # the residual add, in the block's code
                  Edge(blk, f"{blk}/ln2", act), Edge(f"{blk}/ln2", f"{blk}/fc", act),
                  Edge(f"{blk}/fc", f"{blk}/proj", 4 * act), Edge(f"{blk}/proj", blk, act)]
        prev = blk
    out += [dataclasses.replace(by["ln_f"], inputs=(prev,)), by["lm_head"]]
    edges += [Edge(prev, "ln_f", act), Edge("ln_f", "lm_head", act)]
    return dataclasses.replace(flat, layers=tuple(out), edges=tuple(edges))


def _stage_of(plan) -> dict[str, int]:
    return {name: s for s, stage in enumerate(plan.stages) for name in stage.layers}


def _assert_blocks_whole(plan, profile) -> None:
    stage_of = _stage_of(plan)
    for layer in profile.layers:
        if layer.block:
            assert stage_of[layer.name] == stage_of[layer.block], (plan.name, layer.name)


def test_a_block_is_one_pipeline_unit_and_its_two_way_edges_are_no_cycle():
    profile = blocked_gpt()
    units = pipeline_units(profile)
    assert len(units) == 1 + LAYERS + 2  # embedding, the blocks, final norm, head
    assert units[1] == (1, 7)  # block_0's entry and its 5 sub-layers
    assert topological_layers(profile)[:3] == ("wte", "block_0", "block_0/ln1")
    # a real cycle between units is still refused
    looped = dataclasses.replace(profile, edges=profile.edges + (Edge("block_1", "block_0", 1),))
    with pytest.raises(SchemaError, match="cycle"):
        topological_layers(looped)


def test_every_searched_pipeline_keeps_each_block_on_one_stage():
    profile = blocked_gpt()
    result = search(profile, parse_cluster("8xA100-80GB"), 64)
    pipelined = [p for p in result.candidates if p.strategy.pp > 1]
    assert pipelined  # plain pipelines and hybrids
    for plan in pipelined:
        _assert_blocks_whole(plan, profile)
        validate_plan(plan, profile)
    fixed = search(profile, parse_cluster("8xA100-80GB"), 64, fix={"pp": 3, "dp": 1}).chosen
    _assert_blocks_whole(fixed, profile)
    with pytest.raises(PlannerError, match="pp=8.*7 layers a stage boundary may fall between"):
        search(profile, parse_cluster("8xA100-80GB"), 64, fix={"pp": 8, "dp": 1})


def test_a_plan_that_cuts_a_block_is_refused():
    profile = blocked_gpt()
    plan = search(profile, parse_cluster("8xA100-80GB"), 64, fix={"pp": 2, "dp": 1}).chosen
    first, second = plan.stages
    moved = second.layers[:1] and first.layers[-1]  # the last entry of stage 0's last block
    cut = dataclasses.replace(plan, stages=(
        dataclasses.replace(first, layers=first.layers[:-1]),
        dataclasses.replace(second, layers=(moved,) + second.layers)))
    with pytest.raises(PlanMismatchError, match="block .* is cut between stages 0 and 1"):
        validate_plan(cut, profile)


def test_tensor_parallelism_splits_the_sub_layers_as_the_same_layers_written_flat():
    """The Megatron pattern inside each block: the attention (a subclass of
    MultiHeadAttention) by heads, fc column, proj row -- the splits, and nearly the step
    time, of the same GPT whose blocks are written with Keras layers."""
    cluster, fix = parse_cluster("8xA100-80GB"), {"tp": 8, "dp": 1}
    blocked = search(blocked_gpt(), cluster, 64, fix=fix).chosen
    flat = search(gpt_profile(LAYERS, HIDDEN, HEADS, seq=SEQ), cluster, 64, fix=fix).chosen
    splits = dict(blocked.tp_splits)
    for i in range(LAYERS):
        assert splits[f"block_{i}/attention"] == "heads"
        assert splits[f"block_{i}/fc"] == "column" and splits[f"block_{i}/proj"] == "row"
        assert f"block_{i}" not in splits  # the block's own code runs replicated
    flat_splits = dict(flat.tp_splits)
    renamed = {f"block_{i}/{sub}": flat_splits.get(name.format(i=i))
               for i in range(LAYERS) for sub, name in SUBS.items()}
    assert {k: v for k, v in renamed.items() if v} == \
        {k: v for k, v in splits.items() if k.startswith("block_")}
    assert blocked.predicted.step_time_s == pytest.approx(flat.predicted.step_time_s, rel=0.02)


def test_only_subclasses_apply_runs_are_split():
    profile = blocked_gpt(1)
    attention = profile.layer("block_0/attention")
    assert [s.split for s in layer_comm(attention, 0).tp_splits] == ["heads"]
    mine = dataclasses.replace(profile.layer("block_0/fc"), type="MyDense", base_type="Dense")
    assert layer_comm(mine, 0).tp_splits == ()  # its call may differ from Dense's


def test_no_sequence_or_context_parallelism_inside_blocks():
    """A block's own code between its sub-layers runs on whole sequences, so neither is
    offered, and asking for them names why."""
    cluster = parse_cluster("8xA100-80GB")
    result = search(blocked_gpt(), cluster, 64)
    assert not any(p.strategy.sequence_parallel or p.strategy.cp > 1
                   for p in result.candidates)
    for fix in ({"tp": 2, "sequence_parallel": True}, {"cp": 2}):
        with pytest.raises(PlannerError, match="has blocks .* whole sequences"):
            search(blocked_gpt(), cluster, 64, fix=fix)


def attention_block_gpt(layers: int = LAYERS) -> ModelProfile:
    """``blocked_gpt`` with each attention a custom attention block (keras_hub's
    LlamaAttention-like, ``LayerProfile.attention_heads``): its own entry holds the core
    (scores, softmax, context: 4 b s^2 h FLOPs and the saved core bytes), its sub-layers
    the four EinsumDense projections (2 b s h^2 FLOPs, h^2 + h parameters each)."""
    profile = blocked_gpt(layers)
    out, edges = [], [e for e in profile.edges if "/attention" not in e.src + e.dst]
    for layer in profile.layers:
        if not layer.name.endswith("/attention"):
            out.append(layer)
            continue
        h, act = HIDDEN, profile.layer(layer.block).activation_bytes
        core = layer.attention_core_flops_fwd
        proj_flops = (layer.flops_fwd - core) // 4
        params = (layer.params - 4 * h) // 4 + h
        own = dataclasses.replace(
            layer, type="MyAttention", base_type="", params=0, trainable_params=0,
            param_bytes=0, trainable_param_bytes=0, grad_bytes=0, optimizer_bytes=0,
            compute_weight_bytes=0, flops_fwd=core, flops_bwd=2 * core, matmul_flops_fwd=core,
            matmul_flops_bwd=2 * core, attention_heads=HEADS,
            activation_saved_bytes=layer.attention_core_saved_bytes + 2 * act)
        out.append(own)
        for sub in ("query", "key", "value", "output"):
            out.append(dataclasses.replace(
                layer, name=f"{layer.name}/{sub}", type="EinsumDense", base_type="",
                params=params, trainable_params=params, param_bytes=4 * params,
                trainable_param_bytes=4 * params, grad_bytes=4 * params,
                optimizer_bytes=8 * params, compute_weight_bytes=2 * params,
                flops_fwd=proj_flops, flops_bwd=2 * proj_flops, matmul_flops_fwd=proj_flops,
                matmul_flops_bwd=2 * proj_flops, activation_saved_bytes=act,
                attention_core_flops_fwd=0, attention_core_saved_bytes=0, attention_kv_bytes=0,
                attention_kv_heads=0))
        a, blk = layer.name, layer.block
        edges += [Edge(f"{blk}/ln1", f"{a}/{s}", act) for s in ("query", "key", "value")]
        edges += [Edge(f"{a}/{s}", a, act) for s in ("query", "key", "value")]
        edges += [Edge(a, f"{a}/output", act), Edge(f"{a}/output", blk, act)]
    return dataclasses.replace(profile, layers=tuple(out), edges=tuple(edges))


def test_a_custom_attention_block_is_split_by_heads_as_a_whole():
    """Megatron's attention split for an attention written as a custom layer (keras_hub's
    Llama and Gemma): the block by heads, its projections and core with it (named by the
    block alone), as a Keras MultiHeadAttention is; about the same step time."""
    cluster, fix = parse_cluster("8xA100-80GB"), {"tp": 8, "dp": 1}
    custom = search(attention_block_gpt(), cluster, 64, fix=fix).chosen
    flat = search(gpt_profile(LAYERS, HIDDEN, HEADS, seq=SEQ), cluster, 64, fix=fix).chosen
    splits = dict(custom.tp_splits)
    for i in range(LAYERS):
        assert splits[f"block_{i}/attention"] == "heads"
        assert not any(name.startswith(f"block_{i}/attention/") for name in splits)
        assert splits[f"block_{i}/fc"] == "column" and splits[f"block_{i}/proj"] == "row"
    validate_plan(custom, attention_block_gpt())
    assert custom.predicted.step_time_s == pytest.approx(flat.predicted.step_time_s, rel=0.03)
    # tp must divide the key/value heads: at 32 > 16 heads the block is not split by heads
    assert "block_0/attention" not in dict(search(
        attention_block_gpt(), parse_cluster("4x8xA100-80GB"), 64,
        fix={"tp": 32, "dp": 1}).chosen.tp_splits)
