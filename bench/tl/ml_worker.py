#!/usr/bin/env python
"""mixlens side of bench_token_mixing_tl.py (run in the mixlens venv, .venv):

  ml_plain             model.run([ids], logits="last"): the plain forward, nothing read
  ml_token_mixing      model.token_mixing([ids], L): every head, rows and columns -> [1, H, T, T]
                       (one forward with the layer's scan inputs kept, then the exact mixing)
  ml_token_mixing_row  model.token_mixing([ids], L, rows=-1): the last row only
  ml_state_contrib     model.state_contributions([ids], L, T-1): the state after the last token, split
                       by source token -> [1, H, T, *state]
MIXLENS_NUM_THREADS is set from load(threads=) before mixlens is imported.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _proto  # noqa: E402

S: dict = {}


def load(path: str, layer: int | None = None, threads: int = 2):
    os.environ["MIXLENS_NUM_THREADS"] = str(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import mixlens

    m = mixlens.StandardizedTransformer(str(path), output="numpy")
    layers = sorted({v["layer"] for v in m.values() if v["path"].endswith(".linear_attn.token_mixing")})
    L = layers[len(layers) // 2] if layer is None else layer
    S.update(m=m, L=L, ids=None)
    ver = getattr(mixlens, "__version__", "?")
    return {"layer": L, "mixing_layers": layers, "family": m.info.get("family"), "mixlens": ver,
            "mixlens_file": mixlens.__file__}


def set_ids(ids):
    S["ids"] = list(ids)
    return {"tokens": len(ids)}


CELLS = {
    "ml_plain": lambda: S["m"].run([S["ids"]], logits="last"),
    "ml_token_mixing": lambda: S["m"].token_mixing([S["ids"]], S["L"]),
    "ml_token_mixing_row": lambda: S["m"].token_mixing([S["ids"]], S["L"], rows=-1),
    "ml_state_contrib": lambda: S["m"].state_contributions([S["ids"]], S["L"], len(S["ids"]) - 1),
}


def time_cell(cell: str):
    return _proto.timed(CELLS[cell])


def dump(out: str):
    """Arrays for compare_tl.py (float32 .npy, batch 1 dropped)."""
    import numpy as np

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m, L, ids = S["m"], S["L"], S["ids"]
    p = f"layers.{L}.linear_attn."
    names = ["token_mixing", "attention_values", "attention_head_outputs", "states"]
    got = m.run([ids], saves=[p + n for n in names], logits="last")
    tm = m.token_mixing([ids], L)
    T = len(ids)
    sc = m.state_contributions([ids], L, T - 1)
    saved = {
        "ml_mixing_trace": got[p + "token_mixing"][0],     # [H, T, T] (the trace value)
        "ml_mixing": tm["mixing"][0],                      # [H, T, T] (the block API)
        "ml_skip": tm["skip"][0],                          # [T, H, P]
        "ml_values": got[p + "attention_values"][0],      # [T, H*P] or [T, H, P]
        "ml_head_out": got[p + "attention_head_outputs"][0],
        "ml_state_last": got[p + "states"][0, T - 1],      # served layout (key side first)
        "ml_state_contrib_sum": sc[0].astype(np.float64).sum(axis=1).astype(np.float32),
        "ml_ids": np.asarray(ids),
    }
    for k, v in saved.items():
        np.save(out / f"{k}.npy", np.asarray(v))
    return {"files": sorted(saved), "skip_meaning": tm.get("skip_meaning"), "layer": L,
            "shapes": {k: list(np.asarray(v).shape) for k, v in saved.items()}}


if __name__ == "__main__":
    _proto.serve({"load": load, "set_ids": set_ids, "time": time_cell, "dump": dump})
