"""A tiny model file around keras_hub's ``MixtralBackbone`` (a nested model: 1 decoder
block, 4 experts, top 2, no router aux loss, no jitter, token ids and a padding mask of
length ``SEQ``) with a Dense head per position, for the expert-parallel tests: apply swaps
each decoder's ``MixtralSparseMoeBlock`` for its routed expert-parallel twin."""
import keras
import numpy as np

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)
VOCAB, SEQ, WIDTH, OUT = 32, 6, 16, 3


def build_model(router_aux_loss_coef=0.0, layers=1):
    import keras_hub

    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB, num_layers=layers, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=WIDTH, intermediate_dim=16, num_experts=4, top_k=2, sliding_window=SEQ,
        router_aux_loss_coef=router_aux_loss_coef, dropout=0.0, name="mixtral")
    inputs = {"token_ids": keras.Input((SEQ,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((SEQ,), dtype="int32", name="padding_mask")}
    outputs = keras.layers.Dense(OUT, name="head")(backbone(inputs))
    return keras.Model(inputs, outputs, name="tiny_mixtral")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    ids = rng.integers(0, VOCAB, size=(batch_size, SEQ)).astype("int32")
    mask = np.ones((batch_size, SEQ), "int32")
    mask[::2, -2:] = 0  # every other sample padded at its end
    y = rng.normal(size=(batch_size, SEQ, OUT)).astype("float32")
    return {"token_ids": ids, "padding_mask": mask}, y
