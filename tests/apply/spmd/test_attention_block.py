"""``apply.spmd.attention_block``'s projections: what each rank keeps of a projection's
weights (its heads), read back by ``rank_axes`` as the axes the unsplit weights are cut
along. Whole blocks (keras_hub Llama, Gemma; a user's that mixes heads, refused) train in
``tests/apply/test_blocks.py``."""
from __future__ import annotations

from tfplan.apply.groups import Group, group_key
from tfplan.apply.spmd.rank_layers import Rank, RankHeadsProjection
from tests.apply.helpers import cpus


def _rank() -> Rank:
    devices = tuple(cpus(0, 1))
    return Rank("heads", Group("tp", devices, group_key(devices)), devices[0])


def test_an_input_projection_keeps_its_heads_of_kernel_and_bias():
    """Keras' bias spans the output's axes from its first bias axis on: with bias_axes
    "hu" it is [heads, head_dim], so the heads axis is the bias's first."""
    twin = RankHeadsProjection(_rank(), "input", 1, equation="bqm,muh->bquh",
                               output_shape=(None, 4, 2), bias_axes="hu")
    twin.build((None, 3, 8))
    assert tuple(twin.kernel.shape) == (8, 2, 2) and tuple(twin.bias.shape) == (2, 2)
    assert twin.rank_axes() == [1, 0]
    head_dim_bias = RankHeadsProjection(_rank(), "input", 1, equation="bqm,muh->bquh",
                                        output_shape=(None, 4, 2), bias_axes="h")
    head_dim_bias.build((None, 3, 8))
    assert head_dim_bias.rank_axes() == [1, None]  # one bias per head_dim: whole


def test_the_output_projection_contracts_its_heads_and_adds_the_whole_bias_once():
    twin = RankHeadsProjection(_rank(), "output", 0, equation="bquh,uhm->bqm",
                               output_shape=(None, 8), bias_axes="m")
    twin.build((None, 3, 4, 2))
    assert tuple(twin.kernel.shape) == (2, 2, 8) and twin.bias is None
    assert tuple(twin.row_bias.shape) == (8,)
    assert twin.rank_axes() == [0, None]
