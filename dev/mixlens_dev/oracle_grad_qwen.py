"""Gradient oracle for Qwen3.5 / Qwen3-Next / Qwen3.5-MoE / OLMo-Hybrid / Kimi-Linear (issue 12) and LFM2 /
LFM2-MoE (issue 25): torch autograd on transformers' pure-torch Qwen3_5ForCausalLM / Qwen3NextForCausalLM /
OlmoHybridForCausalLM / KimiLinearForCausalLM / Lfm2ForCausalLM / Lfm2MoeForCausalLM with every value of values.md
kept (``retain_grad``), so its ``.grad`` can be compared with mixlens' native backward.

LFM2's short conv (``layers.{i}.linear_attn``) runs written out during the differentiated call
(B | C | x from in_proj, the window shifted token by token with every window retained as ``states``, the
cached window a leaf as ``state_input``); on a prompt it is checked against Lfm2ShortConv.forward itself.

The gated-delta kernels are module globals of ``modeling_qwen3_5`` / ``modeling_qwen3_5_moe`` / ``modeling_qwen3_next``
(oracle_qwen.py relies on the same); the wrapper makes the kernel's inputs (q, k per value head before
the in-kernel L2 norm, v, g, beta, the initial state) retained tensors and runs one of three scans,
whatever kernel transformers picked for the call:

* ``scan="chunk"``: transformers' ``torch_chunk_gated_delta_rule`` (autograd through the chunked
  algorithm); every value except the per-token ``states``, which it never forms.
* ``scan="recurrent"``: transformers' ``torch_recurrent_gated_delta_rule``; same values.
* ``scan="explicit"``: the token recurrence written out here with every ``S_t`` retained; every value.

Attention values: q / k after RoPE (the patched ``apply_rotary_pos_emb``; OLMo-Hybrid's NoPE layout: the
q_norm / k_norm outputs), v and the output-gate logits (Qwen) from the q_proj / v_proj outputs, the
attention output (the module's: before OLMo-Hybrid's post-norm). Edits are ``set_index`` writes
(``out = v.clone(); out[:, idx] = c``): the written elements are constants, as mixlens documents.
A continuation runs the prompt without gradients first (its cache is a constant) and differentiates
the second call, with the GDN ``state_input`` a leaf.

MiniMax (issue 25): the lightning blocks (``self_attn`` modules, served as ``layers.{i}.linear_attn``) run
transformers' own MiniMaxLightningAttention.forward (``scan`` "chunk" / "recurrent": its block form on a prompt,
its token loop over a cache, whichever the call takes) with q | k | v retained after ``act_fn``, the cached kv
state a leaf (``state_input``), the norm's input (``attention_head_outputs``) and the module's output retained;
``decays`` (-slope_rate, a buffer) and ``states`` are not tensors of that graph, so only ``scan="explicit"``
serves them: the module written out with the decays a [B,T,H] leaf and the token recurrence
S_t = exp(decays_t) S_{t-1} + k_t^T v_t, every S_t retained (checked against the module itself on a prompt).
The cache is oracle_minimax's MaskSizedCache (transformers 5.18's causal-mask bug on continuations).

Kimi-Linear: the wrapped kernels are ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``
(decays [B,T,H,Dk], one per key channel; the explicit recurrence decays each key row of S by its own
factor); both block kinds are ``self_attn`` modules (``block_type`` says which); the latent attention's
queries are q_proj's (or q_b_proj's) output, its keys and values this call's rows of ``expand_kv``'s
output (no RoPE).
"""

from __future__ import annotations

import re
import sys

import numpy as np
import torch

from mixlens_dev import oracle_minimax as om
from mixlens_dev import oracle_qwen as oq
from mixlens_dev.grad_common import collect, keep as _keep, set_index as _set_index

_PATH = re.compile(r"^layers\.(\d+)\.(linear_attn|mlp|self_attn)\.([a-z_]+)$")


def explicit_rule(q, k, v, g, beta, S0, keep_states):
    """The gated delta rule token by token ([B,T,H,*] layouts), each state retained."""
    q = oq.mq35.l2norm(q.float(), dim=-1, eps=1e-6) / (q.shape[-1] ** 0.5)
    k = oq.mq35.l2norm(k.float(), dim=-1, eps=1e-6)
    b, T, H, Dk = k.shape
    S = torch.zeros(b, H, Dk, v.shape[-1]) if S0 is None else S0.float()
    outs = []
    for t in range(T):  # g [B,T,H] per head, or [B,T,H,Dk] per key channel (Kimi)
        S = S * (g[:, t].float().exp()[..., None] if g.dim() == 4 else g[:, t].float().exp()[..., None, None])
        mem = (S * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t].float() - mem) * beta[:, t].float()[..., None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        S.retain_grad()
        keep_states.append(S)
        outs.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, 1), S


def _hook_latent_attention(at, i, cur, keep, edit, hook, handles):
    """KimiLinearAttention: queries from q_proj (or q_b_proj), this call's keys and values (the last T rows of
    expand_kv's [B,H,past+T,*] output) as retained tensors; the earlier rows (the cache) stay constants."""
    base = f"layers.{i}.self_attn."
    q_mod = at.q_proj if at.q_proj is not None else at.q_b_proj
    hook(q_mod, lambda m, a, o: _keep(keep, base + "attention_queries", edit(base + "attention_queries", o))
         if cur["grad"] else o)
    orig = type(at).expand_kv.__get__(at)
    t_len = {}

    def expand_kv(kv_nope, k_rot):
        k, v = orig(kv_nope, k_rot)
        if not cur["grad"]:
            return k, v
        t = t_len["t"]
        out = []
        for name, x in (("attention_keys", k), ("attention_values", v)):
            new = _keep(keep, base + name, edit(base + name, x[:, :, -t:]))
            out.append(torch.cat([x[:, :, :-t], new], 2))
        return tuple(out)

    def pre(m, args, kwargs):
        t_len["t"] = (args[0] if args else kwargs["hidden_states"]).shape[1]

    at.expand_kv = expand_kv
    handles.append(at.register_forward_pre_hook(pre, with_kwargs=True))

    def att_post(m, a, o):
        if not cur["grad"]:
            return o
        p = base + "attention_output"
        return (_keep(keep, p, edit(p, o[0])),) + tuple(o[1:])

    hook(at, att_post)


class _Fn(torch.nn.Module):
    """A function as a module (to stand in for a submodule such as act_fn)."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def _hook_lightning(at, i, cur, k_, states, mod, scan, handles, patched, edited):
    """MiniMaxLightningAttention of layer i during the differentiated call (module doc): ``scan`` "explicit"
    replaces the instance's forward with the written-out recurrence; otherwise transformers' forward runs with
    its values retained (a wrapped act_fn, the cache's kv state swapped for a leaf, norm / output hooks).
    ``edited``: the call has edits (the written-out form is then not compared with transformers')."""
    H, hd = at.num_attention_heads, at.head_dim

    def written_out(hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kw):
        b, T, _ = hidden_states.shape
        q, k, v = torch.split(at.act_fn(at.qkv_proj(hidden_states)).reshape(b, T, H, 3 * hd), hd, dim=3)
        # Retained and edited before the padding mask, as in the wrapped act_fn below (oracle_minimax's edits).
        q, k, v = k_("attention_queries", q), k_("attention_keys", k), k_("attention_values", v)
        qkv = mod.apply_mask_to_padding_states(torch.cat([q, k, v], 3).reshape(b, T, -1), attention_mask)
        q, k, v = torch.split(qkv.reshape(b, T, H, 3 * hd), hd, dim=3)
        dec = k_("decays", (-at.slope_rate.reshape(1, 1, H)).expand(b, T, H).clone().requires_grad_(True))
        st = past_key_values.get_linear_cache(i) if past_key_values is not None else None
        cached = isinstance(st, torch.Tensor)
        S = k_("state_input", st.detach().clone().requires_grad_(True)) if cached else torch.zeros(b, H, hd, hd)
        sts = states[f"layers.{i}.linear_attn.states"] = []
        outs = []
        for t in range(T):
            S = dec[:, t].exp()[..., None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
            S.retain_grad()
            sts.append(S)
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        o = k_("attention_head_outputs", torch.stack(outs, 1))
        out = at.out_proj(torch.sigmoid(at.output_gate(hidden_states)) * at.norm(o.reshape(b, T, H * hd)))
        if not cached and not edited:  # a prompt: the same as transformers' block form
            with torch.no_grad():
                ref = type(at).forward(at, hidden_states, None, attention_mask)[0]
            assert torch.allclose(out, ref, atol=1e-5), f"layer {i}: lightning attention written out != transformers"
        if past_key_values is not None:
            past_key_values.set_linear_cache(i, S)
        return out, S

    if scan == "explicit":
        at.forward = lambda *a, **kw: written_out(*a, **kw) if cur["grad"] else type(at).forward(at, *a, **kw)
        patched.append(at)
        return
    orig_act = at.act_fn

    def act(x):
        y = orig_act(x)
        if not cur["grad"]:
            return y
        b, T, _ = y.shape
        q, k, v = torch.split(y.view(b, T, H, 3 * hd), hd, dim=3)
        q, k, v = k_("attention_queries", q), k_("attention_keys", k), k_("attention_values", v)
        return torch.cat([q, k, v], dim=3).reshape(b, T, -1)

    at.act_fn = _Fn(act)  # a submodule attribute takes a module
    patched.append((at, "act_fn", orig_act))

    def pre(m, args, kwargs):
        cache = kwargs.get("past_key_values")
        st = cache.get_linear_cache(i) if cache is not None and cur["grad"] else None
        if isinstance(st, torch.Tensor):
            cache.set_linear_cache(i, k_("state_input", st.detach().clone().requires_grad_(True)))

    def norm_pre(m, a):
        if not cur["grad"]:
            return None
        b, T, _ = a[0].shape
        return (k_("attention_head_outputs", a[0].view(b, T, H, hd)).reshape(b, T, H * hd),)

    handles.append(at.register_forward_pre_hook(pre, with_kwargs=True))
    handles.append(at.norm.register_forward_pre_hook(norm_pre))


def run(model, prompts, metric, scan="chunk", edits=(), pad_id=0, continuation=None):
    """Gradients (numpy, served layouts) of ``metric(logits)`` for every value of the differentiated call:
    the prompt, or (``continuation``: [B, n] ids) the call continuing it."""
    assert scan in ("chunk", "recurrent", "explicit")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mod = sys.modules[type(model).__module__]  # the model's own modeling module (its globals are what it calls)
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    nope = getattr(text, "rotary_emb", True) is None  # OLMo-Hybrid with rope_theta null
    kimi = mod.__name__.endswith("modeling_kimi_linear")
    minimax = mod.__name__.endswith("modeling_minimax")  # lightning blocks as self_attn (block_type says which)
    keep, states = {}, {}
    cur = {"layer": None, "grad": False}
    edits = list(edits)
    lfm2 = hasattr(text, "embedding_norm")  # LFM2 / LFM2-MoE: short conv blocks, their module names
    chunk_name, rec_name = (("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention") if kimi else
                            ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"))
    orig = {n: getattr(mod, n) for n in (*(() if lfm2 or minimax else (chunk_name, rec_name)),
                                         *(() if kimi else ("apply_rotary_pos_emb",)))}

    def edit(path, t):
        for e in edits:
            if e["path"] == path:
                t = _set_index(t, e)
        return t

    def delta_rule(query, key, value, g=None, beta=None, _name=chunk_name, **kw):
        if not cur["grad"]:
            return orig[_name](query, key, value, g=g, beta=beta, **kw)
        base = f"layers.{cur['layer']}.linear_attn."

        def k_(name, t):
            return _keep(keep, base + name, edit(base + name, t))

        query, key, value = k_("attention_queries", query), k_("attention_keys", key), k_("attention_values", value)
        beta, g = k_("betas", beta), k_("decays", g)
        init = kw.pop("initial_state", None)
        if init is not None:
            init = k_("state_input", init.detach().clone().requires_grad_(True))
        if scan == "explicit":
            sts = states[base + "states"] = []
            out, S = explicit_rule(query, key, value, g, beta, init, sts)
        else:
            f = orig[chunk_name if scan == "chunk" else rec_name]
            out, S = f(query, key, value, g=g, beta=beta, initial_state=init, **kw)
        out = k_("attention_head_outputs", out)
        return out, S

    def short_conv(conv, i, hidden_states, past_key_values=None, attention_mask=None, **kw):
        """Lfm2ShortConv.forward written out: the window shifted token by token, each window retained
        (``states``), the window before the call a leaf (``state_input``)."""
        base = f"layers.{i}.linear_attn."

        def k_(name, t):
            return _keep(keep, base + name, edit(base + name, t))

        BCx = conv.in_proj(mod.apply_mask_to_padding_states(hidden_states, attention_mask))
        D = BCx.shape[-1] // 3
        Bg, Cg, xg = k_("attention_keys", BCx[..., :D]), k_("attention_queries", BCx[..., D:2 * D]), \
            k_("attention_values", BCx[..., 2 * D:])
        u = Bg * xg
        b, T, K = u.shape[0], u.shape[1], conv.conv_kernel_size
        if past_key_values is not None and past_key_values.has_previous_state(i):
            S = k_("state_input", past_key_values.layers[i].conv_states[0].detach().clone().requires_grad_(True))
        else:
            S = torch.zeros(b, D, K)
        sts = states[base + "states"] = []
        w = conv.conv.weight[:, 0, :]
        acc = []
        for t in range(T):
            S = torch.cat([S[..., 1:], u[:, t, :, None]], -1)
            S.retain_grad()
            sts.append(S)
            acc.append((S * w).sum(-1) + (conv.conv.bias if conv.conv.bias is not None else 0.0))
        y = k_("attention_head_outputs", Cg * torch.stack(acc, 1))
        if not edits and (past_key_values is None or not past_key_values.has_previous_state(i)):  # as transformers'
            with torch.no_grad():
                ref = type(conv).forward(conv, hidden_states, None, attention_mask)
            assert torch.allclose(conv.out_proj(y), ref, atol=1e-5), f"layer {i}: short conv written out != transformers"
        return conv.out_proj(y)

    def rope(q, k, cos, sin, *a, **kw):
        qe, ke = orig["apply_rotary_pos_emb"](q, k, cos, sin, *a, **kw)
        if cur["grad"]:
            base = f"layers.{cur['layer']}.self_attn."
            qe = _keep(keep, base + "attention_queries", qe)  # [B,H,T,d]: transposed when served
            ke = _keep(keep, base + "attention_keys", ke)
        return qe, ke

    handles, patched = [], []

    def hook(module, fn, **kw):
        handles.append(module.register_forward_hook(fn, **kw))

    def emb_hook(m, a, o):
        if not cur["grad"]:
            return o
        return _keep(keep, "embed_tokens.output", o.detach().requires_grad_(True))

    hook(text.embed_tokens, emb_hook)
    for i, layer in enumerate(text.layers):
        def pre(m, args, kwargs, i=i):
            cur["layer"] = i
            if cur["grad"]:
                _keep(keep, f"layers.{i}.layer_input", args[0] if args else kwargs["hidden_states"])

        def post(m, a, o, i=i):
            if cur["grad"]:
                _keep(keep, f"layers.{i}.layer_output", o[0] if isinstance(o, tuple) else o)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hook(layer, post)

        def mlp_post(m, a, o, i=i):
            if not cur["grad"]:
                return o
            return _keep(keep, f"layers.{i}.mlp.output", edit(f"layers.{i}.mlp.output", o))

        hook(layer.feed_forward if lfm2 else layer.mlp, mlp_post)
        linear = (layer.block_type == "linear_attention" if kimi or minimax
                  else hasattr(layer, "conv" if lfm2 else "linear_attn"))
        if linear:
            def lin_post(m, a, o, i=i):
                if not cur["grad"]:
                    return o
                p = f"layers.{i}.linear_attn.attention_output"
                if minimax:  # (output, kv state)
                    return (_keep(keep, p, edit(p, o[0])),) + tuple(o[1:])
                return _keep(keep, p, edit(p, o))

            lin = layer.self_attn if kimi or minimax else layer.conv if lfm2 else layer.linear_attn
            if minimax:
                def k_lin(name, t, i=i):
                    return _keep(keep, f"layers.{i}.linear_attn.{name}", edit(f"layers.{i}.linear_attn.{name}", t))

                _hook_lightning(lin, i, cur, k_lin, states, mod, scan, handles, patched, bool(edits))
            hook(lin, lin_post)
            if lfm2:  # the instance's forward, during the differentiated call only
                def conv_fwd(*a, conv=lin, i=i, **kw):
                    return short_conv(conv, i, *a, **kw) if cur["grad"] else type(conv).forward(conv, *a, **kw)

                lin.forward = conv_fwd
                patched.append(lin)
        elif kimi:
            _hook_latent_attention(layer.self_attn, i, cur, keep, edit, hook, handles)
        else:
            at = layer.self_attn
            gated = at.q_proj.out_features == 2 * at.config.num_attention_heads * at.head_dim  # Qwen's output gate

            def qk_normed(name, i=i):  # NoPE: q / k as attention reads them, [B,T,H*d]
                return lambda m, a, o: _keep(keep, f"layers.{i}.self_attn.{name}", o) if cur["grad"] else o

            def qproj(m, a, o, i=i):
                return _keep(keep, f"layers.{i}.self_attn.#q_proj", o) if cur["grad"] else o

            def vproj(m, a, o, i=i):
                return _keep(keep, f"layers.{i}.self_attn.attention_values", o) if cur["grad"] else o

            def att_post(m, a, o, i=i):
                if not cur["grad"]:
                    return o
                p = f"layers.{i}.self_attn.attention_output"
                return (_keep(keep, p, edit(p, o[0])),) + tuple(o[1:])

            if gated:
                hook(at.q_proj, qproj)
            if nope:
                hook(at.q_norm, qk_normed("attention_queries"))
                hook(at.k_norm, qk_normed("attention_keys"))
            hook(at.v_proj, vproj)
            hook(at, att_post)
    hook(text.embedding_norm if lfm2 else text.norm, lambda m, a, o: _keep(keep, "ln_final.output", o) if cur["grad"] else o)

    if not lfm2 and not minimax:
        setattr(mod, chunk_name, delta_rule)
        setattr(mod, rec_name, lambda *a, **kw: delta_rule(*a, _name=rec_name, **kw))
    if not kimi:
        mod.apply_rotary_pos_emb = rope
    try:
        ids, mask = oq.pad_prompts(prompts, pad_id)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = om.MaskSizedCache() if minimax else oq.mq35.DynamicCache(config=model.config.get_text_config())
        if continuation is not None:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            x = torch.as_tensor(continuation, dtype=torch.long)
            pos = pos[:, -1:] + torch.arange(1, x.shape[1] + 1)[None]
            mask = torch.cat([mask, torch.ones_like(x)], 1)
            ids = x
        cur["grad"] = True
        with torch.enable_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            logits = _keep(keep, "logits", out.logits.float())
            m = metric(logits)
            m.backward()
    finally:
        for n, f in orig.items():
            setattr(mod, n, f)
        for h in handles:
            h.remove()
        for layer in text.layers if kimi else ():  # the latent attention's wrapped expand_kv (an instance attribute)
            layer.self_attn.__dict__.pop("expand_kv", None)
        for module in patched:
            if isinstance(module, tuple):  # (module, attribute, original): a wrapped instance attribute
                setattr(*module)
            else:
                del module.forward
    grads = collect(keep, states, m)
    hd = next(layer.self_attn.qk_head_dim if kimi else layer.self_attn.head_dim for layer in text.layers
              if (layer.block_type != "linear_attention" if kimi or minimax else hasattr(layer, "self_attn")))
    for path in [p for p in grads if p != "metric"]:
        g, mt = grads[path], _PATH.match(path)
        if path.endswith("#q_proj"):  # per head [query | gate]: the gate half is the gate logits' gradient
            b, T, _ = g.shape
            grads[path.replace("#q_proj", "gate")] = np.ascontiguousarray(g.reshape(b, T, -1, 2 * hd)[..., hd:].reshape(b, T, -1))
            del grads[path]
        elif kimi and mt and mt.group(2) == "self_attn" and mt.group(3) == "attention_queries":
            grads[path] = g.reshape(g.shape[0], g.shape[1], -1, hd)  # q_proj's [B,T,H*hd]
        elif kimi and mt and mt.group(2) == "self_attn" and mt.group(3) in ("attention_keys", "attention_values"):
            grads[path] = np.ascontiguousarray(g.transpose(0, 2, 1, 3))  # expand_kv's [B,H,T,*] -> [B,T,H,*]
        elif mt and mt.group(2) == "self_attn" and mt.group(3) in ("attention_queries", "attention_keys") and nope:
            grads[path] = g.reshape(g.shape[0], g.shape[1], -1, hd)  # [B,T,H*d] -> served [B,T,H,d]
        elif mt and mt.group(2) == "self_attn" and mt.group(3) in ("attention_queries", "attention_keys"):
            grads[path] = np.ascontiguousarray(g.transpose(0, 2, 1, 3))  # [B,H,T,d] -> served [B,T,H,d]
        elif mt and mt.group(2) == "self_attn" and mt.group(3) == "attention_values":
            grads[path] = g.reshape(g.shape[0], g.shape[1], -1, hd)
    return grads
