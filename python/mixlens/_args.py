"""Checks of the public functions' arguments: a wrong kind of argument raises a mixlens error naming it,
never a raw TypeError from deep inside, and is never taken by its truth value or coerced ("12" as layers
1 and 2, 1.5 as token 1)."""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Iterable
from typing import Any, Optional

import numpy as np

from .errors import InputError


class IndexInputError(InputError, IndexError):
    """An index past the end (a layer, a shard, a metric's position): an InputError, and an IndexError so
    that iteration and ``except IndexError`` work as for a list."""


def as_index(value: Any) -> int:
    """An integer argument as a Python int: ints, numpy integers and 0-d integer arrays / tensors
    (``argmax()``), through ``__index__``; TypeError for bools (of any kind), floats, arrays of more than
    one dimension and everything else."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("a bool is not an integer here")
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        if dtype == np.bool_ or dtype is getattr(sys.modules.get("torch"), "bool", None):
            raise TypeError("a bool is not an integer here")
        if getattr(value, "ndim", 0) != 0:  # torch takes any one-element tensor as an index
            raise TypeError("an array is not one integer")
    return operator.index(value)


def index_list(value: Any) -> list:
    """One integer (see as_index) or an iterable of them as a list of ints; TypeError for anything else (a
    string is not a list of digits)."""
    try:
        return [as_index(value)]
    except TypeError:
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise
        return [as_index(v) for v in value]


def index_slice(s: slice) -> slice:
    """A slice with integer bounds (see as_index) or None; TypeError for other bounds."""
    return slice(*(None if v is None else as_index(v) for v in (s.start, s.stop, s.step)))


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """`value` as an int in [lo, hi] (see as_index); else InputError naming the argument and the range."""
    try:
        v = as_index(value)
    except TypeError:
        raise InputError(f"{name} must be an integer in [{lo}, {hi}], got {value!r} ({type(value).__name__})") from None
    if not lo <= v <= hi:
        raise InputError(f"{name} = {v} is out of range: it must be in [{lo}, {hi}]")
    return v


def item_index(what: str, value: Any, n: int) -> int:
    """An index into n items (negative counts from the end) as 0..n-1: InputError for a wrong kind,
    IndexInputError past either end; `what` names the item ("prompt", "shard")."""
    try:
        i = as_index(value)
    except TypeError:
        raise InputError(f"{what} takes a {what} number, got {value!r} ({type(value).__name__})") from None
    if not -n <= i < n:
        raise IndexInputError(f"{what} {i} is out of range (there are {n} {what}s)")
    return i % n


def check_bool(name: str, value: Any) -> bool:
    """A flag argument: True / False (numpy bools too); InputError for anything else ("yes", 1, None), which
    would otherwise count by its truth value."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InputError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def check_float(name: str, value: Any) -> float:
    """A real-number argument (ints, floats, numpy and 0-d tensor numbers; not bools or text) as a float."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or getattr(value, "ndim", 0) != 0:
        raise InputError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {value!r} ({type(value).__name__})") from None


def check_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InputError(f"{name} must be a string, got {value!r} ({type(value).__name__})")
    return value


class ModelBase:
    """The base of the model class (mixlens._model.StandardizedTransformer): lets check_model, and the
    modules below _model that call it (mixlens._extract), recognise a model without importing _model."""

    __slots__ = ()


def check_model(name: str, value: Any) -> None:
    """A mixlens model argument (what mixlens.load returns); InputError naming `name` otherwise."""
    if not isinstance(value, ModelBase):
        raise InputError(f"{name} must be a mixlens model (mixlens.load(...)), got {type(value).__name__}")


def check_path(name: str, value: Any) -> str:
    """A file or folder argument: a str or os.PathLike, as a str."""
    if not isinstance(value, (str, os.PathLike)):
        raise InputError(f"{name} must be a path (str or pathlib.Path), got {value!r} ({type(value).__name__})")
    return os.fspath(value)


def check_strs(name: str, value: Any, allow_none: bool = False) -> Optional[list]:
    """One string or an iterable of strings, as a list."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, bytes) and isinstance(value, Iterable):
        items = list(value)
        for v in items:
            if not isinstance(v, str):
                raise InputError(f"{name} must be strings, got {v!r} ({type(v).__name__}) among them")
        return items
    raise InputError(f"{name} must be a string or a list of strings, got {value!r} ({type(value).__name__})")


def layer_list(name: str, layers: Any, n: int) -> list:
    """Layer indices: None (every layer), one integer or an iterable of integers (not a string: "12" is not
    layers 1 and 2); negatives count from the end. InputError naming the argument otherwise."""
    if layers is None:
        return list(range(n))
    try:
        items = index_list(layers)
    except TypeError:
        raise InputError(f"{name} must be a layer index or a list of them, got {layers!r} "
                         f"({type(layers).__name__})") from None
    out = []
    for layer in items:
        if not -n <= layer < n:
            raise IndexInputError(f"{name}: layer {layer} out of range (the model has {n} layers)")
        out.append(layer + n if layer < 0 else layer)
    return out
