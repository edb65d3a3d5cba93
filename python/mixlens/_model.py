"""The nnsight / nnterp-style front end over the C++ Session (see the package docstring)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np

from . import _core, hub
from ._convert import ValueArray, as_float32, resolve_output, to_output, to_plain
from ._inplace import LiveValues, _Live
from . import _invoke, _nnterp
from .errors import InputError, UnknownAttributeError, UnknownValueError, WriteError

__all__ = ["StandardizedTransformer", "Tracer", "ValueArray", "Cache", "Tokenizer", "load", "default_model_path"]

_ALL_STEPS = (0, 2**31 - 1)
_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
_STEP_KEY = re.compile(r"^(?P<path>.+)@step(?P<step>\d+)$")

Prompt = Union[str, Sequence[int], Sequence[str], Sequence[Sequence[int]], np.ndarray]


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """`value` as a Python int if it is an integer (not bool / float) in [lo, hi]; else InputError naming
    the argument and the range (rather than nanobind's "incompatible function arguments")."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{name} must be an integer in [{lo}, {hi}], got {value!r} ({type(value).__name__})")
    v = int(value)
    if not lo <= v <= hi:
        raise InputError(f"{name} = {v} is out of range: it must be in [{lo}, {hi}]")
    return v


def _check_rows(rows: list, what: str = "token id") -> list:
    """Token-id rows as lists of ints within int32 (ids beyond the vocabulary are reported by the core,
    which knows it)."""
    out = []
    for r, row in enumerate(rows):
        ids = []
        for k, t in enumerate(row):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise InputError(f"{what} at row {r}, position {k} must be an integer, got {t!r} ({type(t).__name__})")
            v = int(t)
            if not 0 <= v <= _INT32_MAX:
                raise InputError(f"{what} {v} at row {r}, position {k} is out of range: ids are in [0, vocab_size)")
            ids.append(v)
        out.append(ids)
    return out


def _as_value(arr: Optional[np.ndarray], fmt: str = "numpy"):
    return to_output(arr, fmt)


_as_float32 = as_float32  # the write conversion (torch / numpy / scalars): mixlens._convert


def _steps_of(key: str) -> tuple[str, int, int]:
    """'path' -> every step; 'path@step3' -> step 3 only."""
    m = _STEP_KEY.match(key)
    if m:
        step = int(m.group("step"))
        return m.group("path"), step, step
    return key, *_ALL_STEPS


def _save_specs(saves: Optional[Iterable[str]]) -> list:
    if saves is None:
        return []
    if isinstance(saves, str):
        saves = [saves]
    return [_steps_of(s) for s in saves]


def _check_saved_steps(specs: list, ran: Iterable[int]) -> None:
    """InputError for a save of one step (``path@stepK``) the run never made (it would silently be absent)."""
    ran = sorted(set(ran))
    for path, first, last in specs:
        if (first, last) != _ALL_STEPS and first not in ran:
            if not ran:
                made = "no step"
            elif len(ran) > 1 and ran == list(range(ran[0], ran[-1] + 1)):
                made = f"steps {ran[0]}..{ran[-1]}"
            else:
                made = ("steps " if len(ran) > 1 else "step ") + ", ".join(map(str, ran))
            raise InputError(f"save '{path}@step{first}': the run never made step {first} (it ran {made})")


def _edit_specs(edits: Union[None, Mapping[str, Any], Iterable[tuple]], fmt: str = "numpy") -> list:
    """{path[@stepK]: array or callable(value) -> value | None} or [(path, value), ...]. A callable gets the
    value in the model's output format; editing it in place and returning None applies the edit."""
    if edits is None:
        return []
    items = edits.items() if isinstance(edits, Mapping) else edits
    specs = []
    for key, value in items:
        path, first, last = _steps_of(key)
        if callable(value):
            fn = value

            def call(v, fn=fn, path=path):
                val = to_output(v, fmt)
                rec = None if val is None else _Live(0, path, val, fmt == "torch")
                out = fn(val)
                if out is None:
                    return None if rec is None or not rec.modified() else as_float32(val, path)
                return as_float32(out, path)

            specs.append((path, first, last, call))
        else:
            specs.append((path, first, last, as_float32(value, path)))
    return specs


def _generic_reason(reason: str, layer: int) -> str:
    """'block 3 ... layers.3.x' -> 'block {i} ... layers.{i}.x' so per-block reasons can be compared."""
    return re.sub(rf"(?<![\w.]){layer}(?![\w])|(?<=layers\.){layer}(?=\.)", "{i}", reason)


class Tokenizer:
    """The checkpoint's tokenizer.json, run natively (matches HF ``tokenizers``)."""

    def __init__(self, core: "_core.Model"):
        self._core = core

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (HF ``Tokenizer.encode(text).ids``). TokenizerError without tokenizer.json."""
        return self._core.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._core.decode(_check_rows([list(ids)])[0], skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._core.token_to_id(token)

    def id_to_token(self, id: int) -> str:
        return self._core.id_to_token(_check_int("token id", id, 0, _INT32_MAX))

    @property
    def vocab_size(self) -> int:
        return self._core.tokenizer_vocab_size


class Cache:
    """Recurrent state of a batch between forward calls (``model.new_cache``): conv windows and SSM
    states per layer. ``model.forward(ids, cache=...)`` and ``model.trace(ids, cache=...)`` continue it."""

    def __init__(self, core_cache: "_core.Cache"):
        self._core = core_cache
        self._busy = False

    @property
    def batch(self) -> int:
        return self._core.batch

    @property
    def seen_tokens(self) -> int:
        return self._core.seen_tokens

    @property
    def steps(self) -> int:
        """Forward calls made with this cache: the step index of the next call."""
        return self._core.steps

    def __repr__(self) -> str:
        return f"mixlens.Cache(batch={self.batch}, seen_tokens={self.seen_tokens}, steps={self.steps})"


# ---- envoys: attribute access that reads / writes through the active tracer -------------------


class _Envoy:
    """Reads and writes ``<prefix><name>`` through the model's open tracer."""

    __slots__ = ("_model", "_prefix")

    def __init__(self, model: "StandardizedTransformer", prefix: str):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        path = self._prefix + name
        if self._model._tracer is None and not self._model._known(path):
            names = ", ".join(self._names()) or "none"
            raise UnknownAttributeError(f"'{path}' is not a value of this model (values here: {names})")
        try:
            return self._model._read(path)
        except UnknownAttributeError:
            raise
        except UnknownValueError as e:  # also an AttributeError, so hasattr() answers False
            raise UnknownAttributeError(str(e)) from None

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_"):
            raise AttributeError(f"cannot set {name!r} on {self._prefix.rstrip('.')}")
        self._model._write(self._prefix + name, value)

    def _names(self) -> list[str]:
        """Value names under this prefix, from the model's values for this very layer (hybrids differ)."""
        p = self._prefix
        return sorted({path[len(p):] for path in self._model._paths() if path.startswith(p)})

    def __dir__(self):
        return self._names()

    def __repr__(self) -> str:
        return f"<mixlens {self._prefix.rstrip('.')}: {', '.join(self._names())}>"


class _Layer(_Envoy):
    """``model.layers[i]``: ``layer_input``, ``layer_output`` (residual stream, ``[B,T,hidden]``) and the
    components ``linear_attn`` (recurrent mixer), ``self_attn`` (attention of a hybrid), ``mlp``."""

    __slots__ = ()

    def __getattr__(self, name: str):
        if name in ("linear_attn", "self_attn", "mlp"):
            return _Envoy(self._model, f"{self._prefix}{name}.")
        return super().__getattr__(name)

    def _names(self) -> list[str]:
        return sorted({n.split(".")[0] for n in super()._names()})


class _Layers(Sequence):
    def __init__(self, model: "StandardizedTransformer"):
        self._model = model

    def __len__(self) -> int:
        return self._model.num_layers

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"layer {i} out of range (the model has {n} layers)")
        return _Layer(self._model, f"layers.{j}.")


class _LayerValue:
    """nnterp's ``model.layers_output[i]`` / ``model.layers_input[i]`` / ``attentions_output[i]`` /
    ``mlps_output[i]`` (read and assign by layer index). `name` is the value's path under ``layers.{i}.``,
    or a function of the layer index giving it (the mixer's path depends on the block's kind)."""

    def __init__(self, model: "StandardizedTransformer", name):
        self._model, self._name = model, name

    def __len__(self) -> int:
        return self._model.num_layers

    def _path(self, i: int) -> str:
        n = self._model.num_layers
        i = _check_int("layer", i, -n, n - 1)
        i = i + n if i < 0 else i
        name = self._name(i) if callable(self._name) else self._name
        return f"layers.{i}.{name}"

    def __getitem__(self, i: int):
        return self._model._read(self._path(i))

    def __setitem__(self, i: int, value) -> None:
        self._model._write(self._path(i), value)


# ---- tracer ------------------------------------------------------------------------------------


class _StepLoop:
    """``tracer.iter[...]``: iterating yields step indices; reads inside the loop body use that step."""

    def __init__(self, tracer: "Tracer", key):
        self._tracer, self._key = tracer, key

    def __iter__(self) -> Iterator[int]:
        tr = self._tracer
        if _invoke.current() is not None:
            raise InputError("tracer.iter inside an invoke: invoke bodies read and write the first step only")
        sess = tr._require_session()
        first, last = sess.first_step, sess.last_step
        key = self._key
        if isinstance(key, slice):
            start, stop, stride = key.indices(last - first + 1)
            steps: Iterable[int] = (first + k for k in range(start, stop, stride))
        elif isinstance(key, int):
            steps = [first + (key if key >= 0 else last - first + 1 + key)]
        else:
            steps = [first + int(k) for k in key]
        for step in steps:
            if step > last:
                break
            tr._live.settle()  # a new step: pending in-place edits go in first
            if not sess.reach_step(step):  # the generation ended (EOS) before this step
                break
            tr._step = step
            yield step


class _StepIndexer:
    def __init__(self, tracer: "Tracer"):
        self._tracer = tracer

    def __getitem__(self, key) -> _StepLoop:
        return _StepLoop(self._tracer, key)

    def __iter__(self) -> Iterator[int]:
        return iter(_StepLoop(self._tracer, slice(None)))


class _StopTrace(Exception):
    """Raised by :meth:`Tracer.stop` and swallowed by that tracer's ``with`` block."""

    def __init__(self, tracer: "Tracer"):
        super().__init__("tracer.stop() outside its own `with` block")
        self.tracer = tracer


class Tracer:
    """The object of ``with model.trace(...) as tracer`` / ``with model.generate(...) as tracer``.

    Inside the block, ``model.<...>`` reads block until the forward (running on a C++ worker thread)
    reaches the value, and assignments replace it before it is consumed. Reads and writes go in
    forward order (``model.values()``); going back raises :class:`mixlens.OutOfOrderError`.

    ``tracer.invoke(prompt)`` (trace / generate opened without inputs) batches several prompts, each with its
    own reads and writes, into one forward; ``tracer.stop()`` ends the block without running the rest;
    ``tracer.attention_mask`` / ``tracer.input_ids`` give the left-padded batch.

    After the block: ``tracer.logits`` (trace: ``[B,T,vocab]``; teacher-forced generate: one array per
    step), ``tracer.tokens`` / ``tracer.text`` (generate: the new tokens / their text, per prompt, or a
    single list / str for a single prompt), ``tracer.saved`` (pre-registered ``saves``), ``tracer.calls``
    (kernel and length of every forward call).
    """

    def __init__(self, model: "StandardizedTransformer", kind: str, inputs: Prompt, *, cache: Optional[Cache] = None,
                 saves=None, edits=None, forced_tokens=None, **gen):
        self._model = model
        self._kind = kind
        # No inputs: the prompts come from tracer.invoke(...) blocks, batched when the block ends.
        self._deferred = inputs is None
        self._invokes: list = []
        self._rows, self._single = ([], False) if inputs is None else model._rows(inputs)
        self._cache = cache
        self._saves = _save_specs(saves)
        self._fmt = model._output
        self._edits = _edit_specs(edits, self._fmt)
        self._forced = forced_tokens
        self._gen = gen
        self._session = None
        self._step = 0
        self._result: Optional[dict] = None
        self._calls: list = []
        self._live = LiveValues(self._apply_write)
        self._stopped = False
        self._shapes: dict = {}

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> "Tracer":
        m = self._model
        if m._tracer is not None:
            raise InputError("a trace is already open on this model; finish it before starting another")
        if self._deferred:
            if self._cache is not None or self._forced is not None:
                raise InputError("tracer.invoke batches fresh prompts: no cache= or forced_tokens= with invokes")
            m._tracer = self
            return self
        self._open_session()
        return self

    def _open_session(self) -> None:
        m = self._model
        core = m._core
        if self._kind == "trace" and self._cache is None:
            self._session = _core.session_run(core, self._rows, self._saves, self._edits)
        elif self._kind == "trace":
            if self._cache._busy:
                raise InputError("this cache is in use by another open trace")
            self._session = _core.session_forward(core, self._rows, self._cache._core, self._saves, self._edits)
            self._cache._busy = True
        elif self._forced is not None:
            self._session = _core.session_teacher_forced(core, self._rows, self._forced, self._saves, self._edits)
        else:
            self._session = _core.session_generate(core, self._rows, saves=self._saves, edits=self._edits, **self._gen)
        self._step = self._session.first_step
        m._tracer = self

    def invoke(self, inputs: Prompt) -> "_invoke._Invoke":
        """nnsight's ``with tracer.invoke(prompt):`` inside ``with model.trace() as tracer:`` (no inputs) or
        ``model.generate(max_new_tokens=...)``: each invoke adds its prompt(s) to one left-padded batch that
        runs as one forward; reads in its body return its own rows, writes replace them. The bodies run
        when the trace block ends, in forward order across invokes (see :mod:`mixlens._invoke`)."""
        if not self._deferred:
            raise InputError("tracer.invoke: open the trace without inputs (model.trace() / model.generate()) to "
                             "batch invokes")
        if self._session is not None or self._model._tracer is not self:
            raise InputError("tracer.invoke is used inside its trace's `with` block")
        rows, single = self._model._rows(inputs)
        return _invoke._Invoke(self, rows, single)

    def __exit__(self, exc_type, exc, tb) -> bool:
        stopped = exc_type is not None and issubclass(exc_type, _StopTrace) and exc.tracer is self
        if self._deferred and self._session is None:
            if exc_type is not None:
                self._model._tracer = None
                return False
            if not self._invokes:
                self._model._tracer = None
                raise InputError("model.trace() / model.generate() without inputs needs tracer.invoke(prompt) blocks")
            for inv in self._invokes:
                inv.first_row = len(self._rows)
                self._rows.extend(inv.rows)
            self._open_session()
            try:
                _invoke.run_invokes(self, self._invokes, None)
            except BaseException as e:
                sess, self._session = self._session, None
                self._model._tracer = None
                self._calls = sess.calls
                sess.close()
                if isinstance(e, _StopTrace) and e.tracer is self:  # tracer.stop() inside an invoke
                    self._stopped = True
                    return True
                raise
        sess = self._session
        try:
            if exc_type is None:
                self._live.settle()  # in-place edits of the last value read reach the rest of the forward
                # Step by step, so Ctrl-C (KeyboardInterrupt) is raised between forward calls rather
                # than after the whole generation: each C++ wait blocks with the GIL released.
                for step in range(sess.first_step + 1, sess.last_step + 1):
                    if not sess.reach_step(step):
                        break
                result = sess.finish()
                self._calls = sess.calls
                _check_saved_steps(self._saves, (c["step"] for c in self._calls))
                self._result = result
            else:
                self._calls = sess.calls
                self._stopped = stopped  # tracer.stop(): the rest of the forward is not run
        finally:
            self._model._tracer = None
            self._session = None
            self._live.close(check=False)
            sess.close()  # aborts the worker when leaving early (an exception, KeyboardInterrupt, stop())
            if self._cache is not None:
                self._cache._busy = False
        return stopped

    def run(self) -> "Tracer":
        """Run without an interleaved block (pre-registered ``saves`` / ``edits`` only); returns self."""
        with self:
            pass
        return self

    # -- reads / writes (used by the envoys) --------------------------------------------------
    def _require_session(self):
        if self._session is None:
            if self._deferred and self._model._tracer is self:
                raise InputError("this trace batches tracer.invoke(...) blocks: read and write values inside an invoke")
            raise InputError("this tracer is not open: values are read inside its `with` block")
        return self._session

    def _read(self, path: str):
        inv = _invoke.current()
        if inv is not None and inv.tracer is self:
            return inv.read(path)
        sess = self._require_session()
        self._live.settle()  # the block moves on: apply in-place edits of the previous value first
        value = to_output(sess.read(self._step, path), self._fmt)
        self._live.track(self._step, path, value, read_only=path.endswith(".states"))
        return value

    def _write(self, path: str, value) -> None:
        inv = _invoke.current()
        if inv is not None and inv.tracer is self:
            return inv.write(path, value)
        sess = self._require_session()
        self._live.settle(keep=(self._step, path))
        arr = as_float32(value, path)
        shape = self._expected_shape(path)
        if shape is not None and arr.shape != shape:
            try:  # a scalar / vector broadcast over the value (mix.betas[...] = 0 style), as torch would
                arr = np.ascontiguousarray(np.broadcast_to(arr, shape))
            except ValueError:
                pass  # the core names the expected and given shapes
        sess.write(self._step, path, arr)
        self._live.wrote(self._step, path)

    def _apply_write(self, step: int, path: str, arr: np.ndarray) -> None:
        self._require_session().write(step, path, arr)

    def _call_seq(self) -> int:
        """Tokens of the forward call at the current step."""
        first = self._require_session().first_step
        if self._kind == "generate" and self._step > first:
            return 1
        return max(len(r) for r in self._rows)

    def _expected_shape(self, path: str) -> Optional[tuple]:
        key = (len(self._rows), self._call_seq())
        table = self._shapes.get(key)
        if table is None:
            table = {v["path"]: tuple(v["shape"]) for v in self._model._core.values(*key)}
            self._shapes[key] = table
        return table.get(path)

    def stop(self) -> None:
        """nnsight's ``tracer.stop()``: end the block here without running the rest of the forward. Values
        read so far stay valid; results (``tracer.logits``, ``tokens``, ``saved``) are not available."""
        self._require_session()
        raise _StopTrace(self)

    @property
    def stopped(self) -> bool:
        """True when the block ended with :meth:`stop`."""
        return self._stopped

    @property
    def input_ids(self):
        """The prompt batch as the forward receives it: ``[B, T]`` token ids, left-padded with the model's
        pad_token_id (int64; a torch tensor or numpy array by the model's output format)."""
        pad = self._model._core.pad_token_id
        T = max(len(r) for r in self._rows)
        ids = np.array([[pad] * (T - len(r)) + list(r) for r in self._rows], dtype=np.int64)
        return to_plain(ids, self._fmt)

    @property
    def attention_mask(self):
        """``[B, T]`` int64, 1 for real tokens and 0 for left padding (transformers' attention_mask of the
        same left-padded batch); a torch tensor or numpy array by the model's output format."""
        T = max(len(r) for r in self._rows)
        mask = np.array([[0] * (T - len(r)) + [1] * len(r) for r in self._rows], dtype=np.int64)
        return to_plain(mask, self._fmt)

    # -- steps ------------------------------------------------------------------------------
    @property
    def iter(self) -> _StepIndexer:
        """``for step in tracer.iter[:]`` / ``[0:3]`` / ``[2]`` / ``[[0, 2]]``: each iteration waits until that
        forward call starts; reads in the body address that step. Stops early when generation ends."""
        return _StepIndexer(self)

    def all(self) -> _StepLoop:
        """nnsight's ``tracer.all()``: every step (same as ``tracer.iter[:]``)."""
        return _StepLoop(self, slice(None))

    @property
    def step(self) -> int:
        """The step reads and writes address now (0 = the prompt)."""
        return self._step

    # -- results ----------------------------------------------------------------------------
    def _done(self) -> dict:
        if self._stopped:
            raise InputError("this trace was stopped with tracer.stop(): the forward did not finish, so it has no results")
        if self._result is None:
            raise InputError("results are available after the `with` block has finished without an error")
        return self._result

    @property
    def logits(self):
        """trace: logits ``[B,T,vocab]`` float32; teacher-forced generate: a list, one array per step."""
        logits = [to_plain(x, self._fmt) for x in self._done()["logits"]]
        if self._kind == "trace":
            return logits[0]
        return logits or None

    output = logits  # nnsight spelling

    @property
    def tokens(self):
        """generate: the new token ids per prompt (a single list for a single prompt)."""
        toks = self._done()["new_tokens"]
        return toks[0] if self._single else toks

    @property
    def text(self):
        """generate: the decoded new tokens per prompt (a single str for a single prompt)."""
        toks = self._done()["new_tokens"]
        texts = [self._model.tokenizer.decode(t) for t in toks]
        return texts[0] if self._single else texts

    @property
    def prompt_ids(self) -> list[list[int]]:
        return self._rows

    @property
    def steps(self) -> int:
        """Forward calls made."""
        return self._done()["steps"]

    @property
    def saved(self) -> dict:
        """Pre-registered saves: trace -> {path: array}; generate -> {path: [array per step, None where
        the value does not exist (state_input at step 0)]}."""
        raw = self._done()["saved"]
        if self._kind == "trace":
            return {_STEP_KEY.match(k).group("path"): to_plain(v, self._fmt) for k, v in raw.items()}
        out: dict = {}
        n = self.steps
        for k, v in raw.items():
            m = _STEP_KEY.match(k)
            out.setdefault(m.group("path"), [None] * n)[int(m.group("step"))] = to_plain(v, self._fmt)
        return out

    @property
    def calls(self) -> list[dict]:
        """Every forward call: step, batch, seq, fresh (no cached state before), kernel ('chunked' or
        'recurrent')."""
        return self._session.calls if self._session is not None else self._calls


# ---- the model ---------------------------------------------------------------------------------


class StandardizedTransformer(_nnterp.NnterpMixin):
    """A recurrent LM (Mamba-2, ...) loaded natively, with nnterp's standardized names.

    ``StandardizedTransformer(path_or_hub_id)`` loads a checkpoint folder (config.json, *.safetensors,
    tokenizer.json) or a hub id from the local HuggingFace cache (never the network). With ``cache_dir`` /
    ``revision`` / ``use_hub=True`` the id is resolved by :func:`mixlens.hub.resolve` (the C++ resolver, in that cache).
    With no path, the model is :func:`default_model_path`: ``$MIXLENS_MODEL``, else the small Mamba-2
    shipped in the repository (``models/mamba2-tinystories``), as the ``mixlens`` CLI does.

    Values (read inside ``with model.trace(...)``; shapes for Mamba-2, ``B`` prompts, ``T`` tokens):

    ==========================================  ====================================================
    ``model.embed_tokens.output``               ``[B,T,hidden]`` token embeddings
    ``model.layers[i].layer_input / output``    ``[B,T,hidden]`` residual stream entering / leaving block i
    ``model.layers[i].linear_attn.<value>``     the recurrent mixer (docs/values.md): ``attention_queries`` (C,
                                                ``[B,T,G,N]``), ``attention_keys`` (B), ``attention_values`` (x,
                                                ``[B,T,H,P]``), ``betas`` (dt, ``[B,T,H]``, >= 0), ``decays`` (A*dt,
                                                <= 0), ``state_input`` (``[B,H,N,P]``, None on a fresh prompt),
                                                ``state_output``, ``states`` (``[B,T,H,N,P]``, read-only),
                                                ``attention_head_outputs`` (y, ``[B,T,H,P]``), ``attention_output``
    ``model.layers[i].self_attn.*`` / ``.mlp``  attention / MLP of hybrid blocks (an error naming the block's
                                                kind where a block has none)
    ``model.ln_final.output``, ``model.logits`` ``[B,T,hidden]``, ``[B,T,vocab]``
    ==========================================  ====================================================

    Values are float32 copies handed out as ``torch.Tensor`` or numpy arrays by ``output=`` ("auto":
    torch when installed; ``$MIXLENS_OUTPUT`` sets the default). An in-place edit of the value read last
    reaches the forward when the block moves on; see :mod:`mixlens._inplace`. nnterp's surface
    (``layers_output``, ``attentions_output``, ``mlps_output``, ``next_token_probs``, ``steer``,
    ``skip_layer(s)``, ``project_on_vocab``, head weights) is in :class:`mixlens._nnterp.NnterpMixin`.
    The numerical reference is HF transformers' pure-torch implementation; ``model.values()`` lists
    every path with its shape and meaning.
    """

    def __init__(self, path_or_hub_id: Optional[str] = None, *, cache_dir: Optional[str] = None,
                 revision: Optional[str] = None, use_hub: bool = False, output: Optional[str] = None):
        self._output = resolve_output(output)
        path = default_model_path() if path_or_hub_id is None else os.fspath(path_or_hub_id)
        if use_hub or cache_dir is not None or revision is not None:
            path = hub.resolve(path, revision=revision, cache_dir=cache_dir)
        self._core = _core.Model.load(path)
        self._tracer: Optional[Tracer] = None
        self._value_paths: Optional[frozenset] = None
        self.layers = _Layers(self)
        self.embed_tokens = _Envoy(self, "embed_tokens.")
        self.ln_final = _Envoy(self, "ln_final.")
        self.layers_input = _LayerValue(self, "layer_input")
        self.layers_output = _LayerValue(self, "layer_output")
        self.tokenizer = Tokenizer(self._core)
        _nnterp.attach(self)

    # -- description ------------------------------------------------------------------------
    @property
    def info(self) -> dict:
        """family, model_type, path, num_layers, hidden_size, vocab_size, layer_kinds."""
        return self._core.info

    @property
    def num_layers(self) -> int:
        return self._core.info["num_layers"]

    @property
    def hidden_size(self) -> int:
        return self._core.info["hidden_size"]

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding / LM head (config.vocab_size; may exceed the tokenizer's vocabulary)."""
        return self._core.info["vocab_size"]

    @property
    def output_format(self) -> str:
        """'torch' or 'numpy': the type of every value this model hands out (``output=`` at load; settable)."""
        return self._output

    @output_format.setter
    def output_format(self, output: str) -> None:
        if self._tracer is not None:
            raise InputError("output_format cannot change while a trace is open")
        self._output = resolve_output(output)

    def values(self, batch: int = 1, seq: int = 1) -> list[dict]:
        """Every value in forward order for a call of `batch` rows and `seq` tokens: path, layer, shape,
        writable, per_token, meaning (the reference quantity it equals)."""
        return self._core.values(batch, seq)

    def _paths(self) -> frozenset:
        """Every value path of this model (``model.values()``), computed once."""
        if self._value_paths is None:
            self._value_paths = frozenset(v["path"] for v in self._core.values())
        return self._value_paths

    def _order(self) -> dict:
        """Value path -> its index in forward order (``model.values()``)."""
        if getattr(self, "_value_order", None) is None:
            self._value_order = {v["path"]: k for k, v in enumerate(self._core.values())}
        return self._value_order

    def _known(self, path: str) -> bool:
        return path in self._paths()

    def support(self) -> dict:
        """docs/values.md ``support()``: value name (``"linear_attn.states"``) -> None when available, else the
        reason (a sentence naming the cause and what to use instead). Where every block answers alike
        the entry is one value, the reason's block index written ``{i}``; where blocks differ (hybrids)
        it is a per-layer ``{layer: None | reason}`` mapping."""
        out = {}
        for name, per_layer in self._core.support().items():
            reasons = {layer: (r or None) for layer, r in per_layer.items()}
            generic = {r if r is None or layer < 0 else _generic_reason(r, layer) for layer, r in reasons.items()}
            out[name] = next(iter(generic)) if len(generic) == 1 else reasons
        return out

    def __repr__(self) -> str:
        i = self.info
        return f"mixlens.StandardizedTransformer({i['family']}, {i['num_layers']} layers, path={i['path']!r})"

    # -- inputs -----------------------------------------------------------------------------
    def _rows(self, inputs: Prompt) -> tuple[list[list[int]], bool]:
        """Token rows and whether the input was a single prompt."""
        if isinstance(inputs, str):
            return [self.tokenizer.encode(inputs)], True
        if hasattr(inputs, "__array__") and not isinstance(inputs, (list, tuple)):
            arr = np.asarray(inputs)
            if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2):
                raise InputError(f"token ids must be a 1-D or 2-D integer array, got {arr.dtype} {arr.shape}")
            return (_check_rows([arr.tolist()]), True) if arr.ndim == 1 else (_check_rows(arr.tolist()), False)
        if not isinstance(inputs, (list, tuple)) or len(inputs) == 0:
            raise InputError("inputs must be a prompt string, a list of prompts, or token ids")
        if all(isinstance(x, str) for x in inputs):
            return [self.tokenizer.encode(x) for x in inputs], False
        if all(isinstance(x, (int, np.integer)) for x in inputs):
            return _check_rows([list(inputs)]), True
        if all(isinstance(x, (list, tuple, np.ndarray)) for x in inputs):
            return _check_rows([list(row) for row in inputs]), False
        raise InputError("inputs must be a prompt string, a list of prompts, token ids, or a list of token-id rows")

    # -- value access through the open tracer ----------------------------------------------
    def _tracer_for(self, path: str) -> Tracer:
        if self._tracer is None:
            raise InputError(f"'{path}' is read inside `with model.trace(...)` or `with model.generate(...)`")
        return self._tracer

    def _read(self, path: str):
        return self._tracer_for(path)._read(path)

    def _write(self, path: str, value) -> None:
        self._tracer_for(path)._write(path, value)

    @property
    def logits(self) -> ValueArray:
        """``[B,T,vocab]`` float32 logits of the current step (read inside a trace)."""
        return self._read("logits")

    @logits.setter
    def logits(self, value) -> None:
        self._write("logits", value)

    # -- runs ---------------------------------------------------------------------------------
    def trace(self, inputs: Optional[Prompt] = None, *, cache: Optional[Cache] = None, saves=None, edits=None) -> Tracer:
        """One forward call over `inputs` (a prompt, a list of prompts as one left-padded batch, or token
        ids); with `cache`, a continuation of it (rows of equal length). `saves`: value paths (``*`` for
        every layer, ``@stepK`` suffix for one step) collected into ``tracer.saved``; `edits`:
        ``{path: array | fn(array) -> array}`` applied before the block sees the value (a function may edit
        its argument in place and return None). Without `inputs`, the prompts come from
        ``tracer.invoke(prompt)`` blocks, batched into one forward (:mod:`mixlens._invoke`)."""
        return Tracer(self, "trace", inputs, cache=cache, saves=saves, edits=edits)

    def generate(self, inputs: Optional[Prompt] = None, max_new_tokens: int = 20, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_id: Optional[int] = None, forced_tokens=None, saves=None, edits=None) -> Tracer:
        """Generation: step 0 runs the prompt, steps 1..max_new_tokens-1 one token each; greedy unless
        `do_sample` (temperature / top_k / top_p / seed as transformers). Stops a row at EOS
        (config.eos_token_id, or `eos_token_id`; -1 disables). `forced_tokens` (one row per prompt)
        teacher-forces the tokens fed after each step instead (``tracer.tokens`` then holds each step's
        greedy prediction and ``tracer.logits`` every step's logits). Use as ``with ... as tracer`` and
        ``tracer.iter``, or ``.run()``."""
        gen = dict(max_new_tokens=_check_int("max_new_tokens", max_new_tokens, 1, _INT32_MAX),
                   greedy=not do_sample, temperature=float(temperature),
                   top_k=_check_int("top_k", top_k, 0, _INT32_MAX), top_p=float(top_p),
                   seed=_check_int("seed", seed, 0, _UINT64_MAX),
                   eos_token_id=None if eos_token_id is None else _check_int("eos_token_id", eos_token_id, -1, _INT32_MAX))
        if forced_tokens is not None:
            forced = np.asarray(forced_tokens, dtype=object)
            rows = forced.tolist() if forced.ndim == 2 else [list(forced_tokens)]
            forced_tokens = _check_rows(rows, "forced token id")
        return Tracer(self, "generate", inputs, saves=saves, edits=edits, forced_tokens=forced_tokens, **gen)

    def run(self, inputs: Prompt, saves=None, edits=None) -> dict:
        """One forward with pre-registered saves / edits (no block): {"logits": [B,T,vocab], path: array}."""
        specs = _save_specs(saves)
        logits, saved = self._core.run(self._rows(inputs)[0], specs, _edit_specs(edits, self._output))
        _check_saved_steps(specs, [0])
        out = {"logits": to_plain(logits, self._output)}
        out.update({_STEP_KEY.match(k).group("path"): to_plain(v, self._output) for k, v in saved.items()})
        return out

    def new_cache(self, batch: int = 1) -> Cache:
        """An empty cache for `batch` rows, for ``forward`` / ``trace(..., cache=)`` continuations."""
        return Cache(self._core.new_cache(_check_int("batch", batch, 1, _INT32_MAX)))

    def forward(self, inputs: Prompt, cache: Cache, saves=None, edits=None) -> dict:
        """One forward call continuing `cache` (updated in place): {"logits": [B,T,vocab], path: array}.
        Several new tokens over a cached state run the chunked kernel from that state."""
        if cache._busy:
            raise InputError("this cache is in use by an open trace")
        specs, step = _save_specs(saves), cache.steps
        logits, saved = self._core.forward(self._rows(inputs)[0], cache._core, specs, _edit_specs(edits, self._output))
        _check_saved_steps(specs, [step])
        out = {"logits": to_plain(logits, self._output)}
        out.update({_STEP_KEY.match(k).group("path"): to_plain(v, self._output) for k, v in saved.items()})
        return out


def default_model_path() -> str:
    """The model loaded when no path is given (same rule as the ``mixlens`` CLI and the C++
    ``mixlens::default_model_path()``): ``$MIXLENS_MODEL`` when set, else the Mamba-2 shipped in the
    repository mixlens was built from (``<repo>/models/mamba2-tinystories``). InputError when neither
    exists."""
    env = os.environ.get("MIXLENS_MODEL")
    if env:
        return env
    candidates = []
    if hasattr(_core, "default_model_path"):
        candidates.append(_core.default_model_path())  # $MIXLENS_MODEL unset: the compiled-in repo path
    # A source checkout on sys.path (python/mixlens -> <repo>/models/...).
    candidates.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models",
                                   "mamba2-tinystories"))
    for c in candidates:
        if os.path.isdir(c):
            return os.path.normpath(c)
    raise InputError("no model given and no default: pass a checkpoint folder or hub id, or set $MIXLENS_MODEL "
                     f"(the shipped model was looked for at {', '.join(map(os.path.normpath, candidates))})")


def load(path_or_hub_id: Optional[str] = None, **kwargs) -> StandardizedTransformer:
    """Same as ``StandardizedTransformer(path_or_hub_id, **kwargs)``; with no path,
    :func:`default_model_path` (``$MIXLENS_MODEL``, else the shipped ``models/mamba2-tinystories``)."""
    return StandardizedTransformer(path_or_hub_id, **kwargs)
