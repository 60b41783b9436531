"""ZeRO stages and offloading: the closed forms of planner.sharding and the new collectives,
and what the search does with them (planner.pricing)."""
from __future__ import annotations

import dataclasses

import pytest

from tfplan.core.cluster import LinkSpec
from tfplan.core.presets import parse_cluster
from tfplan.planner import collectives as coll
from tfplan.planner import sharding
from tfplan.planner.search import search
from tests.planner.gpt_profile import gpt_profile

GB = 1e9
NVLINK = LinkSpec(bandwidth_bytes_per_s=300e9, latency_s=5e-6)
IB = LinkSpec(bandwidth_bytes_per_s=25e9, latency_s=10e-6)


# --- collectives -------------------------------------------------------------------------

@pytest.mark.parametrize("per_node", [(8,), (4, 4), (8, 8, 8, 8), (8, 4), (1, 1, 1)])
def test_allgather_is_half_the_allreduce_of_the_same_group(per_node):
    n = 3 * GB
    assert coll.allgather_time_s(n, per_node, NVLINK, IB) == pytest.approx(
        coll.allreduce_time_s(n, per_node, NVLINK, IB) / 2)


def test_allgather_closed_forms():
    n = 8 * GB
    # one node: the ring all-gather, (k-1)/k N / beta + (k-1) alpha
    assert coll.allgather_time_s(n, (8,), NVLINK, IB) == pytest.approx(
        7 / 8 * n / 300e9 + 7 * 5e-6)
    # 4 nodes of 8: AG_intra(N, 8) + AR_inter(N/8, 4) / 2
    expected = (7 / 8 * n / 300e9 + 7 * 5e-6) + (2 * 3 / 4 * (n / 8) / 25e9 + 2 * 3 * 10e-6) / 2
    assert coll.allgather_time_s(n, (8, 8, 8, 8), NVLINK, IB) == pytest.approx(expected)


def test_tensor_group_allreduce_spans_nodes_over_the_inter_node_link():
    cluster = parse_cluster("2x8xA100-80GB")
    n = 1 * GB
    eight = coll.tensor_group_allreduce_time_s(n, 8, cluster)
    assert eight == pytest.approx(coll.ring_allreduce_time_s(n, 8, cluster.intra_node_link))
    sixteen = coll.tensor_group_allreduce_time_s(n, 16, cluster)
    assert sixteen == pytest.approx(coll.hierarchical_allreduce_time_s(
        n, 8, 2, cluster.intra_node_link, cluster.inter_node_link))
    assert sixteen > 1.5 * eight  # the inter-node hop dominates


# --- memory --------------------------------------------------------------------------------

W, WC, G, S, BIG_W, BIG_G = 40.0, 20.0, 40.0, 80.0, 5.0, 10.0  # bytes of one device's layers


@pytest.mark.parametrize("stage, expected", [
    (0, W + WC + G + S),
    (1, W + WC + G + S / 8),
    (2, W + WC + G / 8 + BIG_G + S / 8),
    (3, (W + WC) / 8 + 2 * BIG_W + G / 8 + BIG_G + S / 8),
])
def test_state_bytes_per_zero_stage(stage, expected):
    # SC'20 Fig. 1: P_os, P_os+g, P_os+g+p; FSDP keeps one layer gathered and one prefetched
    got = sharding.state_bytes(W, WC, G, S, replicas=8, zero_stage=stage, offload="none",
                               largest_gather=BIG_W, largest_grad=BIG_G)
    assert got == pytest.approx(expected)


def test_offload_moves_the_state_to_the_host():
    kw = dict(replicas=8, zero_stage=1, largest_gather=BIG_W, largest_grad=BIG_G)
    assert sharding.state_bytes(W, WC, G, S, offload="optimizer", **kw) == pytest.approx(
        W + WC + G)
    assert sharding.state_bytes(W, WC, G, S, offload="optimizer+weights", **kw) == \
        pytest.approx(2 * BIG_W + G)
    assert sharding.host_state_bytes(W, S, replicas=8, zero_stage=1, offload="optimizer") \
        == pytest.approx(S / 8)
    assert sharding.host_state_bytes(W, S, replicas=8, zero_stage=0,
                                     offload="optimizer+weights") == pytest.approx(S + W)


def test_a_single_replica_shards_nothing():
    for stage in range(4):
        assert sharding.state_bytes(W, WC, G, S, replicas=1, zero_stage=stage, offload="none",
                                    largest_gather=BIG_W, largest_grad=BIG_G) == W + WC + G + S


# --- time ------------------------------------------------------------------------------------

def test_zero_exposed_time_per_stage():
    kw = dict(allreduce_s=4.0, reduce_scatter_s=2.0, gather_weights_s=1.5,
              gather_updated_s=2.0, forward_s=1.0, backward_overlap_s=1.5)
    # stages 0-1: one all-reduce behind the last backward
    assert sharding.zero_exposed_s(0, 4, **kw) == sharding.zero_exposed_s(1, 4, **kw) == 2.5
    # stage 2: a reduce-scatter per micro-batch, then the updated weights gathered
    assert sharding.zero_exposed_s(2, 4, **kw) == pytest.approx(4 * 0.5 + 2.0)
    # stage 3: per micro-batch, the forward gather past the forward, the backward gather
    # and reduce-scatter past the backward
    assert sharding.zero_exposed_s(3, 4, **kw) == pytest.approx(4 * (0.5 + 2.0))


def test_offload_time_closed_form():
    cluster = parse_cluster("8xA100-80GB")
    w, g, s = 4 * GB, 4 * GB, 8 * GB
    link, host = sharding.HOST_LINK_BYTES_PER_S, sharding.HOST_MEMORY_BYTES_PER_S_PER_DEVICE
    t = sharding.offload_time_s("optimizer", 4, weights=w, compute_weights=2 * GB, grads=g,
                                optimizer=s, shard=2, cluster=cluster, forward_s=1.0,
                                backward_s=2.0)
    assert t == pytest.approx(g / 2 / link + (2 * w + g + 2 * s) / 2 / host + w / 2 / link)
    both = sharding.offload_time_s("optimizer+weights", 4, weights=w, compute_weights=2 * GB,
                                   grads=g, optimizer=s, shard=2, cluster=cluster,
                                   forward_s=0.01, backward_s=0.02)
    fetch = 2 * GB / link
    assert both == pytest.approx(t + 4 * ((fetch - 0.01) + (fetch - 0.02)))
    assert sharding.offload_time_s("none", 4, weights=w, compute_weights=0, grads=g,
                                   optimizer=s, shard=1, cluster=cluster, forward_s=1.0,
                                   backward_s=1.0) == 0


# --- what the search does with them ----------------------------------------------------------

def gpt_7b():
    return gpt_profile(32, 4096, 32, vocab=51200, seq=2048)


def _fixed(profile, cluster, batch, **fix):
    return search(profile, parse_cluster(cluster), batch, fix=fix).chosen


def test_7b_does_not_fit_data_parallel_on_8_a100s_until_zero3():
    # the case: 7B with Adam needs ~16 bytes per parameter, 112 GB of state
    profile = gpt_7b()
    base = dict(dp=8, microbatch_size=1, recompute="none")
    plain = _fixed(profile, "8xA100-80GB", 512, **base, zero_stage=0)
    zero1 = _fixed(profile, "8xA100-80GB", 512, **base, zero_stage=1)
    zero2 = _fixed(profile, "8xA100-80GB", 512, **base, zero_stage=2)
    zero3 = _fixed(profile, "8xA100-80GB", 512, **base, zero_stage=3)
    mem = [p.predicted.max_memory_bytes for p in (plain, zero1, zero2, zero3)]
    assert mem[0] > mem[1] > mem[2] > mem[3]
    assert not plain.predicted.fits and not zero1.predicted.fits and zero3.predicted.fits
    # on NVLink the gathers hide behind each micro-batch's compute (7B: 14 GB of float16
    # weights, ~0.05 s per gather against ~0.2 s of forward)
    assert zero3.predicted.breakdown.communication_s == pytest.approx(
        zero1.predicted.breakdown.communication_s, abs=1e-3)
    # on a 1 GB/s link they do not: ZeRO-3 moves 1.5x the all-reduce's bytes per
    # micro-batch (SC'20 Sec. 7.2.2), again for each of the 64 micro-batches
    slow = dataclasses.replace(parse_cluster("8xA100-80GB"),
                               intra_node_link=LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=1e-5))
    slow1, slow3 = (search(profile, slow, 512, fix={**base, "zero_stage": z}).chosen
                    for z in (1, 3))
    assert slow3.predicted.breakdown.communication_s > \
        20 * slow1.predicted.breakdown.communication_s > 0
    # the optimizer update is sharded from stage 1 on
    assert zero1.predicted.breakdown.optimizer_s == pytest.approx(
        plain.predicted.breakdown.optimizer_s / 8)
    # ZeRO-3 re-runs each layer's forward in its backward (apply.spmd.zero3), as full
    # recomputation does: priced the same (and not twice where the plan recomputes too)
    full = _fixed(profile, "8xA100-80GB", 512, **{**base, "recompute": "full"}, zero_stage=1)
    assert zero1.predicted.breakdown.recompute_s == 0
    assert zero3.predicted.breakdown.recompute_s == pytest.approx(
        full.predicted.breakdown.recompute_s, rel=1e-6)
    both = _fixed(profile, "8xA100-80GB", 512, **{**base, "recompute": "full"}, zero_stage=3)
    assert both.predicted.breakdown.recompute_s == pytest.approx(
        zero3.predicted.breakdown.recompute_s, rel=1e-6)
    # with ZeRO-3's recomputed forward priced, two pipeline stages of ZeRO-1 replicas fit
    # and beat it (one device's 14 GB of float16 weights halved, no forward run twice)
    chosen = search(profile, parse_cluster("8xA100-80GB"), 512).chosen
    assert chosen.predicted.fits and chosen.strategy.tp == 1
    assert (chosen.strategy.pp, chosen.strategy.zero_stage) == (2, 1), chosen.name
    assert chosen.predicted.step_time_s < zero3.predicted.step_time_s


def test_offload_fits_where_nothing_else_does_and_costs_host_time():
    profile = gpt_profile(12, 4096, 32, vocab=51200, seq=2048)  # 2.8B parameters: 51 GB of state
    one = dict(dp=1, microbatch_size=1, recompute="full")
    plain = _fixed(profile, "8xA100-40GB", 8, **one, offload="none")
    moved = _fixed(profile, "8xA100-40GB", 8, **one, offload="optimizer")
    assert not plain.predicted.fits and moved.predicted.fits
    assert moved.predicted.breakdown.optimizer_s > 5 * plain.predicted.breakdown.optimizer_s
    single = dataclasses.replace(parse_cluster("8xA100-40GB"), devices_per_node=1)
    chosen = search(profile, single, 8).chosen
    assert chosen.strategy.offload != "none" and chosen.predicted.fits


def test_what_ifs_that_were_refused_are_priced():
    profile = gpt_7b()
    across = _fixed(profile, "2x8xA100-80GB", 64, tp=16, dp=1)  # tp over two nodes
    inside = _fixed(profile, "2x8xA100-80GB", 64, tp=8, dp=1)
    assert across.strategy.tp == 16 and len(across.stages[0].devices) == 16
    assert across.predicted.breakdown.communication_s > inside.predicted.breakdown.communication_s
    wide = _fixed(profile, "8x8xA100-80GB", 512, dp=64, zero_stage=3)
    assert wide.strategy.zero_stage == 3 and wide.strategy.dp == 64


def test_a_last_column_split_prices_the_all_gather_of_its_output():
    """A column split no row split reads next (GPT's lm_head) has its ranks all-gather the
    output (apply.spmd.rank_layers): its forward tp time is that gather, half an all-reduce
    of the output over the tp group; Megatron's column -> row pair gathers nothing."""
    import numpy as np

    from tfplan.planner.context import search_context
    from tfplan.planner.pricing import Pricer
    from tests.planner.gpt_profile import gpt_profile

    cluster = parse_cluster("8xA100-80GB")
    profile = gpt_profile(4, 1024, 16)
    pricer = Pricer(search_context(profile, cluster, 64))
    splits, tp, mbs = pricer.splits_for(8), 8, 1
    assert splits[-1] == "column" and profile.layers[-1].name == "lm_head"
    tpf = pricer.arrays(tp, mbs)["tpf"]
    head = profile.layers[-1]
    gather_s = coll.tensor_group_allreduce_time_s(
        head.activation_bytes * mbs / profile.batch_size, tp, cluster) / 2
    assert tpf[-1] == pytest.approx(gather_s) and gather_s > 0
    fc = max(i for i, s in enumerate(splits[:-1]) if s == "column")  # fc_3, before proj_3
    assert splits[fc + 1] == "row" and tpf[fc] == 0.0  # f's forward is an identity
    assert np.all(tpf >= 0)


def test_zero3_keeps_each_recomputed_layers_inputs_only():
    """ZeRO-3 runs every layer holding weights under tf.recompute_grad (apply.spmd.zero3), so
    its activation memory is those layers' inputs: selective recomputation saves nothing
    more under it, while without ZeRO-3 it does."""
    profile = gpt_7b()
    base = dict(dp=8, microbatch_size=1)
    none3, selective3 = (_fixed(profile, "8xA100-80GB", 512, **base, recompute=r,
                                zero_stage=3) for r in ("none", "selective"))
    none2, selective2 = (_fixed(profile, "8xA100-80GB", 512, **base, recompute=r,
                                zero_stage=2) for r in ("none", "selective"))
    assert none3.predicted.max_memory_bytes == selective3.predicted.max_memory_bytes
    assert selective2.predicted.max_memory_bytes < none2.predicted.max_memory_bytes
    # and far less than ZeRO-2's activations: the state shrinks by 2 bytes a parameter
    # (float16 weights / 8 per device), the activations by much more
    state_saved = 2 * 7e9 * 7 / 8
    assert none2.predicted.max_memory_bytes - none3.predicted.max_memory_bytes > 1.2 * state_saved
