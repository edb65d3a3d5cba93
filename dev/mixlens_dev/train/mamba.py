"""Mamba-1 recipe (MambaForCausalLM): models/mamba-tinystories/.

Like the published state-spaces checkpoints, the embedding table is padded beyond the tokenizer (to a
multiple of 8 rows), tied to the LM head, and ``time_step_rank`` is "auto" (= ceil(hidden / 16)).
Training swaps transformers' token-loop scan for an equal one that backpropagates ~20x faster
(``training_scan``, checked bit-identical first); the saved model and every reference run use
transformers' own function.
"""

from __future__ import annotations

import contextlib

import torch

from mixlens_dev.train import Recipe
from mixlens_dev.train import common as tc


def training_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                  return_last_state=False, **kwargs):
    """transformers' ``mamba_selective_scan`` token loop, written with ``unbind`` instead of per-token
    indexing. Same operations in the same order (checked bit-identical in ``check_training_scan``),
    but the backward of indexing [B,E,T,N] tensors once per token allocates a full-size gradient
    per token, which made a CPU training step ~20x slower. Training only: the saved model and every
    reference run use transformers' own function."""
    import torch.nn.functional as F

    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = (dt[:, :, :, None] * B.transpose(1, 2)[:, None, :, :].float()) * hidden_states[:, :, :, None].float()
    state = torch.zeros_like(discrete_A[:, :, 0])
    outputs = []
    for a_t, bu_t, c_t in zip(discrete_A.unbind(2), deltaB_u.unbind(2), C.unbind(2)):
        state = a_t * state + bu_t
        outputs.append(torch.matmul(state.to(hidden_states.dtype), c_t.unsqueeze(-1))[..., 0])
    y = torch.stack(outputs, dim=-1)
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return (y, state) if return_last_state else y


def check_training_scan(model, stream: torch.Tensor) -> None:
    """The training scan gives transformers' logits bit for bit (eval mode, no cache)."""
    import transformers.models.mamba.modeling_mamba as mm

    x = stream[: 2 * 65].reshape(2, 65)
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=x, use_cache=False).logits
        original, mm.mamba_selective_scan = mm.mamba_selective_scan, training_scan
        try:
            got = model(input_ids=x, use_cache=False).logits
        finally:
            mm.mamba_selective_scan = original
    model.train()
    assert torch.equal(got, ref), f"training scan differs from transformers' by {(got - ref).abs().max():.3e}"


def padded_vocab(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def build_config(a, vocab_size: int):
    from transformers import MambaConfig

    return MambaConfig(
        vocab_size=vocab_size,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        expand=a.expand,
        state_size=a.state_size,
        conv_kernel=4,
        time_step_rank="auto",
        use_bias=False,
        use_conv_bias=True,
        residual_in_fp32=True,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


README = """# mamba-tinystories

A small **Mamba-1** language model (`transformers.MambaForCausalLM`, {params:,} parameters,
float32) trained from scratch on CPU on TinyStories text: the Mamba-1 model of the `mixlens`
tests and demos ({size_mb:.1f} MB in all). It is a test and demo model, not a useful language
model.

""" + tc.CARD_FILES + """
`tokenizer.json` is a byte-level BPE in the GPT-NeoX layout (no normalizer; `ByteLevel`
pre-tokenizer with the GPT-2 regex and `add_prefix_space=false`; `ByteLevel` post-processor and
decoder), {tok_vocab} ids, `<|endoftext|>` = id 0 = bos = eos = pad = unk. The model's embedding
table has **{vocab} rows**: like the published state-spaces checkpoints (50277 tokenizer ids,
50280 rows) it is padded to a multiple of 8 beyond the tokenizer; rows {tok_vocab}..{vocab_last}
are never produced by the tokenizer. Documents are separated by `<|endoftext|>`; no BOS is added
when encoding a prompt.

""" + tc.CARD_CONFIG + """
`time_step_rank` is "auto" in the config (transformers resolves it to ceil(hidden/16) = {rank} and
writes the number into `config.json`).

## Training

- Command: `{command}` (from the repository root; {versions}).
- Data: `data/text/tinystories/` (see its README): {n_docs} documents ({n_train_docs} train /
  {n_val_docs} validation, validation = random whole documents, ~{val_pct:.0f}% of the
  characters, seed {seed}). {n_train_tok:,} training tokens, {n_val_tok:,} validation tokens.
- Tokenizer trained on the training documents only (`tokenizers` BpeTrainer, vocab {tok_vocab}).
- Optimisation: AdamW (betas {betas}, weight decay {wd} on matrices), peak lr {lr}, {warmup}
  warmup steps then cosine to {min_lr:.2g}, grad clip {clip}; {steps} steps of {batch} random windows
  of {seq} tokens ({tok_per_step:,} tokens/step, ~{epochs:.1f} passes over the training tokens);
  `torch.set_num_threads({threads})`, seed {seed}. The budget was ~10 minutes of training:
  transformers' Mamba-1 torch path scans token by token in Python. For training only,
  `mamba_selective_scan` (the kernel slot transformers fills from `mamba_ssm` when installed) is
  replaced by the same token loop written with `unbind` (`training_scan` in the script), checked
  to give transformers' logits bit for bit before training; indexing per token made each
  backward ~20x slower. The saved model is a plain `MambaForCausalLM` checkpoint.
- Wall time: {wall_min:.1f} min of training ({sps:.2f} steps/s) on a 2-core CPU shared with other work.
- Final losses (nats/token): train **{train_loss:.3f}** (eval mode over training windows),
  validation **{val_loss:.3f}**. Best validation loss seen: {best_val:.3f} at step {best_step}.
  With ~{n_train_tok_k}k training tokens the model overfits (it memorises much of the text, and
  the validation loss rises after the first passes); that is why its samples read like the
  training stories.

""" + tc.CARD_TAIL


def add_args(ap) -> None:
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--state-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4090, help="tokenizer ids (the embedding is padded to a multiple of 8)")


def model_vocab(tok_vocab: int) -> int:
    vocab = padded_vocab(tok_vocab, 8)
    return vocab + 8 if vocab == tok_vocab else vocab  # always leave padding rows, as the published checkpoints do


@contextlib.contextmanager
def training(model, stream):
    import transformers.models.mamba.modeling_mamba as mm

    check_training_scan(model, stream)
    original, mm.mamba_selective_scan = mm.mamba_selective_scan, training_scan
    try:
        yield
    finally:
        mm.mamba_selective_scan = original


RECIPE = Recipe(
    family="mamba", model_class="MambaForCausalLM", default_out=tc.REPO / "models" / "mamba-tinystories",
    readme=README, add_args=add_args, build_config=build_config, model_vocab=model_vocab, training=training,
    wall_clock=False, measure_log_every=2, drop_generation_config=True,
    defaults=dict(steps=400, batch_size=16, seq_len=128, lr=3e-3, warmup=30, eval_every=100, threads=1),
    card_fields=lambda f: dict(rank=f["config"].time_step_rank),
    params_note=lambda config: f", time_step_rank {config.time_step_rank}",
    config_keys=["vocab_size", "hidden_size", "num_hidden_layers", "expand", "intermediate_size", "state_size",
                 "time_step_rank", "conv_kernel", "use_bias", "use_conv_bias", "residual_in_fp32",
                 "layer_norm_epsilon", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"],
)
