"""Mamba-2 numerical oracle: every mixer value of transformers' pure-torch Mamba2ForCausalLM.

This module is the reference the C++ tests are compared against (through the committed goldens in
tests/fixtures/mamba2, built by scripts/make_fixtures.py). It imports no test framework.

How values are captured
-----------------------
transformers 5.18 resolves the SSD kernels of ``Mamba2Mixer.forward`` as *module globals* of
``transformers.models.mamba2.modeling_mamba2`` at call time:

* ``mamba2_chunk_scan`` (prompt / multi-token calls) and ``mamba2_selective_state_update``
  (single-token decode) are ``use_kernel_func_from_hub_with_fallback`` wrappers around the
  pure-torch functions (no ``mamba_ssm`` installed, so the torch function is the implementation);
* the ``use_kernelized_func`` class decorator on ``Mamba2Mixer`` is the identity when the
  ``kernels`` package is absent (it is, in the pinned environment), so the mixer does not bind the
  functions as attributes.

So replacing the module globals takes effect. ``_Recorder`` checks it on every forward: each mixer
must have gone through exactly one patched kernel call, otherwise it raises (this is the guard
against a future transformers that resolves the functions elsewhere).

Keys
----
``"<path>@step<k>"`` with path one of ``embed_tokens.output``, ``layers.{i}.layer_input``,
``layers.{i}.layer_output``, ``layers.{i}.linear_attn.<value>``, ``ln_final.output``, ``logits``;
plus ``input_ids``, ``attention_mask`` and ``tokens``. Edited runs add
``edit/<name>/logits@step<k>``. States are served key side first: ``[.., N, P]`` (HF stores
``[B, H, P, N]``).
"""

from __future__ import annotations

import inspect
import re
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
import transformers.models.mamba2.modeling_mamba2 as mm2

MIXER_VALUES = (
    "attention_queries",
    "attention_keys",
    "attention_values",
    "betas",
    "decays",
    "state_input",
    "state_output",
    "states",
    "attention_head_outputs",
    "attention_output",
)

# Paths an edit may target (per layer) and the ops it may use.
EDITABLE = (
    "attention_queries",
    "attention_keys",
    "attention_values",
    "betas",
    "decays",
    "state_input",
    "attention_head_outputs",
    "attention_output",
)
EDIT_OPS = ("scale", "set_index")

# Relative tolerance of the check "last token of the explicit recurrence == HF final state".
# The chunked SSD and the token recurrence associate the fp32 sums differently; observed
# differences on the fixtures are ~1e-7 relative to the state's largest entry.
RECURRENCE_RTOL = 1e-6

_PATH_RE = re.compile(r"^layers\.(\d+)\.linear_attn\.([a-z_]+)$")


def key(path: str, step: int) -> str:
    return f"{path}@step{step}"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").contiguous().numpy().copy()


def _apply_op(value: torch.Tensor, edit: dict) -> torch.Tensor:
    """Apply one edit op to a tensor laid out as served ([B, T, ...] or the state's [B, H, N, P])."""
    op = edit["op"]
    if op == "scale":
        return value * float(edit["factor"])
    if op == "set_index":
        out = value.clone()
        idx = int(edit["index"])
        if not -value.shape[1] <= idx < value.shape[1]:
            raise ValueError(f"edit {edit['name']!r}: index {idx} out of range for axis 1 of {tuple(value.shape)}")
        out[:, idx] = float(edit["value"])
        return out
    raise ValueError(f"edit {edit.get('name')!r}: unknown op {op!r} (expected one of {EDIT_OPS})")


def validate_edit(edit: dict, n_layers: int, n_steps: int) -> tuple[int, str]:
    for field in ("name", "path", "step", "op"):
        if field not in edit:
            raise ValueError(f"edit {edit!r} lacks field {field!r}")
    m = _PATH_RE.match(edit["path"])
    if m is None or m.group(2) not in EDITABLE:
        raise ValueError(f"edit {edit['name']!r}: path {edit['path']!r} is not an editable mixer value {EDITABLE}")
    layer = int(m.group(1))
    if not 0 <= layer < n_layers:
        raise ValueError(f"edit {edit['name']!r}: layer {layer} out of range (model has {n_layers})")
    if not 0 <= int(edit["step"]) < n_steps:
        raise ValueError(f"edit {edit['name']!r}: step {edit['step']} out of range (n_steps {n_steps})")
    if m.group(2) == "state_input" and int(edit["step"]) == 0:
        raise ValueError(f"edit {edit['name']!r}: state_input does not exist at step 0 (fresh prompt)")
    if edit["op"] not in EDIT_OPS:
        raise ValueError(f"edit {edit['name']!r}: unknown op {edit['op']!r}")
    if edit["op"] == "scale" and "factor" not in edit:
        raise ValueError(f"edit {edit['name']!r}: scale needs 'factor'")
    if edit["op"] == "set_index" and ("index" not in edit or "value" not in edit):
        raise ValueError(f"edit {edit['name']!r}: set_index needs 'index' and 'value'")
    return layer, m.group(2)


def token_recurrence(x, dt, A, Bm, S0):
    """Explicit Mamba-2 token recurrence (model-math §9.3), float32.

    x [B,T,H,P], dt [B,T,H] (effective, after softplus/clamp), A [H], Bm [B,T,G,N],
    S0 [B,H,P,N] or None.  Returns the state after every token, HF layout [B,T,H,P,N].
    The per-token update uses the same operation order as HF's selective_state_update:
    S = S*exp(dt*A) + (dt*B)*x.
    """
    x = x.float()
    dt = dt.float()
    A = A.float()
    b, t_len, h, p = x.shape
    g, n = Bm.shape[2], Bm.shape[3]
    Bh = Bm.float().repeat_interleave(h // g, dim=2)  # [B,T,H,N]
    S = torch.zeros(b, h, p, n, dtype=torch.float32) if S0 is None else S0.float().clone()
    out = torch.empty(b, t_len, h, p, n, dtype=torch.float32)
    for t in range(t_len):
        dt_t = dt[:, t, :, None, None]  # [B,H,1,1]
        dA = torch.exp(dt_t * A[None, :, None, None])
        dB = dt_t * Bh[:, t, :, None, :]  # [B,H,1,N]
        dBx = dB * x[:, t, :, :, None]  # [B,H,P,N]
        S = S * dA + dBx
        out[:, t] = S
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / max(scale, 1e-30)


class _Recorder:
    """Patches the Mamba-2 kernels and hooks the modules of one model for one run.

    The module hooks, edits and recording are family-independent: the Mamba-1 oracle
    (oracle_mamba.py) subclasses this and replaces the patched kernels (``__enter__``/``__exit__``).
    """

    KERNEL_NAMES = "mamba2_chunk_scan / mamba2_selective_state_update"

    def __init__(self, model, edits: Sequence[dict] = (), record: bool = True):
        self.model = model
        self.backbone = model.backbone
        self.n_layers = len(self.backbone.layers)
        self.edits = list(edits)
        self.record = record
        self.values: dict[str, np.ndarray] = {}
        self.step = 0
        self.cur_layer: int | None = None
        self.kernel_calls: dict[int, list[str]] = {}
        self.applied: dict[str, int] = {e["name"]: 0 for e in self.edits}
        self.kernel_log: list[tuple[int, int, str]] = []  # (step, layer, kernel)
        self.max_recurrence_err = 0.0  # chunked calls: max relative |recurrence - HF final state|
        self._handles = []
        self._orig_chunk = None
        self._orig_update = None

    # ---- edits -----------------------------------------------------------------------------
    def _edits_for(self, value: str) -> list[dict]:
        out = []
        for e in self.edits:
            layer, name = _PATH_RE.match(e["path"]).group(1, 2)
            if int(layer) == self.cur_layer and name == value and int(e["step"]) == self.step:
                out.append(e)
        return out

    def _edit(self, value: str, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        edits = self._edits_for(value)
        for e in edits:
            new = _apply_op(tensor, e)
            if new.shape != tensor.shape:
                raise ValueError(f"edit {e['name']!r} changed the shape of {value}")
            tensor = new.to(tensor.dtype)
            self.applied[e["name"]] += 1
        return tensor, bool(edits)

    def _edit_dt(self, dt: torch.Tensor, A32: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """betas / decays edits as the dt the kernel is then given (decays = A dt, so a decays write
        sets dt = decays / A); returns (dt, whether anything was written)."""
        dt, w_b = self._edit("betas", dt)
        decays, w_d = self._edit("decays", A32 * dt.float())
        if w_d:
            dt = (decays / A32).to(dt.dtype)
        if (w_b or w_d) and (bool((dt < 0).any()) or bool(torch.isnan(dt).any())):
            raise ValueError("a written betas/decays gives dt < 0 or NaN (betas must be >= 0)")
        return dt, w_b or w_d

    # ---- recording -------------------------------------------------------------------------
    def put(self, path: str, tensor: torch.Tensor):
        if not self.record:
            return
        k = key(path, self.step)
        if k in self.values:
            raise RuntimeError(f"value {k} recorded twice (kernel called twice for one layer?)")
        self.values[k] = _np(tensor)

    def _mix(self, value: str) -> str:
        return f"layers.{self.cur_layer}.linear_attn.{value}"

    def _kernel_entered(self, kind: str):
        if self.cur_layer is None:
            raise RuntimeError(f"{kind} kernel called outside a Mamba2Mixer forward")
        self.kernel_calls.setdefault(self.cur_layer, []).append(kind)
        self.kernel_log.append((self.step, self.cur_layer, kind))

    def _record_mixer(self, x, Bm, Cm, dt_eff, A_h, S0, y, S_final, exact=False):
        """x [B,T,H,P], Bm/Cm [B,T,G,N], dt_eff [B,T,H], A_h [H], S0/S_final [B,H,P,N] (HF layout)."""
        states = token_recurrence(x, dt_eff, A_h, Bm, S0)
        err = _rel_err(states[:, -1], S_final.float())
        if exact and not torch.equal(states[:, -1], S_final.float()):
            raise AssertionError(f"step {self.step} layer {self.cur_layer}: decode recurrence not bit-exact ({err:.3e})")
        if not err <= RECURRENCE_RTOL:
            raise AssertionError(
                f"step {self.step} layer {self.cur_layer}: explicit recurrence final state differs from HF's "
                f"by {err:.3e} relative (limit {RECURRENCE_RTOL})"
            )
        self.max_recurrence_err = max(self.max_recurrence_err, err)
        self.put(self._mix("attention_queries"), Cm.float())
        self.put(self._mix("attention_keys"), Bm.float())
        self.put(self._mix("attention_values"), x.float())
        self.put(self._mix("betas"), dt_eff.float())
        self.put(self._mix("decays"), A_h.float() * dt_eff.float())
        if S0 is not None:
            self.put(self._mix("state_input"), S0.float().transpose(-1, -2))
        self.put(self._mix("state_output"), S_final.float().transpose(-1, -2))
        self.put(self._mix("states"), states.transpose(-1, -2))
        self.put(self._mix("attention_head_outputs"), y.float())

    # ---- patched kernels -------------------------------------------------------------------
    def _chunk_scan(self, *args, **kwargs):
        self._kernel_entered("chunked")
        ba = self._chunk_sig.bind(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        x, dt, A, Bm, Cm = a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]
        if A.dim() != 1:
            raise RuntimeError(f"unexpected A shape {tuple(A.shape)} in mamba2_chunk_scan")
        # Effective dt exactly as the torch kernel computes it.
        dt_eff = dt
        if a["dt_bias"] is not None:
            dt_eff = dt_eff + a["dt_bias"].to(dt_eff.dtype)
        if a["dt_softplus"]:
            dt_eff = F.softplus(dt_eff)
        lo, hi = a["dt_limit"]
        dt_eff = torch.clamp(dt_eff, min=lo, max=hi)

        x, _ = self._edit("attention_values", x)
        Bm, _ = self._edit("attention_keys", Bm)
        Cm, _ = self._edit("attention_queries", Cm)
        A32 = A.to(torch.float32)
        dt_eff, written = self._edit_dt(dt_eff, A32)
        if written:
            a["dt"] = dt_eff
            a["dt_bias"] = None
            a["dt_softplus"] = False
            a["dt_limit"] = (0.0, float("inf"))
        a["hidden_states"], a["B"], a["C"] = x, Bm, Cm
        S0 = a["initial_states"]
        if S0 is not None:
            raise NotImplementedError("multi-token continuation from a cache is not exercised by this oracle")

        result = self._orig_chunk(*ba.args, **ba.kwargs)
        if not a["return_final_states"]:
            raise RuntimeError("oracle runs always use a cache, so the chunk scan must return the final state")
        y, S_final = result
        y, w_y = self._edit("attention_head_outputs", y)
        self._record_mixer(x, Bm, Cm, dt_eff, A32, S0, y, S_final)
        return (y, S_final)

    def _state_update(self, *args, **kwargs):
        self._kernel_entered("recurrent")
        ba = self._update_sig.bind(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        state, x, dt, A, Bm, Cm = a["state"], a["hidden_states"], a["dt"], a["A"], a["B"], a["C"]
        b, h, p = x.shape
        g, n = Bm.shape[1], Bm.shape[2]
        if state.shape != (b, h, p, n) or A.shape != (h, p, n) or dt.shape != (b, h, p):
            raise RuntimeError("unexpected argument shapes in mamba2_selective_state_update")
        # Effective dt as the torch kernel computes it. NB: the decode kernel applies no
        # time_step_limit clamp in transformers 5.18 (the mixer passes no dt_limit).
        dt_eff = dt
        if a["dt_bias"] is not None:
            dt_eff = dt_eff + a["dt_bias"].to(dt_eff.dtype)
        if a["dt_softplus"]:
            dt_eff = F.softplus(dt_eff)
        A_h = A[:, 0, 0]
        if not (bool((A == A_h[:, None, None]).all()) and bool((dt_eff == dt_eff[..., :1]).all())):
            raise RuntimeError("decode A/dt are expected to be per-head values broadcast over P (and N)")

        # state_input: served [B,H,N,P]; edited in that layout and written back into the cache tensor.
        s_served, w_s = self._edit("state_input", state.transpose(-1, -2))
        if w_s:
            state.copy_(s_served.transpose(-1, -2))
        S0 = state.detach().clone()

        x4, _ = self._edit("attention_values", x[:, None])
        B4, _ = self._edit("attention_keys", Bm[:, None])
        C4, _ = self._edit("attention_queries", Cm[:, None])
        dt3 = dt_eff[:, None, :, 0]  # [B,1,H]
        A32 = A_h.to(torch.float32)
        dt3, written = self._edit_dt(dt3, A32)
        if written:
            a["dt"] = dt3[:, 0, :, None].expand(b, h, p)
            a["dt_bias"] = None
            a["dt_softplus"] = False
        a["hidden_states"], a["B"], a["C"] = x4[:, 0], B4[:, 0], C4[:, 0]

        y = self._orig_update(*ba.args, **ba.kwargs)  # updates `state` in place
        y4, w_y = self._edit("attention_head_outputs", y[:, None])
        y = y4[:, 0]
        # The decode kernel performs exactly the recurrence's update: demand bit equality there.
        self._record_mixer(x4, B4, C4, dt3, A32, S0, y4, state, exact=True)
        return y

    # ---- module hooks ----------------------------------------------------------------------
    def _install_hooks(self):
        bb = self.backbone

        def emb_hook(mod, args, out):
            self.put("embed_tokens.output", out)

        self._handles.append(bb.embeddings.register_forward_hook(emb_hook))

        for i, block in enumerate(bb.layers):

            def block_pre(mod, args, kwargs, i=i):
                hs = args[0] if args else kwargs["hidden_states"]
                self.put(f"layers.{i}.layer_input", hs)

            def block_post(mod, args, kwargs, out, i=i):
                self.put(f"layers.{i}.layer_output", out)

            def mixer_pre(mod, args, kwargs, i=i):
                if self.cur_layer is not None:
                    raise RuntimeError("nested mixer calls")
                self.cur_layer = i

            def mixer_post(mod, args, kwargs, out, i=i):
                out, _ = self._edit("attention_output", out)
                self.put(f"layers.{i}.linear_attn.attention_output", out)
                calls = self.kernel_calls.get(i, [])
                if len(calls) != 1:
                    raise RuntimeError(
                        f"layer {i} step {self.step}: expected exactly one patched kernel call, saw {calls}; "
                        f"the mixer does not resolve {self.KERNEL_NAMES} through "
                        "the module globals any more, so the oracle's patching has no effect"
                    )
                self.cur_layer = None
                return out

            self._handles.append(block.register_forward_pre_hook(block_pre, with_kwargs=True))
            self._handles.append(block.register_forward_hook(block_post, with_kwargs=True))
            self._handles.append(block.mixer.register_forward_pre_hook(mixer_pre, with_kwargs=True))
            self._handles.append(block.mixer.register_forward_hook(mixer_post, with_kwargs=True))

        def norm_hook(mod, args, out):
            self.put("ln_final.output", out)

        self._handles.append(bb.norm_f.register_forward_hook(norm_hook))

    def begin_step(self, step: int):
        self.step = step
        self.kernel_calls = {}
        self.cur_layer = None

    def end_step(self):
        missing = [i for i in range(self.n_layers) if len(self.kernel_calls.get(i, [])) != 1]
        if missing:
            raise RuntimeError(f"step {self.step}: layers {missing} did not go through the patched kernels")

    def __enter__(self):
        if isinstance(getattr(mm2.mamba2_chunk_scan, "__self__", None), _Recorder):
            raise RuntimeError("mamba2 kernels are already patched (nested oracle run?)")
        self._orig_chunk = mm2.mamba2_chunk_scan
        self._orig_update = mm2.mamba2_selective_state_update
        self._chunk_sig = inspect.signature(self._orig_chunk)
        self._update_sig = inspect.signature(self._orig_update)
        mm2.mamba2_chunk_scan = self._chunk_scan
        mm2.mamba2_selective_state_update = self._state_update
        self._install_hooks()
        return self

    def __exit__(self, *exc):
        mm2.mamba2_chunk_scan = self._orig_chunk
        mm2.mamba2_selective_state_update = self._orig_update
        for hnd in self._handles:
            hnd.remove()
        self._handles.clear()
        return False


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to one batch: (input_ids int64 [B,T0], attention_mask int64 [B,T0])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    t0 = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t0), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), t0), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, t0 - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[r, t0 - len(p):] = 1
    return ids, mask


def run(
    model,
    prompts: Sequence[Sequence[int]],
    n_steps: int,
    edits: Sequence[dict] = (),
    forced_tokens=None,
    record: bool = True,
    return_recorder: bool = False,
    recorder_cls=None,
):
    """One (possibly edited) generation run; returns every value (see module doc) as numpy arrays.

    forced_tokens: indexed ``forced_tokens[step][row]`` (shape [n_steps or n_steps-1, B]); when
    given, the token fed after step k is forced_tokens[k] instead of the greedy argmax.
    recorder_cls: the kernel-patching recorder (default: this module's Mamba-2 one).
    """
    if n_steps < 1:
        raise ValueError("n_steps must be >= 1")
    cfg = model.config
    if cfg.pad_token_id is None:
        raise ValueError("config.pad_token_id is required for left padding")
    model.eval()
    n_layers = len(model.backbone.layers)
    names = [e["name"] for e in edits]
    if len(set(names)) != len(names):
        raise ValueError(f"edit names must be unique: {names}")
    for e in edits:
        validate_edit(e, n_layers, n_steps)
    if forced_tokens is not None:
        forced_tokens = np.asarray(forced_tokens, dtype=np.int64)
        if forced_tokens.ndim != 2 or forced_tokens.shape[1] != len(prompts) or forced_tokens.shape[0] < n_steps - 1:
            raise ValueError(f"forced_tokens must be [n_steps(-1), B]; got {forced_tokens.shape}")

    ids, mask = pad_prompts(prompts, cfg.pad_token_id)
    bsz = ids.shape[0]
    tokens = torch.zeros((bsz, n_steps), dtype=torch.long)
    rec = (recorder_cls or _Recorder)(model, edits, record=record)
    logits_all = []
    with torch.no_grad(), rec:
        cache = None
        nxt = None
        for step in range(n_steps):
            rec.begin_step(step)
            if step == 0:
                out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            else:
                # HF generate passes no attention mask on decode steps (prepare_inputs_for_generation).
                out = model(input_ids=nxt[:, None], cache_params=cache, use_cache=True)
            rec.end_step()
            cache = out.cache_params
            logits = out.logits
            logits_all.append(_np(logits.float()))
            rec.put("logits", logits.float())
            if forced_tokens is not None and step < forced_tokens.shape[0]:
                nxt = torch.as_tensor(forced_tokens[step], dtype=torch.long)
            else:
                nxt = logits[:, -1].argmax(-1)
            tokens[:, step] = nxt
    unapplied = [n for n, c in rec.applied.items() if c != 1]
    if unapplied:
        raise RuntimeError(f"edits {unapplied} were applied {[rec.applied[n] for n in unapplied]} times (expected 1)")

    values = dict(rec.values)
    values["input_ids"] = _np(ids)
    values["attention_mask"] = _np(mask)
    values["tokens"] = _np(tokens)
    if not record:
        values.update({key("logits", k): v for k, v in enumerate(logits_all)})
    if return_recorder:
        return values, rec
    return values


def capture(
    model, prompts, n_steps, edits: Iterable[dict] = (), forced_tokens=None, recorder_cls=None
) -> dict[str, np.ndarray]:
    """Unedited run (every value, every step) plus, for each edit, an edited run teacher-forced with
    the unedited run's tokens, recorded as ``edit/<name>/logits@step<k>``."""
    edits = list(edits)
    base = run(model, prompts, n_steps, (), forced_tokens=forced_tokens, recorder_cls=recorder_cls)
    forced = base["tokens"].T  # [n_steps, B]
    for e in edits:
        ed = run(model, prompts, n_steps, [e], forced_tokens=forced, record=False, recorder_cls=recorder_cls)
        assert np.array_equal(ed["tokens"][:, : n_steps - 1], base["tokens"][:, : n_steps - 1])
        for k in range(n_steps):
            base[f"edit/{e['name']}/{key('logits', k)}"] = ed[key("logits", k)]
    return base


def value_paths(n_layers: int) -> list[str]:
    paths = ["embed_tokens.output"]
    for i in range(n_layers):
        paths += [f"layers.{i}.layer_input", f"layers.{i}.layer_output"]
        paths += [f"layers.{i}.linear_attn.{v}" for v in MIXER_VALUES]
    return paths + ["ln_final.output", "logits"]


def expected_keys(n_layers: int, n_steps: int, edit_names: Sequence[str] = ()) -> set[str]:
    keys = {"input_ids", "attention_mask", "tokens"}
    for k in range(n_steps):
        for p in value_paths(n_layers):
            if k == 0 and p.endswith(".state_input"):
                continue
            keys.add(key(p, k))
        for name in edit_names:
            keys.add(f"edit/{name}/{key('logits', k)}")
    return keys


def check_invariants(values: dict[str, np.ndarray], n_layers: int, n_steps: int) -> None:
    """The invariants the C++ tests check, on a captured dict (raises AssertionError).

    ``state_output@k == state_input@k+1`` holds bit-exactly (both are copies of the cache).
    ``states[:, -1] == state_output`` is bit-exact on decode steps (the recurrence *is* HF's decode
    update) and within RECURRENCE_RTOL of the state's largest entry on chunked calls (``states``
    comes from the token recurrence, ``state_output`` from HF's chunked SSD).
    """
    for i in range(n_layers):
        base = f"layers.{i}.linear_attn."
        for k in range(n_steps):
            st = values[key(base + "states", k)]
            so = values[key(base + "state_output", k)]
            assert st.shape[:1] + st.shape[2:] == so.shape, f"states/state_output shapes at layer {i} step {k}"
            if k == 0:
                err = float(np.abs(st[:, -1] - so).max()) / max(float(np.abs(so).max()), 1e-30)
                assert err <= RECURRENCE_RTOL, f"states[:, -1] vs state_output at layer {i} step 0: {err:.3e}"
            else:
                assert np.array_equal(st[:, -1], so), f"states[:, -1] != state_output at layer {i} step {k}"
            if k + 1 < n_steps:
                si = values[key(base + "state_input", k + 1)]
                assert np.array_equal(so, si), f"state_output@{k} != state_input@{k + 1} at layer {i}"
            dec = values[key(base + "decays", k)]
            bet = values[key(base + "betas", k)]
            assert dec.dtype == np.float32 and bool((dec <= 0).all()), "decays must be <= 0 float32"
            assert bool((bet >= 0).all()), "betas must be >= 0"
