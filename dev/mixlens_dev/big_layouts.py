#!/usr/bin/env python3
"""Random-weight checkpoints at the published 7-9B configs, streamed to disk (issue 27 item 3).

    python -m mixlens_dev.big_layouts --model qwen3_5_9b|nemotron_h_8b|falcon_mamba_7b --out DIR
                                      [--layers N] [--dtype bfloat16] [--seed 0] [--check]

published_layout.py / published_hybrids.py build a model in memory with torch and save_pretrained it:
fine below 1B, impossible at 9B on a 23 GB machine. Here the model is instantiated on the ``meta``
device (names, shapes, module types: transformers' own class, nothing allocated), and each piece is
made and written in turn: a small subtree (a decoder layer, a norm) is allocated on the CPU, filled by
transformers' own ``_init_weights`` (the init every published_* layout uses: norms 1 or 0, A_log /
dt / D as the releases, projections N(0, initializer_range)), written, and freed; the tables too big
for that (embeddings, LM head) are made and written in row blocks. The safetensors header is written
first (offsets from the meta shapes), then the bytes sequentially; shards of at most 5 GB with
``model.safetensors.index.json`` like the releases. Tensor names are what ``save_pretrained`` writes
(transformers' reverse key mapping, e.g. Nemotron-H's ``model.`` -> ``backbone.``). Peak memory is
one subtree in float32 (under 1 GiB), not the model.

``--layers N`` keeps the first N layers at the real widths (Qwen3.5's layer_types and Nemotron-H's
hybrid_override_pattern truncated with it) for quick checks; ``--check`` then loads the folder with
transformers and with mixlens and compares the logits of a short prompt. ``cached(...)`` builds a
layout once under build/big/ (folder named by a hash of the config, seed, dtype and this file).

Where each config comes from (no internet here; found with the search tool)
-----------------------------------------------------------------------
* Qwen/Qwen3.5-9B (``Qwen3_5ForConditionalGeneration``, the released vision-language model; its
  vision tower and ``lm_head`` are written too, mixlens reads only the text model). Widths: hidden
  4096, 32 layers (3 gated DeltaNet + 1 gated attention, 8 times), MLP 12288, 16 query / 4 KV heads
  of 256, GDN 16 key heads / 32 value heads of 128, vocab 248320, rope_theta 1e7, 64 rotary dims:
  quoted alike by a model-spec page (awesomeagents.ai "Qwen3.5-9B": "Gated DeltaNet Heads 32 for V,
  16 for QK; Head Dim 128; Gated Attention Heads 16 Q, 4 KV; Head Dim 256; RoPE Dim 64"), apxml.com's
  spec table and a GGUF metadata dump (lzwjava.github.io: 32 layers, embed 4096, FFN 12288, 16 heads,
  4 KV heads, vocab 248320, freq_base 10M). Untied head: pegainfer PR #544 ("Qwen3.5-9B and 27B set
  tie_word_embeddings: false and ship a top-level lm_head.weight"). Key set and spelling of the file
  (text_config's attn_output_gate, mamba_ssm_dtype, mtp_*, pad_token_id null, rope_parameters with
  the interleaved mrope_section [11, 11, 10], bos = eos = 248044, the token ids at top level): the
  Qwen3.5-35B-A3B config.json quoted in full by a public Rust test, with the dense 9B's widths.
  Vision tower (depth 27, hidden 1152, MLP 4304, 16 heads, out_hidden_size 4096 = the text width):
  a Python port's Qwen3_5VisionConfig defaults; the same tower as the 35B-A3B file. Not a verified
  copy of the 9B file: every width is from at least two sources, the key set from its sibling.
* nvidia/Nemotron-H-8B-Base-8K: the widths of published_hybrids.NEMOTRON_H_8B_8BLOCKS (two
  parameter-counting projects' copies of config.json), the full 52-block hybrid_override_pattern
  (also in NVIDIA's Megatron-Bridge docs: "8B: 52 layers, Hidden size 4096, FFN 21504, 32 query
  heads, 8 KV groups, KV channels 128, Mamba heads 128, head dim 64, state dim 128"), max positions
  8192 (the "8K"). The key set is the one the checkpoint's own configuration_nemotron_h.py (remote
  code, quoted by a public repository) writes; the values it does not pin are that class's defaults
  (rescale_prenorm_residual true, residual_in_fp32 false, no biases but the conv's, time steps
  0.001 / 0.1 / 1e-4, initializer_range 0.02) except chunk_size 128 (transformers' NemotronHConfig
  default, written for this checkpoint). No auto_map: the folder has no remote code; transformers
  5.18 and mixlens read the legacy keys natively. ~8.1B parameters.
* tiiuae/falcon-mamba-7b: its config.json verbatim (every key but _name_or_path), quoted by a
  benchmark script and an ONNX-export helper; see published_hybrids.py. 64 layers, hidden 4096,
  intermediate 8192, vocab 65024, untied. ~7.3B parameters.

Tokenizers (not the releases': none is available offline; the prompts of the benches are ids):
Qwen3's (151,669 ids, within Qwen3.5's 248,320) for Qwen3.5, gpt-neox-20b's for the others
(published_layout.find_tokenizer). generation_config.json as save_pretrained writes it.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

from mixlens_dev.common import REPO

QWEN3_5_9B_LAYERS = 32
QWEN3_5_9B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "dtype": "bfloat16",
    "image_token_id": 248056,
    "model_type": "qwen3_5",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": 248044,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(QWEN3_5_9B_LAYERS)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_hidden_layers": QWEN3_5_9B_LAYERS,
        "num_key_value_heads": 4,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "video_token_id": 248057,
    "vision_config": {
        "deepstack_visual_indexes": [],
        "depth": 27,
        "dtype": "bfloat16",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "intermediate_size": 4304,
        "model_type": "qwen3_5_vision",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "head_dim": 128,
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "initializer_range": 0.02,
    "intermediate_size": 21504,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "n_groups": 8,
    "num_attention_heads": 32,
    "num_hidden_layers": 52,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_limit": [0.0, float("inf")],
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}
FALCON_MAMBA_7B = {
    "architectures": ["FalconMambaForCausalLM"],
    "bos_token_id": 0,
    "conv_kernel": 4,
    "eos_token_id": 11,
    "expand": 16,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.1,
    "intermediate_size": 8192,
    "layer_norm_epsilon": 1e-05,
    "model_type": "falcon_mamba",
    "num_hidden_layers": 64,
    "pad_token_id": 11,
    "rescale_prenorm_residual": False,
    "residual_in_fp32": True,
    "state_size": 16,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_init_scheme": "random",
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "time_step_rank": 256,
    "time_step_scale": 1.0,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "vocab_size": 65024,
}
# name -> (published config, tokenizer folder under shared/data/tokenizers or None = find_tokenizer's gpt-neox-20b)
LAYOUTS = {
    "qwen3_5_9b": (QWEN3_5_9B, "qwen3"),
    "nemotron_h_8b": (NEMOTRON_H_8B, None),
    "falcon_mamba_7b": (FALCON_MAMBA_7B, None),
}
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
SHARD_BYTES = 5 * 10**9  # the releases' shard size
UNIT_ELEMS = 128 * 2**20  # largest subtree allocated at once (512 MiB in float32; every mixer fits)
ROW_BLOCK_ELEMS = 16 * 2**20  # row block of the tables written in pieces (64 MiB in float32)


def text_part(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def layout_config(name: str, layers: int | None = None, dtype: str = "bfloat16", override: dict | None = None,
                  vision_override: dict | None = None) -> dict:
    """The config.json of layout ``name``: the published one, its first ``layers`` layers if given
    (layer_types / hybrid_override_pattern cut to match), ``override`` merged into the text config and
    ``vision_override`` into the vision config (tests shrink the widths with these), dtype fields set."""
    cfg = copy.deepcopy(LAYOUTS[name][0])
    text = text_part(cfg)
    text.update(override or {})
    if vision_override and "vision_config" in cfg:
        cfg["vision_config"].update(vision_override)
    if layers is not None:
        if not 1 <= layers <= text["num_hidden_layers"]:
            raise ValueError(f"--layers {layers}: {name} has {text['num_hidden_layers']} layers")
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
        if "hybrid_override_pattern" in text:
            text["hybrid_override_pattern"] = text["hybrid_override_pattern"][:layers]
    for part in (cfg, cfg.get("text_config", {}), cfg.get("vision_config", {})):
        for key in ("dtype", "torch_dtype"):
            if key in part:
                part[key] = dtype
    return cfg


def config_json(cfg: dict) -> str:
    # Python's json spells inf as Infinity, as the 2024 files do (transformers reads it back).
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def hf_config(cfg: dict):
    """transformers' config object for a config.json dict (as from_pretrained would read it)."""
    from transformers import AutoConfig

    d = json.loads(config_json(cfg))
    return AutoConfig.for_model(d.pop("model_type"), **d)


def meta_model(cfg: dict):
    """transformers' own model class for ``cfg`` on the meta device: names, shapes, no memory."""
    import torch
    import transformers

    with torch.device("meta"):
        return getattr(transformers, cfg["architectures"][0])(hf_config(cfg))


# ---- the plan: which tensors, in which order, produced how ------------------------------------

def _saved_names(model) -> dict[str, str]:
    """state_dict name -> the name save_pretrained writes (transformers' reverse key mapping), for
    every tensor save_pretrained keeps (tied duplicates dropped)."""
    from transformers.core_model_loading import revert_weight_conversion

    sd = model.state_dict(keep_vars=True)
    params = {id(p) for p in model.parameters()}
    buffers = [k for k, v in sd.items() if id(v) not in params]
    if buffers:  # none in these models; their values would need their own recipe
        raise NotImplementedError(f"persistent buffers are not written: {buffers[:3]}")
    seen, kept = set(), {}
    for k, v in sd.items():
        if id(v) not in seen:  # a tied weight is saved once, under its first name
            seen.add(id(v))
            kept[k] = v
    out = revert_weight_conversion(model, dict(kept))
    by_id = {id(v): k for k, v in kept.items()}
    names = {}
    for saved, v in out.items():
        if id(v) not in by_id:
            raise NotImplementedError(f"{saved}: save_pretrained converts this tensor, not only renames it")
        names[by_id[id(v)]] = saved
    return names


def _init_owners(model) -> dict:
    """module -> the _init_weights that transformers' initialize_weights applies to it (a composite
    model dispatches each sub-model's own, as its smart_apply does)."""
    from transformers import PreTrainedModel

    owners = {}

    def walk(mod, owner):
        for child in mod.children():
            walk(child, child if isinstance(child, PreTrainedModel) else owner)
        owners[mod] = owner._init_weights

    walk(model, model)
    return owners


def plan(model, unit_elems: int = UNIT_ELEMS) -> list[tuple]:
    """Units in write order: ("tree", prefix, module): the subtree allocated and initialised whole;
    ("rows", name, module): one Linear / Embedding weight too big for that, made in row blocks."""
    import torch.nn as nn

    units = []

    def visit(mod, prefix):
        if sum(p.numel() for p in mod.parameters()) <= unit_elems:
            units.append(("tree", prefix, mod))
            return
        for pname, _ in mod.named_parameters(recurse=False):
            if not (isinstance(mod, (nn.Linear, nn.Embedding)) and pname == "weight" and getattr(mod, "bias", None) is None):
                raise NotImplementedError(f"{prefix}{pname}: too big for one piece and not a bias-free Linear / Embedding")
            units.append(("rows", prefix + pname, mod))
        for cname, child in mod.named_children():
            visit(child, f"{prefix}{cname}.")

    visit(model, "")
    return units


def tensor_list(model, units, names: dict[str, str]) -> list[tuple[str, str, list[int]]]:
    """(state_dict name, saved name, shape) of every tensor written, in write order."""
    out = []
    for kind, prefix, mod in units:
        items = [(prefix, mod.weight)] if kind == "rows" else list(mod.state_dict(prefix=prefix, keep_vars=True).items())
        for k, v in items:
            if k in names:
                out.append((k, names[k], list(v.shape)))
    return out


def produce(model, units, names: dict[str, str], dtype, seed: int, row_block_elems: int = ROW_BLOCK_ELEMS):
    """Yield (state_dict name, tensor block) in write order: each tree allocated on the CPU in
    float32, initialised by transformers (post-order, as nn.Module.apply), cast, yielded, freed;
    each big table in row blocks, every block initialised as a module of the same kind."""
    import torch
    import torch.nn as nn
    from transformers import initialization as hf_init

    owners = _init_owners(model)
    with torch.no_grad(), hf_init.guard_torch_init_functions():
        for kind, prefix, mod in units:
            torch.manual_seed(zlib.crc32(f"{seed}:{prefix}".encode()))
            if kind == "tree":
                mod.to_empty(device="cpu")
                post = []

                def order(m):
                    for c in m.children():
                        order(c)
                    post.append(m)

                order(mod)
                for m in post:
                    owners[m](m)
                for k, v in mod.state_dict(prefix=prefix).items():
                    if k in names:
                        yield k, v.to(dtype)
                mod.to("meta")
                continue
            rows, cols = mod.weight.shape
            step = max(1, row_block_elems // cols)
            for r0 in range(0, rows, step):
                n = min(step, rows - r0)
                with torch.device("meta"):
                    if isinstance(mod, nn.Embedding):
                        pad = mod.padding_idx
                        block = nn.Embedding(n, cols, padding_idx=pad - r0 if pad is not None and r0 <= pad < r0 + n else None)
                    else:
                        block = nn.Linear(cols, n, bias=False)
                block.to_empty(device="cpu")
                owners[mod](block)
                yield prefix, block.weight.to(dtype)


# ---- the writer ------------------------------------------------------------------------------

def _header_bytes(entries: list[tuple[str, list[int], int]], dtype_tag: str) -> bytes:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, nbytes in entries:
        header[name] = {"dtype": dtype_tag, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_tensors(out: Path, tensors: list[tuple[str, str, list[int]]], stream, dtype: str,
                  shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write ``stream`` (blocks in ``tensors``' order) as safetensors shards + index under ``out``:
    headers from the shapes first, then the bytes appended as they come. Returns the file names."""
    import torch

    elem = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    sizes = [(k, saved, shape, elem * _numel(shape)) for k, saved, shape in tensors]
    shards, cur, cur_bytes = [], [], 0
    for s in sizes:
        if cur and cur_bytes + s[3] > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += s[3]
    shards.append(cur)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    blocks = iter(stream)
    pending = None  # a block already pulled from the stream
    for fname, shard in zip(files, shards):
        with open(out / (fname + ".partial"), "wb") as f:
            f.write(_header_bytes([(saved, shape, nb) for _, saved, shape, nb in shard], DTYPES[dtype]))
            for key, saved, shape, nbytes in shard:
                left = nbytes
                while left:
                    k, block = pending if pending else next(blocks)
                    pending = None
                    if k != key:
                        raise RuntimeError(f"writer out of order: got {k}, expected {key}")
                    # bfloat16 has no numpy dtype: write the raw bytes through an integer view
                    raw = block.contiguous().view(torch.uint8).numpy()
                    if raw.nbytes > left:
                        raise RuntimeError(f"{key}: {raw.nbytes} bytes for {left} left")
                    f.write(memoryview(raw))
                    left -= raw.nbytes
                weight_map[saved] = fname
        os.replace(out / (fname + ".partial"), out / fname)
    if next(blocks, None) is not None:
        raise RuntimeError("the stream has more tensors than the plan")
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(s[3] for s in sizes)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tokenizer_files(name: str) -> list[Path]:
    from mixlens_dev.published_layout import find_tokenizer

    folder = LAYOUTS[name][1]
    if folder is None:
        return [find_tokenizer()]
    for root in (REPO.parent / "shared" / "data" / "tokenizers", REPO / "tests" / "fixtures" / "tokenizer"):
        if (root / folder / "tokenizer.json").is_file():
            return [p for p in (root / folder / "tokenizer.json", root / folder / "tokenizer_config.json") if p.is_file()]
    raise FileNotFoundError(f"{folder} tokenizer.json not found under shared/data/tokenizers or tests/fixtures/tokenizer")


def make(name: str, out_dir, *, layers: int | None = None, dtype: str = "bfloat16", seed: int = 0,
         override: dict | None = None, vision_override: dict | None = None, unit_elems: int = UNIT_ELEMS,
         row_block_elems: int = ROW_BLOCK_ELEMS, shard_bytes: int = SHARD_BYTES) -> dict:
    """Write layout ``name`` into ``out_dir`` (config.json, generation_config.json, tokenizer,
    safetensors shards): the published config (cut to ``layers``), transformers' init, ``dtype``.
    Returns sizes and timings."""
    import resource

    import torch
    from transformers import GenerationConfig

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = layout_config(name, layers, dtype, override, vision_override)
    (out / "config.json").write_text(config_json(cfg))
    model = meta_model(cfg)
    names = _saved_names(model)
    units = plan(model, unit_elems)
    tensors = tensor_list(model, units, names)
    if {k for k, _, _ in tensors} != set(names):
        raise RuntimeError(f"plan misses {sorted(set(names) - {k for k, _, _ in tensors})[:3]}")
    files = write_tensors(out, tensors, produce(model, units, names, getattr(torch, dtype), seed, row_block_elems), dtype, shard_bytes)
    gen = GenerationConfig.from_model_config(model.config)
    gen.save_pretrained(out)
    for src in tokenizer_files(name):
        shutil.copyfile(src, out / src.name)
    n_params = sum(_numel(shape) for _, _, shape in tensors)
    return {"out_dir": str(out), "model": name, "layers": text_part(cfg)["num_hidden_layers"], "dtype": dtype,
            "parameters": n_params, "tensors": len(tensors), "files": files,
            "bytes": sum((out / f).stat().st_size for f in files), "seconds": round(time.time() - t0, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def expected_tensors(name_or_cfg, **kw) -> dict[str, list[int]]:
    """saved name -> shape of every tensor the layout holds (from the meta model, no memory)."""
    cfg = name_or_cfg if isinstance(name_or_cfg, dict) else layout_config(name_or_cfg, **kw)
    model = meta_model(cfg)
    names = _saved_names(model)
    return {names[k]: list(v.shape) for k, v in model.state_dict(keep_vars=True).items() if k in names}


def sizes(name: str, layers: int | None = None, dtype: str = "bfloat16") -> dict:
    """Bytes of the layout (all tensors / the text model only), its input embedding table and the
    per-token state size of one recurrent layer, from the config alone (for disk and memory checks)."""
    import torch

    cfg = layout_config(name, layers, dtype)
    elem = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    shapes = expected_tensors(cfg)
    total = sum(_numel(s) for s in shapes.values()) * elem
    text = sum(_numel(s) for k, s in shapes.items() if not _not_text(k)) * elem
    emb = max((_numel(s) for k, s in shapes.items() if "embed" in k and not _not_text(k)), default=0) * elem
    t = text_part(cfg)
    if "linear_num_value_heads" in t:  # gated DeltaNet: [HV, Dk, Dv] float32
        state = t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"] * 4
    elif "mamba_num_heads" in t:  # Mamba-2: [H, head_dim, N]
        state = t["mamba_num_heads"] * t["mamba_head_dim"] * t["ssm_state_size"] * 4
    else:  # Mamba-1: [d_inner, N]
        state = t["intermediate_size"] * t["state_size"] * 4
    return {"total_bytes": total, "text_bytes": text, "embedding_bytes": emb, "state_bytes_per_token": state,
            "hidden_size": t["hidden_size"], "tied": bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))),
            "layers": t["num_hidden_layers"]}


def _not_text(saved_name: str) -> bool:
    return "visual" in saved_name or saved_name.startswith("mtp")


def cache_key(name: str, layers: int | None, dtype: str, seed: int) -> str:
    h = hashlib.sha256()
    h.update(config_json(layout_config(name, layers, dtype)).encode())
    h.update(f"{seed}".encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:12]


def cached(name: str, root=REPO / "build" / "big", *, layers: int | None = None, dtype: str = "bfloat16",
           seed: int = 0) -> Path:
    """``root/<name>[-L<layers>]-<dtype>-<hash>``, made the first time and reused after (the
    .complete marker is written last, so a half-written copy is rebuilt)."""
    out = Path(root) / f"{name}{f'-L{layers}' if layers else ''}-{dtype}-{cache_key(name, layers, dtype, seed)}"
    if (out / ".complete").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    info = make(name, out, layers=layers, dtype=dtype, seed=seed)
    (out / ".complete").write_text(json.dumps(info) + "\n")
    return out


# ---- checks ----------------------------------------------------------------------------------

def check_files(out_dir, cfg: dict | None = None) -> list[str]:
    """Problems with the safetensors files of ``out_dir`` against what transformers expects for its
    config.json (names, shapes, one dtype, index consistent, contiguous data); empty = fine."""
    from safetensors import safe_open

    out = Path(out_dir)
    cfg = cfg or json.loads((out / "config.json").read_text())
    want = expected_tensors(cfg)
    dtype = text_part(cfg).get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
    problems, got = [], {}
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    for f in files:
        path = out / f
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        ends = sorted((v["data_offsets"][0], v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__")
        pos = 0
        for a, b in ends:
            if a != pos:
                problems.append(f"{f}: hole or overlap at byte {pos}")
                break
            pos = b
        if 8 + n + pos != path.stat().st_size:
            problems.append(f"{f}: data {pos} bytes, file {path.stat().st_size - 8 - n}")
        with safe_open(str(path), "pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                got[k] = (sl.get_shape(), sl.get_dtype(), f)
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        for k, (_, _, f) in got.items():
            if wm.get(k) != f:
                problems.append(f"index maps {k} to {wm.get(k)}, it is in {f}")
        if set(wm) != set(got):
            problems.append(f"index and files differ: {sorted(set(wm) ^ set(got))[:3]}")
    for k, shape in want.items():
        if k not in got:
            problems.append(f"missing {k} {shape}")
        elif got[k][0] != shape:
            problems.append(f"{k}: shape {got[k][0]} != {shape}")
        elif dtype and got[k][1] != DTYPES[dtype]:
            problems.append(f"{k}: dtype {got[k][1]} != {DTYPES[dtype]}")
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(want))]
    return problems


def compare(out_dir, ids: list[int] | None = None, widen: bool | None = None) -> dict:
    """Load ``out_dir`` with transformers (bfloat16, as asked) and with mixlens (dtype="auto", the
    weights served from the file) and compare the logits of a short prompt. transformers is widened
    to float32 (``widen``; default: when that fits easily) so both multiply the same bf16-rounded
    weights in float32; else it runs in bfloat16 and the tolerance is bf16's."""
    import numpy as np
    import torch
    import transformers

    import mixlens

    out = Path(out_dir)
    cfg = json.loads((out / "config.json").read_text())
    ids = ids or [5, 17, 300, 2024, 11, 77, 4096, 9]
    hf, info = getattr(transformers, cfg["architectures"][0]).from_pretrained(
        str(out), dtype=torch.bfloat16, output_loading_info=True)
    load_problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    if widen is None:
        widen = sum(p.numel() for p in hf.parameters()) * 4 < 0.25 * _mem_available()
    if widen:
        hf = hf.float()
    with torch.no_grad():
        # use_cache=False: transformers 5.18 cannot size a cache without attention layers (--layers 2)
        ref = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    del hf
    m = mixlens.StandardizedTransformer(str(out), dtype="auto")
    got = np.asarray(m.run([ids], logits="all")["logits"])[0]
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return {"load_problems": load_problems, "widened": widen, "rel_rms": rel,
            "top1_agree": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
            "finite": bool(np.isfinite(got).all() and np.isfinite(ref).all()),
            "logit_std": float(got.std()), "positions_differ": bool(np.ptp(got.argmax(-1)) > 0 or got.std(0).max() > 0),
            "tolerance": 1e-3 if widen else 5e-2}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=sorted(LAYOUTS))
    ap.add_argument("--out", help="output folder (default with --cached: build/big/<name>-...)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (same widths)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cached", action="store_true", help="build under build/big/ once (by config hash) and reuse")
    ap.add_argument("--sizes", action="store_true", help="print the layout's byte counts as JSON and exit")
    ap.add_argument("--check", action="store_true", help="then check the files and compare transformers with mixlens")
    a = ap.parse_args(argv)
    if a.sizes:
        print(json.dumps(dict(sizes(a.model, a.layers, a.dtype), key=cache_key(a.model, a.layers, a.dtype, a.seed))))
        return 0
    if a.cached:
        out = cached(a.model, Path(a.out) if a.out else REPO / "build" / "big", layers=a.layers, dtype=a.dtype, seed=a.seed)
        info = json.loads((out / ".complete").read_text())
    elif a.out:
        info = make(a.model, a.out, layers=a.layers, dtype=a.dtype, seed=a.seed)
        out = Path(a.out)
    else:
        ap.error("--out or --cached")
    print(json.dumps(info, indent=1), flush=True)
    if not a.check:
        return 0
    problems = check_files(out)
    for p in problems:
        print("MISMATCH:", p, file=sys.stderr)
    res = compare(out)
    print(json.dumps(res, indent=1))
    ok = (not problems and not res["load_problems"] and res["finite"] and res["positions_differ"]
          and res["rel_rms"] < res["tolerance"])
    print("check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
