"""A tiny model file with two keras_hub ``MixtralTransformerDecoder`` blocks (4 experts, top
2, no router aux loss, no jitter) on an Embedding, for the expert-parallel tests: apply
swaps each block's ``MixtralSparseMoeBlock`` for its routed expert-parallel twin."""
import keras
import numpy as np

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)
VOCAB, SEQ, WIDTH, OUT = 32, 4, 16, 3


def build_model(router_aux_loss_coef=0.0, layers=2):
    from keras_hub.src.models.mixtral.mixtral_decoder import MixtralTransformerDecoder

    ids = keras.Input((SEQ,), dtype="int32", name="token_ids")
    x = keras.layers.Embedding(VOCAB, WIDTH, name="embed")(ids)
    for i in range(layers):
        x = MixtralTransformerDecoder(
            intermediate_dim=16, num_query_heads=4, num_key_value_heads=2, num_experts=4,
            top_k=2, sliding_window=SEQ, router_aux_loss_coef=router_aux_loss_coef,
            name=f"decoder_{i}")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(ids, keras.layers.Dense(OUT, name="head")(x), name="tiny_mixtral")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    x = rng.integers(0, VOCAB, size=(batch_size, SEQ)).astype("int32")
    y = rng.normal(size=(batch_size, OUT)).astype("float32")
    return x, y
