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
