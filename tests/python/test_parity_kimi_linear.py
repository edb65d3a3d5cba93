"""Live parity of Kimi-Linear (Kimi Delta Attention + latent attention + KimiLinearMoE) with
transformers 5.18 (pure torch: its chunk_kda / fused_recurrent_kda fallbacks, flash-linear-attention
not installed), on tiny random checkpoints transformers writes here: logits of a prompt of two
chunks beside a left-padded row, greedy decode steps through the cache, a continuation, both kernel
routes; the KDA values (decays per key channel) and the MLA values against the modules' own.

Tolerance: relative RMS <= 1e-4 on logits, 3e-5 on values (float32 on both sides).
"""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import rel_rms

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LIN, FULL = "linear_attention", "full_attention"
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=6, num_local_experts=8, num_experts_per_tok=2, linear_head_dim=8, linear_num_heads=2,
            linear_conv_kernel_dim=4, layer_types=[LIN, FULL, LIN, LIN], pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)
CASES = {
    # A dense first layer, the MoE after it; one expert group; q from q_proj.
    "dense_then_moe": dict(seed=5, config=dict(BASE, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                                                 n_group=1, topk_group=1, q_lora_rank=None)),
    # Group-limited routing (4 groups of 2, the best 2 kept), latent queries (q_lora_rank), n_shared 2.
    "grouped_router_latent_q": dict(seed=7, config=dict(BASE, mlp_layer_types=["sparse"] * 4, n_group=4,
                                                        topk_group=2, q_lora_rank=12, n_shared_experts=2,
                                                        norm_topk_prob=False)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    spec = CASES[request.param]
    torch.manual_seed(spec["seed"])
    cfg = transformers.KimiLinearConfig(**spec["config"])
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # away from init (biases 0, norms 1) so that a misuse shows
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("o_norm.weight") or name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            if "q_proj" in name or "k_proj" in name or "v_proj" in name or "kv_b_proj" in name or "kv_a_proj" in name:
                p.mul_(10.0)
            if "f_b_proj" in name:
                p.mul_(10.0)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.1 * torch.randn_like(gate.e_score_correction_bias))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return dict(name=request.param, torch_model=model, model=mixlens.StandardizedTransformer(str(path)), config=cfg)


def torch_logits(model, rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.numpy(), mask.numpy()


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("route", ["default", "chunked", "recurrent"])
def test_prompt_logits_match_on_both_kernel_routes(case, route):
    rows = prompts(1, [70, 9])
    want, mask = torch_logits(case["torch_model"], rows)
    mixlens.route_kernels("kimi_linear", route)
    try:
        got = case["model"].run(rows)["logits"]
    finally:
        mixlens.route_kernels("kimi_linear", "default")
    real = mask.astype(bool)  # padded positions: transformers' fully masked softmax differs (not compared)
    assert rel_rms(got[real], want[real]) <= 1e-4
    for b, r in enumerate(rows):  # each row alone equals its padded run
        alone = case["model"].run([r])["logits"][0]
        assert rel_rms(alone, got[b, -len(r):]) <= 1e-5


def test_greedy_decode_matches_transformers(case):
    rows = prompts(2, [20, 6])
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = case["torch_model"].generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    want = out[:, width:].tolist()
    tracer = case["model"].generate(rows, max_new_tokens=8, eos_token_id=-1).run()
    assert [list(t) for t in np.asarray(tracer.tokens).tolist()] == want


def test_continuation_equals_one_call(case):
    rows = prompts(3, [75])
    whole = case["model"].run(rows)["logits"]
    cache = case["model"].new_cache(1)
    a = case["model"].forward([rows[0][:66]], cache=cache)["logits"]
    b = case["model"].forward([rows[0][66:]], cache=cache)["logits"]
    assert rel_rms(np.concatenate([a, b], axis=1), whole) <= 1e-5


def test_values_match_the_modules(case):
    """Layer 0 (KDA) and 1 (MLA): decays [B,T,H,Dk] and the head outputs against the kernel's
    inputs and output in transformers; the attention values against eager attention's."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    rows = prompts(4, [30])
    got = case["model"].run(rows, saves=["layers.0.linear_attn.decays", "layers.0.linear_attn.attention_head_outputs",
                                         "layers.0.linear_attn.state_output", "layers.0.linear_attn.betas",
                                         "layers.1.self_attn.attention_keys", "layers.1.self_attn.attention_values",
                                         "layers.1.self_attn.attention_output", "layers.2.mlp.output"])
    seen = {}
    chunk = mk.chunk_kimi_delta_attention

    def keep(q, k, v, g, beta, *a, **kw):
        o, s = chunk(q, k, v, g, beta, *a, **kw)
        seen.setdefault("kda", (g, beta, o))
        return o, s

    mk.chunk_kimi_delta_attention = keep
    def hook(key, pick):
        def fn(module, args, out):  # returns None: the output is left as it is
            seen.setdefault(key, pick(out))
        return fn

    hooks = [case["torch_model"].model.layers[1].self_attn.register_forward_hook(hook("attn", lambda o: o[0])),
             case["torch_model"].model.layers[2].mlp.register_forward_hook(hook("mlp", lambda o: o))]
    try:
        with torch.no_grad():
            case["torch_model"](input_ids=torch.tensor(rows))
    finally:
        mk.chunk_kimi_delta_attention = chunk
        for h in hooks:
            h.remove()
    g, beta, o = seen["kda"]
    assert got["layers.0.linear_attn.decays"].shape == tuple(g.shape) == (1, 30, 2, 8)
    assert rel_rms(got["layers.0.linear_attn.decays"], g.numpy()) <= 3e-5
    assert rel_rms(got["layers.0.linear_attn.betas"], beta.numpy()) <= 3e-5
    assert rel_rms(got["layers.0.linear_attn.attention_head_outputs"], o.numpy()) <= 3e-5
    assert got["layers.1.self_attn.attention_values"].shape == (1, 30, 2, 6)
    assert rel_rms(got["layers.1.self_attn.attention_output"], seen["attn"].numpy()) <= 3e-5
    assert rel_rms(got["layers.2.mlp.output"], seen["mlp"].numpy()) <= 3e-5


def test_support_names_the_block_kinds(case):
    s = case["model"].support()
    assert s["linear_attn.decays"][0] is None  # supported
    assert "attention block" in s["linear_attn.decays"][1]
    assert "gated_deltanet block" in s["self_attn.attention_output"][0]


def test_kernel_identity_names_the_per_key_channel_rule(case):
    """KDA is not Qwen's gated DeltaNet to a reader of the kernel identity: its decay is per key channel."""
    m = case["model"]
    for i, t in enumerate(case["config"].layer_types):
        if t != LIN:
            continue
        mix = m.layers[i].linear_attn
        assert (mix.kind, mix.state_op) == ("kimi_delta", "kimi_delta_rule")
        assert m._core.mixer_identity(i, 30)["kind"] == "kimi_delta"
    with m.generate([[5, 6, 7]], max_new_tokens=2, eos_token_id=-1) as tracer:
        pass
    assert [c["kernel"] for c in tracer.calls] == ["chunked", "recurrent"]


def test_backward_serves_the_per_key_channel_decay_gradient(case):
    """kimi_linear has a backward (every value against torch autograd: test_grad_qwen.py); decays' gradient
    has the served per-key-channel shape [B,T,HV,Dk]."""
    with case["model"].trace([[5, 6, 7]], grad=True) as tr:
        pass
    # dMetric/dLogits given directly ([B,1,vocab]: the trace's logits are the last position's)
    tr.backward(np.ones((1, 1, 96), np.float32), paths=["layers.0.linear_attn.decays"])
    g = np.asarray(tr.grad("layers.0.linear_attn.decays"))
    cfg = case["config"]
    assert g.shape == (1, 3, cfg.linear_num_heads, cfg.linear_head_dim)
    assert np.isfinite(g).all() and np.abs(g).max() > 0


def test_the_published_config_spelling_loads_the_same_model(tmp_path):
    """The published config.json keeps the linear-attention fields in linear_attn_config (1-indexed
    full_attn_layers / kda_layers, head_dim, num_heads, short_conv_kernel_size) and the dense layers
    as first_k_dense_replace: read as KimiLinearConfig.__post_init__ reads them, the same model."""
    import json
    import shutil

    from mixlens_dev.common import REPO

    src = REPO / "tests/fixtures/kimi_linear/kda_mla_moe_chunks"
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, tmp_path / f)
    cfg = json.loads((src / "config.json").read_text())
    for k in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        del cfg[k]
    cfg["linear_attn_config"] = dict(full_attn_layers=[2], kda_layers=[1, 3], head_dim=8, num_heads=2,
                                     short_conv_kernel_size=4)
    cfg["first_k_dense_replace"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = transformers.KimiLinearConfig.from_pretrained(tmp_path)
    assert hf.layer_types == [LIN, FULL, LIN] and hf.mlp_layer_types == ["dense", "sparse", "sparse"]
    rows = prompts(6, [20])
    want = mixlens.StandardizedTransformer(str(src)).run(rows)["logits"]
    got = mixlens.StandardizedTransformer(str(tmp_path)).run(rows)["logits"]
    np.testing.assert_array_equal(got, want)
    cfg["linear_attn_config"]["full_attn_layers"] = [4]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mixlens.ConfigError, match="full_attn_layers names layer 4"):
        mixlens.StandardizedTransformer(str(tmp_path))
