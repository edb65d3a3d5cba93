"""MiniMax numerical oracle: every value of transformers' pure-torch MiniMaxForCausalLM, prompt then
decode steps (the reference of tests/fixtures/minimax, built by scripts/make_fixtures.py). Imports no
test framework.

How values are captured
-----------------------
Lightning attention (``MiniMaxLightningAttention``, module ``self_attn`` of a linear_attention block,
served as ``layers.{i}.linear_attn``): the module's ``act_fn`` (an instance attribute) is wrapped, so
its output, silu(qkv_proj(x)) reshaped [B, T, H, 3 * head_dim], gives q | k | v per head
(``attention_queries`` / ``attention_keys`` / ``attention_values``, recorded after the padding mask
the module applies next; an edit replaces the activation, so transformers computes on with it);
``decays`` is -slope_rate per head, broadcast over the tokens; the kv state the call starts from is
the cache's linear cache, read (and, for a ``state_input`` edit, written) in the module's pre-hook;
``state_output`` is the state the module returns; ``attention_head_outputs`` is the output norm's
input. ``states`` (the state after every token) comes from an explicit recurrence
S_t = exp(-slope) S_{t-1} + k_t^T v_t that must end at transformers' state within RECURRENCE_RTOL
(transformers' prompt path is the block-wise form). The kernel a call took is "chunked" when the
layer had no linear cache (transformers' block loop) and "recurrent" otherwise (its token loop).
Softmax attention blocks as oracle_qwen (``apply_rotary_pos_emb`` patched).

Keys as oracle_qwen. kv states are ``[B, H, head_dim (k), head_dim (v)]``, transformers' layout.

A transformers 5.18 bug, worked around here
-------------------------------------------
transformers builds the causal mask from layer 0's cache sizes (``is_sliding.index(False)``); when layer 0
is a lightning layer its DynamicLayer never grows, so every call over a cache is masked as if nothing were
cached: a multi-token continuation's queries see only the call's own keys (sdpa's ``is_causal``, aligned
top-left) and a decode step of a left-padded batch attends to the padding. A continuation then differs
from the same tokens in one prompt (by 1.35 in the logits of a fixture model). ``MaskSizedCache`` takes
the mask sizes from the first attention layer instead, and ``mask_sized_cache()`` makes it the cache
MiniMaxModel creates (``generate``), so the oracle and the plain-transformers checks compute what
the model defines: a continuation equals the whole prompt (to 1e-6), as mixlens's does.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch
import transformers.models.minimax.modeling_minimax as mm
from torch import nn

from mixlens_dev import oracle_qwen as oq

EDITABLE = ("attention_queries", "attention_keys", "attention_values", "state_input")


class MaskSizedCache(mm.MiniMaxCache):
    """MiniMaxCache whose mask sizes (and seen length) come from the first attention layer (module doc)."""

    def _sized(self, i: int) -> int:
        lin = [isinstance(c, torch.Tensor) for c in self.linear_cache]
        if i >= len(lin) or not lin[i]:
            return i
        # An attention layer holds [] in linear_cache (or lies past its end) and has a DynamicLayer.
        return next((j for j in range(len(self.layers)) if j >= len(lin) or not lin[j]), i)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._sized(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int):
        return super().get_mask_sizes(query_length, self._sized(layer_idx))

    def get_query_offset(self, layer_idx: int = 0):
        return super().get_query_offset(self._sized(layer_idx))


@contextmanager
def mask_sized_cache():
    """MaskSizedCache as the cache MiniMaxModel.forward creates (generate) while the block runs."""
    orig = mm.MiniMaxCache
    mm.MiniMaxCache = MaskSizedCache
    try:
        yield
    finally:
        mm.MiniMaxCache = orig


def lightning_recurrence(q, k, v, neg_slope, S0):
    """The kv state after every token: k, v [B, T, H, D] (q unused: the state does not read it),
    neg_slope [H], S0 [B, H, D, D]. Returns [B, T, H, D, D]."""
    del q
    ratio = torch.exp(neg_slope)[None, :, None, None]
    S = S0.clone()
    out = []
    for t in range(k.shape[1]):
        S = ratio * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(S)
    return torch.stack(out, 1)


class _Act(nn.Module):
    """The lightning module's act_fn with the recorder's q / k / v capture and edits after it."""

    def __init__(self, rec, orig, heads, hd):
        super().__init__()
        self.rec, self.orig, self.heads, self.hd = rec, orig, heads, hd

    def forward(self, x):
        rec = self.rec
        rec.calls.setdefault(rec.cur_layer, []).append("act")
        y = self.orig(x)
        b, t, _ = y.shape
        y4 = y.view(b, t, self.heads, 3 * self.hd)
        q, k, v = torch.split(y4, self.hd, dim=3)
        q, k, v = rec._edit("attention_queries", q), rec._edit("attention_keys", k), rec._edit("attention_values", v)
        m = rec._mask
        mk = (lambda z: z) if m is None else (lambda z: z * m[:, :, None, None].to(z.dtype))
        rec._qkv = (mk(q), mk(k), mk(v))
        rec.put(rec._mix("attention_queries"), mk(q))
        rec.put(rec._mix("attention_keys"), mk(k))
        rec.put(rec._mix("attention_values"), mk(v))
        return torch.cat([q, k, v], dim=3).reshape(b, t, -1)


class _Recorder(oq._Recorder):
    """oracle_qwen's recorder protocol (put, _edit, begin_step are its own) over MiniMax's modules."""

    def __init__(self, model, edits: Sequence[dict] = (), record: bool = True):
        super().__init__(model, edits, record)
        self._h = []
        self._restore = []  # oracle_qwen's __exit__ runs these: the wrapped act_fn goes back
        self._mask = None
        self._qkv = None
        self._S0 = None

    def _install_lightning(self, i, at):
        def pre(m, args, kwargs, i=i):
            cache = kwargs.get("past_key_values")
            self._mask = kwargs.get("attention_mask")
            hs = args[0] if args else kwargs["hidden_states"]
            st = cache.get_linear_cache(i) if cache is not None else None
            H, D = at.num_attention_heads, at.head_dim
            if isinstance(st, torch.Tensor):
                edited = self._edit("state_input", st)
                if edited is not st:
                    st.copy_(edited)
                self.put(self._mix("state_input"), st)
                self._S0 = st.clone()
                self.kernel_log.append((self.step, i, "recurrent"))
            else:
                self._S0 = torch.zeros(hs.shape[0], H, D, D)
                self.kernel_log.append((self.step, i, "chunked"))
            self.calls.setdefault(i, []).append("lightning")

        def norm_pre(m, a, i=i):
            b, t, _ = a[0].shape
            neg = -at.slope_rate.reshape(-1)
            self.put(self._mix("decays"), neg[None, None, :].expand(b, t, -1))
            self.put(self._mix("attention_head_outputs"), a[0].view(b, t, at.num_attention_heads, at.head_dim))

        def post(m, a, kw, o, i=i):
            q, k, v = self._qkv
            states = lightning_recurrence(q, k, v, -at.slope_rate.reshape(-1), self._S0)
            self.put(self._mix("states"), states)
            ref = o[1]
            err = float((states[:, -1] - ref).norm() / ref.norm().clamp_min(1e-30))
            self.max_recurrence_err = max(self.max_recurrence_err, err)
            if err > oq.RECURRENCE_RTOL:
                raise AssertionError(f"step {self.step} layer {i}: recurrence vs transformers' state rel err {err:.2e}")
            self.put(self._mix("state_output"), ref)
            self.put(self._mix("attention_output"), o[0])

        orig = at.act_fn
        at.act_fn = _Act(self, orig, at.num_attention_heads, at.head_dim)
        self._restore.append(lambda: setattr(at, "act_fn", orig))
        self._h.append(at.register_forward_pre_hook(pre, with_kwargs=True))
        self._h.append(at.norm.register_forward_pre_hook(norm_pre))
        self._h.append(at.register_forward_hook(post, with_kwargs=True))

    def _install(self):
        tm = self.text
        H = self._h
        H.append(tm.embed_tokens.register_forward_hook(lambda m, a, o: self.put("embed_tokens.output", o)))
        for i, layer in enumerate(tm.layers):
            self._hook_block(i, layer, layer.mlp)
            if layer.block_type == "linear_attention":
                self._install_lightning(i, layer.self_attn)
            else:
                self._hook_plain_attention(i, layer.self_attn)
        H.append(tm.norm.register_forward_hook(lambda m, a, o: self.put("ln_final.output", o)))

    def __enter__(self):
        self._orig["apply_rotary_pos_emb"] = self.mod.apply_rotary_pos_emb
        self.mod.apply_rotary_pos_emb = self._rope
        self._install()
        return self

    def end_step(self):
        """Guard: every layer went through its patched function / wrapped act exactly once."""
        for i, layer in enumerate(self.text.layers):
            got = sorted(self.calls.get(i, []))
            want = ["act", "lightning"] if layer.block_type == "linear_attention" else ["rope"]
            if got != want:
                raise RuntimeError(f"step {self.step} layer {i}: patched calls {got}, expected {want}")


def run(model, prompts, pad_id, n_steps, edits=(), feeds=None, record=True):
    """Prompt (step 0) then n_steps-1 more calls, as oracle_qwen.run, through a MaskSizedCache."""
    return oq.run(model, prompts, pad_id, n_steps, edits, feeds=feeds, record=record, recorder=_Recorder,
                  cache=MaskSizedCache())


def check_against_plain_hf(model, values, greedy: bool) -> None:
    """fixtures.qwen.check_against_plain_hf (generate's tokens and logits, the prompt logits) with the
    MaskSizedCache fix in place."""
    from mixlens_dev.fixtures.qwen import check_against_plain_hf as check

    with mask_sized_cache():
        check(model, values, greedy)
