"""Gradient oracle for the Mamba hybrids (issue 12): torch autograd on transformers 5.18's
pure-torch NemotronHForCausalLM / BambaForCausalLM / FalconH1ForCausalLM /
GraniteMoeHybridForCausalLM / JambaForCausalLM / Zamba2ForCausalLM with every value of
values.md kept (``retain_grad``), so its ``.grad`` can be compared with mixlens' native backward.

* Mixer values: the module-global ``mamba2_chunk_scan`` of each hybrid's modeling module is
  replaced as in oracle_grad_mamba2.py (``scan="hf"``: transformers' own chunked scan runs on the
  retained x, B, C, dt; ``scan="recurrence"``: the explicit token recurrence with ``decays = A dt``
  and the per-token ``states`` as tensors of their own).
* Jamba's Mamba-1 mixer: ``mamba_selective_scan`` is replaced by oracle_grad_mamba's explicit
  recurrence (mamba1_scan) for both ``scan`` settings (transformers' own scan is that token loop).
* Attention: queries / keys after RoPE from the patched ``apply_rotary_pos_emb`` (Bamba,
  Falcon-H1: after key_multiplier, as mixlens serves them) or from the q / k projections
  (Nemotron-H: no positional encoding); values from v_proj; outputs from the attention module.
* Where mixlens serves a value after a µP multiplier that transformers applies outside the module
  (Falcon-H1: embeddings, mixer output, attention output; Granite: embeddings and every branch
  output * residual_multiplier), the retained tensor is the multiplied one and the module returns it
  divided back, so the graph is transformers' own. Granite's mlp.output ((MoE + shared MLP) *
  residual_multiplier) is retained at the shared MLP, which returns kept / rm - moe.
* Zamba2: a shared block's values are kept at each hybrid layer through that layer's own modules
  (oracle_hybrids.block_parts); with use_shared_attention_adapter q / k / v are projection + this
  depth's adapter, kept (and edited) at the adapter's hook. Its layers read the embeddings twice
  (the residual and the clone the shared blocks concatenate), so ``layers.{i}.layer_input`` is kept
  as a tensor of its own (``h + 0``): its gradient is the layer's use alone, as mixlens serves it.
* Edits are ``set_index`` writes (``v = v.clone(); v[:, idx] = c``) on linear_attn and self_attn
  values: the written elements are constants, as mixlens documents for writes.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F

from mixlens_dev import oracle_grad_mamba as ogm
from mixlens_dev import oracle_hybrids as oh
from mixlens_dev import oracle_mamba2 as om
from mixlens_dev.grad_common import collect, scan_dt, set_index as _set_index


class _Grad:
    def __init__(self, model, scan, edits):
        assert scan in ("hf", "recurrence")
        self.model, self.scan, self.edits = model, scan, list(edits)
        self.mod = oh.module_for(model)
        self.tm = model.model
        self.cfg = model.config
        self.falcon = self.mod is oh.mf
        self.nemotron = self.mod is oh.mn
        self.granite = self.mod is oh.mg
        self.jamba = self.mod is oh.mj
        self.zamba = self.mod is oh.mz
        self.uses_rope = oh.has_rope(model)
        self.keep: dict[str, torch.Tensor] = {}
        self.keep_states: dict[str, list] = {}
        self.block = None
        self.applied = {id(e): 0 for e in self.edits}
        self.handles = []

    def put(self, path, t):
        if path in self.keep:
            raise RuntimeError(f"{path} kept twice")
        if t.requires_grad:
            t.retain_grad()
        self.keep[path] = t
        return t

    def edit(self, comp, name, t):
        for e in self.edits:
            if e["path"] == f"layers.{self.block}.{comp}.{name}":
                t = _set_index(t, e)
                self.applied[id(e)] += 1
        return t

    # ---- the Mamba-2 scan ------------------------------------------------------------------
    def chunk_scan(self, *args, **kwargs):
        ba = self.sig.bind(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        if a["initial_states"] is not None:
            raise NotImplementedError("the gradient oracle runs fresh prompts")
        base = f"layers.{self.block}.linear_attn."
        dt = scan_dt(a)
        ed = lambda n, t: self.edit("linear_attn", n, t)  # noqa: E731
        x = self.put(base + "attention_values", ed("attention_values", a["hidden_states"]))
        Bm = self.put(base + "attention_keys", ed("attention_keys", a["B"]))
        Cm = self.put(base + "attention_queries", ed("attention_queries", a["C"]))
        dt = self.put(base + "betas", ed("betas", dt))
        A = a["A"].float()
        if self.scan == "hf":
            y, S = self.orig_scan(x, dt, a["A"], Bm, Cm, a["chunk_size"], D=a["D"], dt_bias=None, dt_softplus=False,
                                  dt_limit=(0.0, float("inf")), return_final_states=True)
        else:
            dec = self.put(base + "decays", ed("decays", A * dt.float()))
            b, T, H, P = x.shape
            G, N = Bm.shape[2], Bm.shape[3]
            Bh = Bm.float().repeat_interleave(H // G, dim=2)
            Ch = Cm.float().repeat_interleave(H // G, dim=2)
            S = torch.zeros(b, H, P, N)
            states = []
            for t in range(T):
                S = S * torch.exp(dec[:, t, :, None, None]) + (dt[:, t, :, None, None] * Bh[:, t, :, None, :]) * \
                    x[:, t, :, :, None].float()
                S.retain_grad()  # total derivative: S_t feeds y_t and S_{t+1}
                states.append(S)
            self.keep_states[base + "states"] = states
            st = torch.stack(states, 1)  # [B,T,H,P,N]
            y = (st * Ch[:, :, :, None, :]).sum(-1) + a["D"].float()[None, None, :, None] * x.float()
            S = st[:, -1]
        y = self.put(base + "attention_head_outputs", ed("attention_head_outputs", y))
        return (y, S) if a["return_final_states"] else y

    # ---- the Mamba-1 scan (Jamba) -------------------------------------------------------------
    def selective_scan(self, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, **kw):
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        y, S = ogm.mamba1_scan(self.keep, self.keep_states, f"layers.{self.block}.linear_attn.",
                               lambda n, t: self.edit("linear_attn", n, t), hidden_states.transpose(1, 2),
                               dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D, z.transpose(1, 2), None)
        y = y.transpose(1, 2)
        return (y, S.detach()) if return_last_state else y

    # ---- RoPE (Bamba, Falcon-H1, Granite "rope") ---------------------------------------------
    def rope(self, q, k, cos, sin, *args, **kwargs):
        qe, ke = self.orig_rope(q, k, cos, sin, *args, **kwargs)
        p = f"layers.{self.block}.self_attn."
        qt = self.put(p + "attention_queries", self.edit("self_attn", "attention_queries", qe.transpose(1, 2)))
        kt = self.put(p + "attention_keys", self.edit("self_attn", "attention_keys", ke.transpose(1, 2)))
        return qt.transpose(1, 2), kt.transpose(1, 2)

    # ---- hooks ---------------------------------------------------------------------------------
    def install(self):
        tm, H, cfg = self.tm, self.handles, self.cfg
        emb = tm.embeddings if self.nemotron else tm.embed_tokens
        em, ssm_out, attn_out, mlp_out = oh.multipliers(self.model)

        def emb_hook(m, a, o):
            # The graph's leaf (the weights are frozen): every value downstream requires grad.
            leaf = self.put("embed_tokens.output", (o * em).detach().requires_grad_(True))
            return leaf / em if em != 1.0 else leaf

        H.append(emb.register_forward_hook(emb_hook))
        for i, layer in enumerate(tm.layers):
            def pre(m, args, kwargs, i=i):
                self.block = i
                if self.zamba:  # a tensor of its own: not the embeddings the shared blocks also read
                    h = self.put(f"layers.{i}.layer_input", args[0] + 0)
                    return (h,) + tuple(args[1:]), kwargs
                self.put(f"layers.{i}.layer_input", args[0] if args else kwargs["hidden_states"])

            def post(m, args, kwargs, out, i=i):
                self.put(f"layers.{i}.layer_output", oh._one(out))
                self.block = None

            H.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            H.append(layer.register_forward_hook(post, with_kwargs=True))
            mamba, attn, mlp = oh.block_parts(layer, self.nemotron)
            if mamba is not None:
                def mpost(m, args, kwargs, out, i=i):
                    o3 = out[:, None] if out.dim() == 2 else out
                    kept = self.put(f"layers.{i}.linear_attn.attention_output",
                                    self.edit("linear_attn", "attention_output", o3 * ssm_out))
                    return (kept / ssm_out if ssm_out != 1.0 else kept).reshape(out.shape)

                H.append(mamba.register_forward_hook(mpost, with_kwargs=True))
            if attn is not None:
                hd = attn.head_dim

                def heads(name, i=i, hd=hd):
                    def f(m, a, o):
                        b, t, _ = o.shape
                        kept = self.put(f"layers.{i}.self_attn.{name}",
                                        self.edit("self_attn", name, o.view(b, t, -1, hd)))
                        return kept.reshape(b, t, -1)
                    return f

                if self.zamba and self.cfg.use_shared_attention_adapter:
                    H.extend(self._adapter_hooks(attn, i, hd))
                else:
                    H.append(attn.v_proj.register_forward_hook(heads("attention_values")))
                if not self.uses_rope and not (self.zamba and self.cfg.use_shared_attention_adapter):
                    H.append(attn.q_proj.register_forward_hook(heads("attention_queries")))
                    H.append(attn.k_proj.register_forward_hook(heads("attention_keys")))

                def apost(m, a, o, i=i):
                    kept = self.put(f"layers.{i}.self_attn.attention_output",
                                    self.edit("self_attn", "attention_output", o[0] * attn_out))
                    return (kept / attn_out if attn_out != 1.0 else kept,) + tuple(o[1:])

                H.append(attn.register_forward_hook(apost))
            if mlp is not None and self.granite:
                def granite_mlp(tot, moe, o, i=i):
                    kept = self.put(f"layers.{i}.mlp.output", tot * mlp_out)
                    back = kept / mlp_out if mlp_out != 1.0 else kept
                    return back if moe is None else back - moe

                H.extend(oh.granite_mlp_hooks(layer, granite_mlp))
            elif mlp is not None:
                H.append(mlp.register_forward_hook(
                    lambda m, a, o, i=i: self.put(f"layers.{i}.mlp.output", oh._one(o))))
        H.append(oh.final_norm(self.model).register_forward_hook(lambda m, a, o: self.put("ln_final.output", o)))

    def _adapter_hooks(self, attn, i, hd):
        """Zamba2Attention with adapters: q / k / v = projection(x) + adapter_list[depth](x), kept and
        edited at the adapter's hook (the projection's output stashed); q / k with RoPE are kept by
        the RoPE patch instead."""
        depth = attn.layer_dic[i]
        stash, handles = {}, []
        for name, value in (("q", "attention_queries"), ("k", "attention_keys"), ("v", "attention_values")):
            if name != "v" and self.uses_rope:
                continue
            proj = getattr(attn, f"{name}_proj")
            handles.append(proj.register_forward_hook(lambda m, a, o, name=name: stash.__setitem__(name, o)))

            def total(m, a, o, value=value, name=name):
                base = stash.pop(name)
                b, t, _ = o.shape
                kept = self.put(f"layers.{i}.self_attn.{value}",
                                self.edit("self_attn", value, (base + o).view(b, t, -1, hd)))
                return kept.reshape(b, t, -1) - base

            handles.append(getattr(attn, f"linear_{name}_adapter_list")[depth].register_forward_hook(total))
        return handles

    def __enter__(self):
        m = self.mod
        self.scan_name = "mamba_selective_scan" if self.jamba else "mamba2_chunk_scan"
        self.orig_scan = getattr(m, self.scan_name)
        self.sig = inspect.signature(self.orig_scan)
        setattr(m, self.scan_name, self.selective_scan if self.jamba else self.chunk_scan)
        if self.uses_rope:
            self.orig_rope = m.apply_rotary_pos_emb
            m.apply_rotary_pos_emb = self.rope
        self.install()
        return self

    def __exit__(self, *exc):
        setattr(self.mod, self.scan_name, self.orig_scan)
        if self.uses_rope:
            self.mod.apply_rotary_pos_emb = self.orig_rope
        for h in self.handles:
            h.remove()
        return False


def run(model, prompts, metric, pad_id=0, scan="hf", edits=()) -> dict[str, np.ndarray]:
    """Gradients (numpy, served layouts) of ``metric(logits)`` for every value of one prompt call
    (left-padded batch, position ids and mask as generate builds them)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ids, mask = om.pad_prompts(prompts, pad_id)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    g = _Grad(model, scan, edits)
    with g, torch.enable_grad():
        cache = oh.mn.DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = g.put("logits", out.logits.float())
        m = metric(logits)
        m.backward()
    bad = [e["path"] for e in g.edits if g.applied[id(e)] != 1]
    if bad:
        raise RuntimeError(f"edits {bad} were not applied exactly once")
    return collect(g.keep, g.keep_states, m, transpose_states=not g.jamba)  # Mamba-1 states are [E, N] as served
