"""Mamba hybrids oracle (Nemotron-H, Bamba, Falcon-H1, Granite 4.0-H, Jamba, Zamba2, Zamba): every value of transformers
5.18's pure-torch NemotronHForCausalLM / BambaForCausalLM / FalconH1ForCausalLM /
GraniteMoeHybridForCausalLM / JambaForCausalLM / Zamba2ForCausalLM / ZambaForCausalLM.

Zamba's mixer is Mamba-1 per Mamba head (ZambaMambaMixer): the same patching, once per head
(ZambaRecorder); its one shared block is recorded per depth as Zamba2's.

Jamba's mixer is Mamba-1 (JambaMambaMixer): its values come from oracle_mamba's patching of
``mamba_selective_scan`` / ``mamba_selective_state_update`` (module globals of modeling_jamba, the
same signatures as Mamba-1's), through JambaRecorder; everything else as for the Mamba-2 hybrids.

Zamba2's shared transformer block runs at every "hybrid" layer i through that layer's own module
objects (the parameters are tied, the modules are not), so the per-layer hooks record its values at
depth i as ``layers.{i}.self_attn.*`` / ``layers.{i}.mlp.output`` (the shared MLP's output, before the
layer's linear). With use_shared_attention_adapter the q / k / v are projection + this depth's
adapter: recorded (and edited) from a hook on the adapter, which adds the projection's stashed output.

The Mamba-2 mixer values come from the same kernel patching as oracle_mamba2 (``mamba2_chunk_scan``
and ``mamba2_selective_state_update`` are module globals of each hybrid's modeling module, resolved
at call time; the recorder checks every mixer went through exactly one patched call). Attention
queries/keys come from the patched ``apply_rotary_pos_emb`` (Bamba, Falcon-H1, Granite with
position_embedding_type "rope") or the q/k projections (Nemotron-H, Granite "nope": no positional
encoding); values from v_proj; the rest from module hooks.

Where mixlens serves a value after a µP multiplier that transformers applies outside the module
(Falcon-H1: embeddings * embedding_multiplier, mamba output * ssm_out_multiplier, attention output *
attention_out_multiplier; Granite: embeddings * embedding_multiplier, every branch output *
residual_multiplier), the oracle records the multiplied tensor: what the block adds. Granite's
``mlp.output`` is ``(block_sparse_moe(x) + shared_mlp(x)) * residual_multiplier`` (the shared MLP
alone when num_local_experts is 0), computed as GraniteMoeHybridDecoderLayer does.

Keys: ``"<path>@step<k>"`` as oracle_mamba2, plus ``layers.{i}.self_attn.<value>`` and
``layers.{i}.mlp.output``. Edits: any linear_attn value oracle_mamba2 edits, plus
``self_attn.attention_values`` and ``self_attn.attention_output``.
"""

from __future__ import annotations

import inspect
import re
from typing import Sequence

import numpy as np
import torch

import transformers.models.bamba.modeling_bamba as mb
import transformers.models.falcon_h1.modeling_falcon_h1 as mf
import transformers.models.granitemoehybrid.modeling_granitemoehybrid as mg
import transformers.models.jamba.modeling_jamba as mj
import transformers.models.nemotron_h.modeling_nemotron_h as mn
import transformers.models.zamba.modeling_zamba as mz1
import transformers.models.zamba2.modeling_zamba2 as mz

from mixlens_dev import oracle_mamba as om1
from mixlens_dev import oracle_mamba2 as om
from mixlens_dev.oracle_loop import run_steps

key = om.key
_np = om._np
_PATH_RE = re.compile(r"^layers\.(\d+)\.(linear_attn|self_attn)\.([a-z_]+)$")


def module_for(model):
    name = type(model).__module__
    if "jamba" in name:
        return mj
    if "zamba2" in name:
        return mz
    if name.endswith(".modeling_zamba"):
        return mz1
    return mn if "nemotron_h" in name else mb if "bamba" in name else mg if "granitemoehybrid" in name else mf


def multipliers(model):
    """(embedding, mixer output, attention output, MLP output) factors the oracle records values
    after: Falcon-H1's µP multipliers, Granite's embedding_multiplier and residual_multiplier."""
    cfg, mod = model.config, module_for(model)
    if mod is mf:
        return (float(cfg.embedding_multiplier), float(cfg.ssm_out_multiplier), float(cfg.attention_out_multiplier), 1.0)
    if mod is mg:
        rm = float(cfg.residual_multiplier)
        return float(cfg.embedding_multiplier), rm, rm, rm
    return 1.0, 1.0, 1.0, 1.0


def has_rope(model) -> bool:
    mod = module_for(model)
    if mod is mg:
        return model.config.position_embedding_type == "rope"
    if mod is mz:
        return bool(model.config.use_mem_rope)
    return mod not in (mn, mj, mz1)  # JambaAttention / ZambaAttention have no positional encoding


def final_norm(model):
    tm = model.model
    return tm.norm_f if hasattr(tm, "norm_f") else tm.norm if hasattr(tm, "norm") else tm.final_layernorm


def granite_mlp_hooks(layer, on_output):
    """Hooks giving ``on_output(moe + shared)`` (GraniteMoeHybridDecoderLayer's MLP branch before
    residual_multiplier; the shared MLP alone without experts) from block_sparse_moe and shared_mlp
    (which runs second); ``on_output`` may return a replacement for the shared MLP's output."""
    stash = {}
    handles = []
    if layer.block_sparse_moe is not None:
        handles.append(layer.block_sparse_moe.register_forward_hook(lambda m, a, o: stash.__setitem__("moe", o)))

    def shared(m, a, o):
        moe = stash.pop("moe", None)
        return on_output(o if moe is None else moe + o, moe, o)

    handles.append(layer.shared_mlp.register_forward_hook(shared))
    return handles


def _one(o):
    return o[0] if isinstance(o, tuple) else o


def block_parts(layer, nemotron: bool):
    """(Mamba-2 mixer, attention, MLP / MoE) modules of one decoder layer, None where absent:
    a Nemotron-H block holds one of them (by block_type), Bamba / Falcon-H1 layers several."""
    if nemotron:
        kind = layer.block_type
        return (layer.mixer if kind == "linear_attention" else None, layer.mixer if kind == "full_attention" else None,
                layer.mixer if kind in ("mlp", "moe") else None)
    if isinstance(layer, mz.Zamba2HybridLayer):  # this depth's shared block modules
        st = layer.shared_transformer
        return layer.mamba_decoder.mamba, st.self_attn, st.feed_forward
    if isinstance(layer, mz1.ZambaHybridLayer):  # Zamba's one shared block, this depth's modules
        st = layer.shared_transf
        return layer.mamba_decoder.mamba, st.self_attn, st.feed_forward
    if isinstance(layer, (mz.Zamba2MambaDecoderLayer, mz1.ZambaMambaDecoderLayer)):
        return layer.mamba, None, None
    if hasattr(layer, "shared_mlp"):  # Granite: mamba / self_attn is None on the other kind
        return layer.mamba, layer.self_attn, layer.shared_mlp
    return getattr(layer, "mamba", None), getattr(layer, "self_attn", None), layer.feed_forward


class Recorder(om._Recorder):
    """oracle_mamba2's kernel patching and edits, with the hybrid block structure's hooks."""

    def __init__(self, model, edits: Sequence[dict] = (), record: bool = True):
        # Not calling the parent __init__: it expects model.backbone.
        self.model = model
        self.mod = module_for(model)
        self.tm = model.model
        self.cfg = model.config
        self.n_layers = len(self.tm.layers)
        self.edits = list(edits)
        self.record = record
        self.values = {}
        self.step = 0
        self.cur_layer = None
        self.block = None
        self.kernel_calls = {}
        self.rope_calls = {}
        self.applied = {e["name"]: 0 for e in self.edits}
        self.kernel_log = []
        self.max_recurrence_err = 0.0
        self._handles = []
        self.falcon = self.mod is mf
        self.granite = self.mod is mg
        self.rope = has_rope(model)

    # ---- edits -----------------------------------------------------------------------------
    def _edits_for(self, value, comp="linear_attn"):
        layer = self.cur_layer if comp == "linear_attn" else self.block
        out = []
        for e in self.edits:
            m = _PATH_RE.match(e["path"])
            if m is None:
                raise ValueError(f"edit {e['name']!r}: path {e['path']!r} is not a linear_attn/self_attn value")
            if int(m.group(1)) == layer and m.group(2) == comp and m.group(3) == value and int(e["step"]) == self.step:
                out.append(e)
        return out

    def _edit(self, value, tensor, comp="linear_attn"):
        edits = self._edits_for(value, comp)
        for e in edits:
            tensor = om._apply_op(tensor, e).to(tensor.dtype)
            self.applied[e["name"]] += 1
        return tensor, bool(edits)

    def _state_update(self, *args, **kwargs):
        # torch's vectorised softplus on the head-dim-expanded dt can differ by one ulp between the
        # SIMD body and the scalar tail (Falcon-H1 head_dim 12), so HF's decode dt is not exactly
        # constant over head_dim. Compute it once per head (as mixlens and the chunked path do)
        # and pass it pre-activated; the state update itself is unchanged.
        ba = self._update_sig.bind(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        dt = a["dt"][..., :1]
        if a["dt_bias"] is not None:
            dt = dt + a["dt_bias"][..., :1].to(dt.dtype)
        if a["dt_softplus"]:
            dt = torch.nn.functional.softplus(dt)
        a["dt"], a["dt_bias"], a["dt_softplus"] = dt.expand_as(a["dt"]), None, False
        return super()._state_update(*ba.args, **ba.kwargs)

    # ---- patched RoPE --------------------------------------------------------------------------
    def _rope(self, q, k, cos, sin, *args, **kwargs):
        self.rope_calls.setdefault(self.block, []).append("rope")
        qe, ke = self._orig_rope(q, k, cos, sin, *args, **kwargs)
        p = f"layers.{self.block}.self_attn."
        self.put(p + "attention_queries", qe.transpose(1, 2))
        self.put(p + "attention_keys", ke.transpose(1, 2))
        return qe, ke

    # ---- hooks -------------------------------------------------------------------------------
    def _install_hooks(self):
        tm, H = self.tm, self._handles
        emb = tm.embeddings if self.mod is mn else tm.embed_tokens
        em, ssm_out, attn_out, mlp_out = multipliers(self.model)
        H.append(emb.register_forward_hook(lambda m, a, o: self.put("embed_tokens.output", o * em)))

        for i, layer in enumerate(tm.layers):
            def pre(m, args, kwargs, i=i):
                self.block = i
                self.put(f"layers.{i}.layer_input", args[0] if args else kwargs["hidden_states"])

            def post(m, args, kwargs, out, i=i):
                self.put(f"layers.{i}.layer_output", _one(out))
                self.block = None

            H.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            H.append(layer.register_forward_hook(post, with_kwargs=True))
            mamba, attn, mlp = block_parts(layer, self.mod is mn)
            if mamba is not None:
                def mpre(m, args, kwargs, i=i):
                    self.cur_layer = i

                def mpost(m, args, kwargs, out, i=i):
                    # FalconH1RMSNormGated drops the token axis of a one-token call ([B, D]); the
                    # block broadcasts it back. Record it as [B, 1, D].
                    o3 = out[:, None] if out.dim() == 2 else out
                    scaled, w = self._edit("attention_output", o3 * ssm_out)
                    self.put(f"layers.{i}.linear_attn.attention_output", scaled)
                    if len(self.kernel_calls.get(i, [])) != 1:
                        raise RuntimeError(f"layer {i} step {self.step}: patched kernel calls "
                                           f"{self.kernel_calls.get(i)}; the patching did not take")
                    self.cur_layer = None
                    return (scaled / ssm_out).reshape(out.shape) if w else out

                H.append(mamba.register_forward_pre_hook(mpre, with_kwargs=True))
                H.append(mamba.register_forward_hook(mpost, with_kwargs=True))
            if attn is not None:
                hd = attn.head_dim

                def vproj(m, a, o, i=i, hd=hd):
                    b, t, _ = o.shape
                    v, w = self._edit("attention_values", o.view(b, t, -1, hd), "self_attn")
                    self.put(f"layers.{i}.self_attn.attention_values", v)
                    return v.reshape(b, t, -1) if w else o

                adapters = getattr(attn, "linear_v_adapter_list", None) if self.mod is mz else None
                if adapters is not None:
                    H.extend(self._adapter_hooks(attn, i, hd))
                else:
                    H.append(attn.v_proj.register_forward_hook(vproj))
                if not self.rope and adapters is None:  # no RoPE: q and k straight from the projections
                    H.append(attn.q_proj.register_forward_hook(
                        lambda m, a, o, i=i, hd=hd: self.put(f"layers.{i}.self_attn.attention_queries",
                                                             o.view(o.shape[0], o.shape[1], -1, hd))))
                    H.append(attn.k_proj.register_forward_hook(
                        lambda m, a, o, i=i, hd=hd: self.put(f"layers.{i}.self_attn.attention_keys",
                                                             o.view(o.shape[0], o.shape[1], -1, hd))))

                def apost(m, a, o, i=i):
                    out, w = self._edit("attention_output", o[0] * attn_out, "self_attn")
                    self.put(f"layers.{i}.self_attn.attention_output", out)
                    return (out / attn_out,) + tuple(o[1:]) if w else o

                H.append(attn.register_forward_hook(apost))
            if mlp is not None and self.granite:
                H.extend(granite_mlp_hooks(layer, lambda tot, moe, o, i=i: self.put(f"layers.{i}.mlp.output", tot * mlp_out)))
            elif mlp is not None:
                H.append(mlp.register_forward_hook(lambda m, a, o, i=i: self.put(f"layers.{i}.mlp.output", _one(o))))
        H.append(final_norm(self.model).register_forward_hook(lambda m, a, o: self.put("ln_final.output", o)))

    def _adapter_hooks(self, attn, i, hd):
        """Zamba2Attention with adapters: q / k / v = projection(x) + adapter_list[depth](x); the
        adapter's hook sees the projection's stashed output and records (and edits) the sum."""
        depth = attn.layer_dic[i]
        stash, handles = {}, []
        for name, value in (("q", "attention_queries"), ("k", "attention_keys"), ("v", "attention_values")):
            proj = getattr(attn, f"{name}_proj")
            adapter = getattr(attn, f"linear_{name}_adapter_list")[depth]
            handles.append(proj.register_forward_hook(lambda m, a, o, name=name: stash.__setitem__(name, o)))

            def total(m, a, o, name=name, value=value):
                base = stash.pop(name)
                b, t, _ = o.shape
                tot = (base + o).view(b, t, -1, hd)
                if name == "v":
                    tot, w = self._edit(value, tot, "self_attn")
                    self.put(f"layers.{i}.self_attn.{value}", tot)
                    return tot.reshape(b, t, -1) - base if w else o
                if not self.rope:
                    self.put(f"layers.{i}.self_attn.{value}", tot)
                return o

            handles.append(adapter.register_forward_hook(total))
        return handles

    def begin_step(self, step):
        super().begin_step(step)
        self.rope_calls = {}

    def end_step(self):
        for i, layer in enumerate(self.tm.layers):
            mamba, attn, _ = block_parts(layer, self.mod is mn)
            has_mamba = mamba is not None
            has_rope = self.rope and attn is not None
            if has_mamba and len(self.kernel_calls.get(i, [])) != 1:
                raise RuntimeError(f"step {self.step} layer {i}: mixer did not go through the patched kernels")
            if has_rope and self.rope_calls.get(i) != ["rope"]:
                raise RuntimeError(f"step {self.step} layer {i}: attention did not go through the patched RoPE")

    def __enter__(self):
        m = self.mod
        self._orig_chunk = m.mamba2_chunk_scan
        self._orig_update = m.mamba2_selective_state_update
        self._chunk_sig = inspect.signature(self._orig_chunk)
        self._update_sig = inspect.signature(self._orig_update)
        m.mamba2_chunk_scan = self._chunk_scan
        m.mamba2_selective_state_update = self._state_update
        if self.rope:
            self._orig_rope = m.apply_rotary_pos_emb
            m.apply_rotary_pos_emb = self._rope
        self._install_hooks()
        return self

    def __exit__(self, *exc):
        m = self.mod
        m.mamba2_chunk_scan = self._orig_chunk
        m.mamba2_selective_state_update = self._orig_update
        if self.rope:
            m.apply_rotary_pos_emb = self._orig_rope
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False


class JambaRecorder(Recorder, om1._Recorder):
    """The hybrid hooks with oracle_mamba's Mamba-1 kernel patching (its _scan / _update /
    _record_mixer) in place of the Mamba-2 kernels."""

    def __enter__(self):
        m = self.mod
        self._orig_scan = m.mamba_selective_scan
        self._orig_update = m.mamba_selective_state_update
        self._scan_sig = inspect.signature(self._orig_scan)
        self._update_sig = inspect.signature(self._orig_update)
        m.mamba_selective_scan = self._scan
        m.mamba_selective_state_update = self._update
        self._install_hooks()
        return self

    def __exit__(self, *exc):
        m = self.mod
        m.mamba_selective_scan = self._orig_scan
        m.mamba_selective_state_update = self._orig_update
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False


class ZambaRecorder(JambaRecorder):
    """ZambaMambaMixer calls the Mamba-1 kernels once per Mamba head (channels [h P, (h+1) P), the
    head's own B and C): each call is recorded and edited as Jamba's on its head's slice, and a
    layer's values are put once every head has run (B / C stacked [B,T,H,N], the rest concatenated
    on the channel axis). Edits apply to every head's slice and count once; a set_index on a state
    (its axis 1 is the channel) is refused, since a head's slice would shift the index."""

    def __init__(self, model, edits=(), record=True):
        super().__init__(model, edits, record)
        self.heads = int(model.config.n_mamba_heads)
        self.head = None
        self._calls = {}
        self._parts = {}
        for e in self.edits:
            if e["op"] == "set_index" and e["path"].endswith(("state_input", "states", "state_output")):
                raise ValueError(f"edit {e['name']!r}: set_index on a Zamba state would index a head's channels")

    def _per_head(self, kernel, *args, **kwargs):
        k = (self.step, self.cur_layer)
        self.head = self._calls.get(k, 0)
        self._calls[k] = self.head + 1
        try:
            return kernel(*args, **kwargs)
        finally:
            self.head = None

    def _scan(self, *args, **kwargs):
        return self._per_head(super()._scan, *args, **kwargs)

    def _update(self, *args, **kwargs):
        return self._per_head(super()._update, *args, **kwargs)

    def _kernel_entered(self, kind):
        if self.head == 0:  # one entry per layer call, as the shared checks expect
            super()._kernel_entered(kind)

    def _edit(self, value, tensor, comp="linear_attn"):
        if comp != "linear_attn" or not self.head:
            return super()._edit(value, tensor, comp)
        edits = self._edits_for(value, comp)  # later heads: the same edits, counted at head 0
        for e in edits:
            tensor = om._apply_op(tensor, e).to(tensor.dtype)
        return tensor, bool(edits)

    def put(self, path, tensor):
        if self.head is None or ".linear_attn." not in path:
            return super().put(path, tensor)
        parts = self._parts.setdefault(path, [])
        parts.append(tensor)
        if len(parts) == self.heads:
            del self._parts[path]
            name = path.rsplit(".", 1)[1]
            if name in ("attention_queries", "attention_keys"):
                super().put(path, torch.stack(parts, 2))
            else:
                super().put(path, torch.cat(parts, 1 if name in ("state_input", "state_output") else 2))


def recorder_for(model):
    mod = module_for(model)
    return ZambaRecorder if mod is mz1 else JambaRecorder if mod is mj else Recorder


pad_prompts = om.pad_prompts


def run(model, prompts, pad_id, n_steps, edits=(), feeds=None, record=True):
    """Prompt (step 0), then n_steps-1 single-token steps (greedy, or feeds[k-1] [B,1] when given),
    through a DynamicCache. Position ids and the growing attention mask as generate builds them."""
    ids, mask = pad_prompts(prompts, pad_id)
    cache = mn.DynamicCache(config=model.config)
    with recorder_for(model)(model, edits, record) as rec, torch.no_grad():
        out_values, tokens = run_steps(model, ids, mask, cache, rec, n_steps, feeds)
    bad = [n for n, c in rec.applied.items() if c != 1]
    if bad:
        raise RuntimeError(f"edits {bad} applied {[rec.applied[n] for n in bad]} times (expected 1)")
    values = dict(rec.values) if record else out_values
    values["input_ids"] = ids.numpy()
    values["attention_mask"] = mask.numpy()
    values["tokens"] = torch.stack(tokens, 1).numpy()
    return values, rec


def check_invariants(values, layers_with_mixer, n_steps):
    """values.md invariants on the mixer layers (see oracle_mamba2.check_invariants)."""
    for i in layers_with_mixer:
        base = f"layers.{i}.linear_attn."
        for k in range(n_steps):
            st, so = values[key(base + "states", k)], values[key(base + "state_output", k)]
            if k == 0:
                err = float(np.abs(st[:, -1] - so).max()) / max(float(np.abs(so).max()), 1e-30)
                assert err <= om.RECURRENCE_RTOL * 10, (i, k, err)
            else:
                assert np.array_equal(st[:, -1], so), (i, k)
            if k + 1 < n_steps:
                assert np.array_equal(so, values[key(base + "state_input", k + 1)]), (i, k)
            assert bool((values[key(base + "decays", k)] <= 0).all()) and bool((values[key(base + "betas", k)] >= 0).all())
