"""Shared pieces for training the small models mixlens ships (the skeleton: __init__.py): reading the repo's copy of the training text, splitting it into
documents, training a GPT-NeoX-style byte-level BPE tokenizer, a plain CPU training loop,
saving with ``save_pretrained`` and a greedy sample.

Everything reads from the repository (``data/text/...``); nothing here touches ../shared.
Only transformers, tokenizers and torch are used (pure torch path, no CUDA kernels).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

# The machine's cores are shared with other work (compiles). With OpenMP's default busy-waiting,
# 2 torch threads on an oversubscribed 2-core box ran ~3x slower than 1 thread (0.067 vs 0.20
# steps/s measured here); passive waiting removes that. Must be set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
DATA_DIR = REPO / "data" / "text" / "tinystories"
DATA_FILES = ["tinystories_excerpt_niklas6.txt", "tinystories_sample_cs336.txt"]
PROMPT = "Once upon a time, there was a little"

# Sections the model cards share (str.format fields: files, config_table, vocab, n_docs, ...).
CARD_FILES = """## Files

| file | bytes |
|---|---:|
{files}
"""
CARD_CONFIG = """## Config

{config_table}
"""
CARD_TOKENIZER = """`tokenizer.json` is a byte-level BPE in the GPT-NeoX layout (no normalizer; `ByteLevel`
pre-tokenizer with the GPT-2 regex and `add_prefix_space=false`; `ByteLevel` post-processor and
decoder), {vocab} ids, `<|endoftext|>` = id 0 = bos = eos = pad = unk. Documents are separated by
`<|endoftext|>`; no BOS is added when encoding a prompt.
"""
CARD_DATA = """- Data: `data/text/tinystories/` (copied verbatim from the TinyStories excerpts described in
  `data/text/tinystories/README.md`): {n_docs} documents ({n_train_docs} train / {n_val_docs}
  validation, validation = random whole documents, ~{val_pct:.0f}% of the characters, seed {seed}).
  {n_train_tok:,} training tokens, {n_val_tok:,} validation tokens with this tokenizer.
"""
# The end of every model card (after the family's Training section): the loss history, the greedy
# sample and the data's provenance (str.format fields: history, prompt, sample).
CARD_TAIL = """| step | train loss (EMA) | val loss |
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
EOT = "<|endoftext|>"

# GPT-2 / GPT-NeoX pre-tokenization regex; tokenizers' ByteLevel(use_regex=True) applies exactly
# this pattern, it is written out here for the record (README and tests).
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# --------------------------------------------------------------------------------------- data

# A paragraph that opens like this starts a new TinyStories story. The niklas6 excerpt separates
# paragraphs by blank lines but does not mark story boundaries; these openers are how nearly every
# TinyStories story begins, so they recover most boundaries (some stories stay glued to the
# previous one, which only means a missing <|endoftext|> there).
STORY_OPENER = re.compile(
    r"^(Once upon a time|Once,? there (was|were|lived)|Once,? (a|an|in) |There once (was|were|lived)"
    r"|Long ago|One day, (a|an|there) )"
)


def split_paragraph_stories(text: str) -> list[str]:
    """Split text whose paragraphs are separated by blank lines into stories (heuristic)."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    docs: list[list[str]] = []
    for p in paras:
        if not docs or STORY_OPENER.match(p):
            docs.append([p])
        else:
            docs[-1].append(p)
    return ["\n\n".join(d) for d in docs]


def split_eot_stories(text: str) -> list[str]:
    """Split text whose documents are already separated by <|endoftext|>."""
    return [d.strip() for d in text.split(EOT) if d.strip()]


def read_documents(paths: list[Path]) -> list[str]:
    """Documents from the repo copies: files containing <|endoftext|> are split on it, others with
    the paragraph heuristic. Order is preserved (file order, then document order)."""
    docs: list[str] = []
    for p in paths:
        text = p.read_text(encoding="utf-8")
        docs.extend(split_eot_stories(text) if EOT in text else split_paragraph_stories(text))
    return docs


def train_val_split(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Hold out whole documents, chosen at random (fixed seed) until ~val_fraction of the chars."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    total = sum(len(d) for d in docs)
    val_idx: set[int] = set()
    acc = 0
    for i in order:
        if acc >= val_fraction * total:
            break
        val_idx.add(i)
        acc += len(docs[i])
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


# ---------------------------------------------------------------------------------- tokenizer

def train_bpe_tokenizer(texts: list[str], vocab_size: int, min_frequency: int = 1):
    """GPT-NeoX-style byte-level BPE: no normalizer, ByteLevel pre-tokenizer (GPT-2 regex,
    add_prefix_space=False), ByteLevel post-processor and decoder. <|endoftext|> is id 0, the 256
    byte symbols follow, then the merges. Returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers every input
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # decoders.ByteLevel() takes no options and serializes add_prefix_space=true; the flag does
    # nothing when decoding, but GPT-NeoX's file says false, so write it the same way.
    spec = json.loads(tok.to_str())
    spec["decoder"]["add_prefix_space"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.token_to_id(EOT) == 0, "<|endoftext|> must be id 0"
    return tok


def wrap_tokenizer(tok):
    """A transformers fast tokenizer around ``tok`` (so AutoTokenizer loads the saved folder)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tok, docs: list[str]) -> torch.Tensor:
    """One token stream: <|endoftext|> doc <|endoftext|> doc ... <|endoftext|> (int64)."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = [eot]
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------- training

@dataclass
class TrainArgs:
    steps: int  # number of steps; with `minutes`, only an upper bound
    minutes: float | None = None  # wall-clock budget: the cosine follows elapsed time, stop when spent
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    seed: int = 1234
    threads: int = 2
    log_every: int = 10
    history: list = field(default_factory=list)


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def lr_at(step: int, progress: float, a: TrainArgs) -> float:
    """Linear warmup over `warmup` steps, then cosine from lr down to lr*min_lr_ratio as `progress`
    goes 0 -> 1 (progress = step/steps, or elapsed/budget in the wall-clock mode)."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, max(0.0, progress))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, a: TrainArgs) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (no decay on norms, biases, A_log, D, dt_bias)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "conv1d" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": a.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=a.lr, betas=a.betas)


def random_windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, max_batches: int, batch: int = 8) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the stream."""
    model.eval()
    n = (len(stream) - 1) // seq_len
    windows = [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    if not windows:  # stream shorter than one window
        windows = [stream]
    windows = windows[: max_batches * batch]
    tot, cnt = 0.0, 0
    for i in range(0, len(windows), batch):
        x = torch.stack(windows[i : i + batch])  # all windows have the same length
        out = model(input_ids=x[:, :-1], use_cache=False)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
        )
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def train(model, train_stream: torch.Tensor, val_stream: torch.Tensor, a: TrainArgs, log=print) -> dict:
    """Plain loop: random windows of seq_len+1 tokens, mean next-token cross-entropy.

    Step mode (``minutes`` None): exactly ``steps`` steps, cosine over steps (reproducible).
    Wall-clock mode: after warmup the cosine follows elapsed/budget and training stops when the
    budget is spent (or at ``steps``); the step count then depends on machine load and is
    reported. Returns a summary dict (losses, wall time, steps, steps/s, eval history)."""
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(a.seed)
    opt = make_optimizer(model, a)
    model.train()
    budget = None if a.minutes is None else 60.0 * a.minutes
    t0 = time.time()
    ema = None
    last_val = None
    done = 0
    for step in range(a.steps):
        elapsed = time.time() - t0
        if budget is not None and step > 0 and elapsed >= budget:
            break
        progress = (elapsed / budget) if budget is not None else (step - a.warmup) / max(1, a.steps - a.warmup)
        lr = lr_at(step, progress, a)
        for g in opt.param_groups:
            g["lr"] = lr
        x = random_windows(train_stream, a.batch_size, a.seq_len + 1, gen)
        out = model(input_ids=x[:, :-1], use_cache=False)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        lv = loss.item()
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        done = step + 1
        if done % a.log_every == 0 or done == a.steps:
            el = time.time() - t0
            log(f"step {done} loss {lv:.4f} ema {ema:.4f} lr {lr:.2e} {done / el:.3f} steps/s elapsed {el:.0f}s")
        if a.eval_every and done % a.eval_every == 0:
            last_val = evaluate(model, val_stream, a.seq_len, a.eval_batches)
            a.history.append({"step": done, "train_loss_ema": round(ema, 4), "val_loss": round(last_val, 4),
                              "elapsed_s": round(time.time() - t0, 1)})
            log(f"  eval step {done}: val loss {last_val:.4f} (train ema {ema:.4f})")
    wall = time.time() - t0
    if not a.history or a.history[-1]["step"] != done:
        last_val = evaluate(model, val_stream, a.seq_len, a.eval_batches)
        a.history.append({"step": done, "train_loss_ema": round(ema, 4), "val_loss": round(last_val, 4),
                          "elapsed_s": round(wall, 1)})
        log(f"  eval step {done}: val loss {last_val:.4f} (train ema {ema:.4f})")
    model.eval()
    final_train = evaluate(model, train_stream, a.seq_len, a.eval_batches * 4)
    return {
        "steps": done,
        "wall_s": round(wall, 1),
        "steps_per_s": round(done / wall, 3),
        "final_train_loss": round(final_train, 4),
        "final_train_loss_ema": round(ema, 4),
        "final_val_loss": round(last_val, 4) if last_val is not None else None,
        "history": a.history,
    }


def ngram_baselines(train_stream: torch.Tensor, val_stream: torch.Tensor, vocab_size: int) -> dict[str, float]:
    """Validation loss (nats/token) of count models estimated on the training tokens, for scale:
    add-0.5 unigram, and a bigram interpolated 50/50 with that unigram."""
    from collections import Counter

    tr, va = train_stream.tolist(), val_stream.tolist()
    uni = Counter(tr)
    bi = Counter(zip(tr, tr[1:]))

    def p_uni(t: int) -> float:
        return (uni[t] + 0.5) / (len(tr) + 0.5 * vocab_size)

    n = len(va) - 1
    lu = sum(-math.log(p_uni(t)) for t in va[1:]) / n
    lb = sum(-math.log(0.5 * (bi[(p, t)] / uni[p] if uni[p] else 0.0) + 0.5 * p_uni(t)) for p, t in zip(va, va[1:])) / n
    return {"unigram": round(lu, 3), "bigram": round(lb, 3)}


# ------------------------------------------------------------------------------ save / sample

def greedy_sample(model, hf_tok, prompt: str, max_new_tokens: int = 60) -> str:
    enc = hf_tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=hf_tok.pad_token_id, eos_token_id=hf_tok.eos_token_id,
        )
    return hf_tok.decode(out[0], skip_special_tokens=False)


def folder_bytes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def env_versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "python": os.sys.version.split()[0]}
