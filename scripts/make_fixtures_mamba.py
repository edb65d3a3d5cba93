#!/usr/bin/env python
"""Build the Mamba-1 golden fixtures the C++ tests compare against (sibling of make_fixtures.py).

    .venv/bin/python scripts/make_fixtures_mamba.py [--out tests/fixtures/mamba] [--case NAME ...]

For every case: build a tiny random-weight MambaForCausalLM with transformers (fixed seeds; A_log,
dt_proj.bias, D, the norm weights, conv bias and the optional in/out_proj biases perturbed away
from their init), save_pretrained it (float32 safetensors) into <out>/<case>/, optionally rewrite
the files into the published variant (time_step_rank "auto"), reload it from disk, run the oracle
(tests/python/oracle_mamba.py) and write golden.safetensors and case.json in the format of
tests/fixtures/mamba2 (see tests/fixtures/mamba/README.md).

Before writing it asserts: the reload equals the in-memory model; the key set; the invariants
(bit-exact states vs the kernel's state on every step); the patched run equals plain HF (prompt
logits bit for bit, generate()'s tokens and logits); greedy margins; that every edit changes the
logits from its step on and not before; for padded batches without in_proj bias, that every row
equals its own unpadded run on every real token.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
sys.path.insert(0, str(REPO / "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from transformers import MambaConfig, MambaForCausalLM  # noqa: E402

import make_fixtures as mf  # noqa: E402  (shared helpers of the Mamba-2 generator)
import oracle_mamba as om  # noqa: E402

N_STEPS = 8
PAD, BOS, EOS = 1, 0, 2

COMMON = dict(
    hidden_size=32,
    expand=2,
    state_size=8,
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
    time_step_rank="auto",
)


def mix(layer: int, value: str) -> str:
    return f"layers.{layer}.linear_attn.{value}"


CASES = {
    "basic": dict(
        description="3 layers, state 16, 17-token prompt, tied lm_head, time_step_rank written as \"auto\" (= 2); edits on "
        "every editable mixer value at the prompt and at decode steps",
        seed=21,
        config=dict(num_hidden_layers=3, state_size=16, tie_word_embeddings=True),
        rank_auto_in_file=True,
        prompt_lens=[17],
        edits=[
            dict(name="skip_token3_l1", path=mix(1, "betas"), step=0, op="set_index", index=3, value=0.0),
            dict(name="decays_half_l0", path=mix(0, "decays"), step=0, op="scale", factor=0.5),
            dict(name="values_x2_l1", path=mix(1, "attention_values"), step=0, op="scale", factor=2.0),
            dict(name="keys_x1p5_l2", path=mix(2, "attention_keys"), step=0, op="scale", factor=1.5),
            dict(name="queries_zero_t5_l1", path=mix(1, "attention_queries"), step=0, op="set_index", index=5, value=0.0),
            dict(name="y_x0p5_l0", path=mix(0, "attention_head_outputs"), step=0, op="scale", factor=0.5),
            dict(name="state_in_half_l0_s2", path=mix(0, "state_input"), step=2, op="scale", factor=0.5),
            dict(name="betas_x3_l1_s3", path=mix(1, "betas"), step=3, op="scale", factor=3.0),
            dict(name="decays_zero_l2_s4", path=mix(2, "decays"), step=4, op="set_index", index=0, value=0.0),
        ],
    ),
    "bias_untied": dict(
        description="hidden 40 (E 80), state 8, time_step_rank 5 (explicit), in_proj/out_proj bias, no conv bias, "
        "untied lm_head, 12-token prompt; edits on betas/decays/state_input",
        seed=14,
        config=dict(
            num_hidden_layers=2, hidden_size=40, state_size=8, time_step_rank=5, use_bias=True, use_conv_bias=False,
            tie_word_embeddings=False,
        ),
        prompt_lens=[12],
        edits=[
            dict(name="betas_x2_l0", path=mix(0, "betas"), step=0, op="scale", factor=2.0),
            dict(name="decays_x0p25_l1", path=mix(1, "decays"), step=0, op="scale", factor=0.25),
            dict(name="state_in_x2_l1_s1", path=mix(1, "state_input"), step=1, op="scale", factor=2.0),
        ],
    ),
    "short_prompt": dict(
        description="2-token prompt (shorter than conv_kernel 4), tied lm_head",
        seed=11,
        config=dict(num_hidden_layers=2, tie_word_embeddings=True),
        prompt_lens=[2],
        edits=[
            dict(name="skip_token0_l0", path=mix(0, "betas"), step=0, op="set_index", index=0, value=0.0),
            dict(name="decays_half_l1_s1", path=mix(1, "decays"), step=1, op="scale", factor=0.5),
        ],
    ),
    "padded_batch": dict(
        description="batch of prompts of lengths 13 and 6, left padded (pad id 1), tied lm_head",
        seed=10,
        config=dict(num_hidden_layers=2, tie_word_embeddings=True),
        prompt_lens=[13, 6],
        check_rows=True,
        edits=[
            dict(name="skip_token9_l0", path=mix(0, "betas"), step=0, op="set_index", index=9, value=0.0),
            dict(name="state_in_x2_l1_s1", path=mix(1, "state_input"), step=1, op="scale", factor=2.0),
        ],
    ),
    "padded_bias": dict(
        description="left-padded batch (lengths 7 and 3), 1 layer, state 4, with in_proj bias: transformers masks "
        "the mixer input "
        "(before in_proj) and the conv output, so padded positions feed in_proj's bias into the conv window of "
        "the first real tokens; pins that masking point",
        seed=6,
        config=dict(num_hidden_layers=1, state_size=4, use_bias=True, tie_word_embeddings=True),
        prompt_lens=[7, 3],
        expect_padding_leak=True,
        edits=[dict(name="betas_x2_l0", path=mix(0, "betas"), step=0, op="scale", factor=2.0)],
    ),
}

NOTES = [
    "Keys are '<path>@step<k>'; step 0 is the prompt (transformers' mamba_selective_scan, with attention_mask), "
    "steps 1.. are single-token decode steps (mamba_selective_state_update) without attention mask, fed "
    "tokens[:, k-1].",
    "state_input / state_output are [B,E,N] and states [B,T,E,N] (transformers' own layout); state_input is absent "
    "at step 0 (fresh prompt).",
    "states comes from the explicit recurrence S_t = exp(A dt_t) S_{t-1} + (dt_t B_t) u_t in transformers' "
    "operation order; states[:, -1] equals the kernel's final state bit for bit on every step.",
    "attention_values is u as the scan receives it (after conv+SiLU and the padding mask); x_proj has already read "
    "it, so an attention_values edit changes what tokens write and the D skip, not dt/B/C.",
    "attention_head_outputs is y incl. the D skip, before the silu(z) gate (the oracle calls the kernel with z=None "
    "and gates afterwards with the kernel's own op).",
    "Edited runs (edit/<name>/logits@step<k>) are teacher-forced with the unedited run's tokens. A betas write sets "
    "the kernel's dt directly (no softplus); a decays [B,T,E,N] write sets dt = decays/A, which must agree across "
    "the state axis for every changed (token, channel) row (dt = the mean), rows left unchanged keep their dt.",
    "Padding: transformers 5.18 multiplies the mixer input (before in_proj) and the conv output by the mask. With "
    "in_proj bias (padded_bias) the padded positions therefore carry the bias into the conv window of the first "
    "real tokens, so padded rows differ from their unpadded runs there.",
]


@torch.no_grad()
def perturb(model: MambaForCausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1000)

    def rn(*shape):
        return torch.randn(*shape, generator=g)

    def ru(lo, hi, *shape):
        return torch.rand(*shape, generator=g) * (hi - lo) + lo

    for blk in model.backbone.layers:
        mx = blk.mixer
        mx.A_log.copy_(torch.log(ru(0.3, 6.0, *mx.A_log.shape)))
        dt = torch.exp(ru(math.log(0.01), math.log(0.6), mx.dt_proj.bias.numel()))
        mx.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        mx.D.copy_(ru(-0.5, 1.5, mx.D.numel()))
        if mx.conv1d.bias is not None:
            mx.conv1d.bias.copy_(0.2 * rn(mx.conv1d.bias.numel()))
        for lin in (mx.in_proj, mx.out_proj):
            if lin.bias is not None:
                lin.bias.copy_(0.3 * rn(lin.bias.numel()))
        blk.norm.weight.copy_(1.0 + 0.3 * rn(blk.norm.weight.numel()))
    nf = model.backbone.norm_f
    nf.weight.copy_(1.0 + 0.3 * rn(nf.weight.numel()))


def build_model(spec: dict) -> MambaForCausalLM:
    cfg = MambaConfig(**{**COMMON, **spec["config"]})
    torch.manual_seed(spec["seed"])
    model = MambaForCausalLM(cfg).eval()
    perturb(model, spec["seed"])
    return model


def load_model(path) -> MambaForCausalLM:
    return MambaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def rewrite_published_variants(case_dir: Path, spec: dict) -> None:
    """Turn save_pretrained's output into the published variants a case is about."""
    if spec.get("rank_auto_in_file"):
        cfg_path = case_dir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        assert cfg["time_step_rank"] == math.ceil(cfg["hidden_size"] / 16)
        cfg["time_step_rank"] = "auto"
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_padded_rows(model, prompts, values, n_steps, n_layers, atol=1e-5, strict=True) -> float:
    """Every row of a left-padded batch equals its own unpadded run on every real token's values
    (strict); returns the largest difference."""
    t0 = max(len(p) for p in prompts)
    worst = 0.0
    for r, p in enumerate(prompts):
        single = om.run(model, [p], n_steps, forced_tokens=values["tokens"][r : r + 1].T)
        assert np.array_equal(single["tokens"][0], values["tokens"][r])
        for k in range(n_steps):
            for path in om.value_paths(n_layers):
                kk = om.key(path, k)
                if kk not in single:
                    continue
                got = values[kk][r : r + 1]
                if k == 0 and got.ndim >= 3 and not path.endswith((".state_input", ".state_output")):
                    got = got[:, t0 - len(p) :]  # real tokens of row r
                assert got.shape == single[kk].shape, (kk, got.shape, single[kk].shape)
                d = mf._max_abs(got, single[kk])
                worst = max(worst, d)
                assert d <= atol or not strict, f"row {r}: {kk} differs from the unpadded run by {d:.3e}"
    return worst


def build_case(name: str, out_root: Path) -> dict:
    spec = CASES[name]
    case_dir = out_root / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)

    model = build_model(spec)
    model.save_pretrained(str(case_dir))
    (case_dir / "generation_config.json").unlink(missing_ok=True)
    rewrite_published_variants(case_dir, spec)
    loaded = load_model(case_dir)
    cfg = loaded.config
    n_layers = cfg.num_hidden_layers

    ref_sd = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref_sd[k]), f"{name}: reloaded {k} differs"
    if cfg.tie_word_embeddings:
        assert loaded.lm_head.weight.data_ptr() == loaded.backbone.embeddings.weight.data_ptr()

    prompts = mf.make_prompts(spec["seed"], spec["prompt_lens"], cfg.vocab_size)
    edits = spec["edits"]
    values, rec = om.run(loaded, prompts, N_STEPS, return_recorder=True)
    full = om.capture(loaded, prompts, N_STEPS, edits)
    for k, v in values.items():
        assert np.array_equal(full[k], v), f"{name}: capture() not deterministic on {k}"

    exp = om.expected_keys(n_layers, N_STEPS, [e["name"] for e in edits])
    assert set(full) == exp, f"{name}: key set mismatch {set(full) ^ exp}"
    om.check_invariants(full, n_layers, N_STEPS)
    mf.check_against_plain_hf(loaded, prompts, values, N_STEPS)
    assert rec.kernel_log == [(k, i, "scan" if k == 0 else "update") for k in range(N_STEPS) for i in range(n_layers)]
    margin = mf.greedy_margin(values, N_STEPS)
    assert margin > 2e-2, f"{name}: greedy argmax margin {margin:.2e} too small to be robust"
    assert not (values["tokens"][:, :-1] == cfg.eos_token_id).any(), f"{name}: greedy produced EOS; change the seed"
    changes = {}
    for e in edits:
        d = max(mf._max_abs(full[f"edit/{e['name']}/logits@step{k}"], full[f"logits@step{k}"]) for k in range(N_STEPS))
        assert d > 1e-4, f"{name}: edit {e['name']} changes no logits ({d:.2e})"
        for k in range(int(e["step"])):
            assert np.array_equal(full[f"edit/{e['name']}/logits@step{k}"], full[f"logits@step{k}"])
        changes[e["name"]] = d
    checks = {"greedy_margin_min": margin, "edit_max_logit_change": changes}
    if spec.get("check_rows"):
        checks["padded_vs_unpadded_max_abs"] = check_padded_rows(loaded, prompts, full, N_STEPS, n_layers)
    if spec.get("expect_padding_leak"):
        leak = check_padded_rows(loaded, prompts, full, N_STEPS, n_layers, strict=False)
        assert leak > 1e-3, f"{name}: in_proj bias at padded positions should reach real tokens ({leak:.2e})"
        checks["padded_vs_unpadded_max_abs"] = leak

    golden = {}
    for k, v in full.items():
        v = v.astype(np.float32) if v.dtype.kind == "f" else v.astype(np.int64)
        golden[k] = np.ascontiguousarray(v)
    save_file(golden, str(case_dir / "golden.safetensors"))

    case = {
        "case": name,
        "description": spec["description"],
        "family": "mamba",
        "architecture": "MambaForCausalLM",
        "prompts": prompts,
        "pad_token_id": cfg.pad_token_id,
        "padding_side": "left",
        "n_steps": N_STEPS,
        "decoding": "greedy (argmax of the last position's logits); no EOS stop",
        "edits": edits,
        "config": {
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "state_size": cfg.state_size,
            "time_step_rank": cfg.time_step_rank,
            "conv_kernel": cfg.conv_kernel,
            "vocab_size": cfg.vocab_size,
            "use_bias": cfg.use_bias,
            "use_conv_bias": cfg.use_conv_bias,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]},
        "tolerances": mf.TOLERANCES,
        "checks": checks,
        "notes": NOTES,
    }
    (case_dir / "case.json").write_text(mf._dumps(case) + "\n")
    return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "mamba"))
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="build only these cases")
    args = ap.parse_args(argv)
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
