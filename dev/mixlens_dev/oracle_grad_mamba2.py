"""Gradient oracle for Mamba-2 (issue 12): torch autograd on transformers' pure-torch
Mamba2ForCausalLM, with every value of values.md kept (``retain_grad``) so its ``.grad`` can be
compared with mixlens' native backward.

Values around the mixer come from module hooks (embeddings, each block's input and output, the
mixer output, norm_f, logits). The SSD kernel call is intercepted as in oracle_mamba2.py (module
globals of modeling_mamba2): the kernel's inputs x, B, C and the effective dt (softplus + clamp, as
the kernel computes it) become retained tensors. Two scans:

* ``scan="hf"``: transformers' own ``mamba2_chunk_scan`` runs on them (autograd through its chunked
  algorithm); gives every value except ``decays`` and ``states``, which that algorithm never forms.
* ``scan="recurrence"``: the explicit token recurrence (model-math §9.3, the oracle's
  ``token_recurrence``) with ``decays = A * dt`` and the per-token ``states`` as explicit tensors,
  ``y_t = S_t C_t + D x_t``; gives every value.

Edits are ``set_index`` writes (``out = v.clone(); out[:, idx] = c``): the written elements are
constants, the others carry the gradient, as mixlens documents for writes.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import transformers.models.mamba2.modeling_mamba2 as mm2

from mixlens_dev import oracle_mamba2 as om
from mixlens_dev.grad_common import collect, scan_dt, hook_ssm_backbone, keep as _keep, set_index as _set_index


def run(model, prompts, metric, scan: str = "hf", edits=()) -> dict[str, np.ndarray]:
    """Gradients (numpy, served layouts) of ``metric(logits)`` for every value of one prompt call."""
    assert scan in ("hf", "recurrence")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ids, mask = om.pad_prompts(prompts, model.config.pad_token_id)
    keep: dict[str, torch.Tensor] = {}
    keep_states: dict[str, list] = {}
    edits = list(edits)
    cur = {"layer": None}
    handles = []
    orig = mm2.mamba2_chunk_scan
    sig = inspect.signature(orig)

    def edit(name: str, t: torch.Tensor) -> torch.Tensor:
        for e in edits:
            if e["path"] == f"layers.{cur['layer']}.linear_attn.{name}":
                t = _set_index(t, e)
        return t

    def chunk_scan(*args, **kwargs):
        ba = sig.bind(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        if a["initial_states"] is not None:
            raise NotImplementedError("the gradient oracle runs fresh prompts")
        li = cur["layer"]
        base = f"layers.{li}.linear_attn."
        dt = scan_dt(a)
        x = _keep(keep, base + "attention_values", edit("attention_values", a["hidden_states"]))
        Bm = _keep(keep, base + "attention_keys", edit("attention_keys", a["B"]))
        Cm = _keep(keep, base + "attention_queries", edit("attention_queries", a["C"]))
        dt = _keep(keep, base + "betas", edit("betas", dt))
        A = a["A"].float()
        if scan == "hf":
            y, S = orig(x, dt, a["A"], Bm, Cm, a["chunk_size"], D=a["D"], dt_bias=None, dt_softplus=False,
                        dt_limit=(0.0, float("inf")), return_final_states=True)
        else:
            dec = _keep(keep, base + "decays", edit("decays", A * dt.float()))
            b, T, H, P = x.shape
            G, N = Bm.shape[2], Bm.shape[3]
            Bh = Bm.float().repeat_interleave(H // G, dim=2)
            Ch = Cm.float().repeat_interleave(H // G, dim=2)
            S = torch.zeros(b, H, P, N)
            states, ys = [], []
            for t in range(T):
                S = S * torch.exp(dec[:, t, :, None, None]) + (dt[:, t, :, None, None] * Bh[:, t, :, None, :]) * \
                    x[:, t, :, :, None].float()
                S.retain_grad()  # total derivative: S_t feeds y_t and S_{t+1}
                states.append(S)
            keep_states[base + "states"] = states
            st = torch.stack(states, 1)  # [B,T,H,P,N]
            y = (st * Ch[:, :, :, None, :]).sum(-1) + a["D"].float()[None, None, :, None] * x.float()
            S = st[:, -1]
        y = _keep(keep, base + "attention_head_outputs", edit("attention_head_outputs", y))
        return y, S

    def mpre(mod, args, kwargs, i):
        cur["layer"] = i

    def mpost(mod, args, kwargs, out, i):
        cur["layer"] = i
        out = edit("attention_output", out)
        cur["layer"] = None
        return _keep(keep, f"layers.{i}.linear_attn.attention_output", out)

    hook_ssm_backbone(model.backbone, keep, handles, mpre, mpost)
    mm2.mamba2_chunk_scan = chunk_scan
    try:
        with torch.enable_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            logits = _keep(keep, "logits", out.logits.float())
            m = metric(logits)
            m.backward()
    finally:
        mm2.mamba2_chunk_scan = orig
        for h in handles:
            h.remove()
    return collect(keep, keep_states, m, transpose_states=True)
