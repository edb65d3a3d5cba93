"""Side by side (not a test): TransformerLens 4.3's hook values vs mixlens's TL-named aliases on a shipped
checkpoint (docs/transformer_lens.md records the result).

Needs transformer-lens 4.3 next to mixlens, in its own venv, e.g.
    python3 -m venv /work/tlvenv
    echo <repo>/.venv/lib/python3.11/site-packages > /work/tlvenv/lib/python3.11/site-packages/mixlens.pth
    /work/tlvenv/bin/python -m pip install --no-deps transformer-lens==4.3.0 einops jaxtyping
    /work/tlvenv/bin/python scripts/tl_side_by_side.py [models/qwen3_5-tinystories]
Prints, per TL name, the max |TL - mixlens| and the relative RMS; the names mixlens refuses are compared
through the conversion their error message gives."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from transformer_lens.model_bridge import TransformerBridge

import mixlens

REPO = Path(__file__).resolve().parents[1]
MODEL = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "models" / "qwen3_5-tinystories"
PROMPT = "Once upon a time, there was a little girl who"


def compare(name: str, tl: torch.Tensor, ml: np.ndarray) -> float:
    a = tl.detach().float().numpy()
    if a.shape != ml.shape:
        print(f"{name:48s} SHAPE tl {a.shape} vs mixlens {ml.shape}")
        return float("inf")
    diff = np.abs(a - ml).max()
    rel = float(np.sqrt(((a - ml) ** 2).mean() / max((a**2).mean(), 1e-30)))
    print(f"{name:48s} {str(a.shape):24s} max|d| {diff:.3g}  rel_rms {rel:.3g}")
    return rel


def main() -> None:
    model = mixlens.StandardizedTransformer(str(MODEL), output="numpy")
    ids = model.tokenizer.encode(PROMPT)
    kinds = model.info["layer_kinds"]
    bridge = TransformerBridge.boot_transformers(str(MODEL), dtype=torch.float32, device="cpu")
    for blk in bridge.blocks:  # hook_ssm_state fires only on TL's eager scan
        mix = getattr(blk, "linear_attn", None)
        if mix is not None and hasattr(mix, "eager_scan"):
            mix.eager_scan = True
    _, cache = bridge.run_with_cache(torch.tensor([ids]), use_cache=False)

    names = ["hook_embed", "ln_final.hook_out", "hook_unembed"]
    converted = []  # (TL name, mixlens path, conversion)
    for i, k in enumerate(kinds):
        names += [f"blocks.{i}.hook_resid_pre", f"blocks.{i}.hook_resid_post", f"blocks.{i}.hook_mlp_out"]
        if k == "gated_deltanet":
            names += [f"blocks.{i}.linear_attn.{h}" for h in
                      ("hook_v", "hook_beta", "hook_log_decay", "hook_recurrence_out", "hook_ssm_state", "hook_ssm_out")]
            for h, v in (("hook_q", "attention_queries"), ("hook_k", "attention_keys")):
                converted.append((f"blocks.{i}.linear_attn.{h}", f"layers.{i}.linear_attn.{v}", "[:, :, ::r]"))
        elif k == "attention":
            names += [f"blocks.{i}.attn.hook_pattern", f"blocks.{i}.hook_attn_out"]
            # Refused by mixlens (not checked to be the same quantity on every family): shown for the record.
            for h, v in (("hook_v", "attention_values"), ("hook_rot_q", "attention_queries"),
                         ("hook_rot_k", "attention_keys")):
                converted.append((f"blocks.{i}.attn.{h}", f"layers.{i}.self_attn.{v}", ""))
    ml = model.run([ids], saves=names + [p for _, p, _ in converted])
    worst = 0.0
    for n in names:
        if n not in cache:
            alias = {"hook_unembed": "unembed.hook_out"}.get(n)
            if alias is None or alias not in cache:
                print(f"{n:48s} not in TL's cache")
                continue
            worst = max(worst, compare(n, cache[alias], ml[n]))
            continue
        worst = max(worst, compare(n, cache[n], ml[n]))
    cfg = model.info
    for tl, path, conv in converted:
        if tl not in cache:
            print(f"{tl:48s} not in TL's cache")
            continue
        ref = ml[path]
        if conv:
            r = ref.shape[2] // cache[tl].shape[2]
            worst = max(worst, compare(f"{tl} = {path}{conv} (r={r})", cache[tl], ref[:, :, ::r]))
        else:  # not an alias: printed, not counted
            compare(f"{tl} vs {path} (no alias)", cache[tl], ref)
    print(f"model {cfg['family']} {MODEL.name}: worst rel_rms {worst:.3g}")


if __name__ == "__main__":
    main()
