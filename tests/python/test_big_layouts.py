"""The streamed writer of mixlens_dev/big_layouts.py (issue 27 item 3) at tiny widths: the published
configs of Qwen3.5-9B, Nemotron-H-8B and FalconMamba-7B at their full depth, with the widths shrunk
(a test-only override) and the writer's piece / row-block / shard limits set small so that every
path of the writer runs in seconds. The real layouts are written by `make bench-big`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mixlens_dev import big_layouts as bl
from mixlens_dev.common import tolerance

# Text widths (and Qwen3.5's vision tower) shrunk; depth, layer pattern, vocabularies and every other
# field stay the published ones.
SMALL = {
    "qwen3_5_9b": (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16),
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)),
    "nemotron_h_8b": (dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2), None),
    "falcon_mamba_7b": (dict(hidden_size=64, intermediate_size=128, time_step_rank=8), None),
}
# Small enough that the embeddings and LM heads go in row blocks and the files in several shards.
LIMITS = dict(unit_elems=1_000_000, row_block_elems=3_000_000, shard_bytes=20_000_000)


def small_config(name: str) -> dict:
    override, vision = SMALL[name]
    return bl.layout_config(name, override=override, vision_override=vision)


@pytest.fixture(scope="module", params=sorted(SMALL))
def written(request, tmp_path_factory):
    name = request.param
    out = tmp_path_factory.mktemp(name)
    override, vision = SMALL[name]
    info = bl.make(name, out, override=override, vision_override=vision, seed=3, **LIMITS)
    return name, out, info


def _saved(folder) -> dict:
    """name -> (shape, dtype) of every tensor in a folder's safetensors files."""
    from safetensors import safe_open

    got = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                got[k] = (sf.get_slice(k).get_shape(), sf.get_slice(k).get_dtype())
    return got


def test_files_parse_and_hold_what_transformers_expects(written):
    name, out, info = written
    assert len(info["files"]) > 1 and (out / "model.safetensors.index.json").is_file()
    assert bl.check_files(out) == []
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == json.loads(bl.config_json(small_config(name)))


def test_names_shapes_and_dtype_are_save_pretrained_s(written, tmp_path):
    """The same config built in memory by transformers and saved by save_pretrained (bfloat16) holds
    exactly the tensors the writer wrote, under the same names (Nemotron-H's backbone. prefix)."""
    import torch
    import transformers

    name, out, _ = written
    cfg = small_config(name)
    model = getattr(transformers, cfg["architectures"][0])(bl.hf_config(cfg)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert _saved(tmp_path) == _saved(out)


def test_transformers_and_mixlens_load_it_and_agree(written):
    name, out, _ = written
    res = bl.compare(out, widen=True)
    assert res["load_problems"] == {}, res
    assert res["finite"] and res["positions_differ"], res
    # Both multiply the same bf16 weights in float32: float32 rounding only, over the full depth.
    assert res["rel_rms"] < tolerance("logits"), res
    assert res["top1_agree"] == 1.0, res


def test_a_missing_tensor_is_caught(written, tmp_path):
    """Remove one layer tensor by hand: check_files names it and transformers reports it missing."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    name, out, _ = written
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    victim = next(k for k in sorted(index["weight_map"]) if ".layers.1." in k and k.endswith("weight"))
    shard = bad / index["weight_map"].pop(victim)
    tensors = load_file(str(shard))
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    assert any(victim in p and p.startswith("missing") for p in bl.check_files(bad))
    cfg = json.loads((bad / "config.json").read_text())
    _, info = getattr(transformers, cfg["architectures"][0]).from_pretrained(
        str(bad), dtype=torch.bfloat16, output_loading_info=True)
    assert info["missing_keys"]


def test_the_written_bytes_follow_the_seed(tmp_path):
    """Same seed, same bytes (every piece and row block is seeded by its name); another seed differs."""
    override, _ = SMALL["falcon_mamba_7b"]
    runs = {d: bl.make("falcon_mamba_7b", tmp_path / d, override=override, seed=s, **LIMITS)
            for d, s in (("a", 3), ("b", 3), ("c", 4))}
    files = runs["a"]["files"]
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert any((tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes() for f in files)


@pytest.mark.parametrize("name,layers,kinds", [
    ("qwen3_5_9b", 4, ["linear_attention"] * 3 + ["full_attention"]),
    ("nemotron_h_8b", 8, list("M-M-M-M*")),
    ("falcon_mamba_7b", 2, None),
])
def test_layers_cuts_the_pattern_with_the_depth(name, layers, kinds):
    cfg = bl.layout_config(name, layers)
    text = bl.text_part(cfg)
    assert text["num_hidden_layers"] == layers
    if kinds:
        assert text.get("layer_types", list(text.get("hybrid_override_pattern", ""))) == kinds
    full = bl.text_part(bl.layout_config(name))
    assert all(text[k] == full[k] for k in ("hidden_size", "vocab_size", "intermediate_size"))
    # The meta model (no memory) has that many layers, at the published widths.
    model = bl.meta_model(cfg)
    shapes = bl.expected_tensors(cfg)
    assert sum(1 for k in shapes if k.endswith("layers.%d.%s" % (layers - 1, "input_layernorm.weight" if name == "qwen3_5_9b"
                                                                  else "norm.weight"))) == 1
    assert not any(f"layers.{layers}." in k for k in shapes)
    del model


def test_sizes_match_the_published_parameter_counts():
    """The full layouts, from the meta models: ~9B text + vision, ~8.1B and ~7.3B parameters in bf16."""
    q, n, f = (bl.sizes(m) for m in ("qwen3_5_9b", "nemotron_h_8b", "falcon_mamba_7b"))
    assert 8.9e9 < q["text_bytes"] / 2 < 9.0e9 and 9.3e9 < q["total_bytes"] / 2 < 9.5e9
    assert 8.0e9 < n["total_bytes"] / 2 < 8.2e9
    assert 7.2e9 < f["total_bytes"] / 2 < 7.3e9
    assert np.isclose(q["embedding_bytes"], 248320 * 4096 * 2)
