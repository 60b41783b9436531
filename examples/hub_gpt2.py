"""A keras_hub GPT-2 backbone with a language-model head, random weights (nothing is
downloaded): ``plan analyze examples/hub_gpt2.py --cluster cpu:4 --global-batch 8
--input-shape '*=64'`` plans it, ``examples/train.py`` trains it with the plan.

Needs ``pip install 'tf-parallel-planner[hub]'``. The backbone's inputs (``token_ids``,
``padding_mask``) have a dynamic sequence length; the plan is made for the length given
with ``--input-shape`` (or, without it, the length ``sample_batch`` makes), and
``apply`` refuses batches of another length. Sizes: ``HUB_GPT2_*`` environment variables.
"""
import os

import keras
import keras_hub
import numpy as np

VOCAB = int(os.environ.get("HUB_GPT2_VOCAB", 512))
LAYERS = int(os.environ.get("HUB_GPT2_LAYERS", 4))
HEADS = int(os.environ.get("HUB_GPT2_HEADS", 4))
HIDDEN = int(os.environ.get("HUB_GPT2_HIDDEN", 128))
SEQ = int(os.environ.get("HUB_GPT2_SEQ", 64))

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(learning_rate=1e-3)


def build_model():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, hidden_dim=HIDDEN,
        intermediate_dim=4 * HIDDEN, max_sequence_length=max(SEQ, 64), dropout=0.0)
    logits = keras.layers.Dense(VOCAB, name="lm_head")(backbone.output)
    return keras.Model(backbone.input, logits, name="hub_gpt2")


def sample_batch(batch_size):
    """Next-token prediction on random token sequences of SEQ tokens."""
    rng = np.random.default_rng(batch_size)
    tokens = rng.integers(0, VOCAB, size=(batch_size, SEQ + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((batch_size, SEQ), "int32")}
    return x, tokens[:, 1:]
