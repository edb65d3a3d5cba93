"""Kernel identity (issue 23 item 3, docs/values.md "Kernel identity"): each recurrent mixer names its kind,
prompt and step kernels and state op, and every call carries the seed's (state op, sequence length,
`first`), `first` counting the positions earlier calls of the run pushed through the layer: a generate
of k steps after an n-token prompt gives first = 0, n, n + 1, ..., n + k - 2. On the shipped Mamba-2,
Mamba-1 and Qwen3.5 models, on the default route and with each kernel forced."""

from __future__ import annotations

from pathlib import Path

import pytest

import mixlens

REPO = Path(__file__).resolve().parents[2]
MODELS = {  # model folder, route_kernels family, kind
    "mamba2": ("mamba2-tinystories", "mamba2", "ssd"),
    "mamba": ("mamba-tinystories", "mamba", "selective_scan"),
    "qwen3_5": ("qwen3_5-tinystories", "qwen3_5", "gated_delta"),
}
STATE_OP = {"ssd": "selective_state_update", "selective_scan": "selective_state_update",
            "gated_delta": "gated_delta_rule"}
PROMPT = "Once upon a time there was a little"
STEPS = 5


@pytest.fixture(scope="module", params=sorted(MODELS))
def fam(request):
    folder, family, kind = MODELS[request.param]
    model = mixlens.load(str(REPO / "models" / folder), output="numpy")
    mixers = [i for i, k in enumerate(model.info["layer_kinds"]) if k != "attention"]
    return model, family, kind, mixers


@pytest.fixture(params=["default", "chunked", "recurrent", "chunk_per_token"])
def route(request, fam):
    model, family, _, _ = fam
    if request.param == "chunk_per_token":
        if family == "qwen3_5":
            pytest.skip("gated DeltaNet runs fixed chunks of 64 (chunk_per_token raises UnsupportedError)")
        mixlens.chunk_per_token(model, True)
    else:
        mixlens.route_kernels(family, request.param)
    try:
        yield request.param
    finally:
        mixlens.route_kernels(family, "default")
        if family != "qwen3_5":
            mixlens.chunk_per_token(model, False)


def expected_kernels(route: str, mix) -> tuple[str, str]:
    """(prompt kernel, step kernel) the route says run."""
    if route in ("chunked", "recurrent"):
        return route, route
    return mix.prompt_kernel, "recurrent"


def test_each_mixer_names_its_kind_kernels_and_state_op(fam, route):
    model, family, kind, mixers = fam
    n = len(model.tokenizer.encode(PROMPT))
    for i in mixers:
        mix = model.layers[i].linear_attn
        assert mix.kind == kind and mix.state_op == STATE_OP[kind]
        assert mix.prompt_kernel in ("chunked", "recurrent") and mix.step_kernel in ("chunked", "recurrent")
        if route in ("chunked", "recurrent"):
            assert (mix.prompt_kernel, mix.step_kernel) == (route, route)
        else:
            assert mix.step_kernel == "recurrent"
            if kind != "selective_scan":  # Mamba-1 picks its prompt scan by length and width
                assert mix.prompt_kernel == "chunked"
        assert {"kind", "prompt_kernel", "step_kernel", "state_op", "call"} <= set(dir(mix))
        with model.trace(PROMPT):
            assert model._core.mixer_identity(i, n) == {
                "kind": mix.kind, "prompt_kernel": mix.prompt_kernel, "step_kernel": mix.step_kernel,
                "state_op": mix.state_op}


def test_a_generate_of_k_steps_gives_the_seeds_offsets(fam, route):
    model, family, kind, mixers = fam
    n = len(model.tokenizer.encode(PROMPT))
    mix = model.layers[mixers[-1]].linear_attn
    prompt_kernel, step_kernel = expected_kernels(route, mix)
    seen = []
    with model.generate(PROMPT, max_new_tokens=STEPS, eos_token_id=-1) as tracer:
        for step in tracer.iter[:]:
            mix.betas  # the step's call has started once one of its values is read
            seen.append((step, mix.call))
    want = [(0, {"state_op": prompt_kernel, "seq": n, "first": 0})]
    want += [(k, {"state_op": step_kernel, "seq": 1, "first": n + k - 1}) for k in range(1, STEPS)]
    assert seen == want
    calls = [(c["step"], c["kernel"], c["seq"], c["first"]) for c in tracer.calls]
    assert calls == [(k, c["state_op"], c["seq"], c["first"]) for k, c in want]


def test_first_continues_a_cache_and_counts_left_padding(fam, route):
    model, _, _, mixers = fam
    ids = model.tokenizer.encode(PROMPT)
    cache = model.new_cache(1)
    model.forward([ids[:3]], cache=cache)
    with model.trace([ids[3:]], cache=cache) as tracer:
        call = model.layers[mixers[0]].linear_attn.call
    assert call["first"] == 3 and call["seq"] == len(ids) - 3
    assert [c["first"] for c in tracer.calls] == [3]
    # Two prompts left-padded to the longer one: every row's call starts at the padded length.
    with model.generate([PROMPT, "Once"], max_new_tokens=3, eos_token_id=-1) as tracer:
        pass
    assert [(c["seq"], c["first"]) for c in tracer.calls] == [(len(ids), 0), (1, len(ids)), (1, len(ids) + 1)]


def test_identity_outside_a_mixer_and_call_outside_a_trace(fam):
    model, _, _, mixers = fam
    with pytest.raises(mixlens.InputError, match="call"):
        model.layers[mixers[0]].linear_attn.call
    attention = [i for i, k in enumerate(model.info["layer_kinds"]) if k == "attention"]
    if attention:
        with pytest.raises(mixlens.UnsupportedError, match="attention"):
            model.layers[attention[0]].linear_attn.kind
    with pytest.raises(mixlens.InputError):
        model._core.mixer_identity(model.num_layers, 4)
    with pytest.raises(mixlens.InputError):
        model._core.mixer_identity(0, 0)
