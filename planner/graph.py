"""The model's layer graph, as the planner sees it (networkx).

Pipeline position: built from a ModelProfile by ``planner.search`` before any
split is priced; the pipeline ILP relies on ``topological_layers`` being a
topological order of this graph.

Nodes are the profiled layers (attribute ``profile``: the LayerProfile), edges
the profile's tensors between layers (attribute ``bytes``, for the profile
batch). An edge whose source is not a profiled layer carries a model input
(see ``input_edges``); an edge into a name that is not a profiled layer (a model
output) has nothing on its far side to place and is left out of the graph.
"""
from __future__ import annotations

import networkx as nx

from tfplan.core.errors import SchemaError
from tfplan.profiler.model_profile import Edge, ModelProfile


def layer_graph(profile: ModelProfile) -> nx.DiGraph:
    """A DiGraph of the profiled layers and the tensors between them."""
    names = [layer.name for layer in profile.layers]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise SchemaError(
                f"Profile of {profile.model_name!r} lists layer {name!r} twice; layer names must "
                "be unique. Re-run `plan profile` (Keras names layers uniquely).")
        seen.add(name)
    graph = nx.DiGraph()
    for layer in profile.layers:
        graph.add_node(layer.name, profile=layer)
    for edge in profile.edges:
        if edge.src not in seen or edge.dst not in seen:
            continue
        if edge.src == edge.dst:
            raise SchemaError(f"Profile of {profile.model_name!r} has an edge from layer "
                              f"{edge.src!r} to itself; a layer cannot feed itself.")
        if graph.has_edge(edge.src, edge.dst):  # several tensors between the same pair
            graph.edges[edge.src, edge.dst]["bytes"] += edge.bytes
        else:
            graph.add_edge(edge.src, edge.dst, bytes=edge.bytes)
    return graph


def pipeline_units(profile: ModelProfile) -> tuple[tuple[int, int], ...]:
    """[start, stop) of each unit a pipeline stage boundary may not cut, in profile order:
    a block (``LayerProfile.block``: a custom layer with sub-layers, e.g. a transformer
    block) with all its entries, or one top-level layer. A block's entries exchange
    tensors both ways (its own code reads its sub-layers' outputs and feeds others), so
    only whole blocks are placed on stages (``apply`` places a block whole)."""
    units: list[tuple[int, int]] = []
    for i, layer in enumerate(profile.layers):
        if layer.block and units and profile.layers[units[-1][0]].block == layer.block:
            units[-1] = (units[-1][0], i + 1)
        else:
            units.append((i, i + 1))
    return tuple(units)


def _unit_graph(profile: ModelProfile) -> nx.DiGraph:
    """``layer_graph`` with each block contracted to its first entry (edges inside a block
    dropped): the graph whose order matters for pipeline stages."""
    graph = layer_graph(profile)
    head = {}
    for start, stop in pipeline_units(profile):
        for layer in profile.layers[start:stop]:
            head[layer.name] = profile.layers[start].name
    out = nx.DiGraph()
    out.add_nodes_from(dict.fromkeys(head.values()))
    for u, v in graph.edges:
        if head[u] != head[v]:
            out.add_edge(head[u], head[v])
    return out


def topological_layers(profile: ModelProfile) -> tuple[str, ...]:
    """The profile's own layer order, checked to be a topological order of its graph
    (a block's entries, which feed each other both ways, taken as one node).

    Raises SchemaError naming the first edge that points backwards (or the cycle).
    """
    graph = _unit_graph(profile)
    order = tuple(layer.name for layer in profile.layers)
    position = {name: i for i, name in enumerate(order)}
    if not nx.is_directed_acyclic_graph(graph):
        cycle = " -> ".join(u for u, _ in nx.find_cycle(graph))
        raise SchemaError(f"Profile of {profile.model_name!r} has a cycle among its layers "
                          f"({cycle}); a layer graph must be acyclic.")
    for u, v in sorted(graph.edges, key=lambda e: (position[e[1]], position[e[0]])):
        if position[u] > position[v]:
            raise SchemaError(
                f"Profile of {profile.model_name!r} lists layer {v!r} (position {position[v]}) "
                f"before layer {u!r} (position {position[u]}), which feeds it; the layer order "
                "must be topological. Re-run `plan profile`, which writes layers in Keras's "
                "topological order.")
    return order


def input_edges(profile: ModelProfile) -> tuple[Edge, ...]:
    """Edges that carry a model input (their source is not a profiled layer)."""
    names = {layer.name for layer in profile.layers}
    return tuple(e for e in profile.edges if e.src not in names and e.dst in names)
