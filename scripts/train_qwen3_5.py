#!/usr/bin/env python3
"""Train the small Qwen3.5-style hybrid mixlens ships: ``models/qwen3_5-tinystories/``.

A ``transformers.Qwen3_5ForCausalLM`` (gated DeltaNet and softmax-attention blocks mixed by
``layer_types``, default [linear, linear, linear, full]) trained from scratch on CPU (pure torch
kernels) on the repo's TinyStories text, with the same byte-level BPE tokenizer recipe as the
Mamba-2 model (scripts/train_common.py). Saves with ``save_pretrained`` plus the tokenizer, a
README with the losses and a greedy sample.

    .venv/bin/python scripts/train_qwen3_5.py --measure 10    # time a few steps, save nothing
    .venv/bin/python scripts/train_qwen3_5.py --minutes 15    # wall-clock budget (how the shipped model was trained)
    .venv/bin/python scripts/train_qwen3_5.py --steps 600     # fixed step count (reproducible schedule)

Sizes are small on purpose (hidden 128, head dims 32, 128-token windows): the first attempt at
hidden 256 / head dim 64 / batch 8 x 128 ran at 0.03-0.05 steps/s on the shared 2-core machine,
too slow to train in a quarter of an hour. The tokenizer is the Mamba-2 model's file
(models/mamba2-tinystories/tokenizer.json) reused verbatim, so both shipped models tokenize the
same way and the BPE is not retrained.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_common.py; before torch starts OpenMP

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_common as tc  # noqa: E402

DATA_DIR = tc.REPO / "data" / "text" / "tinystories"
DATA_FILES = ["tinystories_excerpt_niklas6.txt", "tinystories_sample_cs336.txt"]
DEFAULT_OUT = tc.REPO / "models" / "qwen3_5-tinystories"
PROMPT = "Once upon a time, there was a little"
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

## Files

| file | bytes |
|---|---:|
{files}

`tokenizer.json` is a byte-level BPE in the GPT-NeoX layout (no normalizer; `ByteLevel`
pre-tokenizer with the GPT-2 regex and `add_prefix_space=false`; `ByteLevel` post-processor and
decoder), {vocab} ids, `<|endoftext|>` = id 0 = bos = eos = pad = unk. Documents are separated by
`<|endoftext|>`; no BOS is added when encoding a prompt.

## Config

{config_table}

## Training

- Command: `{command}` (from the repository root; {versions}).
- Data: `data/text/tinystories/` (copied verbatim from the TinyStories excerpts described in
  `data/text/tinystories/README.md`): {n_docs} documents ({n_train_docs} train / {n_val_docs}
  validation, validation = random whole documents, ~{val_pct:.0f}% of the characters, seed {seed}).
  {n_train_tok:,} training tokens, {n_val_tok:,} validation tokens with this tokenizer.
- Tokenizer: `models/mamba2-tinystories/tokenizer.json` reused verbatim (trained there on the same
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
the excerpts in `data/text/tinystories/` (see that README for sources and hashes). The excerpt
keeps TinyStories' own mojibake (`â€œ`, `â€™`, ...) in a few stories. The weights are derived from
that text; treat them as CDLA-Sharing-1.0. Reproduce with the command above (same seed, same
versions) — bitwise identity across machines is not promised (CPU thread counts and BLAS vary).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None,
                    help="fixed number of steps (cosine over steps); with --minutes, an upper bound")
    ap.add_argument("--minutes", type=float, default=None,
                    help="wall-clock training budget; the cosine follows elapsed time")
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER,
                    help="tokenizer.json to reuse (default: the Mamba-2 model's)")
    ap.add_argument("--measure", type=int, default=0, metavar="N",
                    help="only time N training steps (after tokenizer training) and exit; saves nothing")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
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
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-size-mb", type=float, default=25.0, help="refuse to save a bigger folder")
    a = ap.parse_args(argv)
    if a.measure:
        a.steps, a.minutes = a.measure, None
    elif a.steps is None and a.minutes is None:
        ap.error("give --steps N, --minutes M (or both), or --measure N")

    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM

    torch.set_num_threads(a.threads)
    tc.set_seed(a.seed)
    t_start = time.time()

    docs = tc.read_documents([DATA_DIR / f for f in DATA_FILES])
    train_docs, val_docs = tc.train_val_split(docs, a.val_fraction, a.seed)
    tok = Tokenizer.from_file(str(a.tokenizer))
    assert tok.token_to_id(tc.EOT) == 0, "<|endoftext|> must be id 0"
    train_stream = tc.encode_documents(tok, train_docs)
    val_stream = tc.encode_documents(tok, val_docs)
    val_pct = 100 * sum(map(len, val_docs)) / sum(map(len, docs))
    print(f"{len(docs)} documents ({len(train_docs)} train / {len(val_docs)} val, {val_pct:.1f}% chars); "
          f"vocab {tok.get_vocab_size()}; {len(train_stream)} train / {len(val_stream)} val tokens "
          f"(tokenizer {time.time() - t_start:.1f}s)", flush=True)

    config = build_config(a, tok.get_vocab_size())
    tc.set_seed(a.seed)
    model = Qwen3_5ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Qwen3_5ForCausalLM: {n_params:,} parameters ({4 * n_params / 1e6:.1f} MB float32)", flush=True)

    targs = tc.TrainArgs(
        steps=a.steps or 10**9, minutes=a.minutes, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
        warmup=min(a.warmup, a.steps or a.warmup),
        weight_decay=a.weight_decay, eval_every=0 if a.measure else a.eval_every, seed=a.seed,
        threads=a.threads, log_every=5 if a.measure else 10,
    )
    summary = tc.train(model, train_stream, val_stream, targs, log=lambda s: print(s, flush=True))
    steps = summary["steps"]
    print(f"trained {steps} steps in {summary['wall_s']}s = {summary['steps_per_s']} steps/s; "
          f"train loss {summary['final_train_loss']}, val loss {summary['final_val_loss']}", flush=True)
    if a.measure:
        return 0

    # ---- save
    out: Path = a.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    hf_tok = tc.wrap_tokenizer(tok)
    hf_tok.save_pretrained(out)
    for f in out.iterdir():  # save_pretrained writes the safetensors file 0600
        f.chmod(0o644)

    # ---- reload from disk (what a user gets) and sample greedily
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m2 = AutoModelForCausalLM.from_pretrained(out)
    t2 = AutoTokenizer.from_pretrained(out)
    m2.eval()
    sample = tc.greedy_sample(m2, t2, a.prompt, max_new_tokens=60)
    print("greedy sample:\n" + sample, flush=True)

    hist = summary["history"]
    best = min(hist, key=lambda h: h["val_loss"])
    cfg = config.to_dict()
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"]
    config_table = "| key | value |\n|---|---|\n" + "\n".join(f"| `{k}` | `{cfg[k]}` |" for k in keys)
    cmd = "python scripts/train_qwen3_5.py " + " ".join(sys.argv[1:] if argv is None else argv)
    tok_per_step = a.batch_size * a.seq_len
    files_before = tc.folder_bytes(out)
    readme_args = dict(
        params=n_params, vocab=tok.get_vocab_size(), config_table=config_table, command=cmd.strip(),
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
        schedule=(f"over a {a.minutes:g}-minute wall-clock budget (the cosine follows elapsed time, so the "
                  f"step count depends on machine load; rerun with `--steps {steps}` for a fixed schedule)"
                  if a.minutes is not None else "over the steps"),
    )
    # the README lists the folder's files including itself: render twice so its own size is right
    files = dict(files_before, **{"README.md": 0})
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
