"""The shipped Qwen3.5-style hybrid (models/qwen3_5-tinystories, trained by
scripts/train_qwen3_5.py): the `mixlens generate --greedy` CLI prints exactly the continuation that
transformers' greedy `generate` produces, on real (trained) weights where the argmax margins are
those of a language model rather than of random weights."""

from __future__ import annotations

from pathlib import Path

from mixlens_dev.cli import REPO, cli

MODEL = REPO / "models" / "qwen3_5-tinystories"
PROMPT = "Once upon a time"
N_NEW = 40


def test_cli_greedy_generate_matches_transformers():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert {"linear_attention", "full_attention"} <= set(model.config.layer_types)  # a real hybrid
    enc = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=N_NEW, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    want = PROMPT + tok.decode(new, skip_special_tokens=False)

    r = cli("generate", "--model", MODEL, PROMPT, "--max-new-tokens", N_NEW, "--greedy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == want
    # A trained model continues with words, not a repeated token: guards against comparing two
    # equally degenerate outputs.
    assert len(set(new)) >= 10, want
