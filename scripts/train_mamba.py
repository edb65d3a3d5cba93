#!/usr/bin/env python3
"""Train the small Mamba-1 model mixlens ships: ``models/mamba-tinystories/``.

Same data and tokenizer approach as scripts/train_mamba2.py (train_common.py): the repo copy of the
TinyStories text, a GPT-NeoX-style byte-level BPE trained on the training split, a plain CPU loop,
``save_pretrained`` plus a README with the losses and a greedy sample. The model is
``transformers.MambaForCausalLM`` (pure torch path). Like the published state-spaces checkpoints,
the embedding table is padded beyond the tokenizer (to a multiple of 8 rows), tied to the LM head,
and ``time_step_rank`` is "auto" (= ceil(hidden / 16)).

    .venv/bin/python scripts/train_mamba.py --measure 10     # time a few steps, save nothing
    .venv/bin/python scripts/train_mamba.py --steps 400      # the shipped model
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_common as tc  # noqa: E402

DATA_DIR = tc.REPO / "data" / "text" / "tinystories"
DATA_FILES = ["tinystories_excerpt_niklas6.txt", "tinystories_sample_cs336.txt"]
DEFAULT_OUT = tc.REPO / "models" / "mamba-tinystories"
PROMPT = "Once upon a time, there was a little"


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

## Files

| file | bytes |
|---|---:|
{files}

`tokenizer.json` is a byte-level BPE in the GPT-NeoX layout (no normalizer; `ByteLevel`
pre-tokenizer with the GPT-2 regex and `add_prefix_space=false`; `ByteLevel` post-processor and
decoder), {tok_vocab} ids, `<|endoftext|>` = id 0 = bos = eos = pad = unk. The model's embedding
table has **{vocab} rows**: like the published state-spaces checkpoints (50277 tokenizer ids,
50280 rows) it is padded to a multiple of 8 beyond the tokenizer; rows {tok_vocab}..{vocab_last}
are never produced by the tokenizer. Documents are separated by `<|endoftext|>`; no BOS is added
when encoding a prompt.

## Config

{config_table}

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

| step | train loss (EMA) | val loss |
|---:|---:|---:|
{history}

## Greedy sample

`model.generate(..., do_sample=False, max_new_tokens=60)` on the prompt `{prompt!r}`:

```text
{sample}
```

## Provenance and license

Text: TinyStories (Eldan & Li 2023, dataset `roneneldan/TinyStories`, license CDLA-Sharing-1.0),
the excerpts in `data/text/tinystories/` (see that README for sources and hashes). The weights are
derived from that text; treat them as CDLA-Sharing-1.0. Reproduce with the command above (same seed,
same versions) — bitwise identity across machines is not promised (CPU thread counts and BLAS vary).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--measure", type=int, default=0, metavar="N",
                    help="only time N training steps (after tokenizer training) and exit; saves nothing")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--state-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4090, help="tokenizer ids (the embedding is padded to a multiple of 8)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a loaded 2-core machine two threads spin against each other)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-size-mb", type=float, default=25.0, help="refuse to save a bigger folder")
    a = ap.parse_args(argv)

    from transformers import MambaForCausalLM

    torch.set_num_threads(a.threads)
    tc.set_seed(a.seed)
    t_start = time.time()

    docs = tc.read_documents([DATA_DIR / f for f in DATA_FILES])
    train_docs, val_docs = tc.train_val_split(docs, a.val_fraction, a.seed)
    tok = tc.train_bpe_tokenizer(train_docs, a.vocab)
    train_stream = tc.encode_documents(tok, train_docs)
    val_stream = tc.encode_documents(tok, val_docs)
    val_pct = 100 * sum(map(len, val_docs)) / sum(map(len, docs))
    tok_vocab = tok.get_vocab_size()
    vocab = padded_vocab(tok_vocab, 8)
    if vocab == tok_vocab:
        vocab += 8  # always leave padding rows, as the published checkpoints do
    print(f"{len(docs)} documents ({len(train_docs)} train / {len(val_docs)} val, {val_pct:.1f}% chars); "
          f"tokenizer {tok_vocab} ids, embedding {vocab} rows; {len(train_stream)} train / {len(val_stream)} val "
          f"tokens (tokenizer {time.time() - t_start:.1f}s)", flush=True)

    config = build_config(a, vocab)
    tc.set_seed(a.seed)
    model = MambaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"MambaForCausalLM: {n_params:,} parameters ({4 * n_params / 1e6:.1f} MB float32), "
          f"time_step_rank {config.time_step_rank}", flush=True)

    import transformers.models.mamba.modeling_mamba as mm

    check_training_scan(model, train_stream)
    original_scan, mm.mamba_selective_scan = mm.mamba_selective_scan, training_scan

    steps = a.measure or a.steps
    targs = tc.TrainArgs(
        steps=steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, warmup=min(a.warmup, steps),
        weight_decay=a.weight_decay, eval_every=0 if a.measure else a.eval_every, seed=a.seed,
        threads=a.threads, log_every=2 if a.measure else 10,
    )
    summary = tc.train(model, train_stream, val_stream, targs, log=lambda s: print(s, flush=True))
    mm.mamba_selective_scan = original_scan
    print(f"trained {steps} steps in {summary['wall_s']}s = {summary['steps_per_s']} steps/s; "
          f"train loss {summary['final_train_loss']}, val loss {summary['final_val_loss']}", flush=True)
    if a.measure:
        return 0

    out: Path = a.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    hf_tok = tc.wrap_tokenizer(tok)
    hf_tok.save_pretrained(out)

    # Reload from disk (what a user gets) and sample greedily.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m2 = AutoModelForCausalLM.from_pretrained(out).eval()
    t2 = AutoTokenizer.from_pretrained(out)
    sample = tc.greedy_sample(m2, t2, a.prompt, max_new_tokens=60)
    print("greedy sample:\n" + sample, flush=True)

    hist = summary["history"]
    best = min(hist, key=lambda h: h["val_loss"])
    cfg = config.to_dict()
    keys = ["vocab_size", "hidden_size", "num_hidden_layers", "expand", "intermediate_size", "state_size",
            "time_step_rank", "conv_kernel", "use_bias", "use_conv_bias", "residual_in_fp32", "layer_norm_epsilon",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"]
    config_table = "| key | value |\n|---|---|\n" + "\n".join(f"| `{k}` | `{cfg[k]}` |" for k in keys)
    cmd = "python scripts/train_mamba.py " + " ".join(sys.argv[1:] if argv is None else argv)
    tok_per_step = a.batch_size * a.seq_len
    readme_args = dict(
        params=n_params, tok_vocab=tok_vocab, vocab=vocab, vocab_last=vocab - 1, rank=config.time_step_rank,
        config_table=config_table, command=cmd.strip(),
        versions=", ".join(f"{k} {v}" for k, v in tc.env_versions().items()),
        n_docs=len(docs), n_train_docs=len(train_docs), n_val_docs=len(val_docs), val_pct=val_pct, seed=a.seed,
        n_train_tok=len(train_stream), n_val_tok=len(val_stream), n_train_tok_k=round(len(train_stream) / 1000),
        betas=targs.betas, wd=a.weight_decay, lr=a.lr, warmup=targs.warmup, min_lr=a.lr * targs.min_lr_ratio,
        clip=targs.grad_clip, steps=steps, batch=a.batch_size, seq=a.seq_len, tok_per_step=tok_per_step,
        epochs=steps * tok_per_step / len(train_stream), threads=a.threads,
        wall_min=summary["wall_s"] / 60, sps=summary["steps_per_s"],
        train_loss=summary["final_train_loss"], val_loss=summary["final_val_loss"],
        best_val=best["val_loss"], best_step=best["step"],
        history="\n".join(f"| {h['step']} | {h['train_loss_ema']:.3f} | {h['val_loss']:.3f} |" for h in hist),
        prompt=a.prompt, sample=sample,
    )
    # The README lists the folder's files including itself: render until its own size is stable.
    files = dict(tc.folder_bytes(out), **{"README.md": 0})
    for _ in range(3):
        table = "\n".join(f"| `{k}` | {v:,} |" for k, v in sorted(files.items()))
        text = README.format(files=table, size_mb=sum(files.values()) / 1e6, **readme_args)
        files["README.md"] = len(text.encode("utf-8"))
    (out / "README.md").write_text(text, encoding="utf-8")

    total = sum(tc.folder_bytes(out).values())
    print(f"saved {tc.rel(out)}: {total / 1e6:.2f} MB: {tc.folder_bytes(out)}", flush=True)
    if total > a.max_size_mb * 1e6:
        print(f"ERROR: folder is {total / 1e6:.1f} MB > {a.max_size_mb} MB", file=sys.stderr)
        return 1
    print(f"total {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
