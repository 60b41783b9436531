"""Helpers that validate JSON documents as they are turned back into dataclasses.

Used by every ``from_dict`` along the pipeline (ModelProfile, ClusterSpec, Plan),
so that a hand-edited or stale file fails with a message naming the field, the
value received and the value expected, instead of a KeyError deep in the planner.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, TypeVar

from tfplan.core.errors import SchemaError

SCHEMA_VERSION = 1
T = TypeVar("T")


def check_version(doc: Mapping[str, Any], kind: str) -> None:
    """Raise SchemaError unless ``doc`` is a mapping of ``kind`` at SCHEMA_VERSION."""
    if not isinstance(doc, Mapping):
        raise SchemaError(f"{kind}: expected a JSON object, received {type(doc).__name__}.")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(
            f"{kind}: schema_version is {version!r}, this version of the tool reads "
            f"schema_version {SCHEMA_VERSION}. Regenerate the file with this version "
            "(e.g. run `plan analyze` again)."
        )


def field(doc: Mapping[str, Any], key: str, kind: str, types: type | tuple[type, ...],
          *, where: str = "", minimum: float | None = None, optional: bool = False,
          default: Any = None) -> Any:
    """Return ``doc[key]`` checked against ``types`` (and ``minimum`` for numbers)."""
    path = f"{kind}{'.' + where if where else ''}.{key}"
    if not isinstance(doc, Mapping):
        raise SchemaError(f"{kind}{'.' + where if where else ''} is {doc!r:.60} "
                          f"({type(doc).__name__}); expected a JSON object with {key!r}.")
    if key not in doc:
        if optional:
            return default
        raise SchemaError(f"{path} is missing. Expected a value of type {_names(types)}.")
    value = doc[key]
    # bool is a subclass of int: refuse it where a number is expected.
    if isinstance(value, bool) and bool not in _as_tuple(types):
        raise SchemaError(f"{path} is {value!r}; expected {_names(types)}.")
    if int in _as_tuple(types) and float not in _as_tuple(types) and isinstance(value, float) \
            and value.is_integer():
        value = int(value)
    if float in _as_tuple(types) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, types):
        raise SchemaError(f"{path} is {value!r} ({type(value).__name__}); expected {_names(types)}.")
    if minimum is not None and value < minimum:
        raise SchemaError(f"{path} is {value!r}; expected a value >= {minimum}.")
    return value


def decode(from_dict: Callable[[Any], T], doc: Any, what: str) -> T:
    """``from_dict(doc)``, with any error a malformed document causes inside it (a value
    of the wrong type deep in a list, say) turned into a SchemaError naming ``what``:
    the boundary between a file's contents and the pipeline's dataclasses."""
    try:
        return from_dict(doc)
    except SchemaError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise SchemaError(f"{what} is malformed ({type(e).__name__}: {e}). Regenerate it with "
                          "this version of the tool (e.g. run `plan analyze` again).") from e


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))
