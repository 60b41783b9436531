"""A tiny model file around keras_hub's ``QwenMoeBackbone`` (a nested model: 1 decoder
block, hidden 16, 4 experts, top 2, a shared expert with its sigmoid gate, no router aux
loss, token ids and a padding mask of length ``SEQ``) with a Dense head per position, for
the expert-parallel tests: apply swaps each decoder's ``QwenSparseMoeBlock`` for its
routed expert-parallel twin (``apply.expert_parallel_qwen``). The batches are
``tiny_mixtral``'s (the same inputs and targets)."""
import keras

from tests.apply.tiny_mixtral import OUT, SEQ, VOCAB, WIDTH, sample_batch  # noqa: F401

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def build_model(router_aux_loss_coefficient=0.0, norm_top_k_prob=False, layers=1):
    import keras_hub

    backbone = keras_hub.models.QwenMoeBackbone(
        vocabulary_size=VOCAB, num_layers=layers, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=WIDTH, intermediate_dim=16, moe_intermediate_dim=8,
        shared_expert_intermediate_dim=8, num_experts=4, top_k=2,
        norm_top_k_prob=norm_top_k_prob,
        router_aux_loss_coefficient=router_aux_loss_coefficient, dropout=0.0, name="qwen")
    inputs = {"token_ids": keras.Input((SEQ,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((SEQ,), dtype="int32", name="padding_mask")}
    outputs = keras.layers.Dense(OUT, name="head")(backbone(inputs))
    return keras.Model(inputs, outputs, name="tiny_qwen_moe")

