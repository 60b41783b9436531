"""Blocks in the profiler (custom layers with sub-layers): repeated blocks traced once
give the numbers of tracing all of them, and a block whose get_config fails is still
compared and re-created from its constructor's arguments. (keras_hub's blocks, with
closed forms: tests/profiler/test_keras_hub.py.)"""
from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from tfplan.profiler.signature import block_of, is_block, layer_config, profiled_layer_paths
from tfplan.profiler.static import profile_model

HIDDEN, SEQ, BLOCKS = 8, 4, 6


class Residual(keras.layers.Layer):
    """x + down(act(up(x))): two Dense sub-layers and the block's own add."""

    def __init__(self, hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden
        self.up = keras.layers.Dense(2 * hidden, activation="relu", name="up")
        self.down = keras.layers.Dense(hidden, name="down")

    def call(self, x):
        return x + self.down(self.up(x))

    def get_config(self):
        return {**super().get_config(), "hidden": self.hidden}


class BrokenConfig(Residual):
    """As keras_hub 0.32's LlamaTransformerDecoder: get_config reads a missing attribute."""

    def get_config(self):
        return {**super().get_config(), "missing": self.missing}


def _stack(block_class=Residual) -> keras.Model:
    x = inputs = keras.Input((SEQ, HIDDEN), name="x")
    for i in range(BLOCKS):
        x = block_class(HIDDEN, name=f"block_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


@pytest.mark.parametrize("block_class", [Residual, BrokenConfig])
def test_repeated_blocks_traced_once_equal_every_block_traced(block_class):
    with tf.Graph().as_default():
        model = _stack(block_class)
        whole = profile_model(model, 2, optimizer="sgd", repeat_blocks=False)
        once = profile_model(model, 2, optimizer="sgd", repeat_blocks=True)
    assert any("repeated blocks traced once" in w for w in once.warnings)
    assert len(whole.layers) == 1 + 3 * BLOCKS
    # every entry of the skipped blocks takes its traced copy's numbers: forward exact; the
    # backward differs by which entry a residual's gradient sum (AddN, 2 b s h FLOPs) is
    # charged to, which alternates between neighbouring blocks in a whole trace
    forward = ("name", "type", "params", "param_bytes", "flops_fwd", "matmul_flops_fwd",
               "activation_bytes", "activation_saved_bytes", "input_bytes", "inputs", "block")
    assert [{k: getattr(l, k) for k in forward} for l in once.layers] == \
        [{k: getattr(l, k) for k in forward} for l in whole.layers]
    assert once.flops_bwd == pytest.approx(whole.flops_bwd, rel=0.01)
    assert set(once.edges) == set(whole.edges)
    # every sub-layer of every block: its Dense FLOPs, in its block
    for i in range(BLOCKS):
        up = once.layer(f"block_{i}/up")
        assert up.block == f"block_{i}" and up.matmul_flops_fwd == 2 * 2 * SEQ * HIDDEN * 2 * HIDDEN


def test_a_failing_get_config_is_read_back_from_the_constructor_arguments():
    block = BrokenConfig(HIDDEN, name="b")
    with pytest.raises(AttributeError):
        block.get_config()
    config = layer_config(block)
    assert config["hidden"] == HIDDEN and config["name"] == "b"
    clone = BrokenConfig.from_config(config)
    assert clone.hidden == HIDDEN and clone.name == "b"

    class Hidden(keras.layers.Layer):  # a required argument the layer does not keep
        def __init__(self, size, **kwargs):
            super().__init__(**kwargs)

        def get_config(self):
            raise NotImplementedError("no config")

    with pytest.raises(NotImplementedError):
        layer_config(Hidden(3))


def test_block_paths_and_membership():
    model = _stack()
    paths = profiled_layer_paths(model)
    assert [n for n, _ in paths][:4] == ["block_0", "block_0/up", "block_0/down", "block_1"]
    assert is_block(paths[0][1]) and not is_block(paths[1][1])
    members = block_of(paths)
    assert members["block_0"] == members["block_0/down"] == "block_0" and "head" not in members


def test_custom_attention_blocks_are_recognised_for_a_heads_split():
    """keras_hub's LlamaAttention and CachedGemmaAttention: attention blocks
    (``profiler.attention_blocks``) with their query and key/value heads; Keras' own
    attention (GPT-2's CachedMultiHeadAttention) and other blocks are not."""
    keras_hub = pytest.importorskip("keras_hub")
    from tfplan.profiler.attention_blocks import attention_block

    with tf.Graph().as_default():
        llama = keras_hub.models.Llama3Backbone(
            vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=16, intermediate_dim=32)
        gemma = keras_hub.models.GemmaBackbone(
            vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32, head_dim=8)
        gpt2 = keras_hub.models.GPT2Backbone(
            vocabulary_size=64, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=16)
        found = {model.name: {n: (a.query_heads, a.kv_heads,
                                  sorted((p.layer.name, p.role) for p in a.projections))
                              for n, l in profiled_layer_paths(model)
                              if (a := attention_block(l)) is not None}
                 for model in (llama, gemma, gpt2)}
    assert found[llama.name] == {"transformer_layer_0/self_attention": (4, 2, [
        ("attention_output", "output"), ("key", "input"), ("query", "input"),
        ("value", "input")])}
    assert list(found[gemma.name].values())[0][:2] == (4, 1)
    assert found[gpt2.name] == {}
    assert attention_block(_stack().get_layer("block_0")) is None  # a block, no heads
