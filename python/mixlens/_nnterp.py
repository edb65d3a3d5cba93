"""nnterp's StandardizedTransformer surface on mixlens models (issue 10 item 3).

Everything here composes the core's primitives: reads and writes inside the open trace (steer,
skip_layer(s), next_token_probs) and ``Model::project_on_vocab`` / ``Model::head_weight`` in C++.
docs/nnterp.md maps every nnterp call to its mixlens spelling and states each difference.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np

from ._args import as_index, check_float, check_int, layer_list
from ._convert import as_float32, is_torch, saveable, to_plain
from ._envoy import _Envoy, _LayerValue
from .errors import InputError


def _softmax_last(logits, fmt: str):
    """softmax over the vocabulary of the last position: [B, T, V] -> [B, V] (left padding: the last real token)."""
    if fmt == "torch":
        import torch

        return torch.as_tensor(logits)[:, -1, :].softmax(-1).as_subclass(torch.Tensor)
    x = np.asarray(logits, dtype=np.float32)[:, -1, :]
    e = np.exp(x - x.max(-1, keepdims=True))
    return saveable(e / e.sum(-1, keepdims=True), fmt)


class _Weighted:
    """``model.lm_head`` (and the ``weight`` of ``embed_tokens`` / ``ln_final``): read access to a weight."""

    def __init__(self, model, role: str):
        self._model, self._role = model, role

    @property
    def weight(self):
        """A float32 copy of the weight (``embed_tokens``/``lm_head``: ``[vocab, hidden]``; ``ln_final``: ``[hidden]``,
        the stored RMSNorm weight: Qwen scales by ``1 + weight``)."""
        return to_plain(self._model._core.head_weight(self._role), self._model._output)

    @weight.setter
    def weight(self, value) -> None:
        from .errors import WriteError

        out = "logits" if self._role == "lm_head" else f"{self._role}.output"
        raise WriteError(f"{self._role}.weight is read-only (mixlens does not change parameters, and the weight "
                         f"it returns is a copy); write the value it produces ({out}) inside a trace instead")

    def __repr__(self) -> str:
        return f"<mixlens {self._role}: weight>"


def attach(model) -> None:
    """Adds the nnterp accessors to a freshly loaded model."""
    kinds = model.info["layer_kinds"]

    def mixer_output(i: int) -> str:
        return "self_attn.attention_output" if kinds[i] == "attention" else "linear_attn.attention_output"

    model.attentions_output = _LayerValue(model, mixer_output)
    model.mlps_output = _LayerValue(model, "mlp.output")
    # nnterp's attention_probabilities[i]: [B, heads, T_q, T_k] of a softmax-attention block (computed only
    # when read; read-only); a recurrent block raises naming its kind.
    model.attention_probabilities = _LayerValue(model, "self_attn.attention_probabilities")
    model.lm_head = _Weighted(model, "lm_head")

    class _HeadEnvoy(_Envoy):
        __slots__ = ("_role",)

        def __init__(self, m, prefix: str, role: str):
            super().__init__(m, prefix)
            object.__setattr__(self, "_role", role)

        @property
        def weight(self):
            return _Weighted(self._model, self._role).weight

        def __setattr__(self, name: str, value) -> None:
            if name == "weight":
                _Weighted(self._model, self._role).weight = value  # raises: weights are read-only
            super().__setattr__(name, value)

    model.embed_tokens = _HeadEnvoy(model, "embed_tokens.", "embed_tokens")
    model.ln_final = _HeadEnvoy(model, "ln_final.", "ln_final")


def _positions(p, name: str):
    """An index of positions / rows: None (all), a slice, an integer, or integers (a list / array / tensor; a
    bool array as a mask). InputError naming the argument for anything else (1.5 is not position 1)."""
    if p is None:
        return slice(None)
    if isinstance(p, slice):
        return p
    try:
        return as_index(p)
    except TypeError:
        pass
    if isinstance(p, (str, bytes)):
        raise InputError(f"steer: {name} must be integers, a slice or None, got {p!r}")
    a = np.asarray(p.detach().cpu().numpy() if is_torch(p) else p)
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iub":
        raise InputError(f"steer: {name} must be integers, a slice or None, got {p!r}")
    return a


class NnterpMixin:
    """nnterp methods of :class:`mixlens.StandardizedTransformer`."""

    # set by attach(): attentions_output, mlps_output (per-layer values), lm_head (.weight),
    # embed_tokens.weight, ln_final.weight

    @property
    def next_token_probs(self):
        """``softmax(logits[:, -1])``: ``[B, vocab]`` next-token probabilities of the current step (read inside a
        trace; left padding, so -1 is every row's last real token). nnterp: ``model.next_token_probs``."""
        return _softmax_last(self.logits, self._output)

    @property
    def token_embeddings(self):
        """``embed_tokens.output`` (nnterp: ``model.token_embeddings``), readable and assignable in a trace."""
        return self._read("embed_tokens.output")

    @token_embeddings.setter
    def token_embeddings(self, value) -> None:
        self._write("embed_tokens.output", value)

    @property
    def attention_mask(self):
        """The open trace's ``[B, T]`` attention mask (1 = real token, 0 = left padding); see Tracer.attention_mask."""
        return self._tracer_for("attention_mask").attention_mask

    @property
    def input_ids(self):
        """The open trace's left-padded ``[B, T]`` token ids."""
        return self._tracer_for("input_ids").input_ids

    @property
    def input_size(self) -> tuple:
        """(batch, seq) of the open trace's prompt batch."""
        ids = self.input_ids
        return tuple(ids.shape)

    def project_on_vocab(self, hidden_state):
        """nnterp's ``project_on_vocab``: ``lm_head(ln_final(h))`` for hidden states ``[..., hidden]`` (torch or
        numpy) -> logits ``[..., vocab]`` float32, computed by the core (``Model::project_on_vocab``), in or out
        of a trace. InputError for a wrong last dimension."""
        logits = to_plain(self._core.project_on_vocab(as_float32(hidden_state, "project_on_vocab")), self._output)
        return saveable(logits, self._output)

    def steer(self, layers: Union[int, Sequence[int]], steering_vector, factor: float = 1,
              positions=None, *, token_positions=None, batch_index=None) -> None:
        """nnterp's ``steer``: ``layers_output[l][batch_index, token_positions] += factor * steering_vector`` for each
        layer in `layers` (in forward order), at the current step of the open trace. `positions` is
        nnterp's deprecated spelling of `token_positions`; None means every position / row."""
        if positions is not None and token_positions is not None:
            raise InputError("steer: give positions or token_positions, not both")
        pos = _positions(token_positions if token_positions is not None else positions, "token_positions")
        rows = _positions(batch_index, "batch_index")
        vec = as_float32(steering_vector, "steering_vector") * np.float32(check_float("factor", factor))
        where = token_positions if token_positions is not None else positions
        for layer in sorted(set(layer_list("steer: layers", layers, self.num_layers))):
            h = as_float32(self.layers_output[layer], f"layers.{layer}.layer_output").copy()
            # numpy's own errors would name neither argument: say which one does not fit.
            try:
                target = h[rows, pos]
            except IndexError as e:
                raise InputError(f"steer: token_positions {where!r} / batch_index {batch_index!r} do not fit layer "
                                 f"{layer}'s output of shape {list(h.shape)} ([batch, seq, hidden]): {e}") from None
            try:
                fits = np.broadcast_shapes(target.shape, vec.shape) == target.shape
            except ValueError:
                fits = False
            if not fits:
                raise InputError(f"steer: steering_vector of shape {list(vec.shape)} does not broadcast to the "
                                 f"steered slice {list(target.shape)}: give [hidden_size] = [{h.shape[-1]}]")
            h[rows, pos] += vec
            self.layers_output[layer] = h

    def skip_layer(self, layer: int, skip_with: Any = None) -> None:
        """nnterp's ``skip_layer``: block `layer`'s output is `skip_with` (default: its own input), so the block adds
        nothing to the residual stream. The block still runs (its cache, e.g. the recurrent state, still
        updates, as in nnterp where the module runs and its output is replaced)."""
        n = self.num_layers
        layer = check_int("skip_layer: layer", layer, -n, n - 1)
        self.skip_layers(layer, layer, skip_with)

    def skip_layers(self, start_layer: int, end_layer: int, skip_with: Any = None) -> None:
        """nnterp's ``skip_layers``: blocks ``start_layer..end_layer`` (inclusive) all output `skip_with` (default: the
        input of `start_layer`)."""
        n = self.num_layers
        start_layer = check_int("skip_layers: start_layer", start_layer, -n, n - 1)
        end_layer = check_int("skip_layers: end_layer", end_layer, -n, n - 1)
        start = start_layer + n if start_layer < 0 else start_layer
        end = end_layer + n if end_layer < 0 else end_layer
        if not 0 <= start <= end < n:
            raise InputError(f"skip_layers({start_layer}, {end_layer}): need 0 <= start <= end < {n}")
        if skip_with is None:
            skip_with = as_float32(self.layers_input[start], f"layers.{start}.layer_input")
        for layer in range(start, end + 1):
            self.layers_output[layer] = skip_with


__all__ = ["NnterpMixin", "attach"]
