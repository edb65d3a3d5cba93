#!/usr/bin/env python3
"""Random-weight stand-ins for published Mamba-2 hybrid (and FalconMamba, Jamba, Qwen3.5-MoE, OLMo-Hybrid, LFM2, MiniMax) checkpoints, made by transformers 5.18
(save_pretrained, bfloat16 like the releases; never committed: built under build/published/).

    .venv/bin/python -m mixlens_dev.published_hybrids falcon_h1_0_5b build/published/x

Where the configs come from (no internet here; the hub files could not be fetched)
----------------------------------------------------------------------------------
* tiiuae/Falcon-H1-0.5B-Base, FULL size (36 layers). Every field below is quoted identically by
  three independent ports found with the search tool: mlx-lm's falcon_h1 ``ModelArgs`` defaults,
  NVIDIA Megatron-Bridge's ``FalconH1ModelProvider500M`` ("Based on tiiuae/Falcon-H1-0.5B-Instruct,
  model architecture from config.json") and a research config ("Source of truth: the published
  Falcon-H1-0.5B-Base config"): hidden 1024, 36 layers, intermediate 2048, 8 heads / 2 KV heads,
  head_dim 64, mamba_d_ssm 1536, 24 mamba heads of 64, d_state 128, 1 group, d_conv 4, chunk 128,
  mamba_rms_norm false, norm_before_gate false, vocab 32784, rope_theta 1e11, untied head
  (Megatron-Bridge), and the µP multipliers.
* nvidia/Nemotron-H-8B-Base-8K, exact widths, REDUCED to its first 8 blocks ("M-M-M-M*" of the
  published 52-block pattern "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", which holds
  every block kind): hidden 4096, 32 heads / 8 KV heads of 128, 128 mamba heads of 64, state 128,
  8 groups, conv 4, vocab 131072 (quoted by two parameter-counting projects' copies of the
  config.json); intermediate 21504, chunk 128, time_step_min 0.001, relu2 are NemotronHConfig's
  defaults, which are the 8B's (the class was written for it). Full depth would be 8.1B params.
* ibm-ai-platform/Bamba-9B, exact widths, REDUCED to 2 layers (attention on layer 1; the
  release has 32 layers with attention on 9, 18, 27): hidden 4096, 32 heads, mamba_d_state 128,
  attn_layer_indices [9, 18, 27] are quoted by a config survey; 8 KV heads, intermediate 14336,
  128 mamba heads (d_head 64), 1 group, d_conv 4, expand 2, chunk 256 are BambaConfig's defaults,
  which match the 9B; vocab 128256, rope_theta 10000, bos/eos 128000/128001, pad 0 and
  partial_rotary_factor 0.5 agree with a published tiny-random config derived from
  ibm-fms/Bamba-9B (yujiepan/bamba-tiny-random, whose config.json names it as its source).
* ibm-granite/granite-4.0-h-350m, FULL size (32 layers, ~340M parameters). The config.json is
  quoted field by field in a Rust MLX port's unit test (Lablup's granitemoehybrid config tests,
  "a trimmed granite-4.0-h-350m config ... values mirror the real checkpoint", validated there against
  mlx-community/granite-4.0-h-350m-4bit): hidden 768, 32 layers with attention at 10, 13, 17, 27,
  12 heads / 4 KV heads, 48 mamba heads of 32, d_state 128, 1 group, d_conv 4, conv bias, no proj
  bias, no experts (num_local_experts 0) and a 2048-wide shared MLP, position_embedding_type "nope",
  embedding_multiplier 12, attention_multiplier 0.015625, residual_multiplier 0.246,
  logits_scaling 3, rms_norm_eps 1e-5, tied embeddings, vocab 100352, eos 100257. A second source
  (a Go port's Granite guide: 12 query / 4 KV heads, 48 SSM heads, state 128, NoPE, 28 Mamba-2 + 4
  attention layers) agrees on what it states. mamba_chunk_size (256) and mamba_expand (2, = 48 * 32
  / 768) are GraniteMoeHybridConfig's defaults.
* tiiuae/falcon-mamba-7b, exact widths, REDUCED to 2 of its 64 layers. Its config.json is quoted
  verbatim (every key, "transformers_version": "4.43.0.dev0") by two independent public code bases
  found with the search tool: an ONNX-export test helper whose docstring links
  https://huggingface.co/tiiuae/falcon-mamba-7b/blob/main/config.json, and a benchmark script's
  ``falcon_mamba_config``; a parameter-counting table quotes the same widths (hidden 4096, 64
  layers, intermediate 8192, vocab 65024, state 16, conv 4, time_step_rank 256, expand 16, untied
  head). The file says both ``expand`` 16 and ``intermediate_size`` 8192: transformers 5.18 sets
  intermediate_size = expand * hidden_size in ``__post_init__`` and then applies the stored key
  (config kwargs are set last), so the model is 8192 wide, as the released weights are. The file
  has no ``mixer_rms_eps`` (FalconMambaConfig's default 1e-6 applies).
* ai21labs/Jamba-tiny-dev CLASS, FULL depth (16 layers). The hub page (found with the search tool)
  lists a 637 MB bfloat16 model.safetensors (~319M parameters, its model card says 319M). Its
  config.json could not be fetched; a model-memory tool's unit test quotes it ("ai21labs/Jamba-tiny-dev's
  actual config.json", live-verified there): 16 layers, 8 attention heads, 2 KV heads, hidden_size
  512, attn_layer_offset 4 / attn_layer_period 8. The rest are JambaConfig's defaults (expert layers
  at offset 1 / period 2, 16 experts top-2, mamba d_state 16, d_conv 4, expand 2, dt rank "auto",
  rms_norm_eps 1e-6, vocab 65536, untied head, bos/eos/pad 1/2/0 as its generation_config.json) but
  intermediate_size: 1024, inferred from the parameter count (with 1024 the layout has ~306M
  parameters; the default 14336 would give ~3.2B). "Class": the widths and the layer / expert
  pattern of the release, not a verified copy of its file.
* Zyphra/Zamba2-1.2B, FULL size (38 layers, ~1.2B parameters). Source: a public architecture
  review packet that ran transformers' Zamba2 modeling code on the hub config.json at revision
  6b05bf29d1bb4ca71a36d12f7da4d3120dcde7fe (found with the search tool) and lists the config's
  values and every traced op: hidden 2048, 38 layers with "hybrid" at 5, 11, 17, 23, 29, 35 (the
  rest Mamba-2), 32 heads / 32 KV heads (head_dim 128 = 2 * 2048 / 32), intermediate 8192, vocab
  32000, max positions 4096, d_state 128, 1 group, 64 mamba heads of 64 (expand 2), d_conv 4, chunk
  256, num_mem_blocks 1, adapter_rank 128, tied embeddings; the trace shows the q / k / v adapters
  (use_shared_attention_adapter true), RoPE with theta 10000 (use_mem_rope true), the shared MLP's
  gelu, and no projection biases (add_bias_linear false). Fields it does not give are Zamba2Config's
  defaults (rms_norm_eps 1e-5, time_step_min 0.001, pad / bos / eos 0 / 1 / 2).
* Falcon-H1-Tiny: no config could be found offline; not built.
* Qwen/Qwen3.5-35B-A3B (Qwen3.5-MoE), exact widths, REDUCED to 2 of its 40 layers (a gated DeltaNet
  block, then a gated-attention block; the release repeats 3 GDN + 1 attention), text model only
  (Qwen3_5MoeForCausalLM: the published file is the VLM, whose text_config this is; the VLM nesting is
  checked by tests/python/test_qwen3_5_vlm_layout.py). transformers 5.18's Qwen3_5MoeTextConfig documents
  its defaults as this checkpoint's (``@auto_docstring(checkpoint="Qwen/Qwen3.5-35B-A3B")``): vocab
  248320, hidden 2048, 40 layers, 16 heads / 2 KV heads of 256, GDN 16 key heads / 32 value heads of
  128, 256 experts of 512, top 8, one shared expert of 512, rms_norm_eps 1e-6, untied head; the
  transformers model doc agrees on the MoE ("256-expert sparse mixture, 8 routed experts ... plus 1
  shared expert", Qwen3.5-35B-A3B as the 35B / 3B-active checkpoint). RoPE as the Qwen3.5 line
  publishes it (rope_theta 1e7, partial_rotary_factor 0.25, the interleaved mrope_section [11, 11, 10]
  of the Qwen3.5-0.8B config in published_layout.py; the Miles RL recipe for this checkpoint quotes
  --rotary-base 10000000 and --rotary-percent 0.25). ~2.6B parameters, ~1B of them the embedding and
  the head.
* allenai/Olmo-Hybrid-7B (OLMo-Hybrid), exact widths, REDUCED to 4 of its 32 layers (3 GDN + 1
  attention, the release's period). transformers 5.18's OlmoHybridConfig documents its defaults as
  this checkpoint's (``@auto_docstring(checkpoint="allenai/Olmo-Hybrid-7B")``): vocab 100352, hidden
  3840, intermediate 11008, 30 heads (KV heads = heads), GDN heads 30 with key dim 96 and value dim
  192 (0.75 * hidden / heads, twice that), conv 4, linear_allow_neg_eigval, rms_norm_eps 1e-6, untied,
  pad 100277, eos 100257; modeling_olmo_hybrid.py states the released checkpoints use no RoPE
  (rope_theta null). Not checked against the hub file itself (no internet here). ~1.6B parameters.
* LiquidAI/LFM2-350M (LFM2), FULL size (16 layers, ~354M parameters). Its config.json could not be
  fetched; several independent ports quote the same fields (found with the search tool): two MLX ports'
  loader tests ("a trimmed LFM2-350M (dense) config", validated against mlx-community/LFM2-350M-8bit),
  a Rust inference engine's config test and a Swift port's "real config" layout test: hidden 1024, 16
  layers with full attention at 2, 5, 8, 10, 12, 14 (the rest short conv), 16 heads / 8 KV heads
  (head_dim 64), vocab 65536, norm_eps 1e-5, conv_L_cache 3, no conv bias, rope_theta 1e6, block_ff_dim
  6656 with block_auto_adjust_ff_dim, block_multiple_of 256, block_ffn_dim_multiplier 1.0 (an MLP
  width of 4608, as two GGUF converters' tests state), max positions 128000, eos 7. Tied embeddings,
  bos 1 and pad 0 are Lfm2Config's defaults, which the ports agree with.
* google/recurrentgemma-2b (RecurrentGemma), exact widths, REDUCED to 3 of its 26 layers (one period of
  block_types: recurrent, recurrent, attention). transformers 5.18's RecurrentGemmaConfig documents its
  defaults as this checkpoint's (``@auto_docstring(checkpoint="google/recurrentgemma-2b")``): vocab 256000,
  hidden 2560, 10 heads with 1 KV head (MQA), lru_width = hidden, attention_window_size 2048,
  conv1d_width 4, logits_soft_cap 30, partial_rotary_factor 0.5, rope_theta 10000, tied embeddings. The
  MLP width is intermediate_size 15360 (an MLP of 7680 = 3 x hidden after the module's // 2), from
  memory of the hub config.json, not the class default (7680); not checked against the hub file
  (no internet here). ~0.9B parameters, 0.66B of them the embedding.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mixlens_dev import published_layout
from mixlens_dev.common import REPO

FALCON_H1_0_5B = dict(
    vocab_size=32784, hidden_size=1024, num_hidden_layers=36, intermediate_size=2048, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
    max_position_embeddings=16384, rope_theta=1e11, attention_bias=False, mlp_bias=False, projectors_bias=False,
    mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=128, mamba_conv_bias=True, mamba_proj_bias=False, mamba_rms_norm=False,
    mamba_norm_before_gate=False, embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625,
    key_multiplier=0.39062499999999994, attention_in_multiplier=1.0, attention_out_multiplier=0.9375,
    ssm_in_multiplier=1.25, ssm_out_multiplier=0.23570226039551587,
    mlp_multipliers=[0.8838834764831844, 0.5859375],
    ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    pad_token_id=0, bos_token_id=1, eos_token_id=11,
)
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_8B_8BLOCKS = dict(
    vocab_size=131072, hidden_size=4096, hybrid_override_pattern=NEMOTRON_H_8B_PATTERN[:8],
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64,
    ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2, intermediate_size=21504, chunk_size=128,
    mlp_hidden_act="relu2", layer_norm_epsilon=1e-5, tie_word_embeddings=False, max_position_embeddings=8192,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
BAMBA_9B_2LAYERS = dict(
    vocab_size=128256, hidden_size=4096, num_hidden_layers=2, attn_layer_indices=[1], num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=14336, mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128,
    mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, rms_norm_eps=1e-5,
    tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=0, bos_token_id=128000, eos_token_id=128001,
)
GRANITE_350M_LAYER_TYPES = ["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)]
GRANITE_4_0_H_350M = dict(
    vocab_size=100352, hidden_size=768, num_hidden_layers=32, layer_types=GRANITE_350M_LAYER_TYPES,
    intermediate_size=2048, shared_intermediate_size=2048, num_local_experts=0, num_experts_per_tok=0,
    num_attention_heads=12, num_key_value_heads=4, attention_bias=False, hidden_act="silu",
    mamba_n_heads=48, mamba_d_head=32, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, position_embedding_type="nope",
    embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.246, logits_scaling=3.0,
    rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=10000.0,
    pad_token_id=100256, bos_token_id=100257, eos_token_id=100257,
)
FALCON_MAMBA_7B_2LAYERS = dict(
    vocab_size=65024, hidden_size=4096, num_hidden_layers=2, intermediate_size=8192, expand=16, state_size=16,
    conv_kernel=4, time_step_rank=256, layer_norm_epsilon=1e-5, hidden_act="silu", initializer_range=0.1,
    residual_in_fp32=True, rescale_prenorm_residual=False, time_step_floor=1e-4, time_step_init_scheme="random",
    time_step_max=0.1, time_step_min=0.001, time_step_scale=1.0, use_bias=False, use_conv_bias=True,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=11, pad_token_id=11,
)
JAMBA_TINY_DEV_CLASS = dict(
    vocab_size=65536, hidden_size=512, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=1024, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1,
    num_experts=16, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto",
    mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    max_position_embeddings=262144, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
QWEN3_5_MOE_35B_A3B_2LAYERS = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
    hidden_act="silu", tie_word_embeddings=False, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
OLMO_HYBRID_7B_4LAYERS = dict(
    vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=30, num_key_value_heads=30,
    linear_num_key_heads=30, linear_num_value_heads=30, linear_key_head_dim=96, linear_value_head_dim=192,
    linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, rms_norm_eps=1e-6, hidden_act="silu",
    tie_word_embeddings=False, max_position_embeddings=65536, attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": None}, pad_token_id=100277, eos_token_id=100257,
)
ZAMBA2_1_2B_TYPES = ["hybrid" if i % 6 == 5 else "mamba" for i in range(38)]
ZAMBA2_1_2B = dict(
    vocab_size=32000, hidden_size=2048, num_hidden_layers=38, layers_block_type=ZAMBA2_1_2B_TYPES,
    num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192, hidden_act="gelu",
    n_mamba_heads=64, mamba_d_state=128, mamba_ngroups=1, mamba_d_conv=4, mamba_expand=2, chunk_size=256,
    num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=128, use_mem_rope=True,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0), add_bias_linear=False, rms_norm_eps=1e-5,
    tie_word_embeddings=True, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# RWKV/rwkv-4-169m-pile, FULL size: hidden 768, 12 layers, vocab 50277, context 1024 (a model-preset table of
# the search tool's corpus: "rwkv-4-pile-169m ... 12-layer RWKV model trained on Pile", 169,342,464 params,
# model card BlinkDL/rwkv-4-pile-169m); attention_hidden_size 768, intermediate 3072, layer_norm_epsilon 1e-5,
# rescale_every 6, bos / eos 0, untied head as quoted by a RwkvConfig dataclass copied from its config.json.
RWKV_4_169M_PILE = dict(
    vocab_size=50277, hidden_size=768, num_hidden_layers=12, attention_hidden_size=768, intermediate_size=3072,
    context_length=1024, layer_norm_epsilon=1e-5, rescale_every=6, bos_token_id=0, eos_token_id=0,
    tie_word_embeddings=False,
)
# moonshotai/Kimi-Linear-48B-A3B-{Base,Instruct}: exact widths, REDUCED to 2 layers (KDA, then MLA) and
# 16 routed experts (the release: 27 layers, 256 experts, ~49B parameters; 256 experts of 3 x 2304 x 1024
# would be 7.2 GB of float32 per MoE layer on each side). The widths are transformers 5.18's
# KimiLinearConfig defaults (its docstring names the 48B-A3B-Base checkpoint), agreeing with mlx-lm's
# kimi_linear ModelArgs: hidden 2304, 32 heads / 32 KV heads, kv_lora_rank 512, no q_lora, qk_nope 128,
# qk_rope 64, v_head_dim 128, intermediate 9216 (the first_k_dense_replace = 1 dense layer),
# moe_intermediate 1024, 1 shared expert, top-8, routed_scaling_factor 2.446, 1 group, KDA 32 heads of
# 128, conv 4, vocab 163840, rms eps 1e-5, untied head; the release's pad / bos / eos ids.
KIMI_LINEAR_48B_A3B_2LAYERS = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
    num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_local_experts=16, num_experts_per_tok=8, n_shared_experts=1,
    routed_scaling_factor=2.446, n_group=1, topk_group=1, norm_topk_prob=True, linear_head_dim=128,
    linear_num_heads=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
    pad_token_id=163839, bos_token_id=163584, eos_token_id=163586,
)
LFM2_350M_TYPES = ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]
LFM2_350M = dict(
    vocab_size=65536, hidden_size=1024, num_hidden_layers=16, layer_types=LFM2_350M_TYPES, num_attention_heads=16,
    num_key_value_heads=8, intermediate_size=6656, block_auto_adjust_ff_dim=True, block_multiple_of=256,
    block_ffn_dim_multiplier=1.0, norm_eps=1e-5, conv_L_cache=3, conv_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=128000,
    tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=7,
)
RECURRENT_GEMMA_2B_3LAYERS = dict(
    num_hidden_layers=3, vocab_size=256000, hidden_size=2560, intermediate_size=15360, num_attention_heads=10,
    num_key_value_heads=1, lru_width=2560, attention_window_size=2048, conv1d_width=4, logits_soft_cap=30.0,
    rms_norm_eps=1e-6, block_types=["recurrent", "recurrent", "attention"],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)
# MiniMaxAI/MiniMax-Text-01 widths, REDUCED to 2 of its 80 layers (a lightning block, then the softmax
# attention block that ends each period of 8: attn_type_list [0]*7 + [1]), 2 of its 32 experts (top-2) and
# a 32000-row vocabulary (the release's 200064-row tables alone would be 2.5B parameters). The widths are
# the MiniMax-M1 release's config.json (same architecture as Text-01 per both model cards: 456B total /
# 45.9B active), quoted verbatim in a public repository found with the search tool: hidden 6144, 64 heads /
# 8 KV heads of head_dim 128 (so the lightning width 8192 differs from hidden), 32 experts of 9216,
# rms_norm_eps 1e-5, rope_theta 1e7, every layernorm_*_alpha (2 * 80)^0.25 = 3.5565588200778455 and beta 1,
# postnorm true (what MiniMaxDecoderLayer does: the normed input is the residual), untied head. Spelled as
# MiniMaxConfig names them (layer_types, *_alpha_factor / *_beta_factor). block_size 256 (MiniMaxConfig's
# default, the release's). Its rotary_dim 64 (half the head) is not a MiniMaxConfig field: transformers 5.18
# rotates the whole head, and so does mixlens. ~1.5B parameters.
MINIMAX_TEXT_01_2LAYERS = dict(
    vocab_size=32000, hidden_size=6144, intermediate_size=9216, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    num_local_experts=2, num_experts_per_tok=2, rms_norm_eps=1e-5, hidden_act="silu", block_size=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7}, max_position_embeddings=10240000,
    full_attn_alpha_factor=3.5565588200778455, full_attn_beta_factor=1.0, linear_attn_alpha_factor=3.5565588200778455,
    linear_attn_beta_factor=1.0, mlp_alpha_factor=3.5565588200778455, mlp_beta_factor=1.0,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
)
# NX-AI/xLSTM-7b: exact widths, REDUCED to 2 of its 32 mLSTM blocks (~0.8B parameters, mostly the two
# 50304-row tables; the full model is ~7B). The widths are transformers 5.18's xLSTMConfig defaults (its
# docstring names the NX-AI/xLSTM-7b checkpoint): embedding 4096, 8 heads, qk_dim_factor 0.5 (qk heads of 256),
# v_dim_factor 1 (v heads of 512), ffn_proj_factor 2.667 rounded up to 64 (10944), gate_soft_cap 15,
# output_logit_soft_cap 30, norm_eps 1e-6, eps 1e-6, chunk_size 64, weight_mode single, vocab 50304, pad / bos /
# eos 1 / 0 / 2; an xLSTM-7B architecture reference written from transformers' modeling code agrees on vocab
# 50304, embedding 4096, 32 blocks and the logit cap of 30.
XLSTM_7B_2BLOCKS = dict(
    vocab_size=50304, hidden_size=4096, num_hidden_layers=2, num_heads=8, qk_dim_factor=0.5, v_dim_factor=1.0,
    ffn_proj_factor=2.667, ffn_round_up_to_multiple_of=64, gate_soft_cap=15.0, output_logit_soft_cap=30.0,
    norm_eps=1e-6, eps=1e-6, chunk_size=64, weight_mode="single", use_bias=False, tie_word_embeddings=False,
    pad_token_id=1, bos_token_id=0, eos_token_id=2,
)
LAYOUTS = {
    "falcon_h1_0_5b": ("FalconH1ForCausalLM", "FalconH1Config", FALCON_H1_0_5B),
    "nemotron_h_8b_8blocks": ("NemotronHForCausalLM", "NemotronHConfig", NEMOTRON_H_8B_8BLOCKS),
    "bamba_9b_2layers": ("BambaForCausalLM", "BambaConfig", BAMBA_9B_2LAYERS),
    "granite_4_0_h_350m": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", GRANITE_4_0_H_350M),
    "falcon_mamba_7b_2layers": ("FalconMambaForCausalLM", "FalconMambaConfig", FALCON_MAMBA_7B_2LAYERS),
    "jamba_tiny_dev_class": ("JambaForCausalLM", "JambaConfig", JAMBA_TINY_DEV_CLASS),
    "qwen3_5_moe_35b_a3b_2layers": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", QWEN3_5_MOE_35B_A3B_2LAYERS),
    "olmo_hybrid_7b_4layers": ("OlmoHybridForCausalLM", "OlmoHybridConfig", OLMO_HYBRID_7B_4LAYERS),
    "zamba2_1_2b": ("Zamba2ForCausalLM", "Zamba2Config", ZAMBA2_1_2B),
    "rwkv_4_169m_pile": ("RwkvForCausalLM", "RwkvConfig", RWKV_4_169M_PILE),
    "kimi_linear_48b_a3b_2layers": ("KimiLinearForCausalLM", "KimiLinearConfig", KIMI_LINEAR_48B_A3B_2LAYERS),
    "lfm2_350m": ("Lfm2ForCausalLM", "Lfm2Config", LFM2_350M),
    "recurrent_gemma_2b_3layers": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", RECURRENT_GEMMA_2B_3LAYERS),
    "minimax_text_01_2layers": ("MiniMaxForCausalLM", "MiniMaxConfig", MINIMAX_TEXT_01_2LAYERS),
    "xlstm_7b_2blocks": ("xLSTMForCausalLM", "xLSTMConfig", XLSTM_7B_2BLOCKS),
}

BUILT_IN_BF16 = {"qwen3_5_moe_35b_a3b_2layers"}
# Buffers the release does not store (MiniMax's lightning decays: the remote code computes them from the
# slope); stored in bfloat16 they would be rounded where both implementations compute them in float32.
NOT_STORED = {"minimax_text_01_2layers": ("slope_rate", "query_decay", "key_decay", "diagonal_decay")}
BUILT_IN_BF16.add("minimax_text_01_2layers")  # ~1.5B parameters: 6 GB in float32 just to build


def make(name: str, out_dir, seed: int = 0) -> dict:
    """save_pretrained a random model of layout `name` in bfloat16 (transformers' own init, rounded
    once; a float32 reference must load the file and widen it so both sides see the same weights)."""
    import torch
    import transformers

    model_cls, cfg_cls, cfg = LAYOUTS[name]
    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    if name in BUILT_IN_BF16:  # built in bfloat16 directly: its float32 model alone would need ~10 GB
        torch.set_default_dtype(torch.bfloat16)
    try:
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**cfg)).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(out)
    if name in NOT_STORED:
        from safetensors.torch import load_file, save_file

        for f in out.glob("*.safetensors"):
            sd = load_file(str(f))
            save_file({k: v for k, v in sd.items() if not k.endswith(NOT_STORED[name])}, str(f), metadata={"format": "pt"})
        index = out / "model.safetensors.index.json"
        if index.is_file():
            import json

            j = json.loads(index.read_text())
            j["weight_map"] = {k: v for k, v in j["weight_map"].items() if not k.endswith(NOT_STORED[name])}
            index.write_text(json.dumps(j, indent=2))
    n = sum(p.numel() for p in model.parameters())
    del model
    return {"out_dir": str(out), "parameters": n, "total_s": round(time.time() - t0, 1)}


def cached(name: str, root=REPO / "build" / "published") -> Path:
    """The `name` folder, built once under `root` and reused (published_layout.cached)."""
    return published_layout.cached(root, name, lambda out: make(name, out), Path(__file__))


if __name__ == "__main__":
    print(make(sys.argv[1], sys.argv[2]))
