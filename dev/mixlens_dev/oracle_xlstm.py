"""xLSTM oracle: transformers 5.18 xLSTMForCausalLM (pure torch, mode "inference") run block by block with
every mixlens value captured and editable. The mLSTM itself is transformers' own backend
(xLSTMLayer.mlstm_backend: chunkwise kernel over whole chunks, the recurrent step for the rest); the
per-token states are transformers' mlstm_recurrent_step_native run token by token. The plain run is checked
against transformers' own forward with its cache (logits and the (C, n, m) state).

State layout (mixlens, docs/values.md "xLSTM"): per layer and row, flat C [NH,Dqk,Dv] | n [NH,Dqk] | m [NH].
decays = logsigmoid(soft-capped fgate pre-activation); a decays edit reaches transformers' backend as the
pre-activation whose logsigmoid it is (computed in float64). betas = exp(soft-capped igate pre-activation),
the input gate; a betas edit enters as its log.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.xlstm import modeling_xlstm as mx

from mixlens_dev.oracle_util import N_STEPS, advance, grad_recorder, mix


def flat(c, n, m):
    """transformers' (C [B,NH,Dqk,Dv], n [B,NH,Dqk], m [B,NH,1]) as mixlens' [B, row]."""
    B = c.shape[0]
    return torch.cat([c.reshape(B, -1), n.reshape(B, -1), m.reshape(B, -1)], 1)


def unflat(s, NH, Dqk, Dv):
    B = s.shape[0]
    a, b = NH * Dqk * Dv, NH * Dqk
    return s[:, :a].reshape(B, NH, Dqk, Dv), s[:, a:a + b].reshape(B, NH, Dqk), s[:, a + b:].reshape(B, NH, 1)


def fgate_of(lf):
    """The forget pre-activation whose logsigmoid is lf (< 0), in float64."""
    d = lf.double()
    return (d - torch.log(-torch.expm1(d))).float()


def step_states(q, k, v, ig, fg, c, n, m, eps, kept=None):
    """transformers' mlstm_recurrent_step_native token by token ([B,NH,T,.] inputs): per-token flat states,
    the outputs h [B,NH,T,Dv] and the last state. ``kept`` (a list): each token's (c, n, m) tensors, retained
    for their ``.grad`` (the graph runs through them). There m is a node of its own after the step (m + 0)
    and h is the step's read again from (c, n, that m): the step's own m is also the stabiliser its C and n
    were just formed with, so its ``.grad`` would hold those in-step paths (which cancel up to eps) rather
    than dL/dm with C and n held, the gradient of the state entry (C's and n's ``.grad`` are that already)."""
    per, hs = [], []
    for t in range(q.shape[2]):
        h, (c, n, m) = mx.mlstm_recurrent_step_native(q[:, :, t], k[:, :, t], v[:, :, t], ig[:, :, t, None],
                                                       fg[:, :, t, None], c, n, m, eps=eps,
                                                       dtype_state=q.dtype)
        if kept is not None and c.requires_grad:
            m = m + 0.0
            qs = q[:, :, t] * (q.shape[-1] ** -0.5)  # the step's read (lines h_num .. h = h_num / h_denom)
            qn = (qs[:, :, None, :] @ n[:, :, :, None]).squeeze(2)
            read = (qs[:, :, None, :] @ c).squeeze(2) / (torch.maximum(qn.abs(), torch.exp(-m)) + eps)
            assert torch.allclose(read, h, rtol=1e-6, atol=1e-7), (read - h).abs().max()
            h = read
            for x in (c, n, m):
                x.retain_grad()
            kept.append((c, n, m))
        per.append(flat(c, n, m))
        hs.append(h)
    return torch.stack(per, 1), torch.stack(hs, 2), (c, n, m)


def dims(cfg):
    NH = cfg.num_heads
    return NH, int(cfg.hidden_size * cfg.qk_dim_factor) // NH, int(cfg.hidden_size * cfg.v_dim_factor) // NH


@torch.no_grad()
def run(model, prompts, edits=(), feeds=None, n_steps: int = N_STEPS, check: bool = True, keep=None,
        route: str = "default"):
    """Every value of a greedy run (prompt rows of equal length) of `n_steps` calls; `feeds` teacher-forces
    steps 1.. (else greedy). Keys '<path>@step<k>', plus 'tokens' [B, n_steps]. ``keep`` (a dict): the last
    step runs with autograd and ``keep`` receives its values as tensors (``retain_grad``; the embeddings and
    state_input as leaves; betas and decays always enter the backend, as their log / the pre-activation whose
    logsigmoid they are) and, under ``<path>#per``, each token's retained (c, n, m). ``route``: "recurrent"
    runs that step's mLSTM by transformers' recurrent step token by token (every token's state in the
    graph); else by its backend (chunkwise over whole chunks, the recurrent step for the rest)."""
    bb = model.backbone
    cfg = model.config
    NH, Dqk, Dv = dims(cfg)
    ids = torch.tensor(prompts)
    B = ids.shape[0]
    L = len(bb.blocks)
    state = [None] * L
    vals, toks = {}, []
    hf_cache = None

    for step in range(n_steps):
        grad = keep is not None and step == n_steps - 1
        put = grad_recorder(vals, edits, step, keep if grad else None,
                            lambda p: p == "embed_tokens.output" or p.endswith("state_input"))

        torch.set_grad_enabled(grad)

        h = put("embed_tokens.output", bb.embeddings(ids))
        T = h.shape[1]
        for i, blk in enumerate(bb.blocks):
            h = put(f"layers.{i}.layer_input", h)
            x = blk.norm_mlstm(h)
            lay = blk.mlstm_layer
            if cfg.weight_mode == "single":
                q, k, v, o = lay.q(x), lay.k(x), lay.v(x), lay.ogate_preact(x)
                ig = mx.soft_cap(lay.igate_preact(x), cfg.gate_soft_cap)
                fp = mx.soft_cap(lay.fgate_preact(x), cfg.gate_soft_cap)
            else:
                q, k, v, o = torch.tensor_split(lay.qkv_opreact(x), (NH * Dqk, 2 * NH * Dqk, 2 * NH * Dqk + NH * Dv), -1)
                ig, fp = torch.tensor_split(mx.soft_cap(lay.ifgate_preact(x), cfg.gate_soft_cap), (NH,), -1)
            q = put(mix(i, "attention_queries"), q)
            k = put(mix(i, "attention_keys"), k)
            v = put(mix(i, "attention_values"), v)
            gi = put(mix(i, "betas"), torch.exp(ig))
            if grad or not torch.equal(gi, torch.exp(ig)):
                ig = torch.log(gi)
            lf0 = F.logsigmoid(fp)
            lf = put(mix(i, "decays"), lf0)
            if grad or not torch.equal(lf, lf0):
                fp = fgate_of(lf)
            if state[i] is None:
                st = torch.zeros(B, NH * Dqk * Dv + NH * Dqk + NH)
            else:
                st = put(mix(i, "state_input"), state[i])
            c0, n0, m0 = unflat(st, NH, Dqk, Dv)
            heads = lambda t: t.reshape(B, T, NH, -1).transpose(1, 2)  # noqa: E731
            qh, kh, vh, ih, fh = heads(q), heads(k), heads(v), ig.transpose(1, 2), fp.transpose(1, 2)
            kept = keep.setdefault(mix(i, "states") + "#per", []) if grad and route == "recurrent" else None
            per, ys, last = step_states(qh, kh, vh, ih, fh, c0, n0, m0, cfg.eps, kept)
            if kept is not None:
                y, (c1, n1, m1) = ys, last
            else:
                y, (c1, n1, m1) = lay.mlstm_backend(query=qh, key=kh, value=vh, igate=ih, fgate=fh, c_initial=c0,
                                                    n_initial=n0, m_initial=m0)
            vals[f"{mix(i, 'states')}@step{step}"] = per.detach().numpy()
            y = put(mix(i, "attention_head_outputs"), y.transpose(1, 2).reshape(B, T, -1))
            out = lay.out_proj(torch.sigmoid(o) * lay.multihead_norm(y.reshape(B, T, NH, Dv)))
            h = h + put(mix(i, "attention_output"), out)
            state[i] = put(mix(i, "state_output"), flat(c1, n1, m1))
            h = h + put(f"layers.{i}.mlp.output", blk.ffn(blk.norm_ffn(h)))
            h = put(f"layers.{i}.layer_output", h)
        h = put("ln_final.output", bb.out_norm(h))
        logits = put("logits", mx.soft_cap(model.lm_head(h), cfg.output_logit_soft_cap))
        if check and not edits:  # transformers' own forward over its own cache: the same logits and state
            out = model(ids, cache_params=hf_cache, use_cache=True)
            hf_cache = out.cache_params
            assert torch.allclose(out.logits, logits, rtol=1e-5, atol=1e-5), (out.logits - logits).abs().max()
            for i in range(L):
                ours = flat(*hf_cache.rnn_state[i])
                assert torch.allclose(ours, state[i], rtol=1e-5, atol=1e-5), (ours - state[i]).abs().max()
        ids = advance(logits, toks, feeds, step, n_steps)
    vals["tokens"] = torch.stack(toks, 1).numpy()
    return vals


def grads(model, prompts, metric, edits=(), continuation=None, route="default"):
    """torch autograd of ``metric(logits)`` for every value of the prompt's call, or (``continuation``:
    [B, n] ids) of the call continuing it: {path: numpy gradient} in mixlens' layouts, plus ``metric``.
    ``route`` "recurrent": transformers' recurrent step per token, ``states`` [B,T,row] (C | n | m) as the
    retained per-token states' gradients; else its backend (no per-token states in the graph, no ``states``).
    ``edits``: set_index writes ({path, index, value}) in that call."""
    n = 1 if continuation is None else 2
    eds = [dict(e, op="set", step=n - 1) for e in edits]
    keep: dict = {}
    with torch.enable_grad():
        run(model, prompts, edits=eds, feeds=None if continuation is None else [continuation], n_steps=n,
            check=False, keep=keep, route=route)
        m = metric(keep["logits"])
        m.backward()

    def g_of(x):
        return x.grad if x.grad is not None else torch.zeros_like(x)

    out = {}
    for path, t in keep.items():
        if path.endswith("#per"):
            if t:
                out[path[:-4]] = torch.stack([flat(g_of(c), g_of(n_), g_of(m_)) for c, n_, m_ in t], 1).numpy()
        else:
            out[path] = g_of(t).detach().numpy().copy()
    out["metric"] = np.array(float(m.detach()))
    return out


def check_generate(model, prompts, values, n_steps: int = N_STEPS) -> None:
    """transformers' greedy generate gives the oracle's tokens."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=n_steps, min_new_tokens=n_steps, do_sample=False)
    assert np.array_equal(gen[:, ids.shape[1]:].numpy(), values["tokens"]), (gen, values["tokens"])
