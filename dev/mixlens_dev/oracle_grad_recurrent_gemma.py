"""Gradient oracle for RecurrentGemma (issue 25): torch autograd on transformers' pure-torch
RecurrentGemmaForCausalLM with every value of values.md kept (``retain_grad``), so its ``.grad`` can be
compared with mixlens' native backward (tests/python/test_grad_recurrent_gemma.py).

The recurrent block (``layers.{i}.linear_attn``) runs written out on every call (the instance's forward
replaced): y = gelu_tanh(linear_y(x)); the conv inputs linear_x(x) (zeroed at padding, as mixlens and
oracle_recurrent_gemma do); per token the window (K-1 rows) the conv reads, shifted by the token's input
and retained (``states``' window rows); u = conv; the gates as RecurrentGemmaRglru.forward computes them
from u; ``attention_values`` is u as the write reads it (a copy: the gates read u before any write, as
mixlens serves it); ``betas`` the input gate, ``decays`` log a_t; h_t = a_t h_{t-1} (0 at a reset) +
SqrtBoundDerivative(1 - a_t^2) i_t u_t, each h_t retained (``states``' row K-1); out = linear_out(h * y).
At a row's padding the state passes through unchanged (mixlens' scan starts at the row's first token),
so its gradient is the one of the state the row starts from. A continuation's conv reads the cached
window (mixlens' rule; transformers' multi-token prefill restarts the conv from zeros). On a fresh
unpadded prompt the written-out block is checked against RecurrentGemmaRecurrentBlock.forward.

Attention (``self_attn``): q / k after the (partial) RoPE, v from v_proj, the attention output; the
mask of a call after the prompt is oracle_recurrent_gemma.windowed_mask (transformers 5.18 sizes it from
the cache's layer 0, which a recurrent block 0 never fills). Edits are grad_common.set_index writes
(``out = v.clone(); out[:, idx] = c``). A continuation runs the prompt without gradients first (its
cache is a constant) and differentiates the second call, ``state_input`` a leaf.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from mixlens_dev import oracle_qwen as oq
from mixlens_dev.grad_common import collect, differentiate, keep as _keep, leaf as _leaf, set_index as _set_index
from mixlens_dev.oracle_recurrent_gemma import windowed_mask


def run(model, prompts, metric, edits=(), pad_id=0, continuation=None, check=True):
    """Gradients (numpy, served layouts) of ``metric(logits)`` for every value of the differentiated call:
    the prompt, or (``continuation``: [B, n] ids) the call continuing it."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mod = sys.modules[type(model).__module__]
    text = model.model
    keep, states, st = {}, {}, {}
    cur = {"layer": None, "grad": False, "mask": None, "call_mask": None}
    edits = list(edits)

    def edit(path, t):
        for e in edits:
            if e["path"] == path:
                t = _set_index(t, e)
        return t

    def k_(path, t):
        return _keep(keep, path, edit(path, t)) if cur["grad"] else t

    def recurrent(blk, i, input_states, position_ids, attention_mask=None, use_cache=True, **kw):
        base = f"layers.{i}.linear_attn."
        lru, mask = blk.rg_lru, cur["call_mask"]
        B, T, _ = input_states.shape
        K, W, H = blk.conv1d_width, blk.lru_width, lru.num_attention_heads
        y = blk.act_fn(blk.linear_y(input_states))
        x = blk.linear_x(input_states) * mask[..., None].to(input_states.dtype)
        fresh = i not in st
        S0 = torch.zeros(B, K, W) if fresh else k_(base + "state_input", st[i].clone().requires_grad_(cur["grad"]))
        w = blk.conv_1d.weight[:, 0, :].T  # [K, W]
        win, h = S0[:, :K - 1], S0[:, K - 1]
        wins, hs, us = [], [], []
        for t in range(T):
            real = mask[:, t, None, None].bool()
            ext = torch.cat([win, x[:, t:t + 1]], 1)
            us.append((ext * w).sum(1) + blk.conv_1d.bias)
            win = torch.where(real, ext[:, 1:], win)
            if cur["grad"]:
                win.retain_grad()
            wins.append(win)
        u = torch.stack(us, 1)
        # RecurrentGemmaRglru.forward's gates, from the conv output.
        act = u.reshape(B * T, H, lru.block_width).permute(1, 0, 2)
        res = torch.baddbmm(lru.input_gate_bias[:, None, :], act, lru.input_gate_weight)
        input_gate = k_(base + "betas", torch.sigmoid(res.transpose(0, 1).reshape(B, T, W)))
        res = torch.baddbmm(lru.recurrent_gate_bias[:, None, :], act, lru.recurrent_gate_weight)
        recurrent_gate = torch.sigmoid(res.transpose(0, 1).reshape(B, T, W))
        log_a = k_(base + "decays", -8.0 * recurrent_gate * nn.functional.softplus(lru.recurrent_param))
        u_w = k_(base + "attention_values", u.clone())
        reset = (position_ids == 0)[..., None]
        multiplier = mod.SqrtBoundDerivative.apply(1 - torch.exp(2 * log_a))
        normalized_x = u_w * input_gate * (reset + ~reset * multiplier)
        a = torch.exp(log_a) * ~reset
        for t in range(T):
            h = torch.where(mask[:, t, None].bool(), a[:, t] * h + normalized_x[:, t], h)
            if cur["grad"]:
                h.retain_grad()
            hs.append(h)
        out_h = k_(base + "attention_head_outputs", torch.stack(hs, 1) * mask[..., None])
        out = blk.linear_out(out_h * y)
        if check and fresh and not edits and bool(mask.all()):
            with torch.no_grad():
                ref = type(blk).forward(blk, input_states, position_ids, None, use_cache=False)[0]
            assert torch.allclose(out, ref, atol=1e-5), f"layer {i}: written-out RG-LRU block != transformers"
        out = k_(base + "attention_output", out)
        st[i] = torch.cat([win, h[:, None]], 1).detach()
        if cur["grad"]:
            states[base + "states"] = (wins, hs)
        return out, None

    def rope(q, k, cos, sin, *a, **kw):
        qe, ke = orig_rope(q, k, cos, sin, *a, **kw)
        if not cur["grad"]:
            return qe, ke
        base = f"layers.{cur['layer']}.self_attn."  # [B,H,T,d]: kept as served, [B,T,H,d]
        qe = k_(base + "attention_queries", qe.transpose(1, 2)).transpose(1, 2)
        ke = k_(base + "attention_keys", ke.transpose(1, 2)).transpose(1, 2)
        return qe, ke

    handles, patched = [], []

    def hook(module, fn, **kw):
        handles.append(module.register_forward_hook(fn, **kw))

    for i, layer in enumerate(text.layers):
        def pre(m, args, kwargs, i=i):
            cur["layer"] = i
            if not cur["grad"]:
                return None
            x = args[0]
            if i == 0:
                x = _leaf(keep, x)
            x = k_(f"layers.{i}.layer_input", x.clone())
            return (x, *args[1:]), kwargs

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hook(layer, lambda m, a, o, i=i: k_(f"layers.{i}.layer_output", o))
        hook(layer.mlp_block, lambda m, a, o, i=i: k_(f"layers.{i}.mlp.output", o))
        blk = layer.temporal_block
        if hasattr(blk, "rg_lru"):
            blk.forward = lambda *a, blk=blk, i=i, **kw: recurrent(blk, i, *a, **kw)
            patched.append(blk)
        else:
            def vproj(m, a, o, i=i, hd=blk.head_dim):
                b, t, _ = o.shape
                return k_(f"layers.{i}.self_attn.attention_values", o.view(b, t, -1, hd)).reshape(b, t, -1)

            hook(blk.v_proj, vproj)
            def att_mask(m, args, kwargs):
                T = (args[0] if args else kwargs["hidden_states"]).shape[1]
                S = cur["mask"].shape[1]
                if T == S:  # a prompt: transformers' own mask
                    return None
                # The sliding-window cache layer returns its last window - 1 keys and the call's: the mask's last
                # columns (the keys before them lie outside every query's window).
                keys = min(S - T, m.sliding_window - 1) + T
                kwargs["attention_mask"] = windowed_mask(m.sliding_window, T, cur["mask"])[..., -keys:]
                return args, kwargs

            handles.append(blk.register_forward_pre_hook(att_mask, with_kwargs=True))
            hook(blk, lambda m, a, o, i=i: (k_(f"layers.{i}.self_attn.attention_output", o[0]),) + tuple(o[1:]))
    hook(text.final_norm, lambda m, a, o: k_("ln_final.output", o))
    orig_rope = mod.apply_rotary_pos_emb
    mod.apply_rotary_pos_emb = rope
    try:
        ids, mask = oq.pad_prompts(prompts, pad_id)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = mod.DynamicCache(config=model.config)

        def call(ids, mask, pos):
            cur["mask"], cur["call_mask"] = mask, mask[:, -ids.shape[1]:]
            return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)

        if continuation is not None:
            with torch.no_grad():
                call(ids, mask, pos)
            ids = torch.as_tensor(continuation, dtype=torch.long)
            pos = pos[:, -1:] + torch.arange(1, ids.shape[1] + 1)[None]
            mask = torch.cat([mask, torch.ones_like(ids)], 1)
        cur["grad"] = True
        m = differentiate(keep, metric, lambda: call(ids, mask, pos).logits)
    finally:
        mod.apply_rotary_pos_emb = orig_rope
        for h in handles:
            h.remove()
        for blk in patched:
            del blk.forward
    grads = collect(keep, {}, m)
    for p, (wins, hs) in states.items():  # [B,T,K,W]: window rows then h, zeros where nothing flowed
        g = [torch.cat([w.grad if w.grad is not None else torch.zeros_like(w),
                        (h.grad if h.grad is not None else torch.zeros_like(h))[:, None]], 1) for w, h in zip(wins, hs)]
        grads[p] = torch.stack(g, 1).numpy().copy()
    return grads
