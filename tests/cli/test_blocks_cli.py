"""``plan analyze`` on models with blocks: a layer the planner cannot see into is named in
the text and in ``--json`` (``opaque_blocks``), a tp that splits nothing says why, and a
keras_hub backbone's tensor-parallel plan splits the projections inside its blocks.

In-process (``tfplan.cli.main``), as tests/cli/test_input_shape_cli.py runs it.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from tests.cli.helpers import run

OPAQUE_FILE = textwrap.dedent("""
    import keras
    from keras import ops

    class OwnKernel(keras.layers.Layer):
        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], shape[-1]), name="kernel")

        def call(self, x):
            return ops.matmul(x, self.kernel)

    def build_model():
        x = keras.Input(shape=(16,), name="features")
        h = OwnKernel(name="mixer")(keras.layers.Dense(16, name="proj")(x))
        return keras.Model(x, keras.layers.Dense(2, name="head")(h))
""")
LLAMA_FILE = textwrap.dedent("""
    import keras_hub

    def build_model():
        return keras_hub.models.Llama3Backbone(
            vocabulary_size=256, num_layers=2, num_query_heads=8, num_key_value_heads=4,
            hidden_dim=1024, intermediate_dim=4096)
""")


def _file(tmp_path, text: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_layer_the_planner_cannot_see_into_is_named_in_text_and_json(tmp_path):
    model = _file(tmp_path, OPAQUE_FILE, "opaque.py")
    base = ["analyze", model, "--cluster", "cpu:2", "--global-batch", "8"]
    code, out, err = run(base + ["--out", str(tmp_path / "a")])
    assert code == 0, err
    assert "Not seen into (kept whole, replicated under tensor parallelism):" in out
    assert "mixer: custom layer OwnKernel multiplies weights it holds itself" in out
    code, out, err = run(base + ["--out", str(tmp_path / "b"), "--json", "--fix", "tp=2"])
    assert code == 0, err
    doc = json.loads(out)
    assert [b["layer"] for b in doc["opaque_blocks"]] == ["mixer"]
    assert "stays whole" in doc["opaque_blocks"][0]["why"]
    # tp=2 on a model this small splits nothing, and says so
    assert not doc["plan"].get("tp_splits")
    assert any(w.startswith("tp=2 splits no layer") for w in doc["warnings"])


def test_a_keras_hub_tensor_parallel_plan_splits_inside_the_blocks(tmp_path):
    """Megatron's pattern inside Llama's blocks: its attention (a custom layer) by heads as a
    whole -- projections and core -- and its MLP gate and up by columns, down by rows."""
    pytest.importorskip("keras_hub")
    model = _file(tmp_path, LLAMA_FILE, "llama.py")
    code, out, err = run(["analyze", model, "--cluster", "8xA100-80GB", "--global-batch", "64",
                          "--input-shape", "*=512", "--fix", "tp=2,dp=4", "--json",
                          "--out", str(tmp_path / "o")])
    assert code == 0, err
    splits = json.loads(out)["plan"]["tp_splits"]
    for i in range(2):
        block = f"transformer_layer_{i}"
        assert splits[f"{block}/self_attention"] == "heads"
        assert not any(n.startswith(f"{block}/self_attention/") for n in splits)
        assert splits[f"{block}/feedforward_gate_dense"] == "column"
        assert splits[f"{block}/feedforward_intermediate_dense"] == "column"
        assert splits[f"{block}/feedforward_output_dense"] == "row"
        assert block not in splits
