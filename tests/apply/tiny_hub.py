"""Tiny keras_hub backbones (GPT-2, Llama 3, Gemma; random weights, nothing downloaded) in a
Functional model with fixed-length inputs and a Dense head, for the apply tests of splits
inside blocks (``tests/apply/test_blocks.py``).

``build_model(kind)`` calls the backbone (a nested model: the plan names its layers
``<kind>/...``, its transformer blocks' sub-layers ``<kind>/transformer_layer_0/...``) on
``token_ids`` and ``padding_mask`` of length ``SEQ`` (``"decoder"``: keras_hub's
TransformerDecoder blocks at the top level instead, ``decoders``) and maps each position's hidden state
to ``OUT`` numbers; the loss is the mean squared error against random targets
(``sample_batch``). Dropout is 0 (an unsplit and a split layer draw different masks).
"""
import keras
import numpy as np

VOCAB, SEQ, OUT = 64, 8, 4

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def backbone(kind):
    import keras_hub

    if kind == "gpt2":
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=16,
            intermediate_dim=32, dropout=0.0, max_sequence_length=SEQ, name=kind)
    if kind == "llama":
        return keras_hub.models.Llama3Backbone(
            vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=16, intermediate_dim=32, dropout=0.0, name=kind)
    if kind == "gemma":
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=16, intermediate_dim=64, head_dim=8, dropout=0.0, name=kind)
    raise ValueError(kind)


def decoders(inputs):
    """keras_hub's TransformerDecoder blocks as top-level layers (no backbone): an
    Embedding, two decoder blocks named ``transformer_layer_0/1`` (GPT-2's)."""
    import keras_hub

    x = keras.layers.Embedding(VOCAB, 16, name="embed")(inputs["token_ids"])
    for i in range(2):
        x = keras_hub.layers.TransformerDecoder(
            intermediate_dim=32, num_heads=4, dropout=0.0, activation="gelu",
            normalize_first=True, name=f"transformer_layer_{i}")(
                x, decoder_padding_mask=inputs["padding_mask"])
    return x


def build_model(kind="llama"):
    inputs = {"token_ids": keras.Input((SEQ,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((SEQ,), dtype="int32", name="padding_mask")}
    hidden = decoders(inputs) if kind == "decoder" else backbone(kind)(inputs)
    outputs = keras.layers.Dense(OUT, name="head")(hidden)
    return keras.Model(inputs, outputs, name=f"tiny_{kind}")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    ids = rng.integers(1, VOCAB, size=(batch_size, SEQ)).astype("int32")
    lengths = rng.integers(SEQ // 2, SEQ + 1, size=(batch_size, 1))
    mask = (np.arange(SEQ)[None, :] < lengths).astype("int32")  # some padding at the end
    y = rng.normal(size=(batch_size, SEQ, OUT)).astype("float32")
    return {"token_ids": ids * mask, "padding_mask": mask}, y
