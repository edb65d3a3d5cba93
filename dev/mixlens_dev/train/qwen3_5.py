"""Qwen3.5-style hybrid recipe (Qwen3_5ForCausalLM): models/qwen3_5-tinystories/.

Gated DeltaNet and softmax-attention blocks mixed by ``layer_types`` (default [linear, linear,
linear, full]). Sizes are small on purpose (hidden 128, head dims 32, 128-token windows): the first
attempt at hidden 256 / head dim 64 / batch 8 x 128 ran at 0.03-0.05 steps/s on the shared 2-core
machine, too slow to train in a quarter of an hour. The tokenizer is the Mamba-2 model's file
(models/mamba2-tinystories/tokenizer.json) reused verbatim, so both shipped models tokenize the
same way and the BPE is not retrained.
"""

from __future__ import annotations

from pathlib import Path

from mixlens_dev.train import Recipe
from mixlens_dev.train import common as tc

TOKENIZER = tc.REPO / "models" / "mamba2-tinystories" / "tokenizer.json"


def build_config(a, vocab_size: int):
    from transformers import Qwen3_5TextConfig

    layer_types = [t.strip() for t in a.layer_types.split(",")]
    assert len(layer_types) == a.layers, "--layer-types needs one entry per layer"
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        layer_types=layer_types,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        linear_num_key_heads=a.linear_key_heads,
        linear_num_value_heads=a.linear_value_heads,
        linear_key_head_dim=a.linear_head_dim,
        linear_value_head_dim=a.linear_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


README = """# qwen3_5-tinystories

A small **Qwen3.5-style hybrid** language model (`transformers.Qwen3_5ForCausalLM`: gated
DeltaNet blocks and gated softmax-attention blocks mixed by `layer_types`, {params:,} parameters,
float32) trained from scratch on CPU on TinyStories text. It is mixlens' real-input check for the
hybrid families: small enough to live in the repository ({size_mb:.1f} MB in all), trained enough to write
TinyStories-like English. It is a test and demo model, not a useful language model.

""" + tc.CARD_FILES + """
""" + tc.CARD_TOKENIZER + """
""" + tc.CARD_CONFIG + """
## Training

- Command: `{command}` (from the repository root; {versions}).
""" + tc.CARD_DATA + """- Tokenizer: `models/mamba2-tinystories/tokenizer.json` reused verbatim (trained there on the same
  training documents, `tokenizers` BpeTrainer, vocab {vocab}).
- Optimisation: AdamW (betas {betas}, weight decay {wd} on matrices), peak lr {lr}, {warmup} warmup
  steps then cosine to {min_lr} {schedule}, grad clip {clip}; {steps} steps of {batch} random windows of
  {seq} tokens ({tok_per_step:,} tokens/step, ~{epochs:.0f} passes over the training tokens);
  `torch.set_num_threads({threads})` with `OMP_WAIT_POLICY=PASSIVE`, seed {seed}.
- Wall time: {wall_min:.1f} min of training ({sps:.2f} steps/s) on a 2-core CPU shared with other work.
- Final losses (nats/token): train **{train_loss:.3f}** (model in eval mode over training windows),
  validation **{val_loss:.3f}**. Best validation loss seen: {best_val:.3f} at step {best_step}.
  With ~{n_train_tok_k}k training tokens the model overfits (memorises much of the text); that is
  why its samples read like the training stories.

""" + tc.CARD_TAIL


def add_args(ap) -> None:
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER,
                    help="tokenizer.json to reuse (default: the Mamba-2 model's)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-types", default="linear_attention,linear_attention,linear_attention,full_attention")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--linear-key-heads", type=int, default=4)
    ap.add_argument("--linear-value-heads", type=int, default=4)
    ap.add_argument("--linear-head-dim", type=int, default=32)


def tokenizer(a, train_docs):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(a.tokenizer))
    assert tok.token_to_id(tc.EOT) == 0, "<|endoftext|> must be id 0"
    return tok


RECIPE = Recipe(
    family="qwen3_5", model_class="Qwen3_5ForCausalLM", default_out=tc.REPO / "models" / "qwen3_5-tinystories",
    readme=README, add_args=add_args, build_config=build_config, tokenizer=tokenizer,
    defaults=dict(batch_size=8, seq_len=128, lr=2e-3, warmup=30, eval_every=50, threads=2),
    config_keys=["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                 "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                 "pad_token_id"],
)
