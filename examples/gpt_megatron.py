"""Example model file: a GPT as in Megatron-LM's weak-scaling table (Narayanan et al., SC'21).

``build_model()`` builds ``gpt(...)`` with the sizes in the environment variables
GPT_LAYERS, GPT_HIDDEN, GPT_HEADS, GPT_VOCAB (51200) and GPT_SEQ (2048); the
defaults are the table's smallest row (1.7B: 24 layers, hidden 2304, 24 heads).
The layers are stock Keras (Embedding, LayerNormalization, MultiHeadAttention,
Dense), built by ``benchmarks/profile_gpt.build_gpt`` (one definition for both).

Try:  GPT_LAYERS=2 plan profile examples/gpt_megatron.py --precision mixed_float16
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.profile_gpt import build_gpt  # noqa: E402

optimizer = "adam"


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048):
    """A pre-norm GPT of ``layers`` blocks (see ``benchmarks/profile_gpt.py``)."""
    return build_gpt(layers, hidden, heads, vocab, seq)


def build_model():
    env = os.environ.get
    return gpt(int(env("GPT_LAYERS", 24)), int(env("GPT_HIDDEN", 2304)),
               int(env("GPT_HEADS", 24)), int(env("GPT_VOCAB", 51200)),
               int(env("GPT_SEQ", 2048)))
