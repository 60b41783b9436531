"""Loading the user's model: a ``.py`` file defining ``build_model()``, or ``module:function``.

Pipeline position: the very first step. ``plan analyze model.py`` (and the
profiler's ``profile_source``) turn a spec string into a ``ModelSource`` here,
then ``build`` makes the keras.Model that ``profiler.static`` measures. Every
failure is a ``ModelLoadError`` whose message shows the user's own traceback
(our loader and importlib frames removed).

A model file may define, besides ``build_model()``:

* ``loss``: anything ``model.compile(loss=...)`` accepts;
* ``optimizer``: an optimizer name, a Keras optimizer, or a no-argument factory;
* ``sample_batch(batch_size) -> (x, y)``: a deterministic batch of data.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from tfplan.core.errors import ModelLoadError

_SPEC_HELP = ("a path to a .py file defining build_model() (optionally FILE.py:FUNCTION), "
              "or MODULE:FUNCTION such as keras.applications:MobileNetV2")
_counter = itertools.count()


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from and how to build it.

    ``build_model`` is a checked wrapper around the user's function: it puts the
    file's folder on ``sys.path``, turns exceptions into ``ModelLoadError`` with
    the user's traceback, and checks that a ``keras.Model`` comes back.
    """

    name: str
    build_model: Callable[[], Any]
    loss: Any | None
    optimizer: Any | None
    sample_batch: Callable[[int], tuple] | None
    origin: str


# --- tracebacks ----------------------------------------------------------------------
def _is_ours(filename: str) -> bool:
    return (os.path.abspath(filename) == os.path.abspath(__file__)
            or filename.startswith("<frozen importlib"))


def user_traceback(exc: BaseException) -> str:
    """``exc`` formatted as Python would, minus the leading loader/importlib frames."""
    tb = exc.__traceback__
    while tb is not None and _is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


#: The import packages of tf-parallel-planner 0.1, now under ``tfplan``.
OLD_PACKAGES = ("apply", "planner", "profiler", "reports")
#: 0.1 modules that moved elsewhere than ``tfplan.<old name>``.
MOVED_MODULES = {**{f"planner.{m}": f"tfplan.core.{m}"
                    for m in ("errors", "schema", "units", "cluster", "presets")},
                 "planner.cli": "tfplan.cli"}


def renamed_module_hint(exc: BaseException) -> str | None:
    """What to write instead, when ``exc`` is a failed import of a 0.1 package name.

    tf-parallel-planner 0.1 installed ``apply``, ``planner``, ``profiler`` and
    ``reports`` as top-level packages; 0.2 installs them under ``tfplan`` only.
    """
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    if top not in OLD_PACKAGES:
        return None
    old = _imported_module(exc) or exc.name
    if old.split(".")[0] != top:
        old = exc.name
    new = MOVED_MODULES.get(old, f"tfplan.{old}")
    return (f"If '{old}' means tf-parallel-planner's module: since version 0.2 it is "
            f"'{new}'. Write `from tfplan import {top}` instead of `import {top}`, and "
            f"`from {new} import ...` instead of `from {old} import ...`.")


def _imported_module(exc: BaseException) -> str | None:
    """The dotted module name in the import statement that raised ``exc``, if readable."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        match = re.match(r"\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))",
                         frame.line or "")
        if match:
            return match.group(1) or match.group(2)
    return None


def _failure(what: str, exc: BaseException, fix: str) -> ModelLoadError:
    hint = renamed_module_hint(exc)
    fix = f"{hint} {fix}" if hint else fix
    return ModelLoadError(
        f"{what} raised {type(exc).__name__}: {exc}. {fix}\n\n{user_traceback(exc)}")


@contextlib.contextmanager
def _on_sys_path(folder: str | None) -> Iterator[None]:
    """Put ``folder`` first on ``sys.path`` for the duration (sibling imports work)."""
    if folder is None or folder in sys.path:
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


# --- the checked build_model wrapper ------------------------------------------------------
def _checked_builder(fn: Callable[..., Any], kwargs: dict[str, Any], label: str,
                     folder: str | None) -> Callable[[], Any]:
    def build_model() -> Any:
        import keras

        with _on_sys_path(folder):
            try:
                model = fn(**kwargs)
            except Exception as exc:
                raise _failure(f"{label}", exc,
                               "Fix the error shown in the traceback below and try again.") from exc
        if not isinstance(model, keras.Model):
            raise ModelLoadError(
                f"{label} returned {type(model).__module__}.{type(model).__qualname__}, "
                "expected a keras.Model (Functional, Sequential or a Model subclass). "
                "Make it return the model object itself, not e.g. its layers, a tuple or "
                "a tf.Module.")
        return model

    build_model.__name__ = getattr(fn, "__name__", "build_model")
    build_model.__doc__ = f"Calls {label} (checked: must return a keras.Model)."
    return build_model


# --- loading ----------------------------------------------------------------------------
def load_model_source(spec: str) -> ModelSource:
    """Load ``spec``: ``path/to/model.py`` [``:function``] or ``module:function``.

    Nothing is built yet (see ``build``). A ``module:function`` whose signature
    has a ``weights`` parameter is called with ``weights=None`` so nothing downloads.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"Model spec {spec!r} is empty; expected {_SPEC_HELP}.")
    spec = spec.strip()
    path, _, func = spec.rpartition(":") if ".py:" in spec else (spec, "", "")
    if path.endswith(".py") or os.path.exists(path):
        return _load_file(path, func or "build_model", spec)
    if ":" in spec:
        return _load_module_function(spec)
    raise ModelLoadError(
        f"Model file {os.path.abspath(spec)} does not exist, and {spec!r} is not of the form "
        f"MODULE:FUNCTION. Expected {_SPEC_HELP}.")


def _load_file(path: str, func_name: str, spec: str) -> ModelSource:
    abspath = os.path.abspath(path)
    if not os.path.isfile(abspath):
        raise ModelLoadError(
            f"Model file {abspath} does not exist (or is not a file). Expected {_SPEC_HELP}; "
            "check the path and the current directory.")
    if not abspath.endswith(".py"):
        raise ModelLoadError(
            f"Model file {abspath} is not a .py file. Expected {_SPEC_HELP}.")
    stem = os.path.splitext(os.path.basename(abspath))[0]
    module_name = f"_plan_model_{''.join(c if c.isalnum() else '_' for c in stem)}_{next(_counter)}"
    folder = os.path.dirname(abspath)
    module_spec = importlib.util.spec_from_file_location(module_name, abspath)
    if module_spec is None or module_spec.loader is None:
        raise ModelLoadError(f"Python cannot import {abspath} as a module. Expected {_SPEC_HELP}.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses, pickle and typing look modules up here
    with _on_sys_path(folder):
        try:
            module_spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(module_name, None)
            if not isinstance(exc, Exception):
                raise
            raise _failure(f"Importing model file {abspath}", exc,
                           "Fix the error shown in the traceback below (it starts in your "
                           "file) and try again.") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module_name)
        listed = ", ".join(defined) if defined else "none"
        raise ModelLoadError(
            f"Model file {abspath} defines no function {func_name}(). Expected a function "
            f"{func_name}() that returns a keras.Model. Callables the file defines: {listed}. "
            f"Rename your model-building function to {func_name}, or name it in the spec "
            f"as {path}:FUNCTION.")
    sample_batch = getattr(module, "sample_batch", None)
    if sample_batch is not None and not callable(sample_batch):
        raise ModelLoadError(
            f"Model file {abspath} defines sample_batch as a {type(sample_batch).__name__}; "
            "expected a function sample_batch(batch_size) returning (x, y). Make it a "
            "function or remove it.")
    return ModelSource(
        name=stem if func_name == "build_model" else f"{stem}:{func_name}",
        build_model=_checked_builder(fn, {}, f"{func_name}() in {abspath}", folder),
        loss=getattr(module, "loss", None), optimizer=getattr(module, "optimizer", None),
        sample_batch=sample_batch, origin=spec)


def _load_module_function(spec: str) -> ModelSource:
    module_name, _, func_name = spec.rpartition(":")
    if not module_name or not func_name:
        raise ModelLoadError(f"Model spec {spec!r} is incomplete; expected {_SPEC_HELP}.")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ModelLoadError(
            f"Could not import module '{module_name}' from spec {spec!r}: {exc}. Expected "
            f"{_SPEC_HELP}; check the spelling, install the package, or pass a .py file path."
        ) from exc
    except Exception as exc:
        raise _failure(f"Importing module '{module_name}'", exc,
                       "Fix the error shown in the traceback below and try again.") from exc
    fn = getattr(module, func_name, None)
    if fn is None or not callable(fn):
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(func_name, names, n=5)
        hint = f" Close names: {', '.join(close)}." if close else ""
        what = "has no attribute" if fn is None else "has a non-callable attribute"
        raise ModelLoadError(
            f"Module '{module_name}' {what} '{func_name}' (spec {spec!r}); expected a "
            f"function returning a keras.Model.{hint}")
    kwargs: dict[str, Any] = {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: call it bare
        params = {}
    if "weights" in params:
        kwargs["weights"] = None
    required = [n for n, p in params.items()
                if n != "weights" and p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ModelLoadError(
            f"{spec} needs arguments ({', '.join(required)}), but MODULE:FUNCTION is called "
            "with none. Write a model file whose build_model() calls it with the arguments "
            "you want, and pass that file instead.")
    return ModelSource(
        name=func_name, build_model=_checked_builder(fn, kwargs, spec, None),
        loss=None, optimizer=None, sample_batch=None, origin=spec)


# --- building ---------------------------------------------------------------------------
def build(source: ModelSource) -> Any:
    """Call ``source.build_model()``; if the model is not built, build it on ``sample_batch(1)``.

    Runs in whatever graph/eager context the caller set (``profiler.static``
    builds inside ``tf.Graph().as_default()`` so no weights are allocated).
    """
    model = source.build_model()
    if model.built:
        return model
    if source.sample_batch is None:
        raise ModelLoadError(
            f"The model from {source.origin} is not built: its layers have no input shape, "
            "so its weights and sizes are unknown. Give the model a keras.Input (Functional) "
            "or an Input layer (Sequential), or define sample_batch(batch_size) returning "
            "(x, y) in the model file so it can be built by calling it once.")
    try:
        batch = source.sample_batch(1)
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        model(x)
    except Exception as exc:
        raise _failure(f"Building the model from {source.origin} by calling it on "
                       "sample_batch(1)[0]", exc,
                       "Make sample_batch(batch_size) return (x, y) with x matching the "
                       "model's input, or give the model a keras.Input.") from exc
    if not model.built:
        raise ModelLoadError(
            f"The model from {source.origin} is still not built after calling it on "
            "sample_batch(1)[0]. Give the model a keras.Input, or build its layers in "
            "build()/call().")
    return model
