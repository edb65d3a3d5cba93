"""LFM2 / LFM2-MoE numerical oracle: every value of transformers' pure-torch Lfm2ForCausalLM /
Lfm2MoeForCausalLM, prompt then decode steps (the reference of tests/fixtures/lfm2*, built by
scripts/make_fixtures.py). Imports no test framework.

How values are captured
-----------------------
The short conv (``Lfm2ShortConv``, served as ``layers.{i}.linear_attn``): ``in_proj``'s output hook
gives B | C | x (``attention_keys`` | ``attention_queries`` | ``attention_values``; an edit replaces
the module output, so transformers computes on with it); the conv window the call starts from is the
cache's ``conv_states`` read (and, for a ``state_input`` edit, written) in the module's pre-hook;
``state_output`` is the cache's ``conv_states`` after the call; ``attention_head_outputs`` is
``out_proj``'s input (C * conv(B * x)). ``states`` (the window after every token) comes from an explicit
recurrence (shift B * x into the window) that must end at transformers' cache (bit for bit: both are
copies of the same numbers). The module globals ``causal_conv1d_fn`` / ``causal_conv1d_update`` and
``apply_rotary_pos_emb`` are wrapped to check that each layer went through them (the attention's
queries and keys are read after RoPE there).

Keys as oracle_qwen: ``"<path>@step<k>"`` plus ``input_ids``, ``attention_mask``, ``tokens``.
Conv windows are ``[B, hidden, L_cache]``, transformers' conv_states layout (oldest token first).
"""

from __future__ import annotations

from typing import Sequence

import torch

from mixlens_dev import oracle_qwen as oq
from mixlens_dev.oracle_qwen import key

EDITABLE = ("attention_queries", "attention_keys", "attention_values", "state_input")


def window_recurrence(u: torch.Tensor, S0: torch.Tensor) -> torch.Tensor:
    """The conv window after every token: u [B, D, T] (B * x), S0 [B, D, K]. Returns [B, T, D, K]."""
    S = S0.clone()
    out = []
    for t in range(u.shape[-1]):
        S = torch.cat([S[..., 1:], u[..., t:t + 1]], dim=-1)
        out.append(S)
    return torch.stack(out, 1)


class _Recorder(oq._Recorder):
    """oracle_qwen's recorder protocol (put, _edit, begin_step are its own) over LFM2's modules."""

    def __init__(self, model, edits: Sequence[dict] = (), record: bool = True):
        super().__init__(model, edits, record)  # the bookkeeping; its GDN kernel names stay unused here
        self._h = []
        self._u = None
        self._S0 = None

    def _wrap(self, name):
        orig = self._orig[name]

        def wrapped(*args, **kwargs):
            self.calls.setdefault(self.cur_layer, []).append(name)
            if name != "apply_rotary_pos_emb":
                self.kernel_log.append((self.step, self.cur_layer, name))
                return orig(*args, **kwargs)
            qe, ke = orig(*args, **kwargs)
            p = f"layers.{self.cur_layer}.self_attn."
            self.put(p + "attention_queries", qe.transpose(1, 2))
            self.put(p + "attention_keys", ke.transpose(1, 2))
            return qe, ke

        return wrapped

    def _install_conv(self, i, conv):
        H = self._h

        def pre(m, args, kwargs, i=i):
            cache = kwargs.get("past_key_values")
            D, K = conv.conv.weight.shape[0], conv.conv_kernel_size
            b = (args[0] if args else kwargs["hidden_states"]).shape[0]
            if cache is not None and cache.has_previous_state(i):
                st = cache.layers[i].conv_states[0]
                edited = self._edit("state_input", st)
                if edited is not st:
                    st.copy_(edited)
                self.put(self._mix("state_input"), st)
                self._S0 = st.clone()
            else:
                self._S0 = torch.zeros(b, D, K)
            self._cache = cache

        def in_proj(m, a, o):
            D = o.shape[-1] // 3
            Bg, Cg, xg = o[..., :D], o[..., D:2 * D], o[..., 2 * D:]
            Bg, Cg, xg = self._edit("attention_keys", Bg), self._edit("attention_queries", Cg), self._edit("attention_values", xg)
            self.put(self._mix("attention_keys"), Bg)
            self.put(self._mix("attention_queries"), Cg)
            self.put(self._mix("attention_values"), xg)
            self._u = (Bg * xg).transpose(-1, -2)
            return torch.cat([Bg, Cg, xg], -1)

        def out_proj_pre(m, a):
            self.put(self._mix("attention_head_outputs"), a[0])

        def post(m, a, kw, o, i=i):
            states = window_recurrence(self._u, self._S0)
            self.put(self._mix("states"), states)
            cache = self._cache
            st = cache.layers[i].conv_states[0]
            if not torch.equal(states[:, -1], st):
                raise AssertionError(f"step {self.step} layer {i}: window recurrence != transformers' conv_states")
            self.put(self._mix("state_output"), st)
            self.put(self._mix("attention_output"), o)

        H.append(conv.register_forward_pre_hook(pre, with_kwargs=True))
        H.append(conv.in_proj.register_forward_hook(in_proj))
        H.append(conv.out_proj.register_forward_pre_hook(out_proj_pre))
        H.append(conv.register_forward_hook(post, with_kwargs=True))

    def _install(self):
        tm = self.model.model
        H = self._h
        H.append(tm.embed_tokens.register_forward_hook(lambda m, a, o: self.put("embed_tokens.output", o)))
        for i, layer in enumerate(tm.layers):
            self._hook_block(i, layer, layer.feed_forward)
            if layer.is_attention_layer:
                self._hook_plain_attention(i, layer.self_attn)
            else:
                self._install_conv(i, layer.conv)
        H.append(tm.embedding_norm.register_forward_hook(lambda m, a, o: self.put("ln_final.output", o)))

    def __enter__(self):
        for name in ("causal_conv1d_fn", "causal_conv1d_update", "apply_rotary_pos_emb"):
            self._orig[name] = getattr(self.mod, name)
            setattr(self.mod, name, self._wrap(name))
        self._install()
        return self

    def __exit__(self, *exc):
        for h in self._h:
            h.remove()
        for name, f in self._orig.items():
            setattr(self.mod, name, f)

    def end_step(self):
        """Guard: every layer went through the patched globals exactly once (the patch took)."""
        for i, layer in enumerate(self.model.model.layers):
            got = self.calls.get(i, [])
            ok = got == ["apply_rotary_pos_emb"] if layer.is_attention_layer else \
                len(got) == 1 and got[0] in ("causal_conv1d_fn", "causal_conv1d_update")
            if not ok:
                raise RuntimeError(f"step {self.step} layer {i}: patched calls {got} (did transformers stop "
                                   "resolving the kernels as module globals?)")


def run(model, prompts, pad_id, n_steps, edits=(), feeds=None, record=True):
    """Prompt (step 0) then n_steps-1 more calls, as oracle_qwen.run."""
    return oq.run(model, prompts, pad_id, n_steps, edits, feeds=feeds, record=record, recorder=_Recorder)
