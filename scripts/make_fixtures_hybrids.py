"""Golden fixtures for the Mamba-2 hybrids: Nemotron-H, Bamba, Falcon-H1.

For every case: build a tiny random-weight NemotronHForCausalLM / BambaForCausalLM /
FalconH1ForCausalLM (float32, fixed seeds; A_log, dt_bias, D and every norm weight perturbed away
from their init), save_pretrained it into tests/fixtures/<family>/<case>/, reload it, run the oracle
(tests/python/oracle_hybrids.py: prompt + 7 decode steps) and write golden.safetensors + case.json.
Before writing it asserts that the patched run equals plain transformers (generate's greedy tokens
and logits), the values.md invariants hold, and every edit changes the logits from its step on.

    .venv/bin/python scripts/make_fixtures_hybrids.py [family ...]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
import oracle_hybrids as oh  # noqa: E402

N_STEPS = 8
PAD = 0
COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
BASE = {
    # n_groups 2 with the grouped gated norm; dt clamp time_step_min = 0.3 bites on random weights;
    # chunk 8 < prompt length.
    "nemotron_h": dict(COMMON, hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, head_dim=8,
                       time_step_min=0.3, layer_norm_epsilon=1e-5, use_conv_bias=True),
    "bamba": dict(COMMON, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                  mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                  time_step_limit=[0.05, 2.0], rms_norm_eps=1e-5),
    # mamba_d_ssm 48 != expand * hidden; every µP multiplier away from 1.
    "falcon_h1": dict(COMMON, num_hidden_layers=2, mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12,
                      mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8, rms_norm_eps=1e-5,
                      mamba_rms_norm=True, mamba_norm_before_gate=False,
                      embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=0.8,
                      attention_out_multiplier=1.3, ssm_in_multiplier=1.2, ssm_out_multiplier=0.7,
                      ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 0.6], key_multiplier=0.75, mlp_multipliers=[1.5, 0.6]),
}
MOE = dict(hybrid_override_pattern="ME*M", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, moe_latent_size=8,
           routed_scaling_factor=1.5, norm_topk_prob=True)
CLASSES = {
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig"),
    "bamba": ("BambaForCausalLM", "BambaConfig"),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config"),
}


def mix(layer, value):
    return f"layers.{layer}.linear_attn.{value}"


def att(layer, value):
    return f"layers.{layer}.self_attn.{value}"


CASES = {
    "nemotron_h": {
        "groups2_edits": dict(config={}, prompts=[19], seed=1, edits=[
            dict(name="betas_half", path=mix(0, "betas"), step=0, op="scale", factor=0.5),
            dict(name="decays_x3_s2", path=mix(2, "decays"), step=2, op="scale", factor=3.0),
            dict(name="state_in_x2_s3", path=mix(0, "state_input"), step=3, op="scale", factor=2.0),
            dict(name="values_tok4", path=mix(2, "attention_values"), step=0, op="set_index", index=4, value=0.5),
            dict(name="attn_v_x2", path=att(1, "attention_values"), step=1, op="scale", factor=2.0)]),
        "padded_batch": dict(config=dict(hybrid_override_pattern="M-*M", n_groups=1, tie_word_embeddings=False),
                             prompts=[13, 5], seed=2, edits=[]),
        # MoE blocks: group-limited routing (2 groups, 1 kept), latent projection, shared expert.
        "moe_latent": dict(config=MOE, prompts=[15, 9], seed=8, edits=[
            dict(name="betas_x2", path=mix(0, "betas"), step=0, op="scale", factor=2.0)]),
    },
    "bamba": {
        "groups2_edits": dict(config={}, prompts=[21], seed=3, edits=[
            dict(name="betas_half", path=mix(0, "betas"), step=0, op="scale", factor=0.5),
            dict(name="decays_x2_s1", path=mix(2, "decays"), step=1, op="scale", factor=2.0),
            dict(name="state_in_head1_s2", path=mix(2, "state_input"), step=2, op="set_index", index=1, value=0.0),
            dict(name="attn_out_half_s3", path=att(1, "attention_output"), step=3, op="scale", factor=0.5)]),
        "padded_batch": dict(config=dict(mamba_n_groups=1, tie_word_embeddings=False), prompts=[12, 6], seed=4,
                             edits=[]),
    },
    "falcon_h1": {
        "norm_gate_first_edits": dict(config={}, prompts=[17], seed=5, edits=[
            dict(name="betas_x0p3", path=mix(0, "betas"), step=0, op="scale", factor=0.3),
            dict(name="decays_x2_s2", path=mix(1, "decays"), step=2, op="scale", factor=2.0),
            dict(name="state_in_x2_s1", path=mix(1, "state_input"), step=1, op="scale", factor=2.0),
            dict(name="attn_v_x2_s4", path=att(0, "attention_values"), step=4, op="scale", factor=2.0)]),
        # mamba_rms_norm off: the decode kernel gates y by silu(z) (attention_head_outputs served so).
        "no_rms_norm_padded": dict(config=dict(mamba_rms_norm=False, tie_word_embeddings=False), prompts=[11, 4],
                                   seed=16, edits=[]),
        "norm_before_gate": dict(config=dict(mamba_norm_before_gate=True, mamba_n_groups=1), prompts=[10], seed=7,
                                 edits=[]),
    },
}


def build_model(family, config: dict, seed: int):
    """A random float32 model of `family` with BASE[family] updated by `config`."""
    torch.manual_seed(seed)
    model_cls, cfg_cls = (getattr(transformers, n) for n in CLASSES[family])
    model = model_cls(cfg_cls(**dict(BASE[family], **config)))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.5, 1.0, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(".D"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.3)
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, zero at init: make it matter
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()


def prompts_for(lengths, seed, vocab):
    g = torch.Generator().manual_seed(seed + 7)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def mixer_layers(model):
    tm = model.model
    if hasattr(tm.layers[0], "block_type") and hasattr(tm, "norm_f"):
        return [i for i, l in enumerate(tm.layers) if l.block_type == "linear_attention"]
    return [i for i, l in enumerate(tm.layers) if hasattr(l, "mamba")]


def check_against_plain_hf(model, prompts, values):
    ids, mask = oh.pad_prompts(prompts, PAD)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N_STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=PAD)
    got = out.sequences[:, ids.shape[1]:].numpy()
    assert np.array_equal(got, values["tokens"]), f"generate tokens {got} != oracle {values['tokens']}"
    for s, lg in enumerate(out.logits):
        assert np.allclose(lg.numpy(), values[oh.key("logits", s)][:, -1], atol=1e-5), f"generate logits step {s}"


def greedy_margin(values):
    m = np.inf
    for k in range(N_STEPS):
        lg = np.sort(values[oh.key("logits", k)][:, -1], axis=-1)
        m = min(m, float((lg[:, -1] - lg[:, -2]).min()))
    return m


def build_case(family, name, out_root: Path):
    spec = CASES[family][name]
    model = build_model(family, spec["config"], spec["seed"])
    case_dir = out_root / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    model.save_pretrained(case_dir)
    model = type(model).from_pretrained(case_dir).eval()
    prompts = prompts_for(spec["prompts"], spec["seed"], model.config.vocab_size)
    values, rec = oh.run(model, prompts, PAD, N_STEPS)
    check_against_plain_hf(model, prompts, values)
    oh.check_invariants(values, mixer_layers(model), N_STEPS)
    assert greedy_margin(values) > 1e-3, f"{family}/{name}: greedy margin too small; pick another seed"
    tokens = values["tokens"]
    feeds = [tokens[:, k - 1:k].tolist() for k in range(1, N_STEPS)]
    for e in spec["edits"]:
        ev, _ = oh.run(model, prompts, PAD, N_STEPS, edits=[e], feeds=feeds, record=False)
        for s in range(N_STEPS):
            diff = float(np.abs(ev[oh.key("logits", s)] - values[oh.key("logits", s)]).max())
            assert (diff == 0.0) == (s < e["step"]), f"edit {e['name']}: step {s} logits diff {diff}"
            values[f"edit/{e['name']}/logits@step{s}"] = ev[oh.key("logits", s)]
    arrays = {k: (v.astype(np.int64) if v.dtype.kind in "iu" else v.astype(np.float32)) for k, v in values.items()}
    save_file(arrays, str(case_dir / "golden.safetensors"))
    case = dict(family=family, prompts=prompts, pad_token_id=PAD, n_steps=N_STEPS, feeds=feeds, greedy=True,
                edits=spec["edits"], config=spec["config"], mixer_layers=mixer_layers(model),
                kernels=sorted({f"step{s}:{k}" for s, _, k in rec.kernel_log}),
                versions=dict(transformers=transformers.__version__, torch=torch.__version__))
    (case_dir / "case.json").write_text(json.dumps(case, indent=1) + "\n")


def main(families) -> int:
    torch.set_num_threads(1)
    for family in families:
        out = REPO / "tests" / "fixtures" / family
        out.mkdir(parents=True, exist_ok=True)
        for name in CASES[family]:
            build_case(family, name, out)
            size = sum(f.stat().st_size for f in (out / name).iterdir())
            print(f"{family}/{name}: {size / 1024:.0f} KiB")
        total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        assert total < 4 * 1024 * 1024, "fixtures exceed the 4 MB budget"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(CASES)))
