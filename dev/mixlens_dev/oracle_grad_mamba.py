"""Gradient oracle for Mamba-1 (issue 12): torch autograd on transformers' pure-torch MambaForCausalLM
(and FalconMambaForCausalLM, whose mixer norms dt_low, B and C before the kernels: autograd takes those norms),
with every value of values.md kept (``retain_grad``) so its ``.grad`` can be compared with mixlens'
native backward.

Values around the mixer come from module hooks (embeddings, each block's input and output, the mixer
output, norm_f, logits). Both Mamba-1 kernels (module globals of modeling_mamba, as in
oracle_mamba.py; of the model's own modeling module) are replaced by one explicit recurrence with every value an explicit tensor:
``mamba_selective_scan`` (multi-token calls) and ``mamba_selective_state_update`` (decode). Per token,
in transformers' operation order: ``S_t = exp(decays_t) S_{t-1} + (dt_t B_t) u_t``, ``y_t = S_t C_t
+ D u_t``, gated ``y * silu(z)``.

Definitions mixlens serves (docs/gradients.md):

* ``attention_values`` is the scan's input u (a copy: x_proj has already read u, as in mixlens,
  so its ``.grad`` is the scan path: state write and D skip);
* ``decays = A * dt`` [B,T,E,N] feeds exp() only; ``betas`` gets both uses of dt;
* a multi-token call over a cache starts its scan from the cached state (mixlens' rule;
  transformers 5.18 restarts from zero there), which is ``state_input``, a leaf;
* ``states`` are the per-token states (total derivative), ``state_output`` has zero gradient.

Edits are ``set_index`` (``out = v.clone(); out[:, idx] = c``) or ``scale_index`` (``out[:, idx] =
(f * v[:, idx]).detach()``): the written elements are constants, the others carry the gradient. A
decays write replaces dt by ``mean_n(decays[n] / A[e,n])`` on every (token, channel) row it changed
(mixlens' rule for Mamba-1), while unchanged rows feed ``exp(decays)`` directly.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from mixlens_dev import oracle_mamba2 as om2
from mixlens_dev.oracle_mamba import modeling_module
from mixlens_dev.grad_common import collect, hook_ssm_backbone, keep as _keep


def _apply_edit(t: torch.Tensor, edit: dict) -> torch.Tensor:
    out = t.clone()
    idx = int(edit["index"])
    if edit.get("op", "set_index") == "set_index":
        out[:, idx] = float(edit["value"])
    elif edit["op"] == "scale_index":
        out[:, idx] = (t[:, idx] * float(edit["factor"])).detach()
    else:
        raise ValueError(f"unknown edit op {edit['op']}")
    return out


def mixlens_edit(edit: dict):
    """The same edit as a mixlens edit function (in place on the served value)."""
    idx = int(edit["index"])

    def f(v):
        if edit.get("op", "set_index") == "set_index":
            v[:, idx] = edit["value"]
        else:
            v[:, idx] = v[:, idx] * edit["factor"]
        return v

    return f


def mamba1_scan(keep, keep_states, base, edit, u, dt_eff, A, Bm, Cm, D, z, S0):
    """The explicit Mamba-1 recurrence with every value kept under ``base`` (``layers.{i}.linear_attn.``)
    and ``edit(name, t)`` applied to it. Served layouts: u, dt_eff, z [B,T,E]; Bm, Cm [B,T,N]; S0
    [B,E,N] or None. Returns (gated y, S_T). Shared with oracle_grad_hybrids (Jamba's mixer)."""
    b, T, E = u.shape
    A = A.float()
    if S0 is not None:
        S0 = S0.detach().clone().float().requires_grad_(True)
        S0 = _keep(keep, base + "state_input", edit("state_input", S0))
    u = _keep(keep, base + "attention_values", edit("attention_values", u.clone()))
    Bm = _keep(keep, base + "attention_keys", edit("attention_keys", Bm))
    Cm = _keep(keep, base + "attention_queries", edit("attention_queries", Cm))
    dt = _keep(keep, base + "betas", edit("betas", dt_eff))
    dec0 = A[None, None] * dt[..., None]
    dec = _keep(keep, base + "decays", edit("decays", dec0))
    changed = (dec.detach() != dec0.detach()).any(-1)  # [B,T,E]
    if bool(changed.any()):
        dt_used = torch.where(changed, (dec / A[None, None]).mean(-1), dt)
        arg = torch.where(changed[..., None], A[None, None] * dt_used[..., None], dec)
    else:
        dt_used, arg = dt, dec
    S = torch.zeros(b, E, A.shape[1]) if S0 is None else S0
    states = []
    for t in range(T):
        S = torch.exp(arg[:, t]) * S + (dt_used[:, t, :, None] * Bm[:, t, None, :]) * u[:, t, :, None]
        if S.requires_grad:
            S.retain_grad()  # total derivative: S_t feeds y_t and S_{t+1}
        states.append(S)
    keep_states[base + "states"] = states
    st = torch.stack(states, 1)  # [B,T,E,N]
    y = (st * Cm[:, :, None, :]).sum(-1) + D.float()[None, None] * u
    y = _keep(keep, base + "attention_head_outputs", edit("attention_head_outputs", y))
    return y * F.silu(z), S


def run(model, prompts, metric, edits=(), prefix=None) -> dict[str, np.ndarray]:
    """Gradients (numpy, served layouts) of ``metric(logits)`` for every value of one call.

    ``prompts``: left-padded token lists of the call. ``prefix``: token lists run first (no gradient)
    whose cache the call continues; then ``prompts`` are the new tokens (equal lengths, no padding).
    """
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    keep: dict[str, torch.Tensor] = {}
    keep_states: dict[str, list] = {}
    cur = {"layer": None, "cache": None, "edits": []}
    handles = []
    mm = modeling_module(model)
    orig_scan, orig_update = mm.mamba_selective_scan, mm.mamba_selective_state_update

    def edit(name: str, t: torch.Tensor) -> torch.Tensor:
        for e in cur["edits"]:
            if e["path"] == f"layers.{cur['layer']}.linear_attn.{name}":
                t = _apply_edit(t, e)
        return t

    def scan(u, dt_eff, A, Bm, Cm, D, z, S0):
        return mamba1_scan(keep, keep_states, f"layers.{cur['layer']}.linear_attn.", edit, u, dt_eff, A, Bm, Cm, D, z, S0)

    def scan_kernel(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                    return_last_state=False, **kw):
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        li = cur["layer"]
        cp = cur["cache"]
        S0 = cp.layers[li].recurrent_states[0] if cp is not None and cp.has_previous_state(li) else None
        y, S = scan(hidden_states.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D,
                    z.transpose(1, 2), S0)
        y = y.transpose(1, 2)
        return (y, S.detach()) if return_last_state else y

    def update_kernel(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kw):
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        y, S = scan(hidden_states[:, None], dt[:, None], A, B[:, None], C[:, None], D, z[:, None], state)
        with torch.no_grad():
            state.copy_(S)
        return y[:, 0]

    def mpre(mod, args, kwargs, i):
        cur["layer"] = i
        cur["cache"] = kwargs.get("cache_params")

    def mpost(mod, args, kwargs, out, i):
        out = edit("attention_output", out)
        cur["layer"] = None
        return _keep(keep, f"layers.{i}.linear_attn.attention_output", out)

    hook_ssm_backbone(model.backbone, keep, handles, mpre, mpost)
    try:
        cache = None
        if prefix is not None:
            pids, pmask = om2.pad_prompts(prefix, model.config.pad_token_id)
            with torch.no_grad():
                mm.mamba_selective_scan, mm.mamba_selective_state_update = scan_kernel, update_kernel
                cache = model(input_ids=pids, attention_mask=pmask, use_cache=True).cache_params
            keep.clear()
            keep_states.clear()
            ids = torch.as_tensor(prompts, dtype=torch.long)
            kwargs = dict(input_ids=ids, cache_params=cache, use_cache=True)
        else:
            ids, mask = om2.pad_prompts(prompts, model.config.pad_token_id)
            kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=True)
        mm.mamba_selective_scan, mm.mamba_selective_state_update = scan_kernel, update_kernel
        cur["edits"] = list(edits)  # the prefix runs unedited
        with torch.enable_grad():
            out = model(**kwargs)
            logits = _keep(keep, "logits", out.logits.float())
            m = metric(logits)
            m.backward()
    finally:
        mm.mamba_selective_scan, mm.mamba_selective_state_update = orig_scan, orig_update
        for h in handles:
            h.remove()
    return collect(keep, keep_states, m)
