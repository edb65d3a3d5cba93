"""Envoys: ``model.layers[i].linear_attn.<value>`` and the other attribute paths, which read and write
values through the model's open tracer (``model._read`` / ``model._write``). The model is passed in; nothing
here imports the model or the tracer class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from . import _core
from ._args import IndexInputError, as_index as _as_index, check_int as _check_int, index_slice as _index_slice
from ._convert import ValueArray
from ._inputs import _INT32_MAX
from .errors import InputError, UnknownAttributeError, UnknownValueError

if TYPE_CHECKING:  # annotations only: the model module imports this one
    from ._model import StandardizedTransformer


_STATE_METHODS = ("state", "state_after", "set_state_after")
# Kernel identity of a recurrent mixer (docs/values.md "Kernel identity"; C++ mixer_identity, CallRecord).
_IDENTITY = ("kind", "prompt_kernel", "step_kernel", "state_op", "call")
# prompt_kernel outside a trace: a prompt of this many tokens (the default prefill piece).
_IDENTITY_PROMPT = 512


def _envoy_fallback(envoy, name: str):
    return _Envoy.__getattr__(envoy, name)


def _value_attr(name: str):
    """``envoy.<name>`` for a value of the envoy's prefix: the per-value path of a `with` block (issue 9
    item 5). A class attribute rather than ``__getattr__``, whose failed lookup first builds an
    AttributeError (~1.5 us a read), and a descriptor in C (``_core.value_attr``, no Python frame): when
    the model's open tracer was entered in this very context, is running and keeps no grad record, it
    calls the session's read_value with the envoy's ``_paths[name]``; anything else goes to
    ``_Envoy.__getattr__``'s full path (which raises or routes it)."""
    return _core.value_attr(name, _envoy_fallback)


# (envoy class, value names) -> its subclass with one descriptor per value name.
_ENVOY_CLASSES: dict = {}


def _envoy_class(cls: type, names: tuple) -> type:
    key = (cls, names)
    sub = _ENVOY_CLASSES.get(key)
    if sub is None:
        attrs: dict = {"__slots__": (), "__module__": cls.__module__, "__doc__": cls.__doc__}
        for n in names:
            if not hasattr(cls, n):  # never shadow a method or property of the envoy itself
                attrs[n] = _value_attr(n)
        sub = _ENVOY_CLASSES[key] = type(cls.__name__, (cls,), attrs)
    return sub


class _Envoy:
    """Reads and writes ``<prefix><name>`` through the model's open tracer. An instance's class is a
    subclass (``_envoy_class``) with a descriptor per value name of its prefix (``_value_attr``), and
    ``_paths`` holds each name's full path, so a read does no string work."""

    __slots__ = ("_model", "_prefix", "_paths")

    def __new__(cls, model: Optional["StandardizedTransformer"] = None, prefix: str = "", *args, **kwargs):
        if model is None:  # copy / pickle protocols make the object first, then set its slots
            return object.__new__(cls)
        paths = model._paths_under(prefix)
        obj = object.__new__(_envoy_class(cls, tuple(sorted(paths))))
        object.__setattr__(obj, "_paths", paths)
        return obj

    def __init__(self, model: "StandardizedTransformer", prefix: str):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _IDENTITY and self._prefix.endswith("linear_attn."):
            return self._identity(name)
        # The per-value path (issue 9 item 5): state methods are the only names looked at first.
        if name in _STATE_METHODS and self._prefix.endswith("linear_attn."):
            if not self._model._known(self._prefix + "states"):
                self._no_state(name)
            if name == "state_after":
                return self._state_after
            if name == "set_state_after":
                return self._set_state_after
            return self._model._read(self._state_path(self._current_token("read")))
        path = self._prefix + name
        model = self._model
        ref = model._open
        t = ref() if ref is not None else None
        if (t is None or t._session is None) and not model._known(path):
            names = ", ".join(self._names()) or "none"
            raise UnknownAttributeError(f"'{path}' is not a value of this model (values here: {names})")
        try:
            return model._read(path)
        except UnknownAttributeError:
            raise
        except UnknownValueError as e:  # also an AttributeError, so hasattr() answers False
            raise UnknownAttributeError(str(e)) from None

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_"):
            raise AttributeError(f"cannot set {name!r} on {self._prefix.rstrip('.')}")
        if name == "state" and self._prefix.endswith("linear_attn."):
            if not self._model._known(self._prefix + "states"):
                self._no_state(name)
            self._model._write(self._state_path(self._current_token("write")), value)
            return
        self._model._write(self._prefix + name, value)

    # -- per-token state (docs/values.md "Per-token state") ------------------------------------
    def _no_state(self, name: str) -> None:
        """Raises for a per-token state name on a block without a recurrent state (a hybrid's attention or
        MLP block), with support()'s reason for that block rather than an unknown-name guess."""
        layer = self._prefix.split(".")[1]
        reason = None
        if layer.isdigit() and int(layer) < self._model.num_layers:
            reason = self._model.support(layer=int(layer)).get("linear_attn." + name)
        raise UnknownAttributeError(f"'{self._prefix}{name}': " + (reason or "this model has no per-token state here"))

    def _state_path(self, t: int) -> str:
        return f"{self._prefix}state@t{t}"

    def _current_token(self, verb: str) -> int:
        tr = self._model._open_tracer()
        if tr is None or tr._token is None:
            raise InputError(f"cannot {verb} '{self._prefix}state' here: it is the state after the current token of "
                             "`for t in tracer.iter[...]` inside `with model.trace(...)`; elsewhere use "
                             "state_after(t) / set_state_after(t, value), or states")
        return tr._token

    def _state_after(self, t: int) -> "ValueArray":
        """The state after token `t` of the current call (negative counts from the end), served key side
        first: ``[B, ...]`` as ``state_output`` (Mamba-2 ``[B,heads,state_dim,head_dim]``, Mamba-1
        ``[B,d_inner,state_dim]``, gated DeltaNet ``[B,HV,Dk,Dv]``), float32, computed on the side from the
        state entering t's chunk (no token loop; nothing else in the call changes). Read inside a trace;
        a layer's tokens go in increasing order (OutOfOrderError otherwise); after the layer's ``states``
        it is its row. Equals ``states[:, t]`` exactly (and ``state_output`` at the last token)."""
        t = _check_int("t", t, -_INT32_MAX, _INT32_MAX)
        return self._model._read(self._state_path(t))

    def _set_state_after(self, t: int, value) -> None:
        """Replace the state after token `t` (shape and dtype as ``state_after(t)``); tokens t+1.. continue
        from it: their values, ``states``, ``state_output``, the logits and the cache follow. WriteError on
        a wrong shape / NaN. Writes at several tokens of one layer go in increasing token order, before the
        layer's ``states`` is read (which then holds the written states)."""
        t = _check_int("t", t, -_INT32_MAX, _INT32_MAX)
        self._model._write(self._state_path(t), value)

    # -- kernel identity (docs/values.md "Kernel identity") ---------------------------------------
    def _identity(self, name: str):
        """``kind``, ``prompt_kernel``, ``step_kernel``, ``state_op`` of this layer's recurrent mixer (C++
        ``mixer_identity``: the prompt kernel for the open trace's prompt length, else a 512-token prompt),
        and inside a trace ``call``: the current step's {"state_op", "seq", "first"} (C++ ``CallRecord``'s
        kernel, seq, first). UnsupportedError on a block without a recurrent mixer."""
        model = self._model
        layer = int(self._prefix.split(".")[1])
        tr = model._open_tracer()
        seq = max((len(r) for r in tr._rows), default=0) if tr is not None else 0
        if tr is not None and tr._embeds is not None:
            seq = tr._embeds.shape[1]
        ident = model._core.mixer_identity(layer, seq or _IDENTITY_PROMPT)
        if name != "call":
            return ident[name]
        if tr is None:
            raise InputError(f"'{self._prefix}call' is the current forward call's (state_op, seq, first): read it "
                             "inside a `with model.trace(...)` / `model.generate(...)` block; after it, tracer.calls")
        sess, step = tr._require_session(), tr._step
        if not any(c["step"] == step for c in sess.calls):
            sess.reach_step(step)  # the block has read nothing of this call yet: let it start
        for c in reversed(sess.calls):
            if c["step"] == step:
                return {"state_op": c["kernel"], "seq": c["seq"], "first": c["first"]}
        raise InputError(f"'{self._prefix}call': the run ended before step {step}")

    def _names(self) -> list[str]:
        """Value names under this prefix, from the model's values for this very layer (hybrids differ)."""
        p = self._prefix
        names = {path[len(p):] for path in self._model._paths() if path.startswith(p)}
        if "states" in names and p.endswith("linear_attn."):
            names |= {"state", "state_after", "set_state_after"} | set(_IDENTITY)
        return sorted(names)

    def __dir__(self):
        return self._names()

    def __repr__(self) -> str:
        return f"<mixlens {self._prefix.rstrip('.')}: {', '.join(self._names())}>"


class _Layer(_Envoy):
    """``model.layers[i]``: ``layer_input``, ``layer_output`` (residual stream, ``[B,T,hidden]``) and the
    components ``linear_attn`` (recurrent mixer), ``self_attn`` (attention of a hybrid), ``mlp``."""

    # The components are made with the layer and sit in its __dict__: ``layer.linear_attn`` is a plain
    # attribute lookup, no Python call (issue 9 item 5).
    __slots__ = ("__dict__",)

    def __init__(self, model: "StandardizedTransformer", prefix: str):
        super().__init__(model, prefix)
        d = self.__dict__
        for name in ("linear_attn", "self_attn", "mlp"):
            d[name] = _Envoy(model, f"{prefix}{name}.")

    def _names(self) -> list[str]:
        return sorted({n.split(".")[0] for n in super()._names()})


class LayerIndexError(IndexInputError):
    """``model.layers[i]`` past the last layer: an InputError, and an IndexError so that iteration and
    ``except IndexError`` work as for a list."""


class _Layers(Sequence):
    def __init__(self, model: "StandardizedTransformer"):
        self._model = model
        self._items: list = [None] * model.num_layers  # the _Layer of each index, made on first use

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if type(i) is int:  # the per-value path (issue 9 item 5): a cached envoy, negatives as lists do
            try:
                layer = self._items[i]
            except IndexError:
                raise LayerIndexError(f"layer {i} out of range (the model has {len(self._items)} layers)") from None
            if layer is not None:
                return layer
        n = len(self)
        try:
            if isinstance(i, slice):
                return [self[j] for j in range(*_index_slice(i).indices(n))]
            j = _as_index(i)
        except TypeError:
            raise InputError(f"model.layers[{i!r}]: a layer index is an integer or a slice of integers, got "
                             f"{type(i).__name__}") from None
        except ValueError as e:  # slice step 0
            raise InputError(f"model.layers[{i!r}]: {e}") from None
        j = j + n if j < 0 else j
        if not 0 <= j < n:
            raise LayerIndexError(f"layer {i} out of range (the model has {n} layers)")
        layer = self._items[j]
        if layer is None:
            layer = self._items[j] = _Layer(self._model, f"layers.{j}.")
        return layer


class _LayerValue:
    """nnterp's ``model.layers_output[i]`` / ``model.layers_input[i]`` / ``attentions_output[i]`` /
    ``mlps_output[i]`` (read and assign by layer index). `name` is the value's path under ``layers.{i}.``,
    or a function of the layer index giving it (the mixer's path depends on the block's kind)."""

    def __init__(self, model: "StandardizedTransformer", name):
        self._model, self._name = model, name
        self._paths: list = [None] * model.num_layers  # each layer's path, made on first use

    def __len__(self) -> int:
        return len(self._paths)

    def _path(self, i: int) -> str:
        if type(i) is int:  # the per-value path: no string work for a layer read before
            try:
                path = self._paths[i]
            except IndexError:
                path = None
            if path is not None:
                return path
        n = len(self._paths)
        i = _check_int("layer", i, -n, n - 1)
        i = i + n if i < 0 else i
        name = self._name(i) if callable(self._name) else self._name
        path = self._paths[i] = f"layers.{i}.{name}"
        return path

    def __getitem__(self, i: int):
        return self._model._read(self._path(i))

    def __setitem__(self, i: int, value) -> None:
        self._model._write(self._path(i), value)


class _TlEnvoy(_Envoy):
    """``model.blocks[i].hook_resid_post``, ``model.blocks[i].linear_attn.hook_beta``: TransformerLens 4 hook
    names (docs/transformer_lens.md), read and written inside a trace as the mixlens values they alias. The core
    resolves each name (src/runtime/tl_names.cpp) and raises for one without an exact alias, saying why."""

    __slots__ = ()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name.startswith("hook_"):
            return self._model._read(self._prefix + name)
        return _TlEnvoy(self._model, f"{self._prefix}{name}.")  # a component: blocks[i].mixer, .attn, ...


class _TlBlocks(Sequence):
    """``model.blocks``: one TransformerLens-named envoy per block (``blocks.{i}.``)."""

    def __init__(self, model: "StandardizedTransformer"):
        self._model = model

    def __len__(self) -> int:
        return self._model.num_layers

    def __getitem__(self, i):
        n = len(self)
        if type(i) is not int:
            raise InputError(f"model.blocks[{i!r}]: a block index is an integer")
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise LayerIndexError(f"block {i} out of range (the model has {n} blocks)")
        return _TlEnvoy(self._model, f"blocks.{j}.")
