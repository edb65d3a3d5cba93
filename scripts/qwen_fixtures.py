"""Golden fixtures for the Qwen gated-DeltaNet hybrids (called by scripts/make_fixtures.py).

For every case: build a tiny random-weight Qwen3_5ForCausalLM / Qwen3NextForCausalLM (float32,
fixed seeds; A_log, dt_bias and every norm weight perturbed away from their init so that mistakes in
their use cannot hide), save_pretrained it into tests/fixtures/<family>/<case>/, reload it, run the
oracle (tests/python/oracle_qwen.py) and write golden.safetensors + case.json. Before writing it
asserts: the patched run equals plain HF (`model.generate` greedy tokens and prompt logits), the
explicit token recurrence ends at the kernel's state, and every edit changes the logits from its step.
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
import oracle_qwen as oq  # noqa: E402

N_STEPS = 8
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None, pad_token_id=0)
LIN, FULL = "linear_attention", "full_attention"


def mix(layer, value):
    return f"layers.{layer}.linear_attn.{value}"


CASES = {
    "qwen3_5": {
        # HV = HK, prompt of 70 tokens: the chunk loop runs twice (64 + 6).
        "hv_eq_hk_chunks": dict(
            config=dict(num_hidden_layers=4, layer_types=[LIN, LIN, FULL, LIN], linear_num_key_heads=2,
                        linear_num_value_heads=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
            prompts=[70], seed=1,
            edits=[dict(name="betas_half", path=mix(0, "betas"), step=0, op="scale", factor=0.5),
                   dict(name="decays_x3", path=mix(1, "decays"), step=0, op="scale", factor=3.0),
                   dict(name="keys_tok5", path=mix(0, "attention_keys"), step=0, op="set_index", index=5, value=0.7),
                   dict(name="state_in_x2", path=mix(3, "state_input"), step=2, op="scale", factor=2.0),
                   dict(name="betas_dec", path=mix(1, "betas"), step=3, op="scale", factor=0.0)]),
        # HV = 2*HK: q/k head repetition; edits to keys are per value head.
        "hv_2hk": dict(
            config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                        linear_num_value_heads=4, tie_word_embeddings=False),
            prompts=[20], seed=2,
            edits=[dict(name="keys_x2", path=mix(0, "attention_keys"), step=0, op="scale", factor=2.0),
                   dict(name="decays_tok3", path=mix(2, "decays"), step=0, op="set_index", index=3, value=0.0),
                   dict(name="state_in_head1", path=mix(2, "state_input"), step=1, op="set_index", index=1, value=0.0)]),
        "short_prompt": dict(
            config=dict(num_hidden_layers=2, layer_types=[LIN, FULL], linear_num_key_heads=2, linear_num_value_heads=4),
            prompts=[2], seed=3, edits=[]),
        "padded_batch": dict(
            config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                        linear_num_value_heads=4),
            prompts=[13, 6, 9], seed=4, edits=[]),
        # prompt, then a 7-token continuation from the cache (chunked kernel with an initial state).
        "continuation": dict(
            config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                        linear_num_value_heads=4),
            prompts=[10], seed=5, continuation=7, edits=[]),
    },
    "qwen3_next": {
        "moe_hv_2hk": dict(
            config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1],
                        norm_topk_prob=True, tie_word_embeddings=False),
            prompts=[67], seed=11,
            edits=[dict(name="betas_half", path=mix(0, "betas"), step=0, op="scale", factor=0.5),
                   dict(name="keys_x2", path=mix(2, "attention_keys"), step=0, op="scale", factor=2.0),
                   dict(name="state_in_x2", path=mix(0, "state_input"), step=2, op="scale", factor=2.0),
                   dict(name="decays_dec", path=mix(2, "decays"), step=4, op="scale", factor=2.0)]),
        "padded_batch": dict(
            config=dict(num_hidden_layers=2, layer_types=[LIN, FULL], linear_num_key_heads=2, linear_num_value_heads=2,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24, norm_topk_prob=False, tie_word_embeddings=False),
            prompts=[11, 5], seed=12, edits=[]),
    },
}


def build_model(family, spec):
    torch.manual_seed(spec["seed"])
    cfg = dict(BASE, **spec["config"])
    if family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**cfg))
    g = torch.Generator().manual_seed(spec["seed"] + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.5, 1.0, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:  # zero-centred norms, q/k norms and the gated norm: away from init
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model.eval()


def prompts_for(spec, vocab):
    g = torch.Generator().manual_seed(spec["seed"] + 7)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in spec["prompts"]]


def check_against_plain_hf(model, prompts, values, pad_id, feeds):
    ids, mask = oq.pad_prompts(prompts, pad_id)
    with torch.no_grad():
        if feeds is None:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N_STEPS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=pad_id)
            got = out.sequences[:, ids.shape[1]:].numpy()
            assert np.array_equal(got, values["tokens"]), f"generate tokens {got} != oracle {values['tokens']}"
            for s, lg in enumerate(out.logits):
                assert np.allclose(lg.numpy(), values[oq.key("logits", s)][:, -1], atol=1e-5), f"generate logits step {s}"
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        plain = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.numpy()
    assert np.array_equal(plain, values[oq.key("logits", 0)]), "patched prompt logits differ from plain HF"


def build_case(family, name, out_root: Path):
    spec = CASES[family][name]
    model = build_model(family, spec)
    case_dir = out_root / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    model.save_pretrained(case_dir)
    model = type(model).from_pretrained(case_dir).eval()
    pad_id = 0
    prompts = prompts_for(spec, model.config.vocab_size)
    feeds = None
    if spec.get("continuation"):
        g = torch.Generator().manual_seed(spec["seed"] + 9)
        feeds = [torch.randint(1, model.config.vocab_size, (len(prompts), spec["continuation"]), generator=g).tolist()]
    values, rec = oq.run(model, prompts, pad_id, N_STEPS, feeds=feeds)
    check_against_plain_hf(model, prompts, values, pad_id, feeds)
    # Teacher-forced feeds for the C++ side: what step k >= 1 receives.
    tokens = values["tokens"]
    step_feeds = [feeds[k - 1] if feeds and k - 1 < len(feeds) else tokens[:, k - 1:k].tolist() for k in range(1, N_STEPS)]
    edits_out = []
    for e in spec["edits"]:
        ev, _ = oq.run(model, prompts, pad_id, N_STEPS, edits=[e], feeds=step_feeds, record=False)
        for s in range(N_STEPS):
            diff = float(np.abs(ev[oq.key("logits", s)] - values[oq.key("logits", s)]).max())
            assert (diff == 0.0) == (s < e["step"]), f"edit {e['name']}: step {s} logits diff {diff}"
            values[f"edit/{e['name']}/logits@step{s}"] = ev[oq.key("logits", s)]
        edits_out.append(e)
    arrays = {k: (v.astype(np.int64) if v.dtype.kind in "iu" else v.astype(np.float32)) for k, v in values.items()}
    save_file(arrays, str(case_dir / "golden.safetensors"))
    case = dict(family=family, prompts=prompts, pad_token_id=pad_id, n_steps=N_STEPS, feeds=step_feeds,
                greedy=feeds is None, edits=edits_out, config=spec["config"],
                kernels=sorted({f"step{s}:{k}" for s, _, k in rec.kernel_log}),
                max_recurrence_rel_err=rec.max_recurrence_err,
                versions=dict(transformers=transformers.__version__, torch=torch.__version__))
    (case_dir / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    return case


def main(families, cases=None) -> int:
    torch.set_num_threads(1)
    for family in families:
        out = REPO / "tests" / "fixtures" / family
        out.mkdir(parents=True, exist_ok=True)
        for name in CASES[family]:
            if cases and name not in cases:
                continue
            build_case(family, name, out)
            size = sum(f.stat().st_size for f in (out / name).iterdir())
            print(f"{family}/{name}: {size / 1024:.0f} KiB")
        total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"total {total / 1024:.0f} KiB in {out}")
        assert total < 4 * 1024 * 1024, "fixtures exceed the 4 MB budget"
    return 0
