#!/usr/bin/env python
"""TransformerLens 4.3 side of bench_token_mixing_tl.py (run in the TL venv: requirements-tl.txt).

Loads a local HF checkpoint folder with TransformerBridge.boot_transformers (HF_HUB_OFFLINE=1),
float32 on the CPU, and serves timed cells and an agreement dump over _proto's line protocol:

  tl_forward     bridge(ids, logits_to_keep=1): the plain forward (last position's logits only, as
                 mixlens' logits="last"; no hooks attached)
  tl_cache       run_with_cache(ids, names_filter=<the layer's hooks>, stop_at_layer=L+1,
                 use_cache=False): the forward TL's SSM functions need (blocks 0..L only)
  tl_effattn     cache.compute_ssm_effective_attention(layer=L[, include_dt_scaling=True]) from the
                 cache of the last tl_cache (made untimed if absent) -> [1, H, T, T]
  tl_state       cache.compute_ssm_state(layer=L, time_step=T-1) -> the state after the last token
  tl_state_all   cache.compute_ssm_state(layer=L): every step's state (memory: see the driver)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _proto  # noqa: E402

S: dict = {}


def _threads(n: int):
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass


def load(path: str, layer: int | None = None, threads: int = 2):
    import transformer_lens
    import transformers
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.model_bridge.generalized_components import GatedDeltaNetBridge, SSM2MixerBridge
    from transformer_lens.model_bridge.generalized_components.ssm_protocol import find_ssm_mixer

    _threads(threads)
    torch.set_grad_enabled(False)
    b = TransformerBridge.boot_transformers(path, device="cpu", dtype=torch.float32)
    b.eval()
    ssm = [i for i, blk in enumerate(b.blocks) if find_ssm_mixer(blk) is not None]
    L = ssm[len(ssm) // 2] if layer is None else layer
    mixer = find_ssm_mixer(b.blocks[L])
    if isinstance(mixer, SSM2MixerBridge):
        family = "ssd"
        p = f"blocks.{L}.mixer."
        hooks = [p + "in_proj.hook_out", p + "conv1d.hook_out"]
        heads = int(mixer.original_component.num_heads)
        extra = [p + "inner_norm.hook_in"]  # y = SSD scan + D x, before the gated norm
    elif isinstance(mixer, GatedDeltaNetBridge):
        family = "gated_delta"
        p = f"blocks.{L}.linear_attn."
        hooks = [p + n for n in ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_log_decay")]
        heads = int(mixer.original_component.num_v_heads)
        extra = [p + "hook_recurrence_out"]  # the fused chunk kernel's head outputs
    else:
        raise TypeError(f"block {L}: {type(mixer).__name__} is not a Mamba-2 / gated DeltaNet mixer")
    S.update(b=b, L=L, family=family, hooks=hooks, extra=extra, mixer=mixer, cache=None, ids=None)
    return {"layer": L, "ssm_layers": ssm, "family": family, "heads": heads, "n_layers": len(b.blocks),
            "versions": {"transformer_lens": __import__("importlib.metadata").metadata.version("transformer-lens"),
                         "transformers": transformers.__version__, "torch": torch.__version__},
            "threads": torch.get_num_threads(), "opt_einsum": bool(torch.backends.opt_einsum.is_available())}


def set_ids(ids):
    S["ids"] = torch.tensor([ids], dtype=torch.long)
    S["cache"] = None
    return {"tokens": len(ids)}


def _cache(names=None):
    _, c = S["b"].run_with_cache(S["ids"], names_filter=names or S["hooks"], stop_at_layer=S["L"] + 1,
                                 use_cache=False)
    return c


def _need_cache():
    if S["cache"] is None:
        S["cache"] = _cache()
    return S["cache"]


def _effattn():
    c = _need_cache()
    if S["family"] == "ssd":
        return c.compute_ssm_effective_attention(layer=S["L"], include_dt_scaling=True)
    return c.compute_ssm_effective_attention(layer=S["L"])


def _forward():
    return S["b"](S["ids"], return_type="logits", logits_to_keep=1)


def _set_cache():
    S["cache"] = _cache()


CELLS = {
    "tl_forward": _forward,
    "tl_cache": _set_cache,
    "tl_effattn": _effattn,
    "tl_state": lambda: _need_cache().compute_ssm_state(layer=S["L"], time_step=S["ids"].shape[1] - 1),
    "tl_state_all": lambda: _need_cache().compute_ssm_state(layer=S["L"]),
}


def time_cell(cell: str):
    if cell != "tl_cache":
        _need_cache()  # the compute cells time the computation from a cache, not the forward
    return _proto.timed(CELLS[cell])


def dump(out: str):
    """Arrays for compare_tl.py (float32 .npy, batch 1 dropped): see the keys below."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    L, fam, mixer = S["L"], S["family"], S["mixer"]
    c = _cache(S["hooks"] + S["extra"])
    T = S["ids"].shape[1]
    saved = {}
    if fam == "ssd":
        terms = mixer._ssd_terms(c, L)  # what both TL functions use (dt, L, x, B, C)
        saved["tl_M_dt"] = c.compute_ssm_effective_attention(layer=L, include_dt_scaling=True)[0]
        saved["tl_M"] = c.compute_ssm_effective_attention(layer=L, include_dt_scaling=False)[0]
        saved["tl_x"] = terms.x[0]            # [T, H, P]
        saved["tl_dt"] = terms.dt[0]          # [T, H]
        saved["tl_D"] = mixer.D.detach().float()  # [H]
        saved["tl_head_out"] = c[S["extra"][0]][0].reshape(T, terms.x.shape[2], -1)  # [T, H, P]
        saved["tl_state_last"] = c.compute_ssm_state(layer=L, time_step=T - 1)[0]  # [H, P, N]
    else:
        saved["tl_M"] = c.compute_ssm_effective_attention(layer=L)[0]  # [H, T, T]
        v = c[S["hooks"][2]][0]
        saved["tl_v"] = v                                        # [T, Hv, Dv]
        saved["tl_q"] = c[S["hooks"][0]][0]
        saved["tl_k"] = c[S["hooks"][1]][0]
        saved["tl_beta"] = c[S["hooks"][3]][0]
        saved["tl_g"] = c[S["hooks"][4]][0]
        saved["tl_head_out"] = c[S["extra"][0]][0]               # [T, Hv, Dv]
        saved["tl_state_last"] = c.compute_ssm_state(layer=L, time_step=T - 1)[0]  # [Hv, Dk, Dv]
    saved["ids"] = S["ids"][0]
    for k, v in saved.items():
        np.save(out / f"{k}.npy", v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v))
    return {"files": sorted(saved), "layer": L}


if __name__ == "__main__":
    _proto.serve({"load": load, "set_ids": set_ids, "time": time_cell, "dump": dump})
