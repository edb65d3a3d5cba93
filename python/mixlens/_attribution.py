"""Residual decomposition, direct logit attribution and attribution patching on StandardizedTransformer
(issue 26 items 2 and 3; docs/attribution.md), in TransformerLens's spelling (``decompose_resid``,
``accumulated_resid``, ``apply_ln_to_stack``, ``logit_attrs``). Every number is computed by the C++ core
(``mixlens/attribution.h``); this module converts inputs and outputs."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import _core
from ._args import as_index, check_bool, check_int
from ._convert import to_plain
from .errors import InputError


def _int_list(name: str, value, allow_none: bool = False) -> Optional[list[int]]:
    """An int or a sequence of ints as a list (None stays None when allowed)."""
    if value is None:
        if allow_none:
            return None
        raise InputError(f"{name} must be an integer or a list of integers, got None")
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    items = value if isinstance(value, (list, tuple)) else [value]
    try:
        return [as_index(v) for v in items]
    except TypeError:
        raise InputError(f"{name} must be an integer or a list of integers, got {value!r}") from None


class ResidStack:
    """Pieces of the residual stream at chosen positions (``mixlens::ResidStack``).

    ``components`` ``[C, B, P, hidden]``, ``labels`` (``"embed"``, ``"layers.3.linear_attn"``, ``"layers.3.mlp"``,
    ``"layers.3"`` for a whole block), ``sources`` (the value each was read from), ``layers`` (-1 for the
    embedding), ``positions`` (call positions of axis 2), ``resid`` ``[B, P, hidden]`` (the residual entering the
    final norm), ``logits`` ``[B, P, vocab]``, ``kind`` (``"decomposed"`` or ``"accumulated"``) and, for a
    decomposition, ``max_rel_error`` (how far the components' sum is from ``resid``)."""

    def __init__(self, model, core):
        self._model, self._core = model, core

    kind = property(lambda self: self._core.kind)
    labels = property(lambda self: list(self._core.labels))
    sources = property(lambda self: list(self._core.sources))
    layers = property(lambda self: list(self._core.layers))
    positions = property(lambda self: list(self._core.positions))
    max_rel_error = property(lambda self: self._core.max_rel_error)

    @property
    def components(self):
        return to_plain(self._core.components, self._model._output)

    @property
    def resid(self):
        return to_plain(self._core.resid, self._model._output)

    @property
    def logits(self):
        return to_plain(self._core.logits, self._model._output)

    def logit_attrs(self, tokens, incorrect_tokens=None, *, exact: bool = False):
        """``model.logit_attrs(self, ...)``."""
        return self._model.logit_attrs(self, tokens, incorrect_tokens, exact=exact)

    def __len__(self) -> int:
        return len(self._core.labels)

    def __repr__(self) -> str:
        return f"<mixlens ResidStack {self.kind}: {len(self)} components at positions {self.positions}>"


class AtpResult:
    """Attribution patching estimates (``mixlens::AtpResult``): ``estimates`` ``[N, B, P]`` for ``nodes`` (value
    paths; ``"layers.i.linear_attn.state"`` is ``state_after(p)``) at ``positions``, ``clean_metric``,
    ``corrupt_metric``, and ``ranked``: ``(node, position, estimate summed over rows)`` by ``|estimate|``."""

    def __init__(self, model, d: dict):
        self._model = model
        self.nodes: list[str] = list(d["nodes"])
        self.layers: list[int] = list(d["layers"])
        self.positions: list[int] = list(d["positions"])
        self._estimates = d["estimates"]
        self.clean_metric: float = d["clean_metric"]
        self.corrupt_metric: float = d["corrupt_metric"]
        self.ranked: list[tuple] = [tuple(r) for r in d["ranked"]]

    @property
    def estimates(self):
        return to_plain(self._estimates, self._model._output)

    def table(self, top: int = 20) -> str:
        """The `top` rows of ``ranked`` as text (node, position, estimate)."""
        top = check_int("top", top, 1, 1 << 30)
        width = max([len(n) for n, _, _ in self.ranked[:top]] + [4])
        lines = [f"{'node':<{width}}  {'pos':>5}  {'estimate':>12}"]
        lines += [f"{n:<{width}}  {p:>5}  {e:>12.6g}" for n, p, e in self.ranked[:top]]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<mixlens AtpResult: {len(self.nodes)} nodes x {len(self.positions)} positions, "
                f"metric clean {self.clean_metric:.6g} corrupt {self.corrupt_metric:.6g}>")


def _metric_fn(metric, seq: int):
    """(callable logits [B,P,V] -> (value, dlogits), the metric's call positions or [] for every position)."""
    pos_of = getattr(metric, "positions", None)
    if hasattr(metric, "dlogits") and hasattr(metric, "value"):
        declared = pos_of(seq) if callable(pos_of) else None
        positions = list(range(seq)) if declared is None else [int(t) for t in declared]

        def fn(z):
            return (float(metric.value(z, positions=positions, seq=seq)),
                    np.ascontiguousarray(metric.dlogits(z, positions=positions, seq=seq), dtype=np.float32))

        return fn, positions
    raise InputError("attribution_patching: metric must be a mixlens.metrics metric (LogitDiff, LogProb, ...), with "
                     "value(logits) and dlogits(logits)")


class AttributionMixin:
    """The attribution surface of :class:`mixlens.StandardizedTransformer` (docs/attribution.md)."""

    def _stack(self, fn, inputs, positions, inputs_embeds, attention_mask) -> ResidStack:
        rows, embeds, mask = self._input_args(inputs, inputs_embeds, attention_mask)
        return ResidStack(self, fn(self._core, rows, embeds, mask, _int_list("positions", positions)))

    def decompose_resid(self, inputs=None, *, positions=-1, inputs_embeds=None, attention_mask=None) -> ResidStack:
        """TransformerLens's ``decompose_resid``: the residual stream entering the final norm at `positions` (call
        positions, negative from the end; an int or a list) split into the embedding and each block's mixer /
        attention / MLP output as added to the residual (a block whose change is not such a sum, e.g. MiniMax's,
        is one component ``"layers.i"``). The components sum to ``resid`` (checked in the core: an error past
        1e-4 relative). Inputs as :meth:`run`."""
        return self._stack(_core.decompose_resid, inputs, positions, inputs_embeds, attention_mask)

    def accumulated_resid(self, inputs=None, *, positions=-1, inputs_embeds=None, attention_mask=None) -> ResidStack:
        """TransformerLens's ``accumulated_resid``: the residual entering block 0 and leaving every block,
        ``[num_layers + 1, B, P, hidden]``; ``logit_attrs(..., exact=True)`` of it is the logit lens."""
        return self._stack(_core.accumulated_resid, inputs, positions, inputs_embeds, attention_mask)

    def apply_ln_to_stack(self, stack: ResidStack):
        """TransformerLens's ``apply_ln_to_stack``: the final norm applied to every piece with its scale frozen at
        the real residual's (times the norm weight): ``[C, B, P, hidden]``."""
        return to_plain(_core.apply_ln_to_stack(self._core, _core_stack(stack)), self._output)

    def logit_attrs(self, stack: ResidStack, tokens, incorrect_tokens=None, *, exact: bool = False):
        """Direct logit attribution ``[C, B, P]``: each piece's share of ``logit[tokens] - logit[incorrect_tokens]``
        (one id, or one per row). ``exact=False``: the final norm's scale frozen at the real residual's
        (TransformerLens), so a decomposition's attributions sum to the logit difference; ``exact=True``: the
        change of the logit difference when the piece is removed from the residual (the norm recomputed), or
        for an accumulated stack the logit lens of each partial residual."""
        toks = _int_list("tokens", tokens)
        bad = _int_list("incorrect_tokens", incorrect_tokens, allow_none=True) or []
        return to_plain(_core.logit_attrs(self._core, _core_stack(stack), toks, bad,
                                          check_bool("exact", exact)), self._output)

    def attribution_patching(self, clean=None, corrupt=None, metric=None, *, nodes: Optional[Sequence[str]] = None,
                             positions=None, ig_steps: int = 0, attention_mask=None, clean_embeds=None,
                             corrupt_embeds=None) -> AtpResult:
        """Node attribution patching (Nanda): for every node at every position, ``(clean - corrupt) . dmetric/dnode``
        at the corrupt run, the first-order estimate of patching the clean value into the corrupt run.
        `clean` / `corrupt`: prompts of equal token length (ids or text; one padding). `metric`: a
        :mod:`mixlens.metrics` metric (``LogitDiff(good, bad)``). `nodes`: kinds among ``layer_output``,
        ``linear_attn.attention_output``, ``self_attn.attention_output``, ``mlp.output``, ``linear_attn.state``
        (default: all). `positions`: call positions (default: every one). ``ig_steps=k >= 1``: EAP-IG, the
        gradient averaged over k points between the corrupt and clean embeddings. ``clean_embeds`` /
        ``corrupt_embeds`` ``[B,T,hidden]`` instead of `clean` / `corrupt`, as ``inputs_embeds`` of :meth:`run`."""
        rc, ec, mask = self._input_args(clean, clean_embeds, attention_mask)
        rx, ex, mask_x = self._input_args(corrupt, corrupt_embeds, attention_mask)
        if mask != mask_x:
            raise InputError("attribution_patching: clean and corrupt need the same attention_mask")
        seq = ec.shape[1] if ec is not None else max(len(r) for r in rc)
        fn, mpos = _metric_fn(metric, seq)
        default_nodes = ["layer_output", "linear_attn.attention_output", "self_attn.attention_output", "mlp.output",
                         "linear_attn.state"]
        kinds = default_nodes if nodes is None else [nodes] if isinstance(nodes, str) else list(nodes)
        pos = [] if positions is None else _int_list("positions", positions)
        d = _core.attribution_patching(self._core, rc, rx, fn, kinds, mask, ec, ex, pos, mpos,
                                       check_int("ig_steps", ig_steps, 0, 1 << 16))
        return AtpResult(self, d)


def _core_stack(stack: Any):
    if not isinstance(stack, ResidStack):
        raise InputError(f"expected a ResidStack from decompose_resid / accumulated_resid, got {type(stack).__name__}")
    return stack._core
