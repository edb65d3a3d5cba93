"""What the parity tests share: reading every value of a generate block, applying an oracle edit on
the mixlens side, comparing with transformers' values, and a case base class that caches the
teacher-forced edited oracle runs."""

from __future__ import annotations

import numpy as np

from mixlens_dev.common import rel_rms, tolerance

N_STEPS = 8


def key(path: str, step: int) -> str:
    return f"{path}@step{step}"


def read_every_value(model, tracer, edit=None) -> dict:
    """Inside a generate block: every value of every step, read in forward order; `edit` (an oracle
    edit dict) is written at its site when the forward gets there."""
    got = {}
    for step in tracer.iter[:]:
        for v in model.values():
            path = v["path"]
            value = model._read(path)
            if edit is not None and edit["step"] == step and edit["path"] == path:
                model._write(path, apply_op(value, edit))
                value = model._read(path)  # the written value, as the rest of the forward sees it
                if path.endswith(".decays"):
                    # Read-after-write: betas (one dt with decays) now reads the dt the write implies,
                    # which transformers records as that step's dt.
                    betas = path.replace(".decays", ".betas")
                    got[key(betas, step)] = model._read(betas)
            if value is None:
                assert step == 0 and path.endswith("state_input"), f"{path}@step{step} is None"
                continue
            got[key(path, step)] = value
    return got


def apply_op(value: np.ndarray, edit: dict) -> np.ndarray:
    if edit["op"] == "scale":
        return value * np.float32(edit["factor"])
    out = value.copy()
    out[:, edit["index"]] = edit["value"]
    return out


def compare(got: dict, ref: dict, label: str, skip=()) -> int:
    keys = [k for k in ref if "@step" in k and not k.startswith("edit/") and k not in skip]
    missing = sorted(set(keys) - set(got))
    assert not missing, f"{label}: not produced: {missing[:5]}"
    bad = []
    for k in keys:
        err = rel_rms(got[k], ref[k])
        if not err <= tolerance(k):
            bad.append(f"{k}: rel RMS {err:.2e}")
    assert not bad, f"{label}: {len(bad)} values differ from transformers: {bad[:8]}"
    return len(keys)


def saved_values(run) -> dict:
    """A finished run's saves as {path@step<k>: value}."""
    return {key(p, k): v for p, per in run.saved.items() for k, v in enumerate(per) if v is not None}


def edited_run(case, edit: dict, how: str):
    """mixlens with `edit`, teacher-forced with the case's unedited tokens, every value read: written
    while the forward runs ("interleaved") or registered before it ("pre_registered").
    Returns (tracer, values)."""
    model = case.model
    if how == "interleaved":
        with model.generate(case.prompts, max_new_tokens=N_STEPS, forced_tokens=case.forced()) as tracer:
            got = read_every_value(model, tracer, edit)
        return tracer, got
    run = model.generate(case.prompts, max_new_tokens=N_STEPS, forced_tokens=case.forced(),
                         saves=[v["path"] for v in model.values()],
                         edits={key(edit["path"], edit["step"]): lambda v, e=edit: apply_op(v, e)}).run()
    return run, saved_values(run)


def assert_edit_moves_logits(tracer, ref: dict, edit: dict, label: str) -> None:
    """The edit changed the logits from its step on, not before (the comparison is not vacuous)."""
    diffs = [rel_rms(tracer.logits[k], ref[key("logits", k)]) for k in range(N_STEPS)]
    assert all(d <= 1e-4 for d in diffs[: edit["step"]]) and any(d > 1e-4 for d in diffs[edit["step"]:]), \
        (label, diffs)


def assert_saves_match(case, first_mixer_layer: int = 0) -> None:
    """A generate run with every value pre-registered as a save holds the oracle's values, no
    state_input at step 0 (fresh prompt) and the oracle's greedy tokens."""
    run = case.model.generate(case.prompts, max_new_tokens=N_STEPS, eos_token_id=-1,
                              saves=[v["path"] for v in case.model.values()]).run()
    compare(saved_values(run), case.ref, case.name + " saves")
    assert run.saved[f"layers.{first_mixer_layer}.linear_attn.state_input"][0] is None
    assert run.tokens == case.ref["tokens"].tolist()


def assert_edits_match(case, how: str) -> None:
    """Each edit of the case's spec, written by mixlens (`how`: edited_run) and inside transformers,
    gives the same values at every step, the edited site included (read-after-write: saves and reads
    hold what the forward used; betas after a decays write is the implied dt), and moves the logits."""
    for edit in case.spec["edits"]:
        ref = case.edited_ref(edit)
        label = f"{case.name} {edit['name']} ({how})"
        tracer, got = edited_run(case, edit, how)
        assert key(edit["path"], edit["step"]) in got, label
        compare(got, ref, label)
        assert_edit_moves_logits(tracer, case.ref, edit, label)


class ParityCase:
    """A fresh random model, its oracle values (self.ref) and mixlens on the same files (self.model);
    a subclass sets torch_model, prompts, ref, model and oracle_run(edits, feeds) -> values."""

    def forced(self) -> list[list[int]]:
        """The tokens fed after steps 0..N-2 (the unedited greedy run), per row."""
        return self.ref["tokens"][:, : N_STEPS - 1].tolist()

    def edited_ref(self, edit: dict) -> dict:
        """transformers with the same edit, teacher-forced with the unedited tokens (cached per edit)."""
        cache = self.__dict__.setdefault("_edited", {})
        if edit["name"] not in cache:
            feeds = [[[t] for t in col] for col in np.array(self.forced()).T.tolist()]
            cache[edit["name"]] = self.oracle_run([edit], feeds)
        return cache[edit["name"]]


class LiveCase(ParityCase):
    """A fresh random model `build(spec)`, saved and reloaded; its oracle values from
    `run(model, prompts, pad, n_steps, edits, feeds=)` (oracle_qwen.run's signature), which
    `check_plain(model, values, greedy=True)` holds to plain transformers; no greedy step a near tie
    (the seeds are chosen so); mixlens on the same files. `self.rec`: the unedited run's recorder."""

    def __init__(self, name: str, spec: dict, tmp_path, build, run, check_plain, pad: int = 0):
        import mixlens
        from mixlens_dev import fixtures as mf

        self.name, self.spec, self._run, self._pad = name, spec, run, pad
        model = build(spec)
        model.save_pretrained(tmp_path)
        self.torch_model = type(model).from_pretrained(tmp_path).eval()
        self.prompts = mf.torch_prompts(spec, self.torch_model.config.vocab_size)
        self.ref, self.rec = run(self.torch_model, self.prompts, pad, N_STEPS)
        check_plain(self.torch_model, self.ref, greedy=True)
        margin = mf.greedy_margin(self.ref, N_STEPS)
        assert margin > 1e-2, f"{name}: greedy margin {margin:.2e}; pick another seed"
        self.model = mixlens.StandardizedTransformer(str(tmp_path))
        self.n_layers = self.torch_model.config.num_hidden_layers

    def oracle_run(self, edits, feeds):
        return self._run(self.torch_model, self.prompts, self._pad, N_STEPS, edits, feeds=feeds)[0]


# The live-parity checks of a one-mixer family whose oracle is run(model, prompts, edits=, feeds=) (RWKV-4,
# xLSTM): `case` is a dict with model (mixlens), torch_model, prompts, ref (the oracle's unedited run) and
# spec["edit"].
def check_every_value(case, label: str) -> None:
    m = case["model"]
    with m.generate(case["prompts"], max_new_tokens=N_STEPS, eos_token_id=-1) as tracer:
        got = read_every_value(m, tracer)
    assert compare(got, case["ref"], label) > 50


def check_greedy_tokens(case) -> None:
    run = case["model"].generate(case["prompts"], max_new_tokens=N_STEPS, eos_token_id=-1).run()
    assert run.tokens == case["ref"]["tokens"].tolist()


def check_edit(case, oracle_run, label: str) -> None:
    """spec["edit"] in mixlens and in the oracle, teacher-forced with the unedited tokens: the same values
    at every step, and the last step's logits moved."""
    e = case["spec"]["edit"]
    feeds = [[[int(t)] for t in case["ref"]["tokens"][:, k]] for k in range(N_STEPS - 1)]
    ref = oracle_run(case["torch_model"], case["prompts"], edits=[e], feeds=feeds)
    m = case["model"]
    forced = case["ref"]["tokens"][:, : N_STEPS - 1].tolist()
    with m.generate(case["prompts"], max_new_tokens=N_STEPS, forced_tokens=forced) as tracer:
        got = read_every_value(m, tracer, e)
    assert compare(got, ref, f"{label} {e['name']}") > 50
    assert np.abs(ref[f"logits@step{N_STEPS - 1}"] - case["ref"][f"logits@step{N_STEPS - 1}"]).max() > 0


def check_padded_rows_alone(case, make_prompts) -> None:
    """Each row of a left-padded batch equals its own run (for families whose transformers ignores padding)."""
    m = case["model"]
    rows = make_prompts(5, [9, 4], case["torch_model"].config.vocab_size)
    batched = m.run(rows)["logits"]
    for r, p in enumerate(rows):
        alone = m.run([p])["logits"]
        assert rel_rms(batched[r, -len(p):], alone[0]) <= 1e-5


def check_backward_refused(case, family: str) -> None:
    import mixlens
    import pytest

    m = case["model"]
    with m.trace(case["prompts"], grad=True) as tr:
        pass
    with pytest.raises(mixlens.UnsupportedError, match=family):
        B, T = len(case["prompts"]), len(case["prompts"][0])
        tr.backward(np.ones((B, T, case["torch_model"].config.vocab_size), np.float32),
                    paths=["layers.0.linear_attn.decays"])


def check_tl_residual_only(case, adapter: str) -> None:
    """TransformerLens names without a TL adapter: the residual stream maps, every other name is refused."""
    import mixlens
    import pytest

    m = case["model"]
    run = m.generate(case["prompts"], max_new_tokens=1, saves=["blocks.1.hook_resid_post"]).run()
    assert np.asarray(run.saved["blocks.1.hook_resid_post"][0]).shape[-1] == case["torch_model"].config.hidden_size
    with pytest.raises(mixlens.UnknownValueError, match=f"no {adapter} adapter"):
        m.generate(case["prompts"], max_new_tokens=1, saves=["blocks.1.hook_mlp_out"]).run()


def live_case(spec: dict, name: str, tmp_path_factory, build, oracle_run, make_prompts) -> dict:
    """The `case` dict the checks above take: build(spec) saved by transformers, reloaded by mixlens, and the
    oracle's unedited run on spec["lens"] prompts."""
    import mixlens

    tm = build(spec)
    path = tmp_path_factory.mktemp(name)
    tm.save_pretrained(str(path))
    prompts = make_prompts(spec["seed"], spec["lens"], tm.config.vocab_size)
    return dict(spec=spec, torch_model=tm, path=path, model=mixlens.StandardizedTransformer(str(path)), prompts=prompts,
                ref=oracle_run(tm, prompts))
