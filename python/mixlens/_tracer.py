"""The tracer of ``with model.trace(...)`` / ``with model.generate(...)``: opens the C++ session, interleaves
the block's reads and writes with the forward (step and token loops, invokes, stop), and holds the results
(logits, tokens, saved values, calls, gradients). The model is passed in; this module does not import it."""

from __future__ import annotations

import contextvars
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from . import _core, _inplace, _invoke
from ._args import check_strs as _check_strs, index_list as _index_list, index_slice as _index_slice
from ._cache import Cache
from ._convert import (ValueArray, as_float32, is_torch, mount_tensor_save, released_error, to_plain, unmount_tensor_save,
                       value_tensor_class)
from ._inplace import released_value_tensor_class
from ._inputs import (_NO_MASK_WITH_CACHE, _STEP_KEY, Prompt, _all_logits, _check_saved_steps, _edit_specs,
                      _embeds_input, _ids_input, _save_specs)
from .errors import InputError, UnknownAttributeError, UnknownValueError

if TYPE_CHECKING:  # annotations only: the model module imports this one
    from ._model import StandardizedTransformer

# The tracers this thread / asyncio context opened (weak references): a read goes to the model's open
# trace only from the context that opened it. New threads start with an empty context.
_OPENED: contextvars.ContextVar[tuple] = contextvars.ContextVar("mixlens_opened_tracers", default=())
_core.value_attr_env(_OPENED, UnknownValueError, UnknownAttributeError)  # what envoy reads check in C


def _released_error(step: int, path: str):
    return released_error((step, path))


def _torch_from_dlpack():
    """DLPack capsule -> torch tensor: torch's C entry point (no Python frame per value), else its public
    wrapper (which takes capsules too)."""
    import torch

    fn = getattr(torch._C, "_from_dlpack", None)
    if fn is None:
        from torch.utils.dlpack import from_dlpack as fn
    return fn


def _iter_key(key) -> Union[slice, list]:
    """``tracer.iter[key]``'s key as a slice of int bounds or a list of ints: an integer (numpy / 0-d tensor
    too), a slice of integers (step not 0), or a sequence of integers; InputError for anything else."""
    what = "tracer.iter[...] takes an integer, a slice of integers or a list of integers"
    try:
        out = _index_slice(key) if isinstance(key, slice) else _index_list(key)
    except TypeError:
        raise InputError(f"{what}, got {key!r} ({type(key).__name__})") from None
    if isinstance(out, slice) and out.step == 0:
        raise InputError("tracer.iter[...]: a slice step cannot be zero")
    return out


class _StepLoop:
    """``tracer.iter[...]``: in a generation, iterating yields step indices and reads inside the loop body
    use that step; in a ``trace`` (one forward call) it yields the call's token indices and
    ``linear_attn.state`` in the body is the state after that token."""

    def __init__(self, tracer: "Tracer", key):
        self._tracer, self._key = tracer, _iter_key(key)

    def _tokens(self) -> Iterator[int]:
        tr = self._tracer
        tr._require_session()
        seq = max(len(r) for r in tr._rows)
        key = self._key
        if isinstance(key, slice):
            tokens: Iterable[int] = range(*key.indices(seq))
        else:
            tokens = [k + seq if k < 0 else k for k in key]
        try:
            for t in tokens:
                if not 0 <= t < seq:
                    raise InputError(f"tracer.iter: token {t} is out of range for a call of {seq} tokens")
                tr._token = t
                yield t
        finally:
            tr._token = None

    def __iter__(self) -> Iterator[int]:
        tr = self._tracer
        if _invoke.current() is not None:
            raise InputError("tracer.iter inside an invoke: invoke bodies read and write the first step only")
        if tr._kind == "trace":
            yield from self._tokens()
            return
        sess = tr._require_session()
        first, last = sess.first_step, sess.last_step
        key = self._key
        if isinstance(key, slice):
            start, stop, stride = key.indices(last - first + 1)
            steps: Iterable[int] = (first + k for k in range(start, stop, stride))
        else:
            steps = [first + (k if k >= 0 else last - first + 1 + k) for k in key]
        for step in steps:
            if step > last:
                break
            # reach_step applies pending in-place edits first (a new step).
            if not sess.reach_step(step):  # the generation ended (EOS) before this step
                break
            tr._step = step
            sess.set_reader(None if tr._grad else tr._ctx, step)
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

    Inside the block, ``model.<...>`` reads run the forward (C++, on this thread)
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

    def __init__(self, model: "StandardizedTransformer", kind: str, inputs: Optional[Prompt], *,
                 cache: Optional[Cache] = None, saves=None, edits=None, forced_tokens=None, inputs_embeds=None,
                 attention_mask=None, grad: bool = False, logits: str = "all", **gen):
        self._session = None  # first: __del__ looks at it even when __init__ raised
        self._save_mounted = False  # torch.Tensor.save mounted by this trace (_convert.mount_tensor_save)
        self._grad = bool(grad)
        self._grad_session = None  # the finished session whose trace holds the gradient record
        self._grad_reads: list = []  # (path, value) read in the block, given .grad by backward()
        self._logits_leaf = None
        self._full_logits = None  # grad trace: every position's logits once formed (_grad_logits)
        self._all_logits = _all_logits(logits)
        if self._grad and not self._all_logits:
            raise InputError("grad=True needs logits='all': backward takes dMetric/dLogits at every position")
        self._holds_model = False
        self._model = model
        self._kind = kind
        self._embeds, self._mask = None, []
        if inputs_embeds is not None:
            if inputs is not None:
                raise InputError("give inputs (text / token ids) or inputs_embeds, not both")
            if forced_tokens is not None:
                raise InputError("forced_tokens takes token-id prompts, not inputs_embeds")
            self._embeds, self._mask, self._single = _embeds_input(inputs_embeds, attention_mask)
            if cache is not None and self._mask:
                raise InputError(_NO_MASK_WITH_CACHE)
            self._rows: list = []
        elif inputs is None:
            # No inputs: the prompts come from tracer.invoke(...) blocks, batched when the block ends.
            if attention_mask is not None:
                raise InputError("attention_mask goes with the inputs of trace(...) / generate(...): the prompts of "
                                 "tracer.invoke(...) are left-padded for you")
            self._rows, self._single = [], False
        else:
            self._rows, self._mask, self._single = _ids_input(model, inputs, attention_mask)
            if self._mask and cache is not None:
                raise InputError(_NO_MASK_WITH_CACHE)
            if self._mask and forced_tokens is not None:
                raise InputError("forced_tokens takes unpadded token-id prompts, not an attention_mask")
        if cache is not None and not isinstance(cache, Cache):
            raise InputError(f"cache must be a cache of this model (model.new_cache(batch)), got {type(cache).__name__}")
        self._cache = cache
        self._saves = _save_specs(saves)
        self._fmt = model._output
        self._edits = _edit_specs(edits, self._fmt)
        self._forced = forced_tokens
        self._gen = gen
        self._step = 0
        self._token: Optional[int] = None  # the token of `for t in tracer.iter[...]` in a trace
        self._result: Optional[dict] = None
        self._calls: list = []
        self._owner_thread = None
        self._opened_token = None
        self._ctx: Optional[tuple] = None  # _OPENED's value in the context that entered (while open)
        self._deferred = inputs is None and inputs_embeds is None
        self._deferred_open = False
        self._invokes: list = []
        self._stopped = False
        self._shapes: dict = {}

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> "Tracer":
        if self._deferred:
            if self._deferred_open or self._result is not None:
                raise InputError("this tracer was already entered; make a new one with model.trace() / model.generate()")
            if self._cache is not None or self._forced is not None:
                raise InputError("tracer.invoke batches fresh prompts: no cache= or forced_tokens= with invokes")
            self._deferred_open = True  # the invoke bodies are captured now and run when the block ends
            self._model._deferred_tracer = weakref.ref(self)
            return self
        return self._enter_session()

    def _enter_session(self) -> "Tracer":
        m = self._model
        if self._session is not None or self._result is not None:
            raise InputError("this tracer was already entered; make a new one with model.trace(...) / model.generate(...)")
        open_t = m._open_tracer()
        if open_t is not None and (open_t._opened_here() or open_t._owner_thread is threading.current_thread()):
            raise InputError("a trace is already open on this model; finish it before starting another"
                             + ("" if open_t._opened_here() else " (it was opened by another asyncio task / context of "
                                "this thread, which would wait on this one forever)"))
        # One open trace per model: another thread's trace makes this one wait until it ends (documented;
        # a trace entered and never exited is released when it is garbage-collected).
        while not m._trace_lock.acquire(timeout=0.1):
            pass
        self._holds_model = True
        try:
            if self._fmt == "torch":
                self._save_mounted = mount_tensor_save()
            self._start_session()
            # In-place edit bookkeeping of the values read in the block lives in the session binding
            # (python/src/session.cpp; rules in mixlens._inplace).
            if self._fmt == "torch":
                self._session.set_output(value_tensor_class(), _torch_from_dlpack(), _released_error,
                                         released_value_tensor_class(), _inplace.WATCH_LIMIT,
                                         _inplace.WATCH_COPY_LIMIT)
            else:
                self._session.set_output(ValueArray, None, _released_error, None, _inplace.WATCH_LIMIT,
                                         _inplace.WATCH_COPY_LIMIT)
        except BaseException:
            self._release_model()
            raise
        self._step = self._session.first_step
        self._owner_thread = threading.current_thread()
        self._opened_token = _OPENED.set(_OPENED.get() + (weakref.ref(self),))
        self._ctx = _OPENED.get()  # the reads' fast check: this very tuple in the reader's context
        # Envoy reads in C (python/src/session.cpp value_attr_fast) check the session's copy of these.
        self._session.set_reader(None if self._grad else self._ctx, self._step)
        m._open = weakref.ref(self)
        return self

    def _start_session(self) -> None:
        core = self._model._core
        e, mask = self._embeds, self._mask
        if self._kind == "trace" and self._cache is None:
            # grad: the forward forms the last position's logits only; a metric's rows (or, when read, every
            # position's) come from the recorded LM-head input (_grad_logits).
            self._session = _core.session_run(core, self._rows, self._saves, self._edits, e, mask,
                                              self._all_logits and not self._grad, grad=self._grad)
        elif self._kind == "trace":
            if self._cache._busy:
                raise InputError("this cache is in use by another open trace")
            self._session = _core.session_forward(core, self._rows, self._cache._core, self._saves, self._edits,
                                                  self._all_logits and not self._grad, e, grad=self._grad)
            self._cache._busy = True
        elif self._forced is not None:
            self._session = _core.session_teacher_forced(core, self._rows, self._forced, self._saves, self._edits)
        else:
            self._session = _core.session_generate(core, self._rows, saves=self._saves, edits=self._edits, embeds=e,
                                                   mask=mask, **self._gen)

    def _opened_here(self) -> bool:
        """True in the thread / asyncio context that entered this tracer."""
        for r in _OPENED.get():  # a loop, not any(generator): this runs for every value read
            if r() is self:
                return True
        return False

    def _release_model(self) -> None:
        """Forget this tracer as the model's open one and let another trace start (idempotent). The model's
        lock is released whatever interrupts the rest (a KeyboardInterrupt landing here left it held: every
        later trace waited forever)."""
        m = self._model
        try:
            if getattr(self, "_save_mounted", False):
                self._save_mounted = False
                unmount_tensor_save()
            self._ctx = None
            if getattr(self, "_session", None) is not None:
                self._session.set_reader(None, 0)
            if m._open is not None and m._open() in (self, None):
                m._open = None
            token, self._opened_token = self._opened_token, None
            if token is not None:
                try:
                    _OPENED.reset(token)
                except (ValueError, RuntimeError):  # exited in another context: drop it from this one
                    _OPENED.set(tuple(r for r in _OPENED.get() if r() is not self and r() is not None))
        finally:
            if self._cache is not None:
                self._cache._busy = False
            if getattr(self, "_holds_model", False):
                self._holds_model = False
                m._trace_lock.release()

    def invoke(self, inputs: Prompt) -> "_invoke._Invoke":
        """nnsight's ``with tracer.invoke(prompt):`` inside ``with model.trace() as tracer:`` (no inputs) or
        ``model.generate(max_new_tokens=...)``: each invoke adds its prompt(s) to one left-padded batch that
        runs as one forward; reads in its body return its own rows, writes replace them. The bodies run
        when the trace block ends, in forward order across invokes (see :mod:`mixlens._invoke`)."""
        if not self._deferred:
            raise InputError("tracer.invoke: open the trace without inputs (model.trace() / model.generate()) to "
                             "batch invokes")
        if self._session is not None or not self._deferred_open:
            raise InputError("tracer.invoke is used inside its trace's `with` block")
        rows, single = self._model._rows(inputs)
        return _invoke._Invoke(self, rows, single)

    def __exit__(self, exc_type, exc, tb) -> bool:
        stopped = exc_type is not None and issubclass(exc_type, _StopTrace) and exc.tracer is self
        if self._deferred and self._deferred_open:
            self._deferred_open = False
            if exc_type is not None:
                return False
            if not self._invokes:
                raise InputError("model.trace() / model.generate() without inputs needs tracer.invoke(prompt) blocks")
            for inv in self._invokes:
                inv.first_row = len(self._rows)
                self._rows.extend(inv.rows)
            self._enter_session()
            try:
                _invoke.run_invokes(self, self._invokes, None)
            except BaseException as e:
                sess, self._session = self._session, None
                self._calls = sess.calls
                try:
                    sess.close()
                finally:
                    self._release_model()
                if isinstance(e, _StopTrace) and e.tracer is self:  # tracer.stop() inside an invoke
                    self._stopped = True
                    return True
                raise
        sess = self._session
        try:
            if exc_type is None:
                sess.settle()  # in-place edits of the last value read reach the rest of the forward
                self._session = None
                # Step by step, so Ctrl-C (KeyboardInterrupt) is raised between forward calls rather
                # than after the whole generation: each C++ wait blocks with the GIL released.
                for step in range(sess.first_step + 1, sess.last_step + 1):
                    if not sess.reach_step(step):
                        break
                result = sess.finish()
                self._calls = sess.calls
                if self._grad:
                    self._grad_session = sess  # keeps the trace (and its record) for backward()
                _check_saved_steps(self._saves, (c["step"] for c in self._calls))
                _check_saved_steps(self._edits, (c["step"] for c in self._calls), "edit")
                self._result = result
            else:
                self._calls = sess.calls
                self._stopped = stopped  # tracer.stop(): the rest of the forward is not run
        finally:
            self._session = None
            sess.close_values(check=False)
            try:
                sess.close()  # aborts the forward when leaving early (an exception, KeyboardInterrupt, stop())
            finally:
                self._release_model()
        return stopped

    def __del__(self):
        # Entered and never exited (no `with`, or the frame was dropped): abort the run so the model is
        # not locked forever, and say so.
        sess = getattr(self, "_session", None)
        if sess is None:
            # Exited, but an interrupt (Ctrl-C) cut the release short: the model's lock goes with the tracer.
            if getattr(self, "_holds_model", False):
                self._release_model()
            return
        self._session = None
        try:
            warnings.warn("a mixlens tracer was entered and never exited: its run was aborted and the model released "
                          "when the tracer was garbage-collected (use `with model.trace(...)`)", RuntimeWarning,
                          stacklevel=2)
        except Exception:  # noqa: BLE001 - interpreter shutdown: warnings may be gone
            pass
        try:
            sess.close()
        finally:
            self._release_model()

    def run(self) -> "Tracer":
        """Run without an interleaved block (pre-registered ``saves`` / ``edits`` only); returns self."""
        with self:
            pass
        return self

    # -- reads / writes (used by the envoys) --------------------------------------------------
    def _require_session(self):
        if self._session is None:
            if self._deferred and self._deferred_open:
                raise InputError("this trace batches tracer.invoke(...) blocks: read and write values inside an invoke")
            raise InputError("this tracer is not open: values are read inside its `with` block")
        return self._session

    def _read(self, path: str):
        inv = _invoke.current()
        if inv is not None and inv.tracer is self:
            return inv.read(path)
        return self._read_here(path)

    def _read_here(self, path: str):
        """_read on the thread that opened the trace (not an invoke body): the per-value hot path."""
        sess = self._session
        if sess is None:
            self._require_session()
        # One binding call: in-place edits of the previous value go in first, then this value is read
        # and becomes the live one (mixlens._inplace describes the rules).
        value = sess.read_value(self._step, path)
        if self._grad:
            self._note_read(path, value)
        return value

    def _note_read(self, path: str, value) -> None:
        """grad=True: a value read in the block gets .grad from backward()."""
        if value is not None:
            self._grad_reads.append((path, value))

    def _refuse_foreign(self, path: str) -> None:
        """Raises for a read / write of `path` from outside the thread and context that opened this tracer:
        never another trace's values, never a wait on itself."""
        sess = self._session
        if sess is not None and sess.in_forward:
            raise InputError(f"'{path}' was read or written through the open tracer from inside the forward (an "
                             "edit function passed in edits=... runs there): it would wait on itself forever "
                             "(deadlock). Use the value the edit function is given; read other values in the "
                             "`with` block instead")
        owner = self._owner_thread
        where = "another asyncio task / context of this thread" if owner is threading.current_thread() else (
            f"thread {owner.name!r}" if owner is not None else "another thread")
        raise InputError(f"'{path}': the trace open on this model belongs to {where}; a thread reads values only "
                         "inside its own `with model.trace(...)` block (opening one waits until that trace ends)")

    def _write(self, path: str, value) -> None:
        inv = _invoke.current()
        if inv is not None and inv.tracer is self:
            return inv.write(path, value)
        sess = self._require_session()
        arr = as_float32(value, path)
        shape = self._expected_shape(path)
        if shape is not None and arr.shape != shape:
            try:  # a scalar / vector broadcast over the value (mix.betas[...] = 0 style), as torch would
                arr = np.ascontiguousarray(np.broadcast_to(arr, shape))
            except ValueError:
                pass  # the core names the expected and given shapes
        sess.write_value(self._step, path, arr)

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
        base, at, _ = path.partition("@t")
        if at and base.endswith(".state"):  # one token's slice of `states` [B,T,...] -> [B,...]
            states = table.get(base + "s")
            return None if states is None else states[:1] + states[2:]
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
        pad_token_id (a batch given with an attention_mask: the ids as given); int64, a torch tensor or numpy
        array by the model's output format."""
        pad = self._model._core.pad_token_id
        T = max(len(r) for r in self._rows)
        ids = np.array([[pad] * (T - len(r)) + list(r) for r in self._rows], dtype=np.int64)
        return to_plain(ids, self._fmt)

    @property
    def attention_mask(self):
        """``[B, T]`` int64, 1 for real tokens and 0 for left padding (transformers' attention_mask of the
        same left-padded batch); a torch tensor or numpy array by the model's output format."""
        T = max(len(r) for r in self._rows)
        if self._mask:  # a batch the caller padded: its own mask
            return to_plain(np.array(self._mask, dtype=np.int64).reshape(len(self._rows), T), self._fmt)
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
        if self._grad and self._kind == "trace":
            if self._fmt != "torch":
                return to_plain(self._grad_logits(), self._fmt)
            # One leaf tensor, so a metric built from it can be differentiated (backward()).
            if self._logits_leaf is None:
                self._logits_leaf = to_plain(self._grad_logits(), self._fmt).requires_grad_(True)
            return self._logits_leaf
        logits = [to_plain(x, self._fmt) for x in self._done()["logits"]]
        if self._kind == "trace":
            return logits[0]
        return logits or None

    output = logits  # nnsight spelling

    @property
    def tokens(self):
        """generate: the new token ids, a list per row when the input had a batch dimension (a list of
        prompts / rows, a [B,T] array, [B,T,hidden] inputs_embeds; B = 1 included), else one flat list (a
        string, flat ids, a [T] array, [T,hidden] inputs_embeds): the same for ids and embeddings."""
        toks = self._done()["new_tokens"]
        return toks[0] if self._single else toks

    @property
    def text(self):
        """generate: the decoded new tokens, shaped as :attr:`tokens` (a str per row, or one str)."""
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

    # -- gradients (issue 12, docs/gradients.md) ------------------------------------------------
    def _grad_logits(self):
        """Every position's logits of a grad trace: the forward returned them when they were saved, else
        they are formed once from the recorded LM-head input."""
        raw = self._done()["logits"][0]
        T = self._calls[-1]["seq"] if self._calls else raw.shape[1]
        if raw.shape[1] == T or self._grad_session is None:
            return raw
        if self._full_logits is None:
            self._full_logits = self._grad_session.logits_at(list(range(T)))
        return self._full_logits

    def backward(self, metric, paths: Optional[Iterable[str]] = None) -> None:
        """Gradients of a scalar `metric` of this trace's logits with respect to its values, computed natively
        (C++ reverse pass through the edited forward). Needs ``model.trace(..., grad=True)``.

        `metric`: a torch scalar computed from ``tracer.logits`` (torch output), a :mod:`mixlens.metrics`
        metric (``LogProb``, ``LogitDiff``; no torch needed), or dMetric/dLogits itself as a ``[B,T,vocab]``
        array. A metric that declares its positions (``Metric.positions``) gets the logits of those
        positions only, and the LM head's backward runs on those rows (docs/gradients.md); reading
        ``tracer.logits`` forms every position's. Gradients are computed for `paths` (value paths, ``*`` for every layer), by default every
        saved path and every value read in the block; each read value gets ``.grad``, and
        :meth:`grad` returns any of them. A second ``backward`` replaces every ``.grad`` (unlike torch's
        ``.backward``, gradients do not accumulate: add them yourself to combine metrics). Errors as
        ``Trace::backward`` (mixlens/trace.h)."""
        paths = _check_strs("paths", paths, allow_none=True)
        if self._session is not None:  # still inside the `with` block
            raise InputError("tracer.backward: call it after the `with` block has ended (the reverse pass needs the "
                             "whole forward); values read in the block get .grad then")
        sess = self._grad_session
        if sess is None:
            self._done()
            raise InputError("tracer.backward: open the trace with grad=True (model.trace(..., grad=True)) so the "
                             "forward keeps what the backward needs")
        raw = self._done()["logits"][0]
        seq = self._calls[-1]["seq"] if self._calls else raw.shape[1]
        positions: list = []  # the call positions dl covers; [] = every one
        pos_of = getattr(metric, "positions", None)
        declared = pos_of(seq) if callable(pos_of) and self._full_logits is None and raw.shape[1] != seq else None
        if declared is not None:
            # The metric reads a few positions: their logits only, and the LM head's backward on those rows.
            positions = [int(t) for t in declared]
            # The last position's are the forward's own (returned [B,1,V]); others are formed here.
            rows = raw if positions == [seq - 1] else self._grad_session.logits_at(positions)
            dl = metric.dlogits(rows, positions=positions, seq=seq)
        elif hasattr(metric, "dlogits") and callable(metric.dlogits):
            dl = metric.dlogits(self._grad_logits())
        elif is_torch(metric) and metric.dim() == 3 and not metric.requires_grad:
            dl = metric.detach().float().cpu().numpy()  # dMetric/dLogits itself, given as a torch tensor
        elif is_torch(metric):
            import torch

            leaf = self._logits_leaf
            if leaf is None or not metric.requires_grad:
                raise InputError("tracer.backward: the metric does not depend on tracer.logits (build it from "
                                 "tracer.logits after the block)")
            if metric.numel() != 1:
                raise InputError(f"tracer.backward: the metric must be a scalar, got shape {tuple(metric.shape)}")
            (g,) = torch.autograd.grad(metric, leaf, allow_unused=True)
            if g is None:
                raise InputError("tracer.backward: the metric does not depend on tracer.logits")
            dl = g.detach().to(torch.float32).contiguous().numpy()
        else:
            dl = as_float32(metric, "dlogits")
        dl = np.ascontiguousarray(dl, dtype=np.float32)
        if paths is None:
            wanted = [p for p, _, _ in self._saves] + [p for p, _ in self._grad_reads]
        else:
            wanted = [paths] if isinstance(paths, str) else list(paths)
        wanted = list(dict.fromkeys(wanted))
        sess.backward(dl, wanted, positions)
        have = set(sess.grad_paths())
        for path, value in self._grad_reads:
            if path in have:
                g = to_plain(sess.grad(path), self._fmt)
                try:
                    value.grad = g
                except (AttributeError, RuntimeError, TypeError):
                    pass  # a tensor type that takes no .grad: tracer.grad(path) still has it

    def grad(self, path: str):
        """The gradient computed by the last :meth:`backward` for `path` (same shape and type as the value)."""
        if self._grad_session is None:
            raise InputError("tracer.grad: run tracer.backward(metric) on a trace opened with grad=True first")
        if not isinstance(path, str):
            raise InputError(f"tracer.grad takes a value path, got {path!r} ({type(path).__name__})")
        return to_plain(self._grad_session.grad(path), self._fmt)

    @property
    def calls(self) -> list[dict]:
        """Every forward call: step, batch, seq, fresh (no cached state before), kernel ('chunked' or
        'recurrent'), first (positions earlier calls of this run pushed through each layer: 0 for the prompt,
        T + k - 1 at generation step k after a T-position prompt). (kernel, seq, first) are the seed's per-call
        (state op, sequence length, first): docs/values.md "Kernel identity"."""
        return self._session.calls if self._session is not None else self._calls
