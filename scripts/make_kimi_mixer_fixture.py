#!/usr/bin/env python
"""Golden fixture of Kimi-Linear's two mixers: Kimi Delta Attention (the gated DeltaNet mixer's `kda`
option, layer 0) and latent attention (the attention mixer's `mla` option, layer 1).

    .venv/bin/python scripts/make_kimi_mixer_fixture.py [--out DIR]    # default tests/fixtures/kimi_linear_mixers

A tiny random KimiLinearForCausalLM (transformers 5.18, its pure-torch KDA: flash-linear-attention is
not used on the CPU) is saved with save_pretrained (the published checkpoint names: q_conv1d /
k_conv1d / v_conv1d, A_log, dt_bias, f_a/f_b_proj, g_a/g_b_proj, o_norm, o_proj). Its layer 0
(KimiLinearDeltaAttention) is run on random block inputs, with a DynamicCache, over three calls:

    step0  a prompt of 70 tokens (two chunks of 64), row 1 left-padded by 5 (chunk_kimi_delta_attention)
    step1  one decode token (recurrent_kimi_delta_attention)
    step2  a continuation of 5 tokens from the cached state (chunked again)

golden.safetensors holds per step: x (the mixer input), q / k / v after conv + SiLU (before the
in-kernel L2 norm), g (per key channel, [B,T,H,Dk]), beta, o (kernel output), state (after the
call), out (the mixer output); mask is the 2-D attention mask. The kernels' inputs and outputs are
captured by wrapping the module's kernel functions (transformers calls them by their module names).
Layer 1 (KimiLinearAttention, eager attention so that the weights come out) runs the same three
calls on its own inputs with the growing 2-D mask: ax (input), aq / ak / av (the call's queries
[B,T,H,hd], keys [B,T,H,hd], values [B,T,H,v_head_dim]), aprobs [B,H,T,T_k], aout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
              qk_nope_head_dim=8, v_head_dim=6, n_group=1, topk_group=1, num_local_experts=4, num_experts_per_tok=2,
              linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
SEED = 1234
PAD = 5  # left padding of row 1 at step 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "kimi_linear_mixers"))
    args = ap.parse_args(argv)
    import transformers
    from transformers import DynamicCache, KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    torch.manual_seed(SEED)
    cfg = KimiLinearConfig(**CONFIG)
    model = KimiLinearForCausalLM(cfg).eval()
    mixer = model.model.layers[0].self_attn
    with torch.no_grad():  # away from their init, so that a misuse cannot hide
        mixer.o_norm.weight.add_(0.3 * torch.randn_like(mixer.o_norm.weight))
        mixer.forget_gate.dt_bias.add_(0.5 * torch.randn_like(mixer.forget_gate.dt_bias))
        mixer.forget_gate.f_b_proj.weight.mul_(10.0)  # decays that differ per key channel
        mixer.g_b_proj.weight.mul_(10.0)
        for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj):  # q / k / v of order 1 (the L2 norm's eps small)
            proj.weight.mul_(30.0)
        la = model.model.layers[1].self_attn  # peaked attention weights, norms away from ones
        la.q_proj.weight.mul_(15.0)
        la.kv_b_proj.weight.mul_(15.0)
        la.kv_a_proj_with_mqa.weight.mul_(15.0)
        la.kv_a_layernorm.weight.add_(0.3 * torch.randn_like(la.kv_a_layernorm.weight))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for extra in ("generation_config.json",):
        (out / extra).unlink(missing_ok=True)

    captured: dict[str, torch.Tensor] = {}

    def wrap(fn):
        def inner(query, key, value, g, beta, *a, **kw):
            o, state = fn(query, key, value, g, beta, *a, **kw)
            captured.update(q=query, k=key, v=value, g=g, beta=beta, o=o, state=state)
            return o, state
        return inner

    kernels_used: list[str] = []

    def tag(fn, name):
        def inner(*a, **kw):
            kernels_used.append(name)
            return fn(*a, **kw)
        return inner

    mk.chunk_kimi_delta_attention = tag(wrap(mk.chunk_kimi_delta_attention), "chunked")
    mk.recurrent_kimi_delta_attention = tag(wrap(mk.recurrent_kimi_delta_attention), "recurrent")

    B, D = 2, CONFIG["hidden_size"]
    mask = torch.ones(B, 70, dtype=torch.long)
    mask[1, :PAD] = 0
    cache = DynamicCache(config=cfg)
    golden: dict[str, torch.Tensor] = {"mask": mask.to(torch.int64)}
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for step, T in enumerate((70, 1, 5)):
            x = torch.randn(B, T, D, generator=gen)
            captured.clear()
            # The recurrent mask only matters on a multi-token call with padding (step 0).
            y = mixer(x, cache_params=cache, attention_mask=mask if step == 0 else None)
            assert captured, "the kernel wrappers were not called: transformers no longer calls them by name"
            golden[f"x@step{step}"] = x
            for k in ("q", "k", "v", "g", "beta", "o", "state"):
                golden[f"{k}@step{step}"] = captured[k].contiguous().float()
            golden[f"out@step{step}"] = y.contiguous()
            assert cache.has_previous_state(0), "later calls must continue from the cached state"
    assert kernels_used == ["chunked", "recurrent", "chunked"], kernels_used

    attn = model.model.layers[1].self_attn
    model.config._attn_implementation = "eager"
    eager = mk.eager_attention_forward

    def keep_eager(module, query, key, value, attention_mask, **kw):
        o, w = eager(module, query, key, value, attention_mask, **kw)
        captured.update(aq=query, ak=key, av=value, aprobs=w)
        return o, w

    mk.eager_attention_forward = keep_eager
    full_mask = mask
    with torch.no_grad():
        for step, T in enumerate((70, 1, 5)):
            x = torch.randn(B, T, D, generator=gen)
            if step:
                full_mask = torch.cat([full_mask, torch.ones(B, T, dtype=torch.long)], dim=1)
            past = full_mask.shape[1] - T
            pos = torch.arange(past, past + T).unsqueeze(0)
            cmask = mk.create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=full_mask,
                                          past_key_values=cache, position_ids=pos)
            captured.clear()
            y, _ = attn(x, attention_mask=cmask, past_key_values=cache)
            golden[f"ax@step{step}"] = x
            golden[f"aq@step{step}"] = captured["aq"].transpose(1, 2).contiguous()
            golden[f"ak@step{step}"] = captured["ak"][:, :, -T:].transpose(1, 2).contiguous()
            golden[f"av@step{step}"] = captured["av"][:, :, -T:].transpose(1, 2).contiguous()
            golden[f"aprobs@step{step}"] = captured["aprobs"].contiguous()
            golden[f"aout@step{step}"] = y.contiguous()
    assert golden["aprobs@step2"].shape[-1] == 76
    save_file({k: v.contiguous() for k, v in golden.items()}, str(out / "golden.safetensors"))
    (out / "case.json").write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                                               "seed": SEED, "pad": PAD, "steps": [70, 1, 5]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
