"""What the block-by-block oracles of the one-mixer families (oracle_rwkv, oracle_xlstm) share: the value
paths, applying a spec edit to a torch value, and the per-step recorder that applies edits and keeps values."""

from __future__ import annotations

import torch

N_STEPS = 8


def mix(layer: int, value: str) -> str:
    return f"layers.{layer}.linear_attn.{value}"


def apply_edit(t: torch.Tensor, e: dict) -> torch.Tensor:
    t = t.clone()
    if e["op"] == "scale":
        return t * e["factor"]
    t[:, e["index"]] = e["value"]
    return t


def recorder(vals: dict, edits, step: int):
    """put(path, t): t with the edits of (path, step) applied, recorded as vals['<path>@step<k>'] (numpy)."""
    def put(path, t):
        for e in edits:
            if e["path"] == path and e["step"] == step:
                t = apply_edit(t, e)
        vals[f"{path}@step{step}"] = t.detach().numpy().copy()
        return t
    return put


def grad_recorder(vals: dict, edits, step: int, keep, leaf):
    """recorder's put for a step run under autograd (``keep`` a dict, else None: recorder's put): each value
    after its edits is kept in ``keep`` with ``retain_grad``; a value ``leaf(path)`` names becomes a leaf (the
    graph's inputs: the embeddings, a cached state)."""
    record = recorder(vals, edits, step)
    if keep is None:
        return record

    def put(path, t):
        t = record(path, t)
        if leaf(path):
            t = t.detach().requires_grad_(True)
        if t.requires_grad:
            t.retain_grad()
        keep[path] = t
        return t
    return put


def advance(logits: torch.Tensor, toks: list, feeds, step: int, n_steps: int):
    """Keeps the greedy token of the last position in `toks`; the ids of call step + 1 (that token, or
    feeds[step] when teacher-forced), None after the last call."""
    nxt = logits[:, -1].argmax(-1)
    toks.append(nxt)
    if step + 1 >= n_steps:
        return None
    return nxt[:, None] if feeds is None else torch.tensor(feeds[step])
