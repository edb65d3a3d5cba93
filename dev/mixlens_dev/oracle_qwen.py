"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / OLMo-Hybrid / Kimi-Linear numerical oracle: every value of transformers' pure-torch hybrids.

The reference the C++ tests compare against (through the goldens in tests/fixtures/qwen3_5 and
tests/fixtures/qwen3_next, built by scripts/make_fixtures.py). Imports no test framework.

How values are captured
-----------------------
transformers 5.18 resolves the gated-DeltaNet kernels as *module globals* of
``modeling_qwen3_5`` / ``modeling_qwen3_5_moe`` / ``modeling_qwen3_next`` / ``modeling_olmo_hybrid`` at call time: ``torch_chunk_gated_delta_rule``
(prompts and multi-token continuations), ``torch_recurrent_gated_delta_rule`` (single-token decode),
``causal_conv1d_fn`` / ``causal_conv1d_update`` and ``apply_rotary_pos_emb`` (attention). The
``use_kernelized_func`` decorator is the identity without the ``kernels`` package, so replacing the
globals takes effect; ``_Recorder`` checks it on every forward (each GDN layer must go through
exactly one patched delta-rule call and one patched conv call, each attention layer through one
patched RoPE call, none on OLMo-Hybrid's NoPE layout, whose q / k are read after q_norm / k_norm),
otherwise it raises. Module hooks capture the rest (``mlp.output`` and ``self_attn.attention_output`` are
the modules' outputs: before OLMo-Hybrid's post-norms).
Kimi-Linear (``modeling_kimi_linear``): the delta-rule globals are ``chunk_kimi_delta_attention`` /
``recurrent_kimi_delta_attention`` (decays per key channel, [B,T,H,Dk]); both block kinds are
``self_attn``; its attention has no RoPE, so the attention layer's ``expand_kv`` (an instance
attribute here) is wrapped instead: it gives the call's keys and values, q_proj / q_b_proj the queries.

Keys: ``"<path>@step<k>"`` (``embed_tokens.output``, ``layers.{i}.layer_input`` / ``layer_output``,
``layers.{i}.linear_attn.<value>``, ``layers.{i}.self_attn.<value>``, ``layers.{i}.mlp.output``,
``ln_final.output``, ``logits``) plus ``input_ids``, ``attention_mask``, ``tokens``; edited runs add
``edit/<name>/logits@step<k>``. GDN states are ``[B, HV, Dk, Dv]``, HF's own layout (key side first).
"""

from __future__ import annotations

import re
import sys
from typing import Sequence

import numpy as np
import torch

import transformers.models.qwen3_5.modeling_qwen3_5 as mq35

from mixlens_dev.oracle_loop import run_steps

_PATH_RE = re.compile(r"^layers\.(\d+)\.linear_attn\.([a-z_]+)$")
EDITABLE = ("attention_queries", "attention_keys", "attention_values", "betas", "decays", "state_input")
RECURRENCE_RTOL = 1e-5  # explicit token recurrence vs the chunked kernel's final state (fp32)


def key(path: str, step: int) -> str:
    return f"{path}@step{step}"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").float().contiguous().numpy().copy()


def _apply_op(value: torch.Tensor, edit: dict) -> torch.Tensor:
    if edit["op"] == "scale":
        return value * float(edit["factor"])
    if edit["op"] == "set_index":  # along axis 1: the token, or the head for state_input
        out = value.clone()
        out[:, int(edit["index"])] = float(edit["value"])
        return out
    raise ValueError(f"edit {edit['name']!r}: unknown op {edit['op']!r}")


def token_recurrence(q, k, v, g, beta, S0):
    """Gated delta rule token by token (model-math §3.3.5), fp32, from the kernel's inputs.
    q, k [B,T,H,Dk] (before the L2 norm), v [B,T,H,Dv], g/beta [B,T,H] (g [B,T,H,Dk]: Kimi's decay per
    key channel, each key row of S decayed by its own factor). Returns [B,T,H,Dk,Dv]."""
    q, k = mq35.l2norm(q.float()), mq35.l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    b, t_len, h, dk = k.shape
    S = torch.zeros(b, h, dk, v.shape[-1]) if S0 is None else S0.float().clone()
    out = torch.empty(b, t_len, h, dk, v.shape[-1])
    for t in range(t_len):
        S = S * (g[:, t].exp()[..., None] if g.dim() == 4 else g[:, t].exp()[..., None, None])
        mem = (S * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t] - mem) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = S
    return out


class _Recorder:
    """Patches the kernels of one modeling module and hooks one model's modules for a run."""

    def __init__(self, model, edits: Sequence[dict] = (), record: bool = True):
        self.model = model
        # The model's own modeling module (qwen3_5, qwen3_5_moe, qwen3_next): its globals are what it calls.
        self.mod = sys.modules[type(model).__module__]
        self.text = model.model.language_model if hasattr(model.model, "language_model") else model.model
        self.kimi = self.mod.__name__.endswith("modeling_kimi_linear")
        self.delta_names = (("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention") if self.kimi else
                            ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"))
        self.n_layers = len(self.text.layers)
        self.nope = getattr(self.text, "rotary_emb", True) is None  # OLMo-Hybrid with rope_theta null
        self.edits = list(edits)
        self.record = record
        self.values: dict[str, np.ndarray] = {}
        self.step = 0
        self.cur_layer: int | None = None
        self.calls: dict[int, list[str]] = {}
        self.applied = {e["name"]: 0 for e in self.edits}
        self.kernel_log: list[tuple[int, int, str]] = []
        self.max_recurrence_err = 0.0
        self._handles = []
        self._orig = {}

    def put(self, path, tensor):
        if not self.record:
            return
        k = key(path, self.step)
        if k in self.values:
            raise RuntimeError(f"{k} recorded twice")
        self.values[k] = _np(tensor)

    def _mix(self, v):
        return f"layers.{self.cur_layer}.linear_attn.{v}"

    def _edit(self, value: str, tensor):
        for e in self.edits:
            layer, name = _PATH_RE.match(e["path"]).group(1, 2)
            if int(layer) == self.cur_layer and name == value and int(e["step"]) == self.step:
                tensor = _apply_op(tensor, e).to(tensor.dtype)
                self.applied[e["name"]] += 1
        return tensor

    # ---- patched functions -------------------------------------------------------------------
    def _delta(self, kind):
        orig = self._orig[kind]

        def wrapped(query, key_, value, g, beta, *args, **kwargs):
            self.calls.setdefault(self.cur_layer, []).append(kind)
            self.kernel_log.append((self.step, self.cur_layer, "chunked" if "chunk" in kind else "recurrent"))
            init = kwargs.get("initial_state")
            query = self._edit("attention_queries", query)
            key_ = self._edit("attention_keys", key_)
            value = self._edit("attention_values", value)
            beta = self._edit("betas", beta)
            g = self._edit("decays", g)
            if init is not None:
                init = self._edit("state_input", init)
                kwargs["initial_state"] = init
            out, S = orig(query, key_, value, g, beta, *args, **kwargs)
            states = token_recurrence(query, key_, value, g, beta, init)
            err = float((states[:, -1] - S).abs().max() / S.abs().max().clamp_min(1e-30))
            if not err <= RECURRENCE_RTOL:
                raise AssertionError(f"step {self.step} layer {self.cur_layer}: recurrence vs kernel {err:.2e}")
            self.max_recurrence_err = max(self.max_recurrence_err, err)
            self.put(self._mix("attention_queries"), query)
            self.put(self._mix("attention_keys"), key_)
            self.put(self._mix("attention_values"), value)
            self.put(self._mix("betas"), beta)
            self.put(self._mix("decays"), g)
            if init is not None:
                self.put(self._mix("state_input"), init)
            self.put(self._mix("states"), states)
            self.put(self._mix("state_output"), S)
            self.put(self._mix("attention_head_outputs"), out)
            return out, S

        return wrapped

    def _conv(self, kind):
        orig = self._orig[kind]

        def wrapped(*args, **kwargs):
            self.calls.setdefault(self.cur_layer, []).append(kind)
            return orig(*args, **kwargs)

        return wrapped

    def _rope(self, q, k, cos, sin, *args, **kwargs):
        self.calls.setdefault(self.cur_layer, []).append("rope")
        qe, ke = self._orig["apply_rotary_pos_emb"](q, k, cos, sin, *args, **kwargs)
        p = f"layers.{self.cur_layer}.self_attn."
        self.put(p + "attention_queries", qe.transpose(1, 2))
        self.put(p + "attention_keys", ke.transpose(1, 2))
        return qe, ke

    # ---- hooks -------------------------------------------------------------------------------
    def _linear(self, layer) -> bool:
        return layer.block_type == "linear_attention" if self.kimi else hasattr(layer, "linear_attn")

    def _install_kimi_attention(self, i, at):
        """KimiLinearAttention: queries from q_proj (or q_b_proj), the call's keys and values from
        expand_kv (the cache's whole length comes back: the last T are this call's)."""
        H, hd = self._h, at.qk_head_dim
        q_mod = at.q_proj if at.q_proj is not None else at.q_b_proj

        def qproj(m, a, o, i=i):
            b, t, _ = o.shape
            self.put(f"layers.{i}.self_attn.attention_queries", o.view(b, t, -1, hd))

        orig = at.expand_kv

        def expand_kv(kv_nope, k_rot, i=i):
            self.calls.setdefault(i, []).append("expand_kv")
            k, v = orig(kv_nope, k_rot)
            t = self._t
            self.put(f"layers.{i}.self_attn.attention_keys", k[:, :, -t:].transpose(1, 2))
            self.put(f"layers.{i}.self_attn.attention_values", v[:, :, -t:].transpose(1, 2))
            return k, v

        def pre(m, args, kwargs):
            self._t = (args[0] if args else kwargs["hidden_states"]).shape[1]

        at.expand_kv = expand_kv
        self._restore.append(lambda: delattr(at, "expand_kv"))
        H.append(q_mod.register_forward_hook(qproj))
        H.append(at.register_forward_pre_hook(pre, with_kwargs=True))
        H.append(at.register_forward_hook(
            lambda m, a, o, i=i: self.put(f"layers.{i}.self_attn.attention_output", o[0])))

    def _hook_block(self, i, layer, mlp):
        """Block i's layer_input / layer_output (it sets cur_layer while it runs) and `mlp`'s output."""
        def pre(m, args, kwargs):
            self.cur_layer = i
            self.put(f"layers.{i}.layer_input", args[0] if args else kwargs["hidden_states"])

        def post(m, args, kwargs, out):
            self.put(f"layers.{i}.layer_output", out[0] if isinstance(out, tuple) else out)
            self.cur_layer = None

        self._h.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        self._h.append(layer.register_forward_hook(post, with_kwargs=True))
        self._h.append(mlp.register_forward_hook(
            lambda m, a, o: self.put(f"layers.{i}.mlp.output", o[0] if isinstance(o, tuple) else o)))

    def _hook_plain_attention(self, i, at):
        """Softmax attention block i without a gate or NoPE (LFM2's, MiniMax's): its values (v_proj's output)
        and attention_output; queries and keys come from the patched apply_rotary_pos_emb."""
        def vproj(m, a, o, hd=at.head_dim):
            b, t, _ = o.shape
            self.put(f"layers.{i}.self_attn.attention_values", o.view(b, t, -1, hd))

        self._h.append(at.v_proj.register_forward_hook(vproj))
        self._h.append(at.register_forward_hook(lambda m, a, o: self.put(f"layers.{i}.self_attn.attention_output", o[0])))

    def _install(self):
        tm = self.text
        H = self._h = []
        self._restore = []

        H.append(tm.embed_tokens.register_forward_hook(lambda m, a, o: self.put("embed_tokens.output", o)))
        for i, layer in enumerate(tm.layers):
            self._hook_block(i, layer, layer.mlp)
            if self._linear(layer):
                H.append((layer.self_attn if self.kimi else layer.linear_attn).register_forward_hook(
                    lambda m, a, o, i=i: self.put(f"layers.{i}.linear_attn.attention_output", o)))
            elif self.kimi:
                self._install_kimi_attention(i, layer.self_attn)
            else:
                at = layer.self_attn
                hd = at.head_dim
                gated = at.q_proj.out_features == 2 * at.config.num_attention_heads * hd  # Qwen's output gate

                def qproj(m, a, o, i=i, hd=hd):
                    b, t, _ = o.shape
                    self.put(f"layers.{i}.self_attn.gate", o.view(b, t, -1, 2 * hd)[..., hd:].reshape(b, t, -1))

                def qk_normed(name, i=i, hd=hd):  # NoPE: q / k as attention reads them, after their norms
                    def hook(m, a, o):
                        b, t, _ = o.shape
                        self.put(f"layers.{i}.self_attn.{name}", o.view(b, t, -1, hd))
                    return hook

                def vproj(m, a, o, i=i, hd=hd):
                    b, t, _ = o.shape
                    self.put(f"layers.{i}.self_attn.attention_values", o.view(b, t, -1, hd))

                if gated:
                    H.append(at.q_proj.register_forward_hook(qproj))
                if self.nope:
                    H.append(at.q_norm.register_forward_hook(qk_normed("attention_queries")))
                    H.append(at.k_norm.register_forward_hook(qk_normed("attention_keys")))
                H.append(at.v_proj.register_forward_hook(vproj))
                H.append(at.register_forward_hook(
                    lambda m, a, o, i=i: self.put(f"layers.{i}.self_attn.attention_output", o[0])))
        H.append(tm.norm.register_forward_hook(lambda m, a, o: self.put("ln_final.output", o)))

    def __enter__(self):
        for name in (*self.delta_names, "causal_conv1d_fn", "causal_conv1d_update",
                     *(() if self.kimi else ("apply_rotary_pos_emb",))):
            self._orig[name] = getattr(self.mod, name)
        for name in self.delta_names:
            setattr(self.mod, name, self._delta(name))
        self.mod.causal_conv1d_fn = self._conv("causal_conv1d_fn")
        self.mod.causal_conv1d_update = self._conv("causal_conv1d_update")
        if not self.kimi:
            self.mod.apply_rotary_pos_emb = self._rope
        self._install()
        return self

    def __exit__(self, *exc):
        for h in self._h:
            h.remove()
        for undo in self._restore:
            undo()
        for name, f in self._orig.items():
            setattr(self.mod, name, f)

    def begin_step(self, step):
        self.step = step
        self.calls = {}

    def end_step(self):
        """Guard: every layer went through the patched functions exactly once (the patch took)."""
        for i, layer in enumerate(self.text.layers):
            got = sorted(self.calls.get(i, []))
            if self._linear(layer):
                ok = len(got) == 2 and any(c in self.delta_names for c in got) and any("conv1d" in c for c in got)
            else:
                ok = got == (["expand_kv"] if self.kimi else [] if self.nope else ["rope"])
            if not ok:
                raise RuntimeError(f"step {self.step} layer {i}: patched calls {got} (did transformers stop "
                                   "resolving the kernels as module globals?)")


def pad_prompts(prompts, pad_id):
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, T - len(p):] = torch.tensor(p)
        mask[r, T - len(p):] = 1
    return ids, mask


def run(model, prompts, pad_id, n_steps, edits=(), feeds=None, record=True, recorder=None, cache=None):
    """Prompt (step 0) then n_steps-1 more calls. feeds[k-1] ([B, n] ids) is fed at step k when given,
    else the greedy token. Position ids as generate builds them (cumsum(mask) - 1, 0 on padding).
    `recorder`: another family's recorder class (oracle_lfm2), the same protocol as _Recorder.
    `cache`: the family's own empty cache (MiniMaxCache) instead of a DynamicCache."""
    ids, mask = pad_prompts(prompts, pad_id)
    if cache is None:
        cache = mq35.DynamicCache(config=model.config.get_text_config())
    with (recorder or _Recorder)(model, edits, record) as rec, torch.no_grad():
        out_values, tokens = run_steps(model, ids, mask, cache, rec, n_steps, feeds)
        for e, n in rec.applied.items():
            if n == 0:
                raise ValueError(f"edit {e!r} was never applied")
    values = rec.values if record else out_values
    values["input_ids"] = ids.numpy()
    values["attention_mask"] = mask.numpy()
    values["tokens"] = torch.stack(tokens, 1).numpy()
    return values, rec
