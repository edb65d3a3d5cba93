"""RecurrentGemma numerical oracle: every value of transformers' pure-torch RecurrentGemmaForCausalLM,
prompt then decode steps (the reference of tests/fixtures/recurrent_gemma, built by
scripts/make_fixtures.py). Imports no test framework.

How values are captured
-----------------------
The recurrent block (``RecurrentGemmaRecurrentBlock``, served as ``layers.{i}.linear_attn``):
``linear_x``'s output hook gives the conv input; the RG-LRU's ``forward`` is replaced on the instance
by ``_rg_lru``, transformers' own lines with the values read (and edited) between them:
``attention_values`` (u, the conv output the RG-LRU receives; an edit of it, as in mixlens, changes
what the token writes and not the gates computed from it), ``betas`` (the input gate), ``decays``
(log a_t); its ``_rnn_scan`` runs unchanged. ``attention_head_outputs`` is the RG-LRU output,
``attention_output`` the block's. The state the call starts from / ends at is the block's
``conv1d_state`` ([B, W, K-1] in transformers, here transposed) stacked with ``rg_lru.recurrent_states``:
mixlens' layout [B, K, W] (rows 0..K-2 the window, oldest first; row K-1 h), read (and written back
when edited) in the block's pre- / post-hooks. ``states`` (after every token) comes from an explicit
recurrence (window shift; h_t = a_t h_{t-1} (0 at a reset) + sqrt(1 - a_t^2) i_t u_t) that must give
transformers' scan output and end at its cache bit for bit.

Padding: transformers feeds the padding positions' ``linear_x`` outputs into the conv of a row's
first real tokens (nothing masks them); mixlens zeroes them so that a padded row equals the row
alone. The oracle zeroes them too (``linear_x`` hook) and zeroes the RG-LRU output at padding (mixlens
reads nothing there); on unpadded rows both are no-ops and the run equals plain transformers
(fixtures/recurrent_gemma.py checks it, and every padded row against the same row alone).

Keys as oracle_qwen: ``"<path>@step<k>"`` plus ``input_ids``, ``attention_mask``, ``tokens``.
"""

from __future__ import annotations

import torch
from torch import nn

from mixlens_dev import oracle_qwen as oq


def explicit_states(x, a, nx, reset, mask, S0):
    """The state after every token, [B, T, K, W]: x [B,T,W] the conv inputs, a / nx [B,T,W] the
    recurrence gate and normalised input the scan receives, reset / mask [B,T] bool, S0 [B,K,W].
    Padding positions (mask False) leave the state zero (mixlens' scan starts at a row's first token)."""
    S = S0.clone()
    out = torch.zeros(x.shape[0], x.shape[1], *S0.shape[1:])
    for t in range(x.shape[1]):
        h = (a[:, t] * ~reset[:, t, None]) * S[:, -1] + nx[:, t]
        S = torch.cat([S[:, 1:-1], x[:, t:t + 1], h[:, None]], 1)
        S = torch.where(mask[:, t, None, None], S, torch.zeros_like(S))
        out[:, t] = S
    return out


def windowed_mask(window: int, T: int, mask):
    """The additive [B, 1, T, S] mask of a call's T last queries over S keys: causal, the padding of
    ``mask`` ([B, S] attention mask) masked, keys within ``window`` of the query (its own included)."""
    S = mask.shape[1]
    q = torch.arange(S - T, S)[:, None]
    s = torch.arange(S)[None]
    ok = (s <= q) & (s > q - window) & mask[:, None, None, :].bool()
    return torch.zeros(ok.shape).masked_fill(~ok, torch.finfo(torch.float32).min)


def fix_mask(m, args, kwargs, mask):
    """A RecurrentGemmaAttention pre-hook's fix (``mask``: the call's whole [B, S] attention mask).
    transformers 5.18 sizes the decode step's mask from the cache's layer 0, which a recurrent
    block 0 never fills: [B, 1, 1, 1] instead of [B, 1, 1, S], and left padding leaks into the
    attention. Such a mask is replaced by the causal, padding-masked, windowed one it stands for."""
    am, S = kwargs.get("attention_mask"), mask.shape[1]
    if am is None or am.shape[-1] == S:
        return None
    T = (args[0] if args else kwargs["hidden_states"]).shape[1]
    kwargs["attention_mask"] = windowed_mask(m.sliding_window, T, mask)
    return args, kwargs


class _Recorder(oq._Recorder):
    """oracle_qwen's recorder protocol (put, _edit, begin_step are its own) over RecurrentGemma's modules."""

    def __init__(self, model, edits=(), record: bool = True):
        super().__init__(model, edits, record)  # the bookkeeping; its GDN kernel names stay unused here
        self._h = []
        self._mask = None

    def _state(self, blk):
        return torch.cat([blk.conv1d_state.transpose(1, 2), blk.rg_lru.recurrent_states[:, None]], 1)

    def _set_state(self, blk, S):
        blk.conv1d_state = S[:, :-1].transpose(1, 2).contiguous()
        blk.rg_lru.recurrent_states = S[:, -1].contiguous()

    def _rg_lru(self, lru, blk):
        """RecurrentGemmaRglru.forward (transformers 5.18), values read and edited between its lines."""
        def forward(activations, position_ids):
            self.calls.setdefault(self.cur_layer, []).append("rg_lru")
            self.kernel_log.append((self.step, self.cur_layer, "recurrent"))
            batch_size, seq_len, lru_width = activations.shape
            reset = position_ids[:, :, None] == 0
            act = activations.reshape(batch_size * seq_len, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)
            res = torch.baddbmm(lru.input_gate_bias[:, None, :], act, lru.input_gate_weight)
            input_gate = torch.sigmoid(res.transpose(0, 1).reshape(batch_size, seq_len, lru_width))
            res = torch.baddbmm(lru.recurrent_gate_bias[:, None, :], act, lru.recurrent_gate_weight)
            recurrent_gate = torch.sigmoid(res.transpose(0, 1).reshape(batch_size, seq_len, lru_width))
            input_gate = self._edit("betas", input_gate)
            self.put(self._mix("betas"), input_gate)
            log_recurrent_gate = -8.0 * recurrent_gate * nn.functional.softplus(lru.recurrent_param)
            log_recurrent_gate = self._edit("decays", log_recurrent_gate)
            self.put(self._mix("decays"), log_recurrent_gate)
            recurrent_gate = torch.exp(log_recurrent_gate)
            a_square = torch.exp(2 * log_recurrent_gate)
            # mixlens: the gates come from the conv output first; an attention_values write changes what
            # the token writes, not its gates (rg_lru_mixer.cpp's value description).
            activations = self._edit("attention_values", activations)
            self.put(self._mix("attention_values"), activations)
            gated_inputs = activations * input_gate
            multiplier = self.mod.SqrtBoundDerivative.apply(1 - a_square)
            multiplier = reset + ~reset * multiplier
            normalized_x = gated_inputs * multiplier.type(activations.dtype)
            S0 = self._S0
            hidden_states, recurrent_states = lru._rnn_scan(hidden_states=normalized_x, recurrent_gate=recurrent_gate,
                                                            reset=reset, recurrent_states=lru.recurrent_states)
            lru.recurrent_states = recurrent_states
            mask = self._mask[:, -seq_len:].bool()
            states = explicit_states(self._x, recurrent_gate, normalized_x, reset[..., 0], mask, S0)
            h = states[..., -1, :]
            if not (torch.equal(h[mask], hidden_states[mask]) and torch.equal(h[:, -1], recurrent_states)):
                raise AssertionError(f"step {self.step} layer {self.cur_layer}: explicit RG-LRU != transformers' scan")
            self._states = states
            hidden_states = hidden_states * mask[..., None]  # mixlens reads nothing at padding
            hidden_states = self._edit("attention_head_outputs", hidden_states)
            self.put(self._mix("attention_head_outputs"), hidden_states)
            return hidden_states

        return forward

    def _install_recurrent(self, i, blk):
        H = self._h

        def pre(m, args, kwargs):
            if self.step == 0:
                blk.conv1d_state = None  # a fresh call: the block makes a zero state (no stale rows of a last run)
                self._S0 = torch.zeros(self._mask.shape[0], blk.conv1d_width, blk.lru_width)
                return
            S = self._edit("state_input", self._state(blk))
            self._set_state(blk, S)
            self.put(self._mix("state_input"), S)
            self._S0 = S.clone()

        def linear_x(m, a, o):
            o = o * self._mask[:, -o.shape[1]:, None].to(o.dtype)  # mixlens zeroes the padding's conv inputs
            self._x = o
            return o

        def post(m, a, kw, o):
            S = self._state(blk)
            if not torch.equal(self._states[:, -1], S):
                raise AssertionError(f"step {self.step} layer {i}: explicit states != transformers' cache")
            self.put(self._mix("states"), self._states)
            S = self._edit("state_output", S)
            self._set_state(blk, S)
            self.put(self._mix("state_output"), S)
            out = self._edit("attention_output", o[0])
            self.put(self._mix("attention_output"), out)
            return out, o[1]

        blk.rg_lru.forward = self._rg_lru(blk.rg_lru, blk)
        self._restore.append(lambda: delattr(blk.rg_lru, "forward"))
        H.append(blk.register_forward_pre_hook(pre, with_kwargs=True))
        H.append(blk.linear_x.register_forward_hook(linear_x))
        H.append(blk.register_forward_hook(post, with_kwargs=True))

    def _install(self):
        tm = self.model.model
        H = self._h
        self._restore = []
        H.append(tm.register_forward_pre_hook(self._read_mask, with_kwargs=True))
        # mixlens' embed_tokens.output is the scaled embedding: the first block's input.
        H.append(tm.layers[0].register_forward_pre_hook(lambda m, a: self.put("embed_tokens.output", a[0])))
        for i, layer in enumerate(tm.layers):
            self._hook_block(i, layer, layer.mlp_block)
            blk = layer.temporal_block
            if hasattr(blk, "rg_lru"):
                self._install_recurrent(i, blk)
            else:
                def vproj(m, a, o, i=i, hd=blk.head_dim):
                    b, t, _ = o.shape
                    self.put(f"layers.{i}.self_attn.attention_values", o.view(b, t, -1, hd))

                H.append(blk.v_proj.register_forward_hook(vproj))
                H.append(blk.register_forward_pre_hook(self._fix_mask, with_kwargs=True))
                H.append(blk.register_forward_hook(
                    lambda m, a, o, i=i: self.put(f"layers.{i}.self_attn.attention_output", o[0])))
        H.append(tm.final_norm.register_forward_hook(lambda m, a, o: self.put("ln_final.output", o)))

    def _fix_mask(self, m, args, kwargs):
        return fix_mask(m, args, kwargs, self._mask)

    def _read_mask(self, m, args, kwargs):
        self._mask = kwargs["attention_mask"]

    def __enter__(self):
        self._orig["apply_rotary_pos_emb"] = self.mod.apply_rotary_pos_emb
        self.mod.apply_rotary_pos_emb = self._rope  # oracle_qwen's: q / k after RoPE, one call per layer
        self._install()
        return self

    def end_step(self):
        """Guard: every block went through its patched call exactly once (the patch took)."""
        for i, layer in enumerate(self.model.model.layers):
            got = self.calls.get(i, [])
            want = ["rg_lru"] if hasattr(layer.temporal_block, "rg_lru") else ["rope"]
            if got != want:
                raise RuntimeError(f"step {self.step} layer {i}: patched calls {got}, expected {want}")


def run(model, prompts, pad_id, n_steps, edits=(), feeds=None, record=True):
    """Prompt (step 0) then n_steps-1 more calls, as oracle_qwen.run."""
    return oq.run(model, prompts, pad_id, n_steps, edits, feeds=feeds, record=record, recorder=_Recorder)
