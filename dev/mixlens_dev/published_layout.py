#!/usr/bin/env python3
"""Build a random-weight stand-in for the published ``AntonV/mamba2-130m-hf`` checkpoint.

No trained Mamba-2 checkpoint is available offline, but the runtime must load the published
layout: a 24-layer, 768-wide model whose config, tensor names, shapes and dtype are those of the
real upload, next to the gpt-neox-20b ``tokenizer.json``. ``make(out_dir)`` creates
``Mamba2ForCausalLM`` with exactly the published config and random weights, saves it with
``save_pretrained`` (float32, ~516 MB: do NOT commit it; write it under /tmp or build/), and copies
the tokenizer next to it.

    .venv/bin/python -m mixlens_dev.published_layout build/mamba2-130m-layout
    .venv/bin/python -m mixlens_dev.published_layout /tmp/m2pub --verbatim-config

``cached_layout()``, ``cached_mamba1_130m()`` and ``cached_qwen3_5_0_8b()`` build each layout once under
build/ (never committed) for the tests and the benches and reuse it: the folder name carries a hash of
this file (an edit rebuilds) and a marker written last keeps a half-built copy from passing.

Where every config value comes from
-----------------------------------
The real file (``config.json`` of AntonV/mamba2-130m-hf, snapshot 05e8773fc4ac1cd067e8a18a5c45372ce5178405,
756 bytes per the hub's file listing) could not be fetched here. It was written by transformers'
``convert_mamba2_ssm_checkpoint_to_pytorch.py`` from ``state-spaces/mamba2-130m``'s mamba_ssm
config ``{"d_model": 768, "n_layer": 24, "vocab_size": 50277, "pad_vocab_size_multiple": 16,
"ssm_cfg": {"layer": "Mamba2"}, "rms_norm": true, "residual_in_fp32": true, "tie_embeddings": true, ...}``.
That script starts from ``Mamba2Config()`` (defaults of the time) and overrides:

- ``hidden_size`` 768 = ``d_model``; ``num_hidden_layers`` 24 = ``n_layer``      (mamba_ssm config)
- ``num_heads`` 24 = hidden_size * expand // head_dim = 768*2//64                   (script formula)
- ``n_groups`` 1 = ``config_ssm.get("n_groups", 1)``                                 (script; key absent)
- ``residual_in_fp32`` true = ``residual_in_fp32``; ``tie_word_embeddings`` true = ``tie_embeddings``
- ``pad_token_id`` = ``bos_token_id`` = ``eos_token_id`` = 0                          (script, non-Codestral)
- ``vocab_size`` 50288 = 50277 padded up to a multiple of ``pad_vocab_size_multiple`` 16 (script)

and keeps these ``Mamba2Config`` defaults: ``expand`` 2, ``head_dim`` 64, ``state_size`` 128,
``conv_kernel`` 4, ``chunk_size`` 256, ``layer_norm_epsilon`` 1e-5, ``use_bias`` false,
``use_conv_bias`` true, ``hidden_act`` "silu", ``initializer_range`` 0.1, ``rms_norm`` true,
``rescale_prenorm_residual`` false, ``time_step_min`` 0.001, ``time_step_max`` 0.1,
``time_step_floor`` 1e-4, ``time_step_limit`` [0.0, inf], ``use_cache`` true.

- ``time_step_rank`` 256, not 48: ``Mamba2Config()`` computed ceil(4096/16) = 256 from its default
  hidden_size 4096 when constructed, and the script never recomputed it after setting 768. The
  same 256 appears in the mamba2-2.7b-hf config (hidden 2560) quoted verbatim in an MLX-Swift test.
  Mamba-2 has no dt projection, so transformers never uses this value for a shape.
- No ``architectures`` key: the script saves the config with ``hf_config.save_pretrained`` (config
  only); vLLM's tests say of this checkpoint "this checkpoint's config has no `architectures` entry".
- No ``norm_before_gate`` key: one version of the script sets it, but the published file is 756
  bytes, which the key set below reproduces exactly without it (785 with it); the 370m and 1.3b
  uploads (757 bytes each) match the same key set with their widths. transformers 5.x has no such
  field (the gated RMSNorm is applied after the gate, i.e. norm_before_gate=False, hard-wired).

Facts also given in the project brief (hidden 768, 24 layers, expand 2, head_dim 64, 24 heads,
state 128, 1 group, conv 4, chunk 256, vocab 50288, eps 1e-5, time_step_limit [0, inf], no bias,
conv bias, residual fp32, tied embeddings, bos=eos=pad=0) all agree with the above.

Serialisation: transformers 5.18's ``save_pretrained`` writes ``architectures``, ``dtype`` and the
infinite limit as ``{"__float__": "Infinity"}``; the 2024 file has no ``architectures`` and a bare
``Infinity`` literal (Python's json). ``verbatim_config=True`` replaces config.json with the
reconstructed 756-byte published text (``PUBLISHED_CONFIG_JSON``) so loaders can be tested on
both spellings; the values are the same either way. The ``transformers_version`` in that text
("4.45.0.dev0") is the one field not pinned down (any ``4.4x.0.dev0`` gives the same 756 bytes).

Tokenizer: ``tokenizer.json`` of gpt-neox-20b (same tokens/merges as the hub copy, see its README),
from ``tests/fixtures/tokenizer/gpt-neox-20b/tokenizer.json`` in this repo, or, where that fixture
is absent, from ``../shared/data/tokenizers/gpt-neox-20b/tokenizer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from mixlens_dev.common import REPO  # noqa: E402
TOKENIZER_CANDIDATES = [
    REPO / "tests" / "fixtures" / "tokenizer" / "gpt-neox-20b" / "tokenizer.json",
    REPO.parent / "shared" / "data" / "tokenizers" / "gpt-neox-20b" / "tokenizer.json",
]

# Every key of the published config.json, with its value (see the module docstring for sources).
PUBLISHED_CONFIG = {
    "bos_token_id": 0,
    "chunk_size": 256,
    "conv_kernel": 4,
    "eos_token_id": 0,
    "expand": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 768,
    "initializer_range": 0.1,
    "layer_norm_epsilon": 1e-05,
    "model_type": "mamba2",
    "n_groups": 1,
    "num_heads": 24,
    "num_hidden_layers": 24,
    "pad_token_id": 0,
    "rescale_prenorm_residual": False,
    "residual_in_fp32": True,
    "rms_norm": True,
    "state_size": 128,
    "tie_word_embeddings": True,
    "time_step_floor": 0.0001,
    "time_step_limit": [0.0, float("inf")],
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "time_step_rank": 256,
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "vocab_size": 50288,
}
PUBLISHED_TRANSFORMERS_VERSION = "4.45.0.dev0"  # not pinned down; see docstring
PUBLISHED_CONFIG_JSON = json.dumps(
    dict(PUBLISHED_CONFIG, transformers_version=PUBLISHED_TRANSFORMERS_VERSION), indent=2, sort_keys=True
) + "\n"
assert len(PUBLISHED_CONFIG_JSON.encode()) == 756  # the hub lists config.json at 756 bytes


def published_config():
    from transformers import Mamba2Config

    kwargs = {k: v for k, v in PUBLISHED_CONFIG.items() if k != "model_type"}
    kwargs["time_step_limit"] = tuple(kwargs["time_step_limit"])
    return Mamba2Config(**kwargs)


def find_tokenizer() -> Path:
    for p in TOKENIZER_CANDIDATES:
        if p.is_file():
            return p
    raise FileNotFoundError("gpt-neox-20b tokenizer.json not found in: " + ", ".join(map(str, TOKENIZER_CANDIDATES)))


def make(out_dir, *, seed: int = 0, verbatim_config: bool = False, tokenizer_json=None) -> dict:
    """Write a random-weight Mamba2ForCausalLM with the published AntonV/mamba2-130m-hf config
    (float32, save_pretrained) plus the gpt-neox-20b tokenizer.json into ``out_dir``.
    Returns a dict with the paths, file sizes, parameter count and timings (seconds)."""
    import torch
    from transformers import Mamba2ForCausalLM

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = published_config()
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(config).to(torch.float32).eval()
    t_init = time.time() - t0
    model.save_pretrained(out)
    t_save = time.time() - t0 - t_init
    tok_src = Path(tokenizer_json) if tokenizer_json else find_tokenizer()
    shutil.copyfile(tok_src, out / "tokenizer.json")
    if verbatim_config:
        (out / "config.json").write_text(PUBLISHED_CONFIG_JSON, encoding="utf-8")
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)
    return {
        "out_dir": str(out),
        "tokenizer_source": str(tok_src),
        "parameters": sum(p.numel() for p in model.parameters()),
        "files": {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()},
        "init_s": round(t_init, 1),
        "save_s": round(t_save, 1),
        "total_s": round(time.time() - t0, 1),
    }


def check(out_dir) -> list[str]:
    """Problems found when reloading ``out_dir`` against the published config (empty = fine)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    problems = []
    cfg = AutoConfig.from_pretrained(out_dir).to_dict()
    for k, v in PUBLISHED_CONFIG.items():
        got = cfg.get(k)
        if isinstance(v, list):
            got = list(got) if got is not None else None
        if got != v:
            problems.append(f"config {k}: {got!r} != published {v!r}")
    with safe_open(str(Path(out_dir) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        emb = f.get_slice("backbone.embeddings.weight").get_shape()
        inp = f.get_slice("backbone.layers.0.mixer.in_proj.weight").get_shape()
        dtype = f.get_slice("backbone.embeddings.weight").get_dtype()
    if emb != [50288, 768]:
        problems.append(f"embeddings {emb}")
    if inp != [1536 + 1536 + 2 * 128 + 24, 768]:
        problems.append(f"in_proj {inp}")
    if dtype != "F32":
        problems.append(f"dtype {dtype}")
    if len([n for n in names if n.startswith("backbone.layers.")]) != 24 * 9:
        problems.append(f"{len(names)} tensors")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", default=str(REPO / "build" / "mamba2-130m-layout"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbatim-config", action="store_true",
                    help="replace config.json with the reconstructed published text (no architectures, bare Infinity)")
    ap.add_argument("--no-check", action="store_true", help="skip reloading and checking the result")
    a = ap.parse_args(argv)
    info = make(a.out_dir, seed=a.seed, verbatim_config=a.verbatim_config)
    print(json.dumps(info, indent=2))
    if not a.no_check:
        problems = check(a.out_dir)
        for p in problems:
            print("MISMATCH:", p, file=sys.stderr)
        print("check:", "ok" if not problems else f"{len(problems)} problem(s)")
        return 1 if problems else 0
    return 0


# ------------------------------------------------------------------------------------------------
# state-spaces/mamba-130m-hf layout (Mamba-1, MambaForCausalLM). The config below is the published
# config.json key for key (transformers' conversion of the original mamba_ssm config, which keeps
# the legacy d_model / n_layer / d_inner / ssm_cfg / fused_add_norm / rms_norm keys that the HF
# math ignores); it agrees with shared/spec/model-math.md section 1.1. There is no
# tie_word_embeddings key: MambaConfig's default (true) ties lm_head to backbone.embeddings.
# vocab_size 50280 is the gpt-neox-20b tokenizer's 50277 ids padded to a multiple of 8.

MAMBA_130M_CONFIG = {
    "architectures": ["MambaForCausalLM"],
    "bos_token_id": 0,
    "conv_kernel": 4,
    "d_inner": 1536,
    "d_model": 768,
    "eos_token_id": 0,
    "expand": 2,
    "fused_add_norm": True,
    "hidden_act": "silu",
    "hidden_size": 768,
    "initializer_range": 0.1,
    "intermediate_size": 1536,
    "layer_norm_epsilon": 1e-05,
    "model_type": "mamba",
    "n_layer": 24,
    "num_hidden_layers": 24,
    "pad_token_id": 0,
    "pad_vocab_size_multiple": 8,
    "rescale_prenorm_residual": False,
    "residual_in_fp32": True,
    "rms_norm": True,
    "ssm_cfg": {},
    "state_size": 16,
    "time_step_floor": 0.0001,
    "time_step_init_scheme": "random",
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "time_step_rank": 48,
    "time_step_scale": 1.0,
    "torch_dtype": "float32",
    "transformers_version": "4.39.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "vocab_size": 50280,
}


def make_mamba1(out_dir, *, seed: int = 0) -> dict:
    """Write a random-weight ``MambaForCausalLM`` with state-spaces/mamba-130m-hf's config (hidden
    768, 24 layers, vocab 50280, state 16, expand 2, conv 4, time_step_rank 48, no in/out bias,
    conv bias, tied embeddings, eps 1e-5) into ``out_dir``: save_pretrained (float32, ~517 MB, do
    NOT commit), then config.json replaced by the published text (legacy keys included), plus the
    gpt-neox-20b tokenizer.json. Returns paths, file sizes, parameter count and timings."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {k: v for k, v in MAMBA_130M_CONFIG.items()
              if k not in ("architectures", "model_type", "torch_dtype", "transformers_version")}
    torch.manual_seed(seed)
    model = MambaForCausalLM(MambaConfig(**kwargs)).to(torch.float32).eval()
    t_init = time.time() - t0
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(MAMBA_130M_CONFIG, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tok_src = find_tokenizer()
    shutil.copyfile(tok_src, out / "tokenizer.json")
    n_params = sum(p.numel() for p in model.parameters())
    del model
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)
    return {"out_dir": str(out), "tokenizer_source": str(tok_src), "parameters": n_params,
            "files": {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()},
            "init_s": round(t_init, 1), "total_s": round(time.time() - t0, 1)}


def check_mamba1(out_dir) -> list[str]:
    """Problems found when reloading a make_mamba1 folder against the published layout."""
    from safetensors import safe_open
    from transformers import AutoConfig

    problems = []
    cfg = AutoConfig.from_pretrained(out_dir)
    want = dict(hidden_size=768, num_hidden_layers=24, vocab_size=50280, state_size=16, expand=2,
                intermediate_size=1536, conv_kernel=4, time_step_rank=48, use_bias=False, use_conv_bias=True,
                tie_word_embeddings=True, layer_norm_epsilon=1e-5)
    for k, v in want.items():
        if getattr(cfg, k) != v:
            problems.append(f"config {k}: {getattr(cfg, k)!r} != {v!r}")
    with safe_open(str(Path(out_dir) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        shapes = {n: f.get_slice(n).get_shape() for n in names if ".layers.0." in n or "layers" not in n}
        dtype = f.get_slice("backbone.embeddings.weight").get_dtype()
    expect = {
        "backbone.embeddings.weight": [50280, 768], "backbone.norm_f.weight": [768],
        "backbone.layers.0.norm.weight": [768], "backbone.layers.0.mixer.in_proj.weight": [3072, 768],
        "backbone.layers.0.mixer.conv1d.weight": [1536, 1, 4], "backbone.layers.0.mixer.conv1d.bias": [1536],
        "backbone.layers.0.mixer.x_proj.weight": [80, 1536], "backbone.layers.0.mixer.dt_proj.weight": [1536, 48],
        "backbone.layers.0.mixer.dt_proj.bias": [1536], "backbone.layers.0.mixer.A_log": [1536, 16],
        "backbone.layers.0.mixer.D": [1536], "backbone.layers.0.mixer.out_proj.weight": [768, 1536],
    }
    for n, shape in expect.items():
        if shapes.get(n) != shape:
            problems.append(f"{n}: {shapes.get(n)} != {shape}")
    if dtype != "F32":
        problems.append(f"dtype {dtype}")
    if len([n for n in names if n.startswith("backbone.layers.")]) != 24 * 10:
        problems.append(f"{len(names)} tensors")
    return problems


def cached(root, name: str, make_fn, source: Path) -> Path:
    """``root/<name>-<hash of source>``, made by ``make_fn(out)`` the first time and reused after;
    older copies of ``name`` are deleted (each is hundreds of MB). The marker is written last."""
    import hashlib

    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:12]
    root = Path(root)
    out = root / f"{name}-{digest}"
    if (out / ".complete").is_file():
        return out
    for stale in root.glob(f"{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    make_fn(out)
    (out / ".complete").write_text(digest + "\n")
    return out


def cached_layout(root=REPO / "build") -> Path:
    """The mamba2-130m layout (config.json, model.safetensors, tokenizer.json), built once."""
    return cached(root, "mamba2-130m-layout", make, Path(__file__))


def cached_mamba1_130m(root=REPO / "build" / "published") -> Path:
    """The make_mamba1 folder, built once under ``root``."""
    return cached(root, "mamba-130m-layout", make_mamba1, Path(__file__))


# ------------------------------------------------------------------------------------------------
# Qwen/Qwen3.5-0.8B layout (added for the gated DeltaNet families; the Mamba-2 code above is
# unchanged). The published checkpoint is the vision-language model: config.json has model_type
# "qwen3_5" with the text model in text_config, and the weights live under
# model.language_model.* (text), model.visual.* (vision) with lm_head tied to the embeddings.
# Values: docs/ copy of /work/shared/spec/model-math.md section 1.3 (text_config, every field).
# The vision_config below follows the same section (depth 12, hidden 768, 12 heads, out 1024,
# patch 16, temporal patch 2, merge 2); its intermediate_size 3072 and num_position_embeddings
# 2304 are not in the spec (unverified) and only shape vision tensors, which mixlens never reads.

QWEN3_5_0_8B_TEXT_CONFIG = {
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attention_bias": False,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "tie_word_embeddings": True,
    "bos_token_id": 248044,
    "eos_token_id": 248044,
}
QWEN3_5_0_8B_VISION_CONFIG = {
    "depth": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072, "out_hidden_size": 1024,
    "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
    "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
}
QWEN3_5_0_8B_TOP = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                    "vision_end_token_id": 248054, "tie_word_embeddings": True}


def qwen3_5_0_8b_config():
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=dict(QWEN3_5_0_8B_TEXT_CONFIG), vision_config=dict(QWEN3_5_0_8B_VISION_CONFIG),
                         **QWEN3_5_0_8B_TOP)


def make_qwen3_5_0_8b(out_dir, *, seed: int = 0) -> dict:
    """Write a random-weight ``Qwen3_5ForConditionalGeneration`` with Qwen/Qwen3.5-0.8B's config into
    ``out_dir`` (save_pretrained, bfloat16 like the release: ~1.8 GB instead of ~3.6 GB float32).

    The model is initialised in float32 (transformers' own init) and rounded to bfloat16 once;
    a float32 reference must therefore load the saved file and widen it (``.float()``), so both
    sides see the same bf16-rounded weights. No tokenizer: the Qwen tokenizer is not available
    offline, so prompts are token ids."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(qwen3_5_0_8b_config()).to(torch.bfloat16).eval()
    t_init = time.time() - t0
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)
    return {"out_dir": str(out), "parameters": n_params,
            "files": {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()},
            "init_s": round(t_init, 1), "total_s": round(time.time() - t0, 1)}


def cached_qwen3_5_0_8b(root=REPO / "build" / "published") -> Path:
    """The make_qwen3_5_0_8b folder (~1.8 GB), built once under ``root``."""
    return cached(root, "qwen3_5-0.8b-layout", make_qwen3_5_0_8b, Path(__file__))


if __name__ == "__main__":
    sys.exit(main())
