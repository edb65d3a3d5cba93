"""Mamba-2 recipe (Mamba2ForCausalLM): models/mamba2-tinystories/, the model mixlens runs by default.

The tokenizer is a GPT-NeoX-style byte-level BPE (4096 ids, ``<|endoftext|>`` = 0) trained on the
training split; transformers' pure torch path on CPU.
"""

from __future__ import annotations

from mixlens_dev.train import Recipe
from mixlens_dev.train import common as tc


def build_config(a, vocab_size: int):
    from transformers import Mamba2Config

    assert (a.expand * a.hidden) % a.head_dim == 0
    return Mamba2Config(
        vocab_size=vocab_size,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        expand=a.expand,
        head_dim=a.head_dim,
        num_heads=a.expand * a.hidden // a.head_dim,
        state_size=a.state_size,
        n_groups=1,
        conv_kernel=4,
        chunk_size=a.chunk_size,
        use_bias=False,
        use_conv_bias=True,
        residual_in_fp32=True,
        layer_norm_epsilon=1e-5,
        time_step_limit=(0.0, float("inf")),
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


README = """# mamba2-tinystories

A small **Mamba-2** language model (`transformers.Mamba2ForCausalLM`, {params:,} parameters,
float32) trained from scratch on CPU on TinyStories text. It is the model `mixlens` runs by default:
small enough to live in the repository ({size_mb:.1f} MB in all), and its greedy output is readable
TinyStories English ({fit_short}). It is a test and demo model, not a useful language model.

""" + tc.CARD_FILES + """
""" + tc.CARD_TOKENIZER + """
""" + tc.CARD_CONFIG + """
## Training

- Command: `{command}` (from the repository root; {versions}).
""" + tc.CARD_DATA + """- Tokenizer trained on the training documents only (`tokenizers` BpeTrainer, vocab {vocab},
  min_frequency 1: with ~200 KB of text, min_frequency 2 stops at ~3,400 ids).
- Optimisation: AdamW (betas {betas}, weight decay {wd} on matrices), peak lr {lr}, {warmup} warmup
  steps then cosine to {min_lr} {schedule}, grad clip {clip}; {steps} steps of {batch} random
  windows of {seq} tokens ({tok_per_step:,} tokens/step, ~{epochs:.0f} passes over the training
  tokens); `torch.set_num_threads({threads})` with `OMP_WAIT_POLICY=PASSIVE`, seed {seed}.
- Wall time: {wall_min:.1f} min of training ({sps:.2f} steps/s) on a 2-core CPU shared with other work.
- Final losses (nats/token): train **{train_loss:.3f}** (model in eval mode over training windows),
  validation **{val_loss:.3f}**. Best validation loss seen: {best_val:.3f} at step {best_step}.
  For scale, count models estimated on the same training tokens score {base_uni:.3f} (add-0.5
  unigram) and {base_bi:.3f} (bigram interpolated 50/50 with it) on the validation tokens.
  {fit_note}

""" + tc.CARD_TAIL


def add_args(ap) -> None:
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state-size", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)


def card_fields(f: dict) -> dict:
    """The fit note: how far the model memorised its text, and the n-gram baselines for scale."""
    data, prompt, sample = f["data"], f["prompt"], f["sample"]
    train_text = "\n\n".join(data["train_docs"])
    continuation = sample[len(prompt):].strip()
    if continuation and (prompt + sample[len(prompt):]).strip() in train_text:
        verbatim = ("The whole sample (prompt and continuation) occurs verbatim in the training text: the model has "
                    "memorised that story.")
    elif continuation and continuation in train_text:
        verbatim = "The continuation occurs verbatim in the training text."
    else:
        verbatim = "The continuation does not occur verbatim in the training text."

    n_train_tok = f["n_train_tok"]
    base = tc.ngram_baselines(data["train_stream"], data["val_stream"], f["vocab"])
    passes = f["epochs"]
    gap = f["val_loss"] - f["train_loss"]
    k_tok = round(n_train_tok / 1000)
    if gap > 0.5:
        fit_note = (f"The gap between validation and train loss ({gap:.2f}) shows the model memorising its ~{k_tok}k "
                    f"training tokens; that is part of why its samples read like the training stories. {verbatim}")
    else:
        fit_note = (f"Train and validation losses are close: {passes:.0f} passes over ~{k_tok}k tokens have not "
                    f"made it memorise the text. {verbatim}")
    if f["val_loss"] > base["unigram"]:
        fit_note += (" On held-out stories it scores worse than the unigram baseline: it is a memoriser, not a "
                     "general model (the real fix is more text; the full TinyStories set is not available offline).")
    fit_short = ("largely memorised from its ~%dk training tokens, see Training" % k_tok if gap > 0.5
                 else "see Training for losses")
    return dict(fit_note=fit_note, fit_short=fit_short, base_uni=base["unigram"], base_bi=base["bigram"])


RECIPE = Recipe(
    family="mamba2", model_class="Mamba2ForCausalLM", default_out=tc.REPO / "models" / "mamba2-tinystories",
    readme=README, add_args=add_args, build_config=build_config, card_fields=card_fields,
    defaults=dict(batch_size=8, seq_len=256, lr=2e-3, warmup=20, eval_every=25, threads=2),
    config_keys=["vocab_size", "hidden_size", "num_hidden_layers", "expand", "num_heads", "head_dim", "state_size",
                 "n_groups", "conv_kernel", "chunk_size", "use_bias", "use_conv_bias", "residual_in_fp32",
                 "layer_norm_epsilon", "time_step_limit", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                 "pad_token_id"],
)
