"""Helpers shared by the gradient oracles (oracle_grad_*.py: torch autograd on transformers'
pure-torch models) and the gradient tests (test_grad_*.py), issue 12: keeping a value for its
``.grad``, the set_index edit, collecting the gradients as numpy, and the relative-RMS comparison."""

from __future__ import annotations

import numpy as np
import torch

from mixlens_dev.common import rel_rms

TOL = 1e-4  # relative RMS of every gradient against torch autograd, float32 (issue 12)


def keep(store: dict, path: str, t: torch.Tensor) -> torch.Tensor:
    """Store ``t`` under ``path`` and keep its ``.grad`` after backward (non-leaf tensors)."""
    if t.requires_grad:
        t.retain_grad()
    store[path] = t
    return t


def set_index(t: torch.Tensor, edit: dict) -> torch.Tensor:
    """The oracle's write: ``out = t.clone(); out[:, index] = value`` (written elements are constants)."""
    out = t.clone()
    out[:, int(edit["index"])] = float(edit["value"])
    return out


def mixlens_edits(edits) -> dict:
    """The same set_index edits as mixlens edit functions ({path: fn}, in place on the served value)."""
    def setter(e):
        def f(v):
            v[:, e["index"]] = e["value"]
            return v
        return f

    return {e["path"]: setter(e) for e in edits}


def scan_dt(a: dict) -> torch.Tensor:
    """The dt transformers' mamba2_chunk_scan uses, from its bound arguments: (+ dt_bias), softplus, clamp."""
    dt = a["dt"]
    if a["dt_bias"] is not None:
        dt = dt + a["dt_bias"].to(dt.dtype)
    if a["dt_softplus"]:
        dt = torch.nn.functional.softplus(dt)
    return torch.clamp(dt, min=a["dt_limit"][0], max=a["dt_limit"][1])


def leaf(store: dict, out: torch.Tensor) -> torch.Tensor:
    """The embeddings as the graph's leaf (the weights are frozen): every value downstream requires grad."""
    return keep(store, "embed_tokens.output", out.detach().requires_grad_(True))


def hook_ssm_backbone(bb, store: dict, handles: list, mixer_pre, mixer_post) -> None:
    """Hooks of a Mamba / Mamba-2 backbone: the embeddings leaf, each block's layer_input / layer_output,
    the given mixer pre / post hooks (with_kwargs, bound to the layer index ``i``), and norm_f."""
    handles.append(bb.embeddings.register_forward_hook(lambda mod, args, out: leaf(store, out)))
    for i, block in enumerate(bb.layers):
        def pre(mod, args, kwargs, i=i):
            keep(store, f"layers.{i}.layer_input", args[0] if args else kwargs["hidden_states"])

        def post(mod, args, kwargs, out, i=i):
            return keep(store, f"layers.{i}.layer_output", out)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
        handles.append(block.mixer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: mixer_pre(mod, args, kwargs, i), with_kwargs=True))
        handles.append(block.mixer.register_forward_hook(
            lambda mod, args, kwargs, out, i=i: mixer_post(mod, args, kwargs, out, i), with_kwargs=True))
    handles.append(bb.norm_f.register_forward_hook(lambda mod, args, out: keep(store, "ln_final.output", out)))


def differentiate(store: dict, metric, forward) -> torch.Tensor:
    """Runs ``forward()`` (returning logits) with autograd, keeps its logits (float32) in ``store`` and
    backpropagates ``metric(logits)``; returns the metric."""
    with torch.enable_grad():
        m = metric(keep(store, "logits", forward().float()))
        m.backward()
    return m


def collect(store: dict, states: dict, metric: torch.Tensor, transpose_states: bool = False) -> dict[str, np.ndarray]:
    """The gradients as numpy (zeros where nothing flowed): every kept tensor, each per-token state list
    stacked on axis 1 (``transpose_states``: its last two axes swapped, to the served key-side-first
    layout), and ``metric``'s value."""
    grads = {}
    for path, sts in states.items():
        g = torch.stack([s.grad if s.grad is not None else torch.zeros_like(s) for s in sts], 1)
        grads[path] = (g.transpose(-1, -2) if transpose_states else g).contiguous().numpy().copy()
    for path, t in store.items():
        g = t.grad if t.grad is not None else torch.zeros_like(t)
        grads[path] = g.detach().float().contiguous().numpy().copy()
    grads["metric"] = np.array(float(metric.detach()))
    return grads


def mixlens_grads(model, prompts, paths, metric, edits=None, **trace_kwargs):
    """mixlens' gradients of ``metric(logits)`` for ``paths`` in one recorded call, and the trace."""
    with model.trace(prompts, saves=paths, edits=edits, grad=True, **trace_kwargs) as tr:
        pass
    tr.backward(metric(tr.logits))
    return {p: tr.grad(p).numpy() for p in paths}, tr


def primed_cache(model, prompts):
    """A cache that has run ``prompts`` (no gradients): what a continuation starts from."""
    cache = model.new_cache(len(prompts))
    with model.trace(prompts, cache=cache):
        pass
    return cache


def call_grads(model, prompts, cont, paths, metric, edits=None):
    """mixlens_grads of the prompt (``cont`` None) or of the call continuing it with ``cont`` ([B, n] ids)."""
    if not cont:
        return mixlens_grads(model, prompts, paths, metric, edits)
    return mixlens_grads(model, cont, paths, metric, edits, cache=primed_cache(model, prompts))


def split_call_grads(model, prompts, cont, j, layers, W):
    """For the call continuing ``prompts`` (one row) with ``cont``, the metric <W, logits> at positions j..:
    ``layers.{i}.linear_attn.states``' gradients of the whole call, and ``state_input``'s when tokens j.. run as
    a call of their own after tokens ..j-1 (whole, split: [path per layer])."""
    paths = [f"layers.{i}.linear_attn.states" for i in layers]
    whole, _ = mixlens_grads(model, cont, paths, lambda z: (z[:, j:] * W[:, j:]).sum(), cache=primed_cache(model, prompts))
    cache = primed_cache(model, prompts)
    with model.trace([cont[0][:j]], cache=cache):
        pass
    paths_in = [f"layers.{i}.linear_attn.state_input" for i in layers]
    split, _ = mixlens_grads(model, [cont[0][j:]], paths_in, lambda z: (z * W[:, j:]).sum(), cache=cache)
    return [whole[p] for p in paths], [split[p] for p in paths_in]


def compare(got: dict, ref: dict, label: str, paths=None, skip=()) -> int:
    """Assert every gradient of ``ref`` (or of ``paths``) matches ``got`` to TOL relative RMS; returns
    how many were compared."""
    bad, n = [], 0
    for path in (paths if paths is not None else ref):
        if path == "metric" or path in skip:
            continue
        assert path in got, f"{label}: mixlens served no gradient for {path}"
        err = rel_rms(got[path], ref[path])
        n += 1
        if not err <= TOL:
            bad.append(f"{path}: rel RMS {err:.2e}")
    assert not bad, f"{label}: {len(bad)} gradients differ from torch autograd: {bad[:8]}"
    return n


class FixtureCase:
    """A committed fixture (directory ``d``): transformers' model ``cls`` (eval, weights frozen: the graph starts at
    the values), mixlens' (torch output), its prompts, an optional continuation ``cont`` and random target ids of
    the differentiated call (seeded by ``name``)."""

    def __init__(self, cls, d, name, cont=None):
        import json

        import mixlens

        self.torch_model = cls.from_pretrained(str(d)).eval()
        for p in self.torch_model.parameters():
            p.requires_grad_(False)
        self.model = mixlens.StandardizedTransformer(str(d), output="torch")
        self.prompts = json.loads((d / "case.json").read_text())["prompts"]
        self.cont = cont
        B, T = len(self.prompts), len(cont[0]) if cont else len(self.prompts[0])
        vocab = self.torch_model.config.vocab_size
        self.targets = torch.as_tensor(np.random.default_rng(len(name)).integers(0, vocab, size=(B, T)))

    def block_paths(self, n_layers, mixer_values):
        """The embeddings, the head's values and every block's residual stream, mlp.output and the linear_attn
        ``mixer_values`` (with state_input on a continuation)."""
        out = ["embed_tokens.output", "ln_final.output", "logits"]
        for i in range(n_layers):
            out += [f"layers.{i}.layer_input", f"layers.{i}.layer_output", f"layers.{i}.mlp.output"]
            out += [f"layers.{i}.linear_attn.{v}" for v in mixer_values]
            if self.cont:
                out.append(f"layers.{i}.linear_attn.state_input")
        return out

    def metric(self, logits):
        """log p(target) summed over the call, plus a logit difference at its last position."""
        lp = torch.log_softmax(logits, -1).gather(-1, self.targets[..., None])[..., 0]
        return lp.sum() + 0.5 * (logits[:, -1, 3] - logits[:, -1, 7]).sum()
