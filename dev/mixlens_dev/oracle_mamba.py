"""Mamba-1 numerical oracle: every mixer value of transformers' pure-torch MambaForCausalLM and
FalconMambaForCausalLM (the same mixer with weightless RMS norms on dt_low, B and C).

The reference the C++ tests compare against (through the committed goldens in
tests/fixtures/mamba, built by scripts/make_fixtures_mamba.py). It imports no test framework and
shares the family-independent machinery (module hooks, edits, keys, the generation loop) with the
Mamba-2 oracle, oracle_mamba2.py.

How values are captured
-----------------------
transformers 5.18's ``MambaMixer.forward`` calls two kernels resolved as *module globals* of
``transformers.models.mamba.modeling_mamba`` at call time (``use_kernel_func_from_hub_with_fallback``
wrappers whose implementation is the pure-torch function when ``mamba_ssm`` is absent;
``use_kernelized_func`` is the identity without the ``kernels`` package):

* ``mamba_selective_scan`` for every multi-token call (the token loop over the whole sequence,
  starting from a zero state), and
* ``mamba_selective_state_update`` for a single-token call over a cached state (decode).

The recorder replaces both, in the modeling module of the model it runs (``modeling_mamba`` or
``modeling_falcon_mamba``, which defines the same two functions). It receives the kernel inputs (u after conv+SiLU and the padding mask,
the raw dt before dt bias and softplus, A, B, C, D, z), applies the edits to them in the served
layout, calls the original kernel **with z=None** so that y (incl. the D skip) comes back before
the gate, applies edits to y, then gates with ``y * silu(z)`` exactly as the kernel does (same op,
same tensors: bit-identical to the unpatched run). The per-token ``states`` come from an explicit
recurrence in the kernel's own operation order (``S = exp(A dt) S + (dt B) u``), which must equal
the kernel's final state bit for bit on every call.

Mamba-1 specifics (values.md Mamba-1 column)
--------------------------------------------
Served layouts: C, B ``[B,T,N]``; u, dt, y ``[B,T,E]``; decays ``A*dt`` ``[B,T,E,N]``; states
``[B,E,N]`` (HF's own layout, no transpose). A ``decays`` write maps back to one dt per
(token, channel): rows left unchanged keep their dt; a changed row must give the same
``decays[n] / A[e,n]`` for every n within DECAY_AGREEMENT (relative), and dt is their mean
(float64, then float32) -- the rule mixlens implements.

FalconMamba: ``FalconMambaMixer.forward`` norms dt_low, B and C before it calls the kernels, so the
kernels' B / C (served as attention_keys / attention_queries) and dt are already the normed ones.
"""

from __future__ import annotations

import inspect
import sys

import numpy as np
import torch
import torch.nn.functional as F
from mixlens_dev import oracle_mamba2 as om2

MIXER_VALUES = om2.MIXER_VALUES
EDITABLE = om2.EDITABLE
key = om2.key
pad_prompts = om2.pad_prompts
value_paths = om2.value_paths
expected_keys = om2.expected_keys

# Relative spread of decays[n] / A[e, n] over n that a decays write may have (float rounding of a
# consistent edit such as a scale is ~1e-7).
DECAY_AGREEMENT = 1e-5


def token_recurrence(u, dt, A, Bm, S0):
    """Explicit Mamba-1 recurrence in transformers' operation order, float32.

    u, dt [B,T,E]; A [E,N]; Bm [B,T,N]; S0 [B,E,N] or None. Returns the state after every token
    [B,T,E,N]. Per token: dA = exp(A*dt), dBu = (dt*B)*u, S = dA*S + dBu (mamba_selective_scan; the
    decode update computes the same products, S*dA + dBx).
    """
    u, dt, A, Bm = u.float(), dt.float(), A.float(), Bm.float()
    b, t_len, e = u.shape
    n = A.shape[1]
    S = torch.zeros(b, e, n, dtype=torch.float32) if S0 is None else S0.float().clone()
    out = torch.empty(b, t_len, e, n, dtype=torch.float32)
    for t in range(t_len):
        dA = torch.exp(A[None] * dt[:, t, :, None])
        dBu = (dt[:, t, :, None] * Bm[:, t, None, :]) * u[:, t, :, None]
        S = dA * S + dBu
        out[:, t] = S
    return out


def dt_from_decays(written: torch.Tensor, before: torch.Tensor, A: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """The one dt per (token, channel) a decays write [B,T,E,N] stands for (see module doc)."""
    changed = (written != before).any(-1)  # [B,T,E]
    ratio = written.double() / A.double()[None, None]
    lo, hi = ratio.min(-1).values, ratio.max(-1).values
    bad = changed & (~torch.isfinite(lo) | ~torch.isfinite(hi) | ((hi - lo) > DECAY_AGREEMENT * torch.maximum(hi.abs(), lo.abs())))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"decays write at (batch, token, channel) {idx} implies different dt across the state axis")
    return torch.where(changed, ratio.mean(-1).float(), dt)


def modeling_module(model):
    """The transformers modeling module whose globals ``model``'s mixers resolve the kernels from
    (modeling_mamba for MambaForCausalLM, modeling_falcon_mamba for FalconMambaForCausalLM)."""
    mod = sys.modules[type(model).__module__]
    if not hasattr(mod, "mamba_selective_scan"):
        raise TypeError(f"{type(model).__name__} is not a Mamba-1 model of transformers")
    return mod


class _Recorder(om2._Recorder):
    """Patches the Mamba-1 kernels; hooks, edits and recording come from the Mamba-2 recorder."""

    KERNEL_NAMES = "mamba_selective_scan / mamba_selective_state_update"

    def _edit_dt(self, dt_s: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """betas then decays edits on dt [B,T,E]; returns (dt, written)."""
        dt_s, w_b = self._edit("betas", dt_s)
        dec = A.float()[None, None] * dt_s.float()[..., None]
        dec_new, w_d = self._edit("decays", dec)
        if w_d:
            dt_s = dt_from_decays(dec_new, dec, A, dt_s)
        if (w_b or w_d) and (bool((dt_s < 0).any()) or bool(torch.isnan(dt_s).any())):
            raise ValueError("a written betas/decays gives dt < 0 or NaN (betas must be >= 0)")
        return dt_s, w_b or w_d

    def _record_mixer(self, u, Bm, Cm, dt, A, S0, y, S_final):
        """Served layouts: u, dt, y [B,T,E]; Bm, Cm [B,T,N]; A [E,N]; S0 / S_final [B,E,N]."""
        states = token_recurrence(u, dt, A, Bm, S0)
        if not torch.equal(states[:, -1], S_final.float()):
            err = float((states[:, -1] - S_final.float()).abs().max())
            raise AssertionError(f"step {self.step} layer {self.cur_layer}: explicit recurrence != kernel state ({err:.3e})")
        self.put(self._mix("attention_queries"), Cm.float())
        self.put(self._mix("attention_keys"), Bm.float())
        self.put(self._mix("attention_values"), u.float())
        self.put(self._mix("betas"), dt.float())
        self.put(self._mix("decays"), A.float()[None, None] * dt.float()[..., None])
        if S0 is not None:
            self.put(self._mix("state_input"), S0.float())
        self.put(self._mix("state_output"), S_final.float())
        self.put(self._mix("states"), states)
        self.put(self._mix("attention_head_outputs"), y.float())

    # ---- patched kernels -------------------------------------------------------------------
    def _scan(self, *args, **kwargs):
        self._kernel_entered("scan")
        if self.step != 0:
            # transformers 5.18 restarts the scan from a zero state on a multi-token call over a
            # cache; the oracle only runs prompts (step 0) and single-token decode steps.
            raise NotImplementedError("multi-token continuation from a cache is not exercised by this oracle")
        ba = self._scan_sig.bind(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        if a["use_mambapy"]:
            raise RuntimeError("use_mambapy changes the scan algorithm; the oracle expects the token loop")
        if not a["return_last_state"]:
            raise RuntimeError("oracle runs always use a cache, so the scan must return the final state")
        u, dt, A, Bk, Ck = a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]  # [B,E,T], [B,E,T], [E,N], [B,N,T]
        dt_eff = dt
        if a["delta_bias"] is not None:
            dt_eff = dt_eff + a["delta_bias"].to(dt.dtype)[..., None]
        if a["delta_softplus"]:
            dt_eff = F.softplus(dt_eff)

        u_s, w_u = self._edit("attention_values", u.transpose(1, 2))
        B_s, w_k = self._edit("attention_keys", Bk.transpose(1, 2))
        C_s, w_q = self._edit("attention_queries", Ck.transpose(1, 2))
        dt_s, w_dt = self._edit_dt(dt_eff.transpose(1, 2), A)
        # Unedited inputs stay the very tensors the mixer passed (bit-identical run).
        if w_u:
            a["hidden_states"] = u_s.transpose(1, 2)
        if w_k:
            a["B"] = B_s.transpose(1, 2)
        if w_q:
            a["C"] = C_s.transpose(1, 2)
        if w_dt:
            a["dt"], a["delta_bias"], a["delta_softplus"] = dt_s.transpose(1, 2), None, False
        z, a["z"] = a["z"], None

        y, S_final = self._orig_scan(*ba.args, **ba.kwargs)  # y [B,E,T] incl. D skip, before the gate
        y_s, w_y = self._edit("attention_head_outputs", y.transpose(1, 2))
        if w_y:
            y = y_s.transpose(1, 2)
        self._record_mixer(u_s, B_s, C_s, dt_s, A, None, y_s, S_final)
        if z is not None:
            y = y * F.silu(z)
        return (y, S_final)

    def _update(self, *args, **kwargs):
        self._kernel_entered("update")
        ba = self._update_sig.bind(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        state, x, dt, A, Bm, Cm = a["state"], a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]
        b, e = x.shape
        if state.shape != (b, e, A.shape[1]) or dt.shape != (b, e) or Bm.dim() != 2:
            raise RuntimeError("unexpected argument shapes in mamba_selective_state_update")
        dt_eff = dt
        if a["dt_bias"] is not None:
            dt_eff = dt_eff + a["dt_bias"].to(dt.dtype)
        if a["dt_softplus"]:
            dt_eff = F.softplus(dt_eff)

        s_new, w_s = self._edit("state_input", state)  # served layout == HF layout [B,E,N]
        if w_s:
            state.copy_(s_new)
        S0 = state.detach().clone()

        u4, w_u = self._edit("attention_values", x[:, None])
        B4, w_k = self._edit("attention_keys", Bm[:, None])
        C4, w_q = self._edit("attention_queries", Cm[:, None])
        dt3, w_dt = self._edit_dt(dt_eff[:, None], A)
        if w_u:
            a["hidden_states"] = u4[:, 0]
        if w_k:
            a["B"] = B4[:, 0]
        if w_q:
            a["C"] = C4[:, 0]
        if w_dt:
            a["dt"], a["dt_bias"], a["dt_softplus"] = dt3[:, 0], None, False
        z, a["z"] = a["z"], None

        y = self._orig_update(*ba.args, **ba.kwargs)  # updates `state` in place; y [B,E] before the gate
        y4, w_y = self._edit("attention_head_outputs", y[:, None])
        if w_y:
            y = y4[:, 0]
        self._record_mixer(u4, B4, C4, dt3, A, S0, y4, state)
        if z is not None:
            y = y * F.silu(z)
        return y

    def __enter__(self):
        self.mod = modeling_module(self.model)
        if isinstance(getattr(self.mod.mamba_selective_scan, "__self__", None), _Recorder):
            raise RuntimeError("mamba kernels are already patched (nested oracle run?)")
        self._orig_scan = self.mod.mamba_selective_scan
        self._orig_update = self.mod.mamba_selective_state_update
        self._scan_sig = inspect.signature(self._orig_scan)
        self._update_sig = inspect.signature(self._orig_update)
        self.mod.mamba_selective_scan = self._scan
        self.mod.mamba_selective_state_update = self._update
        self._install_hooks()
        return self

    def __exit__(self, *exc):
        self.mod.mamba_selective_scan = self._orig_scan
        self.mod.mamba_selective_state_update = self._orig_update
        for hnd in self._handles:
            hnd.remove()
        self._handles.clear()
        return False


def run(model, prompts, n_steps, edits=(), forced_tokens=None, record=True, return_recorder=False):
    """One (possibly edited) generation run of a MambaForCausalLM (see oracle_mamba2.run)."""
    return om2.run(model, prompts, n_steps, edits, forced_tokens=forced_tokens, record=record,
                   return_recorder=return_recorder, recorder_cls=_Recorder)


def capture(model, prompts, n_steps, edits=(), forced_tokens=None) -> dict[str, np.ndarray]:
    """Unedited run plus one teacher-forced run per edit (see oracle_mamba2.capture)."""
    return om2.capture(model, prompts, n_steps, edits, forced_tokens=forced_tokens, recorder_cls=_Recorder)


def check_invariants(values: dict[str, np.ndarray], n_layers: int, n_steps: int) -> None:
    """The C++ tests' invariants on a captured dict; for Mamba-1 ``states[:, -1] == state_output``
    holds bit-exactly on every step (the explicit recurrence *is* the kernel's)."""
    om2.check_invariants(values, n_layers, n_steps)
    for i in range(n_layers):
        for k in range(n_steps):
            st = values[key(f"layers.{i}.linear_attn.states", k)]
            so = values[key(f"layers.{i}.linear_attn.state_output", k)]
            assert np.array_equal(st[:, -1], so), f"states[:, -1] != state_output at layer {i} step {k}"
