"""Live parity of the Mamba-1 families with transformers 5.18 (MambaForCausalLM and FalconMambaForCausalLM,
pure-torch path; the FalconMamba cases carry family="falcon_mamba").

Fresh random models built here (seeds distinct from the committed fixtures), every value at every
step (prompt + 7 decode steps) read through the Python API and compared with
tests/python/oracle_mamba.py, on both selective-scan algorithms; edits against transformers
running the same modification; the published state-spaces/mamba-130m-hf layout; the shipped
models/mamba-tinystories; and the one place mixlens departs from transformers on purpose
(multi-token continuation over a cache).

Tolerance: relative RMS <= 1e-5 per value, 1e-4 on logits (float32 on both sides).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import mixlens
from mixlens_dev import oracle_mamba as om
from mixlens_dev.common import REPO, rel_rms, tolerance
from mixlens_dev.parity import ParityCase, compare, edited_run, read_every_value

N_STEPS = 8
SHIPPED = REPO / "models" / "mamba-tinystories"


def mix(layer: int, value: str) -> str:
    return f"layers.{layer}.linear_attn.{value}"


CASES = {
    "basic_t19": dict(
        seed=61, config=dict(num_hidden_layers=2, state_size=16, tie_word_embeddings=True), lens=[19],
        edits=[
            dict(name="decays_half", path=mix(0, "decays"), step=0, op="scale", factor=0.5),
            dict(name="skip_t4", path=mix(1, "betas"), step=0, op="set_index", index=4, value=0.0),
            dict(name="state_in_x0p5_s3", path=mix(1, "state_input"), step=3, op="scale", factor=0.5),
            dict(name="values_x2_s2", path=mix(0, "attention_values"), step=2, op="scale", factor=2.0),
            dict(name="y_x0p5_s1", path=mix(1, "attention_head_outputs"), step=1, op="scale", factor=0.5),
        ],
    ),
    "bias_untied": dict(
        seed=72, config=dict(num_hidden_layers=2, hidden_size=48, time_step_rank=4, use_bias=True,
                             use_conv_bias=False, tie_word_embeddings=False), lens=[9],
        edits=[
            dict(name="keys_x1p5", path=mix(0, "attention_keys"), step=0, op="scale", factor=1.5),
            dict(name="decays_x0p3_s2", path=mix(1, "decays"), step=2, op="scale", factor=0.3),
        ],
    ),
    "short_prompt": dict(
        seed=63, config=dict(num_hidden_layers=2, tie_word_embeddings=True), lens=[3],
        edits=[dict(name="queries_zero_t1", path=mix(0, "attention_queries"), step=0, op="set_index", index=1,
                    value=0.0)],
    ),
    "padded_batch": dict(
        seed=64, config=dict(num_hidden_layers=2, tie_word_embeddings=True), lens=[11, 4],
        edits=[dict(name="betas_x2_s1", path=mix(0, "betas"), step=1, op="scale", factor=2.0)],
    ),
    # FalconMamba: the same mixer with RMS norms on dt_low, B and C (mixer_rms_eps).
    "falcon_basic_t19": dict(
        family="falcon_mamba", seed=66, config=dict(num_hidden_layers=2, state_size=16, tie_word_embeddings=True),
        lens=[19],
        edits=[
            dict(name="decays_half", path=mix(0, "decays"), step=0, op="scale", factor=0.5),
            dict(name="keys_x1p5", path=mix(1, "attention_keys"), step=0, op="scale", factor=1.5),
            dict(name="queries_zero_t3", path=mix(0, "attention_queries"), step=0, op="set_index", index=3, value=0.0),
            dict(name="state_in_x0p5_s3", path=mix(1, "state_input"), step=3, op="scale", factor=0.5),
            dict(name="values_x2_s2", path=mix(0, "attention_values"), step=2, op="scale", factor=2.0),
            dict(name="y_x0p5_s1", path=mix(1, "attention_head_outputs"), step=1, op="scale", factor=0.5),
        ],
    ),
    "falcon_padded_eps": dict(
        family="falcon_mamba", seed=67,
        config=dict(num_hidden_layers=2, hidden_size=48, time_step_rank=4, use_conv_bias=False,
                    tie_word_embeddings=False, mixer_rms_eps=0.05),
        lens=[11, 4],
        edits=[dict(name="betas_x2_s1", path=mix(0, "betas"), step=1, op="scale", factor=2.0),
               dict(name="skip_t6", path=mix(1, "betas"), step=0, op="set_index", index=6, value=0.0)],
    ),
    "falcon_short_prompt": dict(
        family="falcon_mamba", seed=68, config=dict(num_hidden_layers=2, tie_word_embeddings=True), lens=[3],
        edits=[dict(name="keys_zero_t1", path=mix(0, "attention_keys"), step=0, op="set_index", index=1, value=0.0)],
    ),
}


def build(tmp_path: Path, seed: int, config: dict, family: str = "mamba"):
    from mixlens_dev.fixtures import mamba as mfm

    model = mfm.build_model({"seed": seed, "config": config}, family)
    model.save_pretrained(str(tmp_path))
    return mfm.load_model(tmp_path, family)


class Case(ParityCase):
    def __init__(self, name: str, tmp_path):
        from mixlens_dev import fixtures as mf

        spec = CASES[name]
        self.name, self.spec = name, spec
        self.family = spec.get("family", "mamba")
        self.torch_model = build(tmp_path, spec["seed"], spec["config"], self.family)
        self.prompts = mf.make_prompts(spec["seed"], spec["lens"], self.torch_model.config.vocab_size)
        self.ref = om.run(self.torch_model, self.prompts, N_STEPS)
        margin = mf.greedy_margin(self.ref, N_STEPS)
        assert margin > 1e-2, f"{name}: greedy margin {margin:.2e}; pick another seed"
        self.model = mixlens.StandardizedTransformer(str(tmp_path))
        assert self.model.info["family"] == self.family
        self.n_layers = self.torch_model.config.num_hidden_layers


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def route(case):
    """Sets the case family's route (and chunk length) for one test and restores the defaults."""
    models = []

    def set_route(name: str, model=None, chunk_per_token: bool = False):
        mixlens.route_kernels(case.family, name)
        if model is not None:
            mixlens.chunk_per_token(model, chunk_per_token)
            models.append(model)

    yield set_route
    mixlens.route_kernels(case.family, "default")
    for m in models:
        mixlens.chunk_per_token(m, False)


@pytest.mark.parametrize("algorithm", ["default", "recurrent", "chunked", "chunked_per_token"])
def test_every_value_every_step(case, algorithm, route):
    if algorithm == "chunked_per_token":
        route("chunked", case.model, chunk_per_token=True)  # chunk length 1: every token carries
    else:
        route(algorithm)
    with case.model.generate(case.prompts, max_new_tokens=N_STEPS, eos_token_id=-1) as tracer:
        got = read_every_value(case.model, tracer)
    n = compare(got, case.ref, f"{case.name} {algorithm}")
    assert n >= N_STEPS * case.n_layers * 12
    assert tracer.tokens == case.ref["tokens"].tolist()
    kernels = [c["kernel"] for c in tracer.calls]
    if algorithm == "default":
        # Decode steps run the single-token update; the prompt's algorithm is the faster one here.
        assert kernels[1:] == ["recurrent"] * (N_STEPS - 1)
    else:
        assert set(kernels) == {algorithm.split("_")[0]}


def test_greedy_tokens_without_a_block(case):
    run = case.model.generate(case.prompts, max_new_tokens=N_STEPS, eos_token_id=-1).run()
    assert run.tokens == case.ref["tokens"].tolist()


def test_edits_match_transformers_with_the_same_modification(case, route):
    for algorithm in ("recurrent", "chunked"):
        route(algorithm)
        for edit in case.spec["edits"]:
            ref = om.run(case.torch_model, case.prompts, N_STEPS, [edit], forced_tokens=np.array(case.forced()).T)
            with case.model.generate(case.prompts, max_new_tokens=N_STEPS, forced_tokens=case.forced()) as tracer:
                got = read_every_value(case.model, tracer, edit)
            # A decays write is a dt write: transformers records the edited dt as that step's betas,
            # and betas read after the write is that dt (read-after-write), so nothing is exempt.
            compare(got, ref, f"{case.name} {edit['name']} ({algorithm})")
            assert any(rel_rms(tracer.logits[k], case.ref[om.key("logits", k)]) > 1e-4 for k in range(N_STEPS))
            # Pre-registered: saves of every value hold what the forward used, edited site included.
            _, saved = edited_run(case, edit, "pre_registered")
            compare(saved, ref, f"{case.name} {edit['name']} ({algorithm}, pre-registered)")


def test_decays_write_with_no_single_dt_is_refused(case):
    with pytest.raises(mixlens.WriteError, match="state axis"):
        with case.model.trace(case.prompts[0]):
            d = case.model.layers[0].linear_attn.decays
            d[0, 0, 0, 1] *= 2.0  # one state index of one (token, channel) row
            case.model.layers[0].linear_attn.decays = d


def test_continuation_from_the_cache_equals_the_whole_prompt(tmp_path):
    """mixlens continues a multi-token call from the cached SSM state (values.md invariant).
    transformers 5.18 keeps the conv context but restarts mamba_selective_scan from a zero state
    (it takes no initial state), so its continuation differs from the whole prompt: this test pins
    both facts so that a change on either side is noticed."""
    hf = build(tmp_path, 65, dict(num_hidden_layers=2, tie_word_embeddings=True))
    ids = [int(t) for t in np.random.default_rng(65).integers(3, 97, size=14)]
    split = 6
    with torch.no_grad():
        whole = hf(input_ids=torch.tensor([ids]), use_cache=True).logits.numpy()
        first = hf(input_ids=torch.tensor([ids[:split]]), use_cache=True)
        cont = hf(input_ids=torch.tensor([ids[split:]]), cache_params=first.cache_params, use_cache=True).logits.numpy()
    assert rel_rms(cont, whole[:, split:]) > 1e-3, "transformers now continues from the cached state: update mamba.cpp"

    model = mixlens.StandardizedTransformer(str(tmp_path))
    cache = model.new_cache(1)
    model.forward([ids[:split]], cache=cache)
    ours = model.forward([ids[split:]], cache=cache)["logits"]
    assert rel_rms(ours, whole[:, split:]) <= 1e-4
    # Token-by-token decode over the cache is where transformers does carry the state: equal too.
    cache = model.new_cache(1)
    model.forward([ids[:split]], cache=cache)
    steps = np.concatenate([model.forward([[t]], cache=cache)["logits"] for t in ids[split:]], axis=1)
    assert rel_rms(steps, whole[:, split:]) <= 1e-4


# ---- real checkpoints -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def published_layout():
    from mixlens_dev import published_layout as mpl

    path = mpl.cached_mamba1_130m(REPO / "build" / "published")
    assert not mpl.check_mamba1(path)
    return path


def test_published_mamba_130m_layout(published_layout):
    """state-spaces/mamba-130m-hf's exact config and tensor layout (random weights): loads, matches
    transformers' logits, and serves the values with the published shapes."""
    from transformers import MambaForCausalLM

    cfg = json.loads((published_layout / "config.json").read_text())
    assert cfg["time_step_rank"] == 48 and cfg["vocab_size"] == 50280 and "tie_word_embeddings" not in cfg
    model = mixlens.StandardizedTransformer(str(published_layout))
    assert model.info["family"] == "mamba" and model.num_layers == 24
    ids = model.tokenizer.encode("Mamba reads")[:3]
    assert len(ids) == 3 and max(ids) < 50277  # the tokenizer's ids; rows 50277..50279 are padding
    out = model.run([ids], saves=["layers.*.linear_attn.states", "layers.0.layer_output"])
    assert out["layers.0.linear_attn.states"].shape == (1, 3, 1536, 16)
    assert out["layers.23.linear_attn.states"].shape == (1, 3, 1536, 16)
    assert out["layers.0.layer_output"].shape == (1, 3, 768)
    hf = MambaForCausalLM.from_pretrained(str(published_layout), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), use_cache=True).logits.numpy()
    assert out["logits"].shape == (1, 3, 50280)
    assert rel_rms(out["logits"], ref) <= 1e-4


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(), reason="models/mamba-tinystories not trained yet")
def test_shipped_model_generates_what_transformers_generates():
    from transformers import AutoTokenizer, MambaForCausalLM

    prompt = "Once upon a time, there was a little"
    model = mixlens.StandardizedTransformer(str(SHIPPED))
    hf = MambaForCausalLM.from_pretrained(str(SHIPPED), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(SHIPPED))
    ids = tok(prompt)["input_ids"]
    assert model.tokenizer.encode(prompt) == ids
    assert hf.config.vocab_size > tok.vocab_size  # the embedding is padded beyond the tokenizer
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=0)
        ref_logits = hf(input_ids=torch.tensor([ids])).logits.numpy()
    new = gen[0, len(ids):].tolist()
    run = model.generate([ids], max_new_tokens=20).run()
    assert run.tokens[0] == new
    assert rel_rms(model.run([ids])["logits"], ref_logits) <= tolerance("logits")
