#!/usr/bin/env python
"""Agreement of TransformerLens 4.3's SSM effective attention / state with mixlens' exact token_mixing,
from the .npy files tl_worker.py and ml_worker.py dumped into one folder (numpy only; float64 math).

    python compare_tl.py DIR --kind ssd|gated_delta     -> one JSON line (also DIR/agreement.json)

rel(a, ref) = ||a - ref||_F / ||ref||_F, per head (max and median over heads), ref = mixlens' exact value
or the model's own head outputs.
"""
import argparse
import json
from pathlib import Path

import numpy as np


def rel(a, ref, axis=None):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    num = np.sqrt(((a - ref) ** 2).sum(axis=axis))
    den = np.sqrt((ref ** 2).sum(axis=axis))
    return num / np.where(den == 0, 1, den)


def per_head(a, ref):
    """[H, ...] arrays -> {max, median, per_head} of rel over each head."""
    r = rel(a, ref, axis=tuple(range(1, np.ndim(ref))))
    return {"max": float(r.max()), "median": float(np.median(r)), "per_head": [float(x) for x in r]}


def gla_matrix(q, k, beta, g, normalise):
    """TL's gated-linear-attention form M[h,i,j] = (q_i . k_j) beta_j exp(sum_{j<r<=i} g_r), optionally
    with q, k L2-normalised and q scaled by 1/sqrt(Dk) as the kernel does (float64)."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    if normalise:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * q.shape[-1] ** -0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    qk = np.einsum("ihd,jhd->hij", q, k)
    cs = np.cumsum(g.astype(np.float64), axis=0).T  # [H, T]
    Llog = cs[:, :, None] - cs[:, None, :]
    T = q.shape[0]
    L = np.where(np.tril(np.ones((T, T), bool))[None], np.exp(np.minimum(Llog, 0)), 0.0)
    return qk * beta.astype(np.float64).T[:, None, :] * L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--kind", choices=["ssd", "gated_delta"], required=True)
    a = ap.parse_args()
    d = Path(a.dir)
    ld = lambda n: np.load(d / f"{n}.npy")
    out = {"kind": a.kind}
    assert (ld("ids") == ld("ml_ids")).all(), "the two sides ran different prompts"
    M = ld("ml_mixing").astype(np.float64)                 # [H, T, T]
    H, T, _ = M.shape
    out["tokens"], out["heads"] = int(T), int(H)
    out["ml_block_vs_trace"] = float(rel(ld("ml_mixing"), ld("ml_mixing_trace")))
    x_ml = ld("ml_values").reshape(T, H, -1).astype(np.float64)
    y_ml = ld("ml_head_out").reshape(T, H, -1).astype(np.float64)
    y_tl = ld("tl_head_out").reshape(T, H, -1).astype(np.float64)
    skip = ld("ml_skip").reshape(T, H, -1).astype(np.float64)
    rebuild_ml = np.einsum("hts,shp->thp", M, x_ml) + skip
    out["ml_rebuild_vs_ml_head_out"] = float(rel(rebuild_ml, y_ml))
    out["ml_rebuild_vs_transformers_head_out"] = float(rel(rebuild_ml, y_tl))
    out["ml_head_out_vs_transformers_head_out"] = float(rel(y_ml, y_tl))
    st_ml = ld("ml_state_last").astype(np.float64)
    out["ml_state_contrib_sum_vs_state"] = float(rel(ld("ml_state_contrib_sum"), st_ml))
    if a.kind == "ssd":
        x_tl = ld("tl_x").astype(np.float64)
        D = ld("tl_D").astype(np.float64)
        Mdt, M0 = ld("tl_M_dt").astype(np.float64), ld("tl_M").astype(np.float64)
        out["values_ml_vs_tl_x"] = float(rel(x_ml, x_tl))
        out["tl_M_dt_vs_ml_mixing"] = per_head(Mdt, M)
        out["tl_M_dt_vs_ml_mixing_max_abs"] = float(np.abs(Mdt - M).max())
        out["tl_M_no_dt_vs_ml_mixing"] = per_head(M0, M)
        dt = ld("tl_dt").astype(np.float64)  # [T, H]
        out["tl_M_no_dt_times_dt_s_vs_ml_mixing"] = per_head(M0 * dt.T[:, None, :], M)
        out["tl_M_dt_has_zero_upper_triangle"] = bool(np.allclose(np.triu(Mdt, 1), 0))
        out["ml_skip_vs_D_x"] = float(rel(skip, D[None, :, None] * x_tl))
        rebuild_tl = np.einsum("hts,shp->thp", Mdt, x_tl)
        out["tl_M_dt_at_x_vs_transformers_head_out"] = float(rel(rebuild_tl, y_tl))
        out["tl_M_dt_at_x_plus_D_x_vs_transformers_head_out"] = float(rel(rebuild_tl + D[None, :, None] * x_tl, y_tl))
        out["tl_M_no_dt_at_x_plus_D_x_vs_transformers_head_out"] = float(
            rel(np.einsum("hts,shp->thp", M0, x_tl) + D[None, :, None] * x_tl, y_tl))
        st_tl = ld("tl_state_last").astype(np.float64)  # [H, P, N]
        out["tl_state_last_vs_ml_state"] = float(rel(st_tl.transpose(0, 2, 1), st_ml)) if st_ml.shape == st_tl.transpose(0, 2, 1).shape \
            else f"shapes {st_ml.shape} vs {st_tl.shape}"
    else:
        v = ld("tl_v").astype(np.float64)
        out["values_ml_vs_tl_v"] = float(rel(x_ml, v))
        Mtl = ld("tl_M").astype(np.float64)
        out["tl_M_vs_ml_mixing"] = per_head(Mtl, M)
        q, k = ld("tl_q"), ld("tl_k")
        rep = H // q.shape[1]
        q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
        beta, g = ld("tl_beta"), ld("tl_g")
        out["tl_formula_recomputed_vs_tl_M"] = float(rel(gla_matrix(q, k, beta, g, False), Mtl))
        Mn = gla_matrix(q, k, beta, g, True)
        out["tl_formula_with_kernel_qk_norm_vs_ml_mixing"] = per_head(Mn, M)
        out["tl_M_at_v_vs_transformers_head_out"] = float(rel(np.einsum("hts,shp->thp", Mtl, v), y_tl))
        out["tl_formula_with_qk_norm_at_v_vs_transformers_head_out"] = float(rel(np.einsum("hts,shp->thp", Mn, v), y_tl))
        st_tl = ld("tl_state_last").astype(np.float64)  # [H, Dk, Dv]
        out["tl_state_last_vs_ml_state"] = float(rel(st_tl, st_ml.reshape(st_tl.shape))) if st_ml.size == st_tl.size \
            else f"shapes {st_ml.shape} vs {st_tl.shape}"
    (d / "agreement.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
