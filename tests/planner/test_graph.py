"""planner.graph: the layer graph and its topological order."""
from __future__ import annotations

import pytest

from tfplan.core.errors import SchemaError
from tfplan.planner.graph import input_edges, layer_graph, topological_layers
from tfplan.profiler.model_profile import Edge, LayerProfile, ModelProfile


def _layer(name: str) -> LayerProfile:
    return LayerProfile(name=name, type="Dense", params=1, trainable_params=1, param_bytes=4,
                        grad_bytes=4, optimizer_bytes=8, activation_bytes=16, flops_fwd=2,
                        flops_bwd=4)


def _profile(names, edges) -> ModelProfile:
    return ModelProfile(model_name="g", batch_size=1, precision="float32", optimizer="adam",
                        optimizer_slots_per_param=2, layers=tuple(_layer(n) for n in names),
                        edges=tuple(Edge(*e) for e in edges))


RESIDUAL = _profile(["a", "b", "c", "add"], [("input_1", "a", 64), ("a", "b", 16),
                                            ("b", "c", 16), ("a", "add", 16), ("c", "add", 16),
                                            ("add", "output", 16)])


def test_graph_nodes_carry_profiles_and_edges_carry_bytes():
    g = layer_graph(RESIDUAL)
    assert list(g.nodes) == ["a", "b", "c", "add"]
    assert g.nodes["b"]["profile"].name == "b"
    assert set(g.edges) == {("a", "b"), ("b", "c"), ("a", "add"), ("c", "add")}
    assert g.edges["a", "add"]["bytes"] == 16
    assert input_edges(RESIDUAL) == (Edge("input_1", "a", 64),)


def test_parallel_edges_add_their_bytes():
    g = layer_graph(_profile(["a", "b"], [("a", "b", 10), ("a", "b", 6)]))
    assert g.edges["a", "b"]["bytes"] == 16


def test_topological_layers_is_the_profile_order():
    assert topological_layers(RESIDUAL) == ("a", "b", "c", "add")


def test_backward_edge_is_refused_with_both_names():
    bad = _profile(["a", "c", "b"], [("a", "b", 1), ("b", "c", 1)])
    with pytest.raises(SchemaError, match=r"'c'.*before layer 'b'.*topological"):
        topological_layers(bad)


def test_cycle_duplicate_and_self_loop_are_refused():
    with pytest.raises(SchemaError, match="cycle"):
        topological_layers(_profile(["a", "b"], [("a", "b", 1), ("b", "a", 1)]))
    with pytest.raises(SchemaError, match="twice"):
        layer_graph(_profile(["a", "a"], []))
    with pytest.raises(SchemaError, match="itself"):
        layer_graph(_profile(["a"], [("a", "a", 1)]))
