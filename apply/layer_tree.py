"""Where a layer sits among its parent's attributes, and the name scopes it was built in.

Pipeline position: the bottom of ``apply``'s layer surgery, shared by ``apply.blocks``
(which swaps sharded twins in place inside blocks) and ``apply.sharded_attention_block``
(which replaces a whole attention block by its split twin); imports nothing of apply.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tfplan.profiler.signature import SEPARATOR

Step = tuple  # ("layer", name) in a model; ("attr", name) or ("item", name, key) in a block


def references(parent: Any, child: Any) -> list[Step]:
    """Every attribute of ``parent`` (and entry of an attribute's list or dict) that is
    ``child``, attributes first."""
    out: list[Step] = []
    items: list[Step] = []
    for key, value in vars(parent).items():
        if value is child:
            out.append(("attr", key))
        elif isinstance(value, (list, tuple)):
            items += [("item", key, i) for i, v in enumerate(value) if v is child]
        elif isinstance(value, dict):
            items += [("item", key, k) for k, v in value.items() if v is child]
    return out + items


@contextlib.contextmanager
def scopes_of(layer: Any) -> Iterator[None]:
    """The name scopes ``layer`` was built in (its path but its own name), so that a twin
    built here names its variables ``block/sub/kernel_0`` as the unsplit one's
    ``block/sub/kernel``."""
    import keras

    with contextlib.ExitStack() as stack:
        for part in (getattr(layer, "path", None) or "").split(SEPARATOR)[:-1]:
            if part:
                stack.enter_context(keras.name_scope(part))
        yield
