"""GroupQueryAttention split by heads on the SPMD engine
(apply.spmd.rank_layers.RankGroupQueryAttention): rank t holds num_query_heads/tp query
heads and num_key_value_heads/tp key/value heads, trains like one device, reads and writes
the unsplit layer's weights, returns every head's attention scores, and a tp that does not
divide the key/value heads is refused. The tiny Llama block (tests/apply/tiny_llama.py)
with sequence parallelism too: tests/apply/spmd/test_sequence.py."""
from __future__ import annotations

import keras
import numpy as np
import pytest

from tfplan import apply
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.spmd.rank_layers import RankGroupQueryAttention
from tfplan.core.errors import PlannerError
from tests.apply import helpers
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, step_losses, tp_plan)
from tests.apply.test_tensor_parallel import _short

pytestmark = pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")

SPLITS = (("embed", "vocab"), ("attention", "heads"), ("mlp_gate", "column"),
          ("mlp_up", "column"), ("mlp_down", "row"), ("logits", "column"))
STEPS = 10


def test_tp2_trains_like_one_device_with_heads_on_their_ranks():
    module, model = base_model("tiny_llama")
    plan = tp_plan(model, [cpus(2, 3)], SPLITS)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    # 4 query heads over 2 key/value heads: 2 query heads and 1 key/value head per rank
    for copy, device in zip(wrapped.device_models, cpus(2, 3)):
        attention = copy.get_layer("attention")
        assert isinstance(attention, RankGroupQueryAttention)
        assert (attention.num_query_heads, attention.num_key_value_heads) == (2, 1)
        kernels = [tuple(w.shape) for w in attention.weights if w.path.endswith("kernel")]
        assert kernels == [(16, 2, 4), (16, 1, 4), (16, 1, 4), (2, 4, 16)]
        assert {_short(w.value.device) for w in attention.weights} == {device}
    for got, want in zip(wrapped.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)  # read back unsplit
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    x, _ = batches[0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches), helpers.reference_losses("tiny_llama",
                                                                                STEPS))
    helpers.assert_state_where_planned(wrapped, plan)


def test_weights_saved_unsplit(tmp_path):
    module, model = base_model("tiny_llama")
    wrapped = apply.wrap(model, tp_plan(model, [cpus(0, 1)], SPLITS))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, 2, GLOBAL_BATCH)
    step_losses(wrapped, batches)
    x = batches[0][0]
    path = str(tmp_path / "gqa.weights.h5")
    wrapped.save_weights(path)
    plain = keras.models.clone_model(model)
    plain.load_weights(path)  # the unsplit layer reads the trained shards
    np.testing.assert_allclose(plain.predict_on_batch(x), wrapped.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
    plain_path = str(tmp_path / "plain.weights.h5")
    model.save_weights(plain_path)
    again = apply.wrap(model, tp_plan(model, [cpus(0, 1)], SPLITS))
    again.load_weights(path)
    np.testing.assert_allclose(again.predict_on_batch(x), plain.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
    again.load_weights(plain_path)  # the user's file, back to the start
    np.testing.assert_allclose(again.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
    saved = str(tmp_path / "gqa.keras")
    wrapped.save(saved)
    loaded = keras.models.load_model(saved, compile=False)
    assert type(loaded.get_layer("attention")) is keras.layers.GroupQueryAttention
    np.testing.assert_allclose(loaded.predict_on_batch(x), wrapped.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tp", [3, 4])
def test_tp_that_does_not_divide_the_kv_heads_is_refused(tp):
    _, model = base_model("tiny_llama")  # 2 key/value heads
    plan = tp_plan(model, [cpus(*range(tp))], (("attention", "heads"),), cluster_size=tp * 2)
    with pytest.raises(PlannerError, match=r"'attention' \(4 query heads, 2 key/value heads\)"
                                           rf".*tp = {tp}.*tp must divide num_key_value_heads"
                                           r" = 2.*tp in \[1, 2\]"):
        apply.wrap(model, plan)


@pytest.mark.parametrize("scores", [False, True])
def test_padding_mask_and_attention_scores_match_the_unsplit_layer(scores):
    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(6,), dtype="int32")
    x = keras.layers.Embedding(10, 8, mask_zero=True, name="embed")(ids)
    layer = keras.layers.GroupQueryAttention(4, 4, 2, name="attention")
    outputs = layer(x, x, return_attention_scores=scores, use_causal_mask=True)
    model = keras.Model(ids, outputs)
    plan = tp_plan(model, [cpus(0, 1)], (("attention", "heads"),))
    wrapped = apply.wrap(model, plan)
    x = np.array([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]], dtype="int32")
    got, want = wrapped.predict_on_batch(x), model.predict_on_batch(x)
    for g, w in zip(got if scores else [got], want if scores else [want]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
