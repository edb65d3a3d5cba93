"""The generation loop of the oracles that run a model through a DynamicCache (oracle_qwen,
oracle_hybrids): prompt at step 0, then one call per step, position ids and the growing attention
mask as `generate` builds them."""

from __future__ import annotations

import torch


def run_steps(model, ids, mask, cache, rec, n_steps: int, feeds=None) -> tuple[dict, list]:
    """Steps 0..n_steps-1 under `rec` (a recorder already entered): feeds[k-1] ([B, n] ids) is fed at
    step k when given, else the greedy token. Returns ({logits@step<k>: array}, greedy tokens per step)."""
    logits_by_step, tokens = {}, []
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    x, m = ids, mask
    for step in range(n_steps):
        rec.begin_step(step)
        out = model(input_ids=x, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True)
        rec.end_step()
        logits = out.logits.float()
        rec.put("logits", logits)
        logits_by_step[f"logits@step{step}"] = logits.detach().cpu().contiguous().numpy().copy()
        nxt = logits[:, -1].argmax(-1)
        tokens.append(nxt)
        x = nxt[:, None] if feeds is None or step >= len(feeds) else torch.tensor(feeds[step], dtype=torch.long)
        pos = pos[:, -1:] + torch.arange(1, x.shape[1] + 1)[None]
        m = torch.cat([m, torch.ones_like(x)], dim=1)
    return logits_by_step, tokens
