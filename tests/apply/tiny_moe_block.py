"""A tiny model file whose ``tfplan.layers.MixtureOfExperts`` sits inside a custom block (a
pre-norm residual MoE block, two of them), for the expert-parallel tests: apply swaps the
block's sub-layer for its expert-parallel twin in place."""
import keras

from tfplan.layers import MixtureOfExperts

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)
SEQ, FEATURES, WIDTH = 4, 6, 16


class MoEBlock(keras.layers.Layer):
    """x + MoE(LayerNorm(x))."""

    def __init__(self, num_experts=4, **kwargs):
        super().__init__(**kwargs)
        self.num_experts = num_experts
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.moe = MixtureOfExperts(num_experts, 2, 16, aux_loss_weight=0.0, name="moe")

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.moe.build(input_shape)

    def call(self, x):
        return x + self.moe(self.norm(x))

    def get_config(self):
        return {**super().get_config(), "num_experts": self.num_experts}


def build_model():
    inputs = keras.Input(shape=(SEQ, FEATURES), name="tokens")
    x = keras.layers.Dense(WIDTH, activation="tanh", name="embed")(inputs)
    x = MoEBlock(name="block_0")(x)
    x = MoEBlock(name="block_1")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x), name="tiny_moe_block")


def sample_batch(batch_size):
    from tests.apply.tiny_moe import sample_batch as tokens

    return tokens(batch_size)
