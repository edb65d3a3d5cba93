#!/usr/bin/env python
"""Build the Mamba-2 golden fixtures the C++ tests compare against.

    .venv/bin/python scripts/make_fixtures.py [--out tests/fixtures/mamba2] [--case NAME ...]

For every case: build a tiny random-weight Mamba2ForCausalLM with transformers (fixed seeds, with
A_log / dt_bias / D / norm weights / conv bias perturbed away from their init so that mistakes in
their use cannot hide), save_pretrained it (float32 safetensors) into <out>/<case>/, reload it from
disk, run the oracle (tests/python/oracle_mamba2.py) and write

    <out>/<case>/golden.safetensors   every captured value (float32) and ids (int64)
    <out>/<case>/case.json            prompts, pad id, n_steps, edits, versions, tolerances, checks

Before writing, the script asserts what the C++ tests will rely on: the key set, the state
invariants, the patched run equals plain HF (prompt logits and a real `generate`), clamp activity
where a case is about the clamp, greedy margins, and for batched cases that every row equals its
own unpadded run on every real token.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from transformers import Mamba2Config, Mamba2ForCausalLM  # noqa: E402

import oracle_mamba2 as om  # noqa: E402

N_STEPS = 8
PAD, BOS, EOS = 1, 0, 2

COMMON = dict(
    hidden_size=32,
    num_heads=4,
    head_dim=16,
    expand=2,
    state_size=16,
    conv_kernel=4,
    vocab_size=97,
    use_conv_bias=True,
    use_bias=False,
    residual_in_fp32=True,
    layer_norm_epsilon=1e-5,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    hidden_act="silu",
    rms_norm=True,
)


def mix(layer: int, value: str) -> str:
    return f"layers.{layer}.linear_attn.{value}"


CASES = {
    "g1_chunks": dict(
        description="n_groups 1, chunk_size 8, 21-token prompt (3 chunks, ragged last chunk), 3 layers, tied "
        "lm_head; edits on betas/decays/values/state_input at prompt and decode steps",
        seed=31,
        config=dict(num_hidden_layers=3, n_groups=1, chunk_size=8, tie_word_embeddings=True),
        prompt_lens=[21],
        edits=[
            dict(name="skip_token3_l1", path=mix(1, "betas"), step=0, op="set_index", index=3, value=0.0),
            dict(name="decays_half_l0", path=mix(0, "decays"), step=0, op="scale", factor=0.5),
            dict(name="values_x2_l1", path=mix(1, "attention_values"), step=0, op="scale", factor=2.0),
            dict(name="state_in_half_l0_s2", path=mix(0, "state_input"), step=2, op="scale", factor=0.5),
            dict(name="betas_x3_l1_s3", path=mix(1, "betas"), step=3, op="scale", factor=3.0),
        ],
    ),
    "g2_clamp": dict(
        description="n_groups 2, chunk_size 16, 12-token prompt, time_step_limit (0.02, 0.2) active on the "
        "prompt, untied lm_head; edits on keys/queries/betas",
        seed=10,
        config=dict(
            num_hidden_layers=2, n_groups=2, chunk_size=16, tie_word_embeddings=False, time_step_limit=(0.02, 0.2)
        ),
        dt_bias=[-5.0, -2.4, -1.2, 0.6],
        prompt_lens=[12],
        edits=[
            dict(name="keys_x1p5_l0", path=mix(0, "attention_keys"), step=0, op="scale", factor=1.5),
            dict(name="queries_zero_t5_l1", path=mix(1, "attention_queries"), step=0, op="set_index", index=5, value=0.0),
            dict(name="betas_x2_l0", path=mix(0, "betas"), step=0, op="scale", factor=2.0),
            dict(name="queries_x0p5_l1_s4", path=mix(1, "attention_queries"), step=4, op="scale", factor=0.5),
        ],
    ),
    "short_prompt": dict(
        description="2-token prompt (shorter than conv_kernel 4), n_groups 1, chunk_size 8, tied lm_head",
        seed=11,
        config=dict(num_hidden_layers=2, n_groups=1, chunk_size=8, tie_word_embeddings=True),
        prompt_lens=[2],
        edits=[
            dict(name="skip_token0_l0", path=mix(0, "betas"), step=0, op="set_index", index=0, value=0.0),
        ],
    ),
    "padded_batch": dict(
        description="batch of prompts of lengths 13 and 6, left padded (pad id 1), n_groups 1, chunk_size 8, "
        "tied lm_head",
        seed=10,
        config=dict(num_hidden_layers=2, n_groups=1, chunk_size=8, tie_word_embeddings=True),
        prompt_lens=[13, 6],
        edits=[
            dict(name="skip_token9_l0", path=mix(0, "betas"), step=0, op="set_index", index=9, value=0.0),
            dict(name="state_in_x2_l1_s1", path=mix(1, "state_input"), step=1, op="scale", factor=2.0),
        ],
    ),
}

# Suggested comparison tolerances for an implementation under test against the golden values:
# pass when |got - golden| <= atol + rtol * |golden| elementwise. Keyed by the last path component.
TOLERANCES = {
    "default": {"atol": 1e-5, "rtol": 1e-4},
    "embed_tokens.output": {"atol": 0.0, "rtol": 0.0},
    "betas": {"atol": 1e-6, "rtol": 1e-5},
    "decays": {"atol": 1e-6, "rtol": 1e-5},
    "states": {"atol": 2e-5, "rtol": 1e-4},
    "state_input": {"atol": 2e-5, "rtol": 1e-4},
    "state_output": {"atol": 2e-5, "rtol": 1e-4},
    "logits": {"atol": 1e-4, "rtol": 1e-4},
    "edit_logits": {"atol": 1e-4, "rtol": 1e-4},
    "input_ids": {"exact": True},
    "attention_mask": {"exact": True},
    "tokens": {"exact": True},
}

NOTES = [
    "Keys are '<path>@step<k>'; step 0 is the prompt (chunked kernel), steps 1.. are single-token decode "
    "steps (recurrent kernel) without attention mask, fed tokens[:, k-1].",
    "state_input / state_output / states are key side first: [B,H,N,P] / [B,T,H,N,P] (HF stores [B,H,P,N]).",
    "state_input is absent at step 0 (fresh prompt).",
    "states comes from the explicit token recurrence S_t = exp(A dt_t) S_{t-1} + (dt_t B_t) x_t in float32 "
    "from the kernel inputs; on step 0 states[:, -1] matches HF's chunked final state to ~1e-7 relative, "
    "on decode steps bit-exactly.",
    "transformers 5.18 clamps dt to time_step_limit only in the chunked (prompt) kernel; the decode kernel "
    "(mamba2_selective_state_update) receives no dt_limit, so decode-step betas are softplus(dt+dt_bias) "
    "unclamped. The goldens record what the kernel consumed.",
    "Edited runs (edit/<name>/logits@step<k>) are teacher-forced with the unedited run's tokens. A betas or "
    "decays write sets the kernel's dt directly (no softplus, no clamp); decays writes dt = decays / A.",
    "Padded positions (attention_mask 0) hold HF's values there: the mixer input and conv output are zeroed, "
    "so x/B/C/y/attention_output are 0 and states stay 0, but betas/decays are softplus(dt_bias)-based.",
]


@torch.no_grad()
def perturb(model: Mamba2ForCausalLM, seed: int, dt_bias=None) -> None:
    g = torch.Generator().manual_seed(seed + 1000)
    cfg = model.config
    H = cfg.num_heads

    def rn(*shape):
        return torch.randn(*shape, generator=g)

    def ru(lo, hi, *shape):
        return torch.rand(*shape, generator=g) * (hi - lo) + lo

    for blk in model.backbone.layers:
        mx = blk.mixer
        mx.A_log.copy_(torch.log(ru(0.3, 6.0, H)))
        if dt_bias is None:
            dt = torch.exp(ru(math.log(0.005), math.log(0.5), H))
            mx.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        else:
            mx.dt_bias.copy_(torch.tensor(dt_bias, dtype=torch.float32) + 0.1 * rn(H))
        mx.D.copy_(ru(-0.5, 1.5, H))
        mx.norm.weight.copy_(1.0 + 0.3 * rn(mx.norm.weight.numel()))
        mx.conv1d.bias.copy_(0.2 * rn(mx.conv1d.bias.numel()))
        blk.norm.weight.copy_(1.0 + 0.3 * rn(blk.norm.weight.numel()))
    nf = model.backbone.norm_f
    nf.weight.copy_(1.0 + 0.3 * rn(nf.weight.numel()))


def make_prompts(seed: int, lens: list[int], vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # real tokens avoid the special ids 0..2 (bos, pad, eos) so padding is unambiguous
    return [[int(t) for t in rng.integers(3, vocab, size=n)] for n in lens]


def build_model(spec: dict) -> Mamba2ForCausalLM:
    cfg = Mamba2Config(**{**COMMON, **spec["config"]})
    torch.manual_seed(spec["seed"])
    model = Mamba2ForCausalLM(cfg).eval()
    perturb(model, spec["seed"], spec.get("dt_bias"))
    return model


def load_model(path) -> Mamba2ForCausalLM:
    return Mamba2ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _max_abs(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0


def check_padded_rows(model, prompts, values, n_steps, n_layers, atol=1e-5) -> float:
    """Every row of a left-padded batch equals its own unpadded run on every real token's values."""
    t0 = max(len(p) for p in prompts)
    worst = 0.0
    for r, p in enumerate(prompts):
        forced = values["tokens"][r : r + 1].T  # [n_steps, 1]
        single = om.run(model, [p], n_steps, forced_tokens=forced)
        assert np.array_equal(single["tokens"][0], values["tokens"][r])
        for k in range(n_steps):
            for path in om.value_paths(n_layers):
                kk = om.key(path, k)
                if kk not in single:
                    continue
                got = values[kk][r : r + 1]
                ref = single[kk]
                if k == 0 and got.ndim >= 3 and not path.endswith((".state_input", ".state_output")):
                    got = got[:, t0 - len(p) :]  # real tokens of row r
                assert got.shape == ref.shape, (kk, got.shape, ref.shape)
                d = _max_abs(got, ref)
                worst = max(worst, d)
                assert d <= atol, f"row {r}: {kk} differs from the unpadded run by {d:.3e}"
    return worst


def check_against_plain_hf(model, prompts, values, n_steps) -> None:
    """The patched run reproduces unpatched HF: prompt logits bit-exactly, and generate()'s tokens/logits."""
    ids = torch.as_tensor(values["input_ids"])
    mask = torch.as_tensor(values["attention_mask"])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        assert np.array_equal(out.logits.numpy(), values[om.key("logits", 0)]), "patched prompt logits != plain HF"
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n_steps,
            min_new_tokens=n_steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.config.pad_token_id,
        )
    new = gen.sequences[:, ids.shape[1] :].numpy()
    assert np.array_equal(new, values["tokens"]), f"generate tokens {new} != oracle tokens {values['tokens']}"
    for k, lg in enumerate(gen.logits):
        d = _max_abs(lg.float().numpy(), values[om.key("logits", k)][:, -1])
        assert d <= 1e-6, f"generate logits differ at step {k}: {d:.3e}"


def greedy_margin(values, n_steps) -> float:
    m = math.inf
    for k in range(n_steps):
        lg = np.sort(values[om.key("logits", k)][:, -1], axis=-1)
        m = min(m, float((lg[:, -1] - lg[:, -2]).min()))
    return m


def _dumps(obj) -> str:
    """Indented JSON with lists of numbers kept on one line (prompts read as token lists)."""
    text = json.dumps(obj, indent=1, allow_nan=False)
    return re.sub(r"\[[-0-9.eE+,\s]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)


def build_case(name: str, out_root: Path) -> dict:
    spec = CASES[name]
    case_dir = out_root / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)

    model = build_model(spec)
    model.save_pretrained(str(case_dir))
    for extra in ("generation_config.json",):
        (case_dir / extra).unlink(missing_ok=True)
    loaded = load_model(case_dir)
    cfg = loaded.config
    n_layers = cfg.num_hidden_layers

    # the files reproduce the in-memory model
    ref_sd = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref_sd[k]), f"{name}: reloaded {k} differs"
    assert loaded.lm_head.weight.data_ptr() == loaded.backbone.embeddings.weight.data_ptr() or not cfg.tie_word_embeddings

    prompts = make_prompts(spec["seed"], spec["prompt_lens"], cfg.vocab_size)
    edits = spec["edits"]
    values, rec = om.run(loaded, prompts, N_STEPS, return_recorder=True)
    full = om.capture(loaded, prompts, N_STEPS, edits)
    for k, v in values.items():
        assert np.array_equal(full[k], v), f"{name}: capture() not deterministic on {k}"

    # --- checks -----------------------------------------------------------------------------
    exp = om.expected_keys(n_layers, N_STEPS, [e["name"] for e in edits])
    assert set(full) == exp, f"{name}: key set mismatch {set(full) ^ exp}"
    om.check_invariants(full, n_layers, N_STEPS)
    check_against_plain_hf(loaded, prompts, values, N_STEPS)
    assert rec.kernel_log == [(k, i, "chunked" if k == 0 else "recurrent") for k in range(N_STEPS) for i in range(n_layers)]
    margin = greedy_margin(values, N_STEPS)
    assert margin > 2e-2, f"{name}: greedy argmax margin {margin:.2e} too small to be robust"
    assert not (values["tokens"][:, :-1] == cfg.eos_token_id).any(), f"{name}: greedy produced EOS; change the seed"
    for e in edits:
        d = max(_max_abs(full[f"edit/{e['name']}/logits@step{k}"], full[f"logits@step{k}"]) for k in range(N_STEPS))
        assert d > 1e-4, f"{name}: edit {e['name']} changes no logits ({d:.2e})"
        for k in range(int(e["step"])):
            assert np.array_equal(full[f"edit/{e['name']}/logits@step{k}"], full[f"logits@step{k}"])

    checks = {
        "max_recurrence_rel_err_step0": rec.max_recurrence_err,
        "greedy_margin_min": margin,
        "edit_max_logit_change": {
            e["name"]: max(_max_abs(full[f"edit/{e['name']}/logits@step{k}"], full[f"logits@step{k}"]) for k in range(N_STEPS))
            for e in edits
        },
    }
    lo, hi = cfg.time_step_limit
    if (lo, hi) != (0.0, float("inf")):
        b0 = np.concatenate([full[om.key(mix(i, "betas"), 0)].ravel() for i in range(n_layers)])
        bd = np.concatenate([full[om.key(mix(i, "betas"), k)].ravel() for i in range(n_layers) for k in range(1, N_STEPS)])
        clamp = {
            "step0_at_lo": int((b0 == np.float32(lo)).sum()),
            "step0_at_hi": int((b0 == np.float32(hi)).sum()),
            "step0_inside": int(((b0 > lo) & (b0 < hi)).sum()),
            "decode_outside_limit_unclamped": int(((bd < lo) | (bd > hi)).sum()),
            "decode_total": int(bd.size),
        }
        assert clamp["step0_at_lo"] > 0 and clamp["step0_at_hi"] > 0 and clamp["step0_inside"] > 0, clamp
        checks["clamp"] = clamp
    if len(prompts) > 1:
        checks["padded_vs_unpadded_max_abs"] = check_padded_rows(loaded, prompts, full, N_STEPS, n_layers)

    # --- write ------------------------------------------------------------------------------
    golden = {}
    for k, v in full.items():
        if v.dtype.kind == "f":
            v = v.astype(np.float32)
        elif v.dtype.kind in "iu":
            v = v.astype(np.int64)
        golden[k] = np.ascontiguousarray(v)
    save_file(golden, str(case_dir / "golden.safetensors"))

    case = {
        "case": name,
        "description": spec["description"],
        "family": "mamba2",
        "architecture": "Mamba2ForCausalLM",
        "prompts": prompts,
        "pad_token_id": cfg.pad_token_id,
        "padding_side": "left",
        "n_steps": N_STEPS,
        "decoding": "greedy (argmax of the last position's logits); no EOS stop",
        "edits": edits,
        "config": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in {
                "num_hidden_layers": cfg.num_hidden_layers,
                "hidden_size": cfg.hidden_size,
                "num_heads": cfg.num_heads,
                "head_dim": cfg.head_dim,
                "n_groups": cfg.n_groups,
                "state_size": cfg.state_size,
                "conv_kernel": cfg.conv_kernel,
                "chunk_size": cfg.chunk_size,
                "vocab_size": cfg.vocab_size,
                # +inf is written as null (JSON has no infinity)
                "time_step_limit": [float(x) if math.isfinite(x) else None for x in cfg.time_step_limit],
                "tie_word_embeddings": cfg.tie_word_embeddings,
            }.items()
        },
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]},
        "tolerances": TOLERANCES,
        "checks": checks,
        "notes": NOTES,
    }
    (case_dir / "case.json").write_text(_dumps(case) + "\n")
    return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "mamba2"))
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="build only these cases")
    ap.add_argument("--family", action="append", choices=["mamba2", "qwen3_5", "qwen3_next"],
                    help="families to build (default: all); Qwen cases live in scripts/qwen_fixtures.py")
    ap.add_argument("--qwen-case", action="append", help="build only these Qwen cases")
    args = ap.parse_args(argv)
    families = args.family or ["mamba2", "qwen3_5", "qwen3_next"]
    qwen = [f for f in families if f != "mamba2"]
    if qwen:
        import qwen_fixtures

        qwen_fixtures.main(qwen, args.qwen_case)
    if "mamba2" not in families:
        return 0
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.case or list(CASES):
        case = build_case(name, out)
        size = sum(f.stat().st_size for f in (out / name).iterdir())
        print(f"{name}: {size / 1024:.0f} KiB, checks {json.dumps(case['checks'])}")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"total {total / 1024:.0f} KiB in {out}")
    assert total < 3 * 1024 * 1024, "fixtures exceed the 3 MB budget"
    return 0


if __name__ == "__main__":
    sys.exit(main())
