"""The training skeleton of the small models mixlens ships; a family is a ``Recipe`` (train/<family>.py).

    .venv/bin/python scripts/train.py mamba2 --measure 20       # time a few steps, save nothing
    .venv/bin/python scripts/train.py mamba2 --minutes 14       # wall-clock budget (how the shipped model was trained)
    .venv/bin/python scripts/train.py mamba --steps 160 --eval-every 40
    .venv/bin/python scripts/train.py qwen3_5 --steps 600 --dry-run   # print the resolved run, train nothing

Every family runs the same steps: read the repo copy of the TinyStories text (common.py), split whole
documents into train / validation, get the tokenizer (trained on the training split, or a saved one),
build the transformers config and model from the arguments, train with the plain CPU loop (AdamW,
warmup + cosine over steps or over a wall-clock budget), save_pretrained with the tokenizer, reload
what was saved, sample greedily and write the README (model card) from the family's template. A
recipe gives the parts that differ: the size arguments and their defaults, the config, the
tokenizer, an optional context around training (Mamba-1's faster training scan), the card.

The shipped models' READMEs record their commands as ``python scripts/train_<family>.py ARGS``
(the per-family scripts this replaced): the same run is ``python scripts/train.py <family> ARGS``.
Wall-clock mode exists because this machine's 2 cores are shared: measured throughput of the same
step ranged from 1.1 to 0.07 steps/s with other people's compiles running, so a step count picked
from a short measurement could not keep the run near its 12-15 minute budget.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mixlens_dev.train import common as tc


@dataclass
class Recipe:
    """The parts of a training run that differ by family."""

    family: str
    model_class: str  # transformers class name
    default_out: Path
    readme: str  # model-card template (str.format fields: see write_card)
    config_keys: list[str]  # config fields listed in the card
    add_args: Callable[[argparse.ArgumentParser], None]  # the size arguments with this family's defaults
    build_config: Callable[[Any, int], Any]  # (args, model vocab size) -> transformers config
    defaults: dict = field(default_factory=dict)  # this family's defaults of the shared arguments
    tokenizer: Callable[[Any, list], Any] | None = None  # (args, train docs) -> tokenizers.Tokenizer; default: train BPE
    model_vocab: Callable[[int], int] = lambda n: n  # embedding rows for a tokenizer of n ids
    wall_clock: bool = True  # --minutes supported
    measure_log_every: int = 5
    training: Callable[[Any, Any], Any] = lambda model, stream: contextlib.nullcontext()
    drop_generation_config: bool = False
    card_fields: Callable[[dict], dict] = lambda f: {}  # extra template fields from the common ones
    params_note: Callable[[Any], str] = lambda config: ""


def recipes() -> dict[str, Recipe]:
    from mixlens_dev.train import mamba, mamba2, qwen3_5

    return {r.family: r for r in (mamba2.RECIPE, mamba.RECIPE, qwen3_5.RECIPE)}


def parser(r: Recipe) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"scripts/train.py {r.family}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None,
                    help="fixed number of steps (cosine over steps); with --minutes, an upper bound")
    if r.wall_clock:
        ap.add_argument("--minutes", type=float, default=None,
                        help="wall-clock training budget; the cosine follows elapsed time")
    ap.add_argument("--measure", type=int, default=0, metavar="N",
                    help="only time N training steps (after the tokenizer) and exit; saves nothing")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved arguments, config and schedule as JSON; train nothing")
    ap.add_argument("--out", type=Path, default=r.default_out)
    r.add_args(ap)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (on a loaded 2-core machine two threads can spin against each other)")
    ap.add_argument("--prompt", default=tc.PROMPT)
    ap.add_argument("--max-size-mb", type=float, default=25.0, help="refuse to save a bigger folder")
    ap.add_argument("--card-only", action="store_true",
                    help="do not train: rewrite README.md of --out from its saved model and the run's "
                         "build/<name>.summary.json (same data/tokenizer arguments as the run)")
    ap.set_defaults(**r.defaults)
    return ap


def train_args(a, measure_log_every: int) -> tc.TrainArgs:
    return tc.TrainArgs(
        steps=a.steps or 10**9, minutes=getattr(a, "minutes", None), batch_size=a.batch_size, seq_len=a.seq_len,
        lr=a.lr, warmup=min(a.warmup, a.steps or a.warmup), weight_decay=a.weight_decay,
        eval_every=0 if a.measure else a.eval_every, seed=a.seed, threads=a.threads,
        log_every=measure_log_every if a.measure else 10,
    )


def main(family: str, argv=None) -> int:
    import torch
    import transformers

    r = recipes()[family]
    ap = parser(r)
    a = ap.parse_args(argv)
    if a.card_only:
        pass
    elif a.measure:
        a.steps = a.measure
        if r.wall_clock:
            a.minutes = None
    elif a.steps is None and getattr(a, "minutes", None) is None:
        ap.error("give --steps N" + (", --minutes M (or both)" if r.wall_clock else "") + ", or --measure N")

    torch.set_num_threads(a.threads)
    tc.set_seed(a.seed)
    t_start = time.time()

    docs = tc.read_documents([tc.DATA_DIR / f for f in tc.DATA_FILES])
    train_docs, val_docs = tc.train_val_split(docs, a.val_fraction, a.seed)
    tok = r.tokenizer(a, train_docs) if r.tokenizer else tc.train_bpe_tokenizer(train_docs, a.vocab)
    train_stream = tc.encode_documents(tok, train_docs)
    val_stream = tc.encode_documents(tok, val_docs)
    val_pct = 100 * sum(map(len, val_docs)) / sum(map(len, docs))
    tok_vocab = tok.get_vocab_size()
    vocab = r.model_vocab(tok_vocab)
    data = dict(docs=docs, train_docs=train_docs, val_docs=val_docs, val_pct=val_pct, tok=tok,
                train_stream=train_stream, val_stream=val_stream, vocab=vocab)
    ids = f"tokenizer {tok_vocab} ids, embedding {vocab} rows" if vocab != tok_vocab else f"vocab {tok_vocab}"
    print(f"{len(docs)} documents ({len(train_docs)} train / {len(val_docs)} val, {val_pct:.1f}% chars); "
          f"{ids}; {len(train_stream)} train / {len(val_stream)} val tokens "
          f"(tokenizer {time.time() - t_start:.1f}s)", flush=True)

    if a.card_only:
        saved = json.loads((a.out / "tokenizer.json").read_text(encoding="utf-8"))
        if saved["model"] != json.loads(tok.to_str())["model"]:
            print("ERROR: the saved tokenizer differs from the one these arguments train", file=sys.stderr)
            return 1
        return write_card(r, a.out, a, data, json.loads(summary_file(a.out).read_text(encoding="utf-8")))

    config = r.build_config(a, vocab)
    targs = train_args(a, r.measure_log_every)
    if a.dry_run:
        print(json.dumps({"family": r.family, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                          "config": json.loads(config.to_json_string(use_diff=False)),
                          "train": {k: v for k, v in vars(targs).items() if k != "history"}},
                         indent=1, sort_keys=True), flush=True)
        return 0
    tc.set_seed(a.seed)
    model = getattr(transformers, r.model_class)(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{r.model_class}: {n_params:,} parameters ({4 * n_params / 1e6:.1f} MB float32){r.params_note(config)}",
          flush=True)

    with r.training(model, train_stream):
        summary = tc.train(model, train_stream, val_stream, targs, log=lambda s: print(s, flush=True))
    steps = summary["steps"]
    print(f"trained {steps} steps in {summary['wall_s']}s = {summary['steps_per_s']} steps/s; "
          f"train loss {summary['final_train_loss']}, val loss {summary['final_val_loss']}", flush=True)
    if a.measure:
        return 0

    out: Path = a.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    if r.drop_generation_config:
        (out / "generation_config.json").unlink(missing_ok=True)
    tc.wrap_tokenizer(tok).save_pretrained(out)
    for f in out.iterdir():  # save_pretrained writes the safetensors file 0600
        f.chmod(0o644)
    summary.update(command=command_line(r, argv), minutes=getattr(a, "minutes", None), warmup=targs.warmup,
                   betas=list(targs.betas), min_lr_ratio=targs.min_lr_ratio, grad_clip=targs.grad_clip,
                   versions=tc.env_versions())
    summary_path = summary_file(out)
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    tc.write_json(summary_path, summary)
    print(f"training summary: {tc.rel(summary_path)}", flush=True)
    rc = write_card(r, out, a, data, summary)
    print(f"total {time.time() - t_start:.0f}s", flush=True)
    return rc


def command_line(r: Recipe, argv) -> str:
    return (f"python scripts/train.py {r.family} " + " ".join(sys.argv[2:] if argv is None else argv)).strip()


def summary_file(out: Path) -> Path:
    """Where a run keeps its summary for --card-only (build/ is not committed)."""
    return tc.REPO / "build" / f"{out.name}.summary.json"


def write_card(r: Recipe, out: Path, a, data: dict, summary: dict) -> int:
    """Reload the saved folder (what a user gets), sample greedily, write README.md."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    sample = tc.greedy_sample(model, hf_tok, a.prompt, max_new_tokens=60)
    print("greedy sample:\n" + sample, flush=True)

    n_train_tok, n_val_tok = len(data["train_stream"]), len(data["val_stream"])
    tok_vocab = data["tok"].get_vocab_size()
    steps = summary["steps"]
    hist = summary["history"]
    best = min(hist, key=lambda h: h["val_loss"])
    cfg = model.config.to_dict()
    config_table = "| key | value |\n|---|---|\n" + "\n".join(f"| `{k}` | `{cfg[k]}` |" for k in r.config_keys)
    tok_per_step = a.batch_size * a.seq_len
    minutes = summary.get("minutes")
    fields = dict(
        params=sum(p.numel() for p in model.parameters()), vocab=data["vocab"], tok_vocab=tok_vocab,
        vocab_last=data["vocab"] - 1, config=model.config, config_table=config_table, command=summary["command"],
        versions=", ".join(f"{k} {v}" for k, v in summary["versions"].items()),
        n_docs=len(data["docs"]), n_train_docs=len(data["train_docs"]), n_val_docs=len(data["val_docs"]),
        val_pct=data["val_pct"], seed=a.seed, n_train_tok=n_train_tok, n_val_tok=n_val_tok,
        n_train_tok_k=round(n_train_tok / 1000), betas=tuple(summary["betas"]), wd=a.weight_decay, lr=a.lr,
        warmup=summary["warmup"], min_lr=a.lr * summary["min_lr_ratio"], clip=summary["grad_clip"], steps=steps,
        batch=a.batch_size, seq=a.seq_len, tok_per_step=tok_per_step, epochs=steps * tok_per_step / n_train_tok,
        threads=a.threads, wall_min=summary["wall_s"] / 60, sps=summary["steps_per_s"],
        train_loss=summary["final_train_loss"], val_loss=summary["final_val_loss"],
        best_val=best["val_loss"], best_step=best["step"],
        history="\n".join(f"| {h['step']} | {h['train_loss_ema']:.3f} | {h['val_loss']:.3f} |" for h in hist),
        prompt=a.prompt, sample=sample, data=data,
        schedule=(f"over a {minutes:g}-minute wall-clock budget (the cosine follows elapsed time, so the "
                  f"step count depends on machine load; rerun with `--steps {steps}` for a fixed schedule)"
                  if minutes is not None else "over the steps"),
    )
    fields.update(r.card_fields(fields))
    # the README lists the folder's files including itself: re-render until its own size is stable
    files = dict(tc.folder_bytes(out), **{"README.md": 0})
    for _ in range(4):
        table = "\n".join(f"| `{k}` | {v:,} |" for k, v in sorted(files.items()))
        text = r.readme.format(files=table, size_mb=sum(files.values()) / 1e6, **fields)
        files["README.md"] = len(text.encode("utf-8"))
    (out / "README.md").write_text(text, encoding="utf-8")

    total = sum(tc.folder_bytes(out).values())
    print(f"saved {tc.rel(out)}: {total / 1e6:.2f} MB: {tc.folder_bytes(out)}", flush=True)
    if total > a.max_size_mb * 1e6:
        print(f"ERROR: folder is {total / 1e6:.1f} MB > {a.max_size_mb} MB", file=sys.stderr)
        return 1
    return 0
