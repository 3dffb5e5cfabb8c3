"""``module.path:function[:key=value,...]`` specs: import user code and build its model on the meta device.

The module is imported with the current directory first on ``sys.path`` (as ``python -m`` would), and the
function is called with the target device as torch's default device (``with torch.device("meta")``, restored
on exit), so an 8.6B-parameter model costs no memory. It returns ``(model, example_inputs)``: an ``nn.Module``
and a tensor or a tuple of tensors, on meta or CPU; tensors are moved to the target device.

Keyword arguments: ``batch`` and ``seq`` when the function accepts them, and every ``key=value`` of the spec
(ints, floats, ``true`` / ``false``, else strings). ``heads`` and ``kv_heads`` are also kept as hints for
dimensions the graph cannot show (an attention written with matmul + softmax), and are passed only if the
function accepts them. When the function takes no ``batch``, tensors whose dim 0 is the batch of the first
input are resized along dim 0 to the requested batch (meta tensors: free); likewise dim 1 of 2-D integer (token)
inputs to a requested ``seq``. Every failure is a ``ConfigError`` (the spec is wrong) or an
``UnsupportedModelError`` (the user code fails), naming the module, function or line and the fix.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from costmodel.errors import ConfigError, UnsupportedModelError

log = logging.getLogger(__name__)

DIM_HINTS = ("heads", "kv_heads")
"""Spec keys the planner reads as model dimensions (also passed to the function when it accepts them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UserSpec:
    """A parsed ``module.path:function[:key=value,...]`` spec."""

    module: str
    function: str
    options: MappingProxyType


@dataclass(frozen=True, kw_only=True, slots=True)
class UserModel:
    """What the user function built, on the target device."""

    model: Any
    example_inputs: tuple
    hints: MappingProxyType
    """``heads`` / ``kv_heads`` given in the spec (ints), for ``planner.dims``."""


def looks_like_user_spec(spec: str) -> bool:
    mod, _, rest = spec.partition(":")
    fn = rest.partition(":")[0]
    return bool(mod) and bool(fn) and all(p.isidentifier() for p in mod.split(".")) and fn.isidentifier()


def parse_user_spec(spec: str) -> UserSpec:
    mod, _, rest = spec.partition(":")
    fn, _, body = rest.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ConfigError(f"model spec {spec!r}: option {item!r} is not key=value "
                              f"(form: module.path:function:key=value,key=value)")
        options[key] = _parse_value(raw.strip())
    for key in DIM_HINTS:
        if key in options and (isinstance(options[key], bool) or not isinstance(options[key], int)
                               or options[key] < 1):
            raise ConfigError(f"model spec {spec!r}: {key}={options[key]!r} must be a positive integer")
    return UserSpec(module=mod, function=fn, options=MappingProxyType(options))


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def build_user_model(spec: str, *, batch: int, seq: int | None, device: str) -> UserModel:
    """Import, call and check the user function ``spec`` names (see the module docstring)."""
    parsed = parse_user_spec(spec)
    dev = _device(device)
    with _cwd_on_path():
        fn = _function(spec, parsed)
        kwargs = _kwargs(spec, fn, parsed, batch=batch, seq=seq)
        result = _call(spec, fn, kwargs, dev)
    model, inputs = _check_result(spec, result)
    if any(p.device != dev for p in model.parameters()) or any(b.device != dev for b in model.buffers()):
        log.info("%s: moving the model its function built to %s", spec, dev)
        model = model.to(dev)
    inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(dev), inputs)
    if "batch" not in kwargs:
        first = next((t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        inputs = _resize(spec, inputs, first, dim=0, size=batch, what="batch")
    if seq is not None and "seq" not in kwargs:
        inputs = _resize_tokens(spec, inputs, seq)
    hints = {k: parsed.options[k] for k in DIM_HINTS if k in parsed.options}
    return UserModel(model=model, example_inputs=inputs, hints=MappingProxyType(hints))


def _device(device: str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a torch device ({e}); use 'meta' or 'cpu'") from None


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    """The current directory first on ``sys.path`` while the user module is imported and called."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _function(spec: str, parsed: UserSpec) -> Callable:
    mod = _import(spec, parsed.module)
    fn = getattr(mod, parsed.function, None)
    if not callable(fn):
        funcs = sorted(n for n, v in vars(mod).items() if inspect.isfunction(v) and not n.startswith("_")
                       and v.__module__ == mod.__name__)
        raise ConfigError(
            f"model spec {spec!r}: module {parsed.module!r} ({getattr(mod, '__file__', '?')}) has no function "
            f"{parsed.function!r}; its functions: {', '.join(funcs) or 'none'}"
        )
    return fn


def _import(spec: str, name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            rel = Path(*name.split("."))
            raise ConfigError(
                f"model spec {spec!r}: no module {name!r}: looked for {rel}.py or {rel}/__init__.py in the current "
                f"directory {os.getcwd()} and on sys.path; run from the directory that holds it or add that "
                "directory to PYTHONPATH"
            ) from None
        raise UnsupportedModelError(f"model spec {spec!r}: importing {name!r} failed{_where(e)}: {e}; install "
                                    f"{e.name!r} or fix the import") from None
    except Exception as e:  # noqa: BLE001 - any error while importing user code becomes one typed error
        raise UnsupportedModelError(f"model spec {spec!r}: importing {name!r} raised "
                                    f"{type(e).__name__}{_where(e)}: {e}") from None


def _where(exc: BaseException) -> str:
    """`` at file:line (code)`` of the innermost frame outside torch and autopar."""
    here = str(Path(__file__).parent)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and not f.filename.startswith(here) and "importlib" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} ({(f.line or '').strip()})"


def _kwargs(spec: str, fn: Callable, parsed: UserSpec, *, batch: int, seq: int | None) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepts = lambda k: takes_any or (k in params and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY)  # noqa: E731
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None and accepts(k)}
    for key, value in parsed.options.items():
        if accepts(key):
            kwargs[key] = value
        elif key not in DIM_HINTS:
            names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            raise ConfigError(f"model spec {spec!r}: {parsed.function}() takes no argument {key!r}; "
                              f"its arguments: {', '.join(names) or 'none'}")
    return kwargs


def _call(spec: str, fn: Callable, kwargs: dict[str, Any], dev: torch.device) -> Any:
    try:
        with dev:  # the default device for every tensor the function creates (restored on exit)
            return fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - any error in user code becomes one typed error
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UnsupportedModelError(
            f"model spec {spec!r}: {getattr(fn, '__name__', 'the function')}({args}) raised "
            f"{type(e).__name__}{_where(e)}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        ) from None


def _check_result(spec: str, result: Any) -> tuple[Any, tuple]:
    form = "return (model, example_inputs): an nn.Module and a tensor or a tuple of tensors"
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = f"a {type(result).__name__} of {len(result)}" if isinstance(result, (tuple, list)) \
            else f"a {type(result).__name__}"
        raise ConfigError(f"model spec {spec!r}: the function returned {got}; it must {form}")
    model, inputs = result
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model spec {spec!r}: the model it returned is a {type(model).__name__}, not an "
                          f"nn.Module; it must {form}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not any(isinstance(x, torch.Tensor)
                                                         for x in pytree.tree_leaves(tuple(inputs))):
        raise ConfigError(f"model spec {spec!r}: example_inputs is a {type(inputs).__name__} holding no tensor; "
                          f"it must {form}")
    return model, tuple(inputs)


def _resize(spec: str, inputs: tuple, ref: torch.Tensor | None, *, dim: int, size: int, what: str) -> tuple:
    """Tensors sharing ``ref``'s size along ``dim`` get ``size`` there (new_zeros: free on meta)."""
    if ref is None or ref.shape[dim] == size:
        return inputs
    old = ref.shape[dim]
    log.info("%s: example inputs resized from %s %d to %d along dim %d (the function takes no %r)",
             spec, what, old, size, dim, what)

    def fix(t: torch.Tensor) -> torch.Tensor:
        if t.dim() <= dim or t.shape[dim] != old:
            return t
        shape = list(t.shape)
        shape[dim] = size
        return t.new_zeros(shape)

    return pytree.tree_map_only(torch.Tensor, fix, inputs)


def _resize_tokens(spec: str, inputs: tuple, seq: int) -> tuple:
    tokens = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() == 2
              and not t.dtype.is_floating_point]
    if not tokens:
        log.warning("%s: seq=%d ignored: the function takes no 'seq' argument and has no (batch, seq) token input",
                    spec, seq)
        return inputs
    return _resize(spec, inputs, tokens[0], dim=1, size=seq, what="seq")
