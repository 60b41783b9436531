"""Per-layer communication bytes under each strategy (profiler.comm), hand-checked."""
from __future__ import annotations

from tfplan.profiler.comm import layer_comm, profile_comm
from tfplan.profiler.model_profile import Edge, LayerProfile, ModelProfile


def _layer(name: str, type_: str, *, params: int = 0, act: int = 0) -> LayerProfile:
    return LayerProfile(name=name, type=type_, params=params, trainable_params=params,
                        param_bytes=4 * params, grad_bytes=4 * params,
                        optimizer_bytes=8 * params, activation_bytes=act, flops_fwd=0,
                        flops_bwd=0)


def test_dense_column_and_row_splits_follow_megatron_f_and_g():
    dense = _layer("fc1", "Dense", params=32 * 64 + 64, act=8 * 64 * 4)
    c = layer_comm(dense, input_bytes=8 * 32 * 4)
    assert c.dp_allreduce_bytes == 4 * (32 * 64 + 64)
    splits = {s.split: (s.fwd_allreduce_bytes, s.bwd_allreduce_bytes) for s in c.tp_splits}
    # column: f = identity forward, all-reduce of the input gradient backward
    assert splits["column"] == (0, 8 * 32 * 4)
    # row: g = all-reduce of the output forward, identity backward
    assert splits["row"] == (8 * 64 * 4, 0)
    assert c.pp_send_bytes == 8 * 64 * 4


def test_attention_embedding_and_replicated_layers():
    mha = layer_comm(_layer("attn", "MultiHeadAttention", params=10, act=4096), input_bytes=4096)
    assert [(s.split, s.fwd_allreduce_bytes, s.bwd_allreduce_bytes) for s in mha.tp_splits] == \
        [("heads", 4096, 4096)]
    emb = layer_comm(_layer("tok", "Embedding", params=1000, act=2048), input_bytes=64)
    assert [(s.split, s.fwd_allreduce_bytes, s.bwd_allreduce_bytes) for s in emb.tp_splits] == \
        [("vocab", 2048, 0)]
    conv = layer_comm(_layer("conv", "DepthwiseConv2D", params=5, act=100), input_bytes=100)
    assert conv.tp_splits == () and conv.dp_allreduce_bytes == 20 and conv.pp_send_bytes == 100


def test_profile_comm_takes_input_bytes_from_edges_when_not_recorded():
    a, b = _layer("a", "Dense", params=3, act=40), _layer("b", "Dense", params=5, act=12)
    profile = ModelProfile(model_name="m", batch_size=1, precision="float32", optimizer="adam",
                           optimizer_slots_per_param=2, layers=(a, b),
                           edges=(Edge("a", "b", 40),))
    comm = profile_comm(profile)
    assert [c.name for c in comm] == ["a", "b"]
    assert dict((s.split, s.bwd_allreduce_bytes) for s in comm[1].tp_splits)["column"] == 40
    assert sum(c.dp_allreduce_bytes for c in comm) == 4 * (3 + 5)


def test_splits_need_the_degree_to_divide_what_they_cut_equally():
    """What apply.spmd cuts into equal shards: a column split's output units (a row split's
    inputs may cut unequally), an Embedding's vocabulary; a grouped convolution is not split."""
    from dataclasses import replace

    dense = replace(_layer("fc", "Dense", params=33 * 12, act=8 * 12 * 4), output_shape=(12,))
    by = {s.split: s for s in layer_comm(dense, input_bytes=8 * 33 * 4).tp_splits}
    assert [t for t in range(1, 9) if by["column"].allows(t)] == [1, 2, 3, 4, 6]
    assert all(by["row"].allows(t) for t in range(1, 9))
    emb = replace(_layer("tok", "Embedding", params=1000 * 16, act=2048), output_shape=(8, 16))
    (vocab,) = layer_comm(emb, input_bytes=64).tp_splits
    assert vocab.degree_divides == 1000 and vocab.allows(8) and not vocab.allows(3)
    grouped = replace(_layer("conv", "Conv2D", params=100, act=100), groups=2)
    assert layer_comm(grouped, input_bytes=100).tp_splits == ()
    unknown = _layer("fc", "Dense", params=10, act=40)  # no output shape: any degree
    assert all(s.allows(5) for s in layer_comm(unknown, input_bytes=4).tp_splits)
