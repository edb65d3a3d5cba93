"""RWKV-4 oracle: transformers 5.18 RwkvForCausalLM (eval: layers rescaled) run block by block with every
mixlens value captured and editable, the WKV recurrence being rwkv_linear_attention_cpu's arithmetic with a
per-token decay (so a decays edit is per token). The plain run is checked against transformers' own forward
(logits, the five-tensor state) and its WKV against rwkv_linear_attention_cpu itself.

State layout (mixlens, docs/values.md): per layer and row, flat [3A + 2D] = num | den | max | time-mix last
x (ln1 output) | channel-mix last x (ln2 output).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

from mixlens_dev.oracle_util import N_STEPS, advance, grad_recorder, mix


def wkv(k, v, w, u, num, den, mx, kept=None):
    """rwkv_linear_attention_cpu's loop, w [B,T,A] per token (log decay, <= 0); returns y, per-token
    (num, den, max) [B,T,3A] and the final state. ``kept`` (a list): each token's (num, den, max) tensors,
    retained for their ``.grad`` (the graph runs through them)."""
    T = k.shape[1]
    y = torch.zeros_like(k)
    per = []
    for t in range(T):
        ck, cv = k[:, t].float(), v[:, t]
        mo = torch.maximum(mx, ck + u)
        e1 = torch.exp(mx - mo)
        e2 = torch.exp(ck + u - mo)
        y[:, t] = (e1 * num + e2 * cv) / (e1 * den + e2)
        ms = torch.maximum(mx + w[:, t], ck)
        e1 = torch.exp(mx + w[:, t] - ms)
        e2 = torch.exp(ck - ms)
        num = e1 * num + e2 * cv
        den = e1 * den + e2
        mx = ms
        if kept is not None and num.requires_grad:
            for t_ in (num, den, mx):
                t_.retain_grad()
            kept.append((num, den, mx))
        per.append(torch.cat([num, den, mx], -1))
    return y, torch.stack(per, 1), (num, den, mx)


def shift(x, start):
    """Token shift: x[t-1], start at t = 0."""
    return torch.cat([start[:, None], x[:, :-1]], 1)


@torch.no_grad()
def run(model, prompts, edits=(), feeds=None, n_steps: int = N_STEPS, check: bool = True, keep=None):
    """Every value of a greedy run (prompt rows of equal length) of `n_steps` calls; `feeds` teacher-forces
    steps 1.. (else greedy). Keys '<path>@step<k>', plus 'tokens' [B, n_steps]. ``keep`` (a dict): the last
    step runs with autograd and ``keep`` receives its values as tensors (``retain_grad``; the embeddings,
    decays and state_input as leaves) and, under ``<path>#per``, each token's retained (num, den, max)."""
    rw = model.rwkv
    rw._rescale_layers()
    cfg = model.config
    L, D, A = cfg.num_hidden_layers, cfg.hidden_size, cfg.attention_hidden_size
    ids = torch.tensor(prompts)
    B = ids.shape[0]
    state = [None] * L
    vals, toks = {}, []
    hf_state = None

    for step in range(n_steps):
        grad = keep is not None and step == n_steps - 1
        put = grad_recorder(vals, edits, step, keep if grad else None,
                            lambda p: p == "embed_tokens.output" or p.endswith(("decays", "state_input")))

        torch.set_grad_enabled(grad)
        h = put("embed_tokens.output", rw.embeddings(ids))
        for i, blk in enumerate(rw.blocks):
            h = put(f"layers.{i}.layer_input", h)
            if i == 0:
                h = blk.pre_ln(h)
            att, ff = blk.attention, blk.feed_forward
            x = blk.ln1(h)
            T = x.shape[1]
            if state[i] is None:
                st = torch.cat([torch.zeros(B, 2 * A), torch.full((B, A), -1e30), torch.zeros(B, 2 * D)], 1)
            else:
                st = put(mix(i, "state_input"), state[i])
            num, den, mx, xa, xf = st.split([A, A, A, D, D], 1)
            s = shift(x, xa)
            k = put(mix(i, "attention_keys"), att.key(x * att.time_mix_key + s * (1 - att.time_mix_key)))
            v = put(mix(i, "attention_values"), att.value(x * att.time_mix_value + s * (1 - att.time_mix_value)))
            w = put(mix(i, "decays"), (-torch.exp(att.time_decay)).expand(B, T, A).contiguous())
            r = put(mix(i, "attention_queries"),
                    torch.sigmoid(att.receptance(x * att.time_mix_receptance + s * (1 - att.time_mix_receptance))))
            y, per, (num, den, mx) = wkv(k, v, w, att.time_first, num, den, mx,
                                         keep.setdefault(mix(i, "states") + "#per", []) if grad else None)
            if check and not edits:  # the WKV loop is transformers' own function
                ry, rs = rwkv_linear_attention_cpu(att.time_decay, att.time_first, k, v, state=[
                    st[:, :A], st[:, A:2 * A], st[:, 2 * A:3 * A]], return_state=True)
                assert torch.equal(ry, y) and all(torch.equal(a, b) for a, b in zip(rs, (num, den, mx)))
            y = put(mix(i, "attention_head_outputs"), y)
            out = put(mix(i, "attention_output"), att.output(r * y))
            h = h + out
            x2 = blk.ln2(h)
            vals[f"{mix(i, 'states')}@step{step}"] = torch.cat([per, x, x2], -1).detach().numpy().copy()
            state[i] = torch.cat([num, den, mx, x[:, -1], x2[:, -1]], 1)
            state[i] = put(mix(i, "state_output"), state[i])
            s2 = shift(x2, xf)
            kk = torch.square(torch.relu(ff.key(x2 * ff.time_mix_key + s2 * (1 - ff.time_mix_key))))
            rr = torch.sigmoid(ff.receptance(x2 * ff.time_mix_receptance + s2 * (1 - ff.time_mix_receptance)))
            h = h + put(f"layers.{i}.mlp.output", rr * ff.value(kk))
            if cfg.rescale_every > 0 and (i + 1) % cfg.rescale_every == 0:
                h = h / 2
            h = put(f"layers.{i}.layer_output", h)
        h = put("ln_final.output", rw.ln_out(h))
        logits = put("logits", model.head(h))
        if check and not edits:
            # transformers' own forward over its own state gives the same logits and state. Row by row:
            # its one-token step broadcasts a [B, D] shift state against [B, 1, D] to [B, B, D] when B > 1.
            hf_state = hf_state or [None] * B
            for b in range(B):
                out = model(ids[b:b + 1], state=hf_state[b], use_cache=True)
                hf_state[b] = out.state
                assert torch.allclose(out.logits, logits[b:b + 1], rtol=1e-5, atol=1e-5), (out.logits - logits[b:b + 1]).abs().max()
                for i in range(L):  # its five-tensor state is ours, re-laid
                    hs = out.state
                    ours = torch.cat([hs[2][:, :, i], hs[3][:, :, i], hs[4][:, :, i], hs[1][:, :, i], hs[0][:, :, i]], 1)
                    assert torch.allclose(ours, state[i][b:b + 1], rtol=1e-5, atol=1e-5)
        ids = advance(logits, toks, feeds, step, n_steps)
    vals["tokens"] = torch.stack(toks, 1).numpy()
    return vals


def grads(model, prompts, metric, edits=(), continuation=None):
    """torch autograd of ``metric(logits)`` for every value of the prompt's call, or (``continuation``:
    [B, n] ids) of the call continuing it: {path: numpy gradient} in mixlens' layouts, ``states`` as its
    num | den | max part [B,T,3A] (the shift parts of a state are the ln outputs themselves, not tensors of
    their own here), plus ``metric``. ``edits``: set_index writes ({path, index, value}) in that call.

    The max entries' gradients (``states`` and ``state_input``) are the exact partials ``g_num num + g_den den``
    (a state stands for (num e^max, den e^max)), not autograd's: through ``torch.maximum`` and
    ``exp(max - maximum(max, .))`` autograd returns 0 for them, which central differences contradict
    (test_grad_rwkv.py::test_max_entry_gradient_is_the_exact_partial)."""
    n = 1 if continuation is None else 2
    eds = [dict(e, op="set", step=n - 1) for e in edits]
    keep: dict = {}
    with torch.enable_grad():
        run(model, prompts, edits=eds, feeds=None if continuation is None else [continuation], n_steps=n,
            check=False, keep=keep)
        m = metric(keep["logits"])
        m.backward()
    out = {}

    def g_of(x):
        return x.grad if x.grad is not None else torch.zeros_like(x)

    for path, t in keep.items():
        if path.endswith("#per"):
            g = [torch.cat([g_of(n), g_of(d), g_of(n) * n + g_of(d) * d], -1) for n, d, _ in t]
            out[path[:-4]] = torch.stack(g, 1).detach().numpy()
        else:
            out[path] = g_of(t).detach().numpy().copy()
            if path.endswith("state_input"):
                A = model.config.attention_hidden_size
                out[path][:, 2 * A:3 * A] = (g_of(t)[:, :A] * t[:, :A] + g_of(t)[:, A:2 * A] * t[:, A:2 * A]).detach().numpy()
    out["metric"] = np.array(float(m.detach()))
    return out


def check_generate(model, prompts, values, n_steps: int = N_STEPS) -> None:
    """transformers' greedy generate gives the oracle's tokens (row by row: its batched step is broken, above)."""
    for b, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, max_new_tokens=n_steps, min_new_tokens=n_steps, do_sample=False)
        assert np.array_equal(gen[0, ids.shape[1]:].numpy(), values["tokens"][b]), (gen, values["tokens"])
