"""Issue 7 items 4-6 and issue 11 items 1 and 5 through the Python API, on every family's fixture:
cache snapshots (copy / copy.copy / copy.deepcopy / restore) and rollback, cold == warm scoring,
inputs_embeds (numpy and torch) == ids, read-after-write inside `with` blocks, two threads on one
model, an edit function reading through the tracer, a tracer never exited, and Ctrl-C."""

from __future__ import annotations

import _thread
import copy
import gc
import threading
import time
import warnings

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import REPO, rel_rms

FAMILIES = ["mamba/basic", "mamba2/g1_chunks", "qwen3_5/hv_2hk", "qwen3_next/moe_hv_2hk", "nemotron_h/groups2_edits",
            "bamba/groups2_edits", "falcon_h1/norm_before_gate",
            "zamba/shared_edits",
            "kimi_linear/kda_mla_moe_chunks"]


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda p: p.replace("/", "_"))
def model(request):
    return mixlens.load(str(REPO / "tests" / "fixtures" / request.param))


def ids(n: int, seed: int = 0) -> list[int]:
    return [(i * 37 + seed * 11 + 5) % 97 for i in range(n)]


def mixer_layer(model) -> int:
    return next(v["layer"] for v in model.values() if v["path"].endswith(".linear_attn.betas"))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ---- cache snapshots -------------------------------------------------------------------------


def test_copy_copy_and_deepcopy_are_real_copies(model):
    cache = model.new_cache(1)
    model.forward(ids(8), cache=cache)
    for snap in (cache.copy(), copy.copy(cache), copy.deepcopy(cache)):
        assert snap is not cache and snap._core is not cache._core
        assert (snap.steps, snap.seen_tokens) == (1, 8)
        a = model.forward([3], cache=snap)["logits"]
        assert snap.steps == 2 and cache.steps == 1  # the live cache did not move
        b = model.forward([3], cache=cache.copy())["logits"]
        np.testing.assert_array_equal(a, b)


def test_rollback_equals_never_seeing_the_wrong_tail(model):
    prompt, wrong, right = ids(10), ids(4, 1), ids(4, 2)
    cache = model.new_cache(1)
    model.forward(prompt, cache=cache)
    snap = cache.copy()
    for t in wrong:
        model.forward([t], cache=cache)
    cache.restore(snap)
    fresh = model.new_cache(1)
    model.forward(prompt, cache=fresh)
    np.testing.assert_array_equal(model.forward(right, cache=cache)["logits"], model.forward(right, cache=fresh)["logits"])
    with pytest.raises(mixlens.InputError, match="takes a mixlens Cache"):
        cache.restore("not a cache")
    # Not while an open trace runs over the cache.
    with model.trace([1], cache=cache):
        with pytest.raises(mixlens.InputError, match="an open trace is running over it"):
            cache.copy()


def test_cold_equals_warm_scoring_at_every_position(model):
    text = ids(13, 3)
    cold = log_softmax(model.run([text])["logits"][0])
    for k in range(1, len(text)):
        if k == len(text) - 1 and model.info["family"] in ("bamba", "nemotron_h"):
            continue  # a one-token continuation runs the decode step, which differs in the reference itself
        cache = model.new_cache(1)
        warm = [model.forward(text[:k], cache=cache)["logits"][0], model.forward(text[k:], cache=cache)["logits"][0]]
        np.testing.assert_allclose(log_softmax(np.concatenate(warm)), cold, atol=2e-4, rtol=0)


# ---- inputs_embeds ---------------------------------------------------------------------------


def test_embeddings_equal_ids_in_run_trace_and_generate(model):
    torch = pytest.importorskip("torch")
    prompts = [ids(9, 5), ids(5, 6)]
    ref = model.run(prompts, saves=["embed_tokens.output"])
    E = ref["embed_tokens.output"]
    mask = np.zeros(E.shape[:2], dtype=np.int64)
    mask[0, :] = 1
    mask[1, 4:] = 1
    np.testing.assert_array_equal(model.run(inputs_embeds=E, attention_mask=mask)["logits"], ref["logits"])
    with model.trace(inputs_embeds=torch.from_numpy(E).requires_grad_(), attention_mask=torch.from_numpy(mask)) as tr:
        np.testing.assert_array_equal(model.embed_tokens.output, E)
    np.testing.assert_array_equal(tr.logits, ref["logits"])
    by_ids = model.generate(prompts, max_new_tokens=5, eos_token_id=-1).run()
    by_emb = model.generate(inputs_embeds=E, attention_mask=mask, max_new_tokens=5, eos_token_id=-1).run()
    assert by_emb.tokens == by_ids.tokens
    # A single prompt as [T, hidden], continuing a cache with embeddings too.
    single = model.run(prompts[0], saves=["embed_tokens.output"])
    one = model.generate(inputs_embeds=single["embed_tokens.output"][0], max_new_tokens=4, eos_token_id=-1).run()
    assert one.tokens == model.generate(prompts[0], max_new_tokens=4, eos_token_id=-1).run().tokens
    c1, c2 = model.new_cache(1), model.new_cache(1)
    model.forward(prompts[0][:4], cache=c1)
    model.forward(prompts[0][:4], cache=c2)
    np.testing.assert_array_equal(model.forward(prompts[0][4:], cache=c1)["logits"],
                                  model.forward(inputs_embeds=single["embed_tokens.output"][:, 4:], cache=c2)["logits"])


def test_ids_padded_by_the_caller_with_their_attention_mask_equal_ragged_rows(model):
    """transformers' input_ids + attention_mask (a batch the caller left-padded, e.g. a tokenizer's output):
    with the model's pad id at padded positions it is the same batch mixlens pads itself (bitwise); another
    id there changes only the padded positions' values (the mask keeps them out of every real token's)."""
    torch = pytest.importorskip("torch")
    prompts = [ids(9, 5), ids(5, 6)]
    T, pad = 9, model._core.pad_token_id
    mask = np.array([[1] * 9, [0] * 4 + [1] * 5])
    saves = ["layers.*.layer_output"]
    ref = model.run(prompts, saves=saves)
    ours = model.run([prompts[0], [pad] * 4 + prompts[1]], attention_mask=mask, saves=saves)
    for k in ref:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(ref[k]), err_msg=k)
    odd = torch.tensor([prompts[0], [3, 1, 4, 1] + prompts[1]])
    with model.trace({"input_ids": odd, "attention_mask": torch.from_numpy(mask)}) as tr:
        h = model.layers_output[0].save()
    np.testing.assert_array_equal(np.asarray(tr.attention_mask), mask)
    np.testing.assert_array_equal(np.asarray(tr.input_ids), odd.numpy())
    real = mask.astype(bool)
    # Float rounding only (an MoE groups other tokens per expert); the pad id's own rows do differ.
    assert rel_rms(np.asarray(tr.logits)[real], np.asarray(ref["logits"])[real]) <= 1e-5
    assert not np.array_equal(np.asarray(h)[1, :4], np.asarray(ref["layers.0.layer_output"])[1, :4])
    gen = dict(max_new_tokens=4, eos_token_id=-1)
    assert model.generate(odd, attention_mask=mask, **gen).run().tokens == model.generate(prompts, **gen).run().tokens
    # What cannot be a left-padded batch is refused, naming the problem.
    with pytest.raises(mixlens.InputError, match="row 1 is not left padding"):
        model.run(odd, attention_mask=mask[:, ::-1].copy())  # right padding
    with pytest.raises(mixlens.InputError, match="attention_mask has shape"):
        model.run(odd, attention_mask=mask[:, 1:])
    with pytest.raises(mixlens.InputError, match="has no real token"):
        model.run(odd, attention_mask=np.array([[1] * 9, [0] * 9]))
    with pytest.raises(mixlens.InputError, match="attention_mask has shape"):
        model.run(prompts, attention_mask=mask)  # ragged rows are not a padded batch
    with pytest.raises(mixlens.InputError, match="dict input"):
        model.run({"input_ids": odd, "token_type_ids": odd})
    with pytest.raises(mixlens.InputError, match="cannot pad a call over a cache"):
        model.trace(odd, attention_mask=mask, cache=model.new_cache(2))


def test_generated_tokens_have_one_shape_for_one_prompt_given_as_ids_or_as_embeddings(model):
    """`tracer.tokens` (and `text`) follow the input's batch dimension, the same for ids and embeddings: a
    prompt without one (flat ids, a [T] array, [T,hidden] embeddings) gives a flat list; with one ([ids],
    a [1,T] array, [1,T,hidden] embeddings, as `run` returns them) a list per row."""
    prompt = ids(9, 5)
    E = model.run(prompt, saves=["embed_tokens.output"])["embed_tokens.output"]  # [1, T, hidden]
    gen = dict(max_new_tokens=3, eos_token_id=-1)
    flat = [model.generate(x, **gen).run() for x in (prompt, np.array(prompt))]
    flat.append(model.generate(inputs_embeds=E[0], **gen).run())
    rows = [model.generate(x, **gen).run() for x in ([prompt], np.array([prompt]))]
    rows.append(model.generate(inputs_embeds=E, **gen).run())
    with model.generate(inputs_embeds=E, **gen) as tr:
        pass
    rows.append(tr)
    want = flat[0].tokens
    assert len(want) == 3 and all(isinstance(t, int) for t in want)
    for r in flat:
        assert r.tokens == want
    for r in rows:
        assert r.tokens == [want]


def test_bad_embedding_inputs_are_clear_errors(model):
    D = model.info["hidden_size"]
    with pytest.raises(mixlens.InputError, match="not both"):
        model.run([1, 2], inputs_embeds=np.zeros((1, 2, D)))
    with pytest.raises(mixlens.InputError, match=r"\[batch, seq, hidden\]"):
        model.run(inputs_embeds=np.zeros((1, 2, 3, D)))
    with pytest.raises(mixlens.InputError, match="hidden_size"):
        model.run(inputs_embeds=np.zeros((1, 2, D + 1)))
    with pytest.raises(mixlens.InputError, match="attention_mask has shape"):
        model.run(inputs_embeds=np.zeros((1, 2, D)), attention_mask=[[1, 1, 1]])
    with pytest.raises(mixlens.InputError, match="attention_mask has shape"):  # ids take a mask of their shape
        model.run([1, 2], attention_mask=[[1, 1, 1]])


# ---- read-after-write ------------------------------------------------------------------------


def test_reads_after_writes_return_what_the_forward_uses(model):
    li = mixer_layer(model)
    mix = f"layers.{li}.linear_attn"
    prompt = ids(9, 7)
    quarter = lambda v: v * 0.25  # noqa: E731
    pre = model.run(prompt, saves=[f"{mix}.betas"], edits={f"{mix}.decays": quarter})
    with model.trace(prompt) as tr:
        m = model.layers[li].linear_attn
        m.betas  # read before the write
        m.decays = m.decays * 0.25
        betas_after = m.betas
    np.testing.assert_array_equal(betas_after, pre[f"{mix}.betas"])
    # A save registered before an edit of the same site records the edit.
    plain = model.run(prompt, saves=[f"{mix}.betas"])
    edited = model.run(prompt, saves=[f"{mix}.betas"], edits={f"{mix}.betas": lambda v: v * 0.5})
    np.testing.assert_array_equal(edited[f"{mix}.betas"], (plain[f"{mix}.betas"] * 0.5).astype(np.float32))
    # And a pre-registered save of a value written in the block.
    with model.trace(prompt, saves=[f"{mix}.betas"]) as tr:
        model.layers[li].linear_attn.betas = plain[f"{mix}.betas"] * 2
    np.testing.assert_array_equal(tr.saved[f"{mix}.betas"], (plain[f"{mix}.betas"] * 2).astype(np.float32))


def test_decode_step_reads_in_natural_order(model):
    li = mixer_layer(model)
    mix = f"layers.{li}.linear_attn"
    ref = model.generate(ids(6), max_new_tokens=3, eos_token_id=-1,
                         saves=[f"{mix}.attention_head_outputs", f"{mix}.state_output", f"{mix}.states"]).run()
    with model.generate(ids(6), max_new_tokens=3, eos_token_id=-1) as tr:
        for step in tr.iter[1:3]:
            m = model.layers[li].linear_attn
            y, s, st = m.attention_head_outputs, m.state_output, m.states
            np.testing.assert_array_equal(y, ref.saved[f"{mix}.attention_head_outputs"][step])
            np.testing.assert_array_equal(s, ref.saved[f"{mix}.state_output"][step])
            np.testing.assert_array_equal(st, ref.saved[f"{mix}.states"][step])


# ---- threads, deadlock, leaks, Ctrl-C (issue 11) -----------------------------------------------


def test_another_threads_read_raises_and_its_trace_waits(model):
    prompt = ids(7)
    ref = model.run(prompt, saves=["layers.0.layer_output"])["layers.0.layer_output"]
    other_read: list = []
    other_trace: list = []

    def reader():
        try:
            model.layers[0].layer_output
        except mixlens.InputError as e:
            other_read.append(str(e))

    def tracer():
        with model.trace(ids(7)) as t2:
            other_trace.append(model.layers[0].layer_output)
        other_trace.append(t2.logits)

    with model.trace(prompt):
        model.layers[0].layer_input
        th = threading.Thread(target=reader)
        th.start()
        th.join()
        waiter = threading.Thread(target=tracer)
        waiter.start()
        time.sleep(0.3)
        assert not other_trace, "another thread's trace ran while this one was open"
        mine = model.layers[0].layer_output
    waiter.join(10)
    assert other_read and "belongs to thread 'MainThread'" in other_read[0], other_read
    np.testing.assert_array_equal(mine, ref)
    np.testing.assert_array_equal(other_trace[0], ref)


def test_an_edit_reading_through_the_tracer_raises_instead_of_hanging(model):
    def edit(v):
        model.layers[0].layer_output  # would wait on the forward that is calling this function
        return v

    t0 = time.monotonic()
    with pytest.raises(mixlens.InputError, match="would wait on itself forever"):
        with model.trace(ids(5), edits={"layers.0.layer_input": edit}):
            model.logits
    assert time.monotonic() - t0 < 10
    with model.trace(ids(5)):  # the model is free again
        model.logits


def test_a_tracer_never_exited_is_released_when_collected(model):
    t = model.trace(ids(5))
    t.__enter__()
    model.layers[0].layer_input
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del t
        gc.collect()
    assert any("entered and never exited" in str(x.message) for x in w), [str(x.message) for x in w]
    with model.trace(ids(5)) as tr:
        model.logits
    assert tr.logits.shape[1] == 5


def test_the_forward_runs_on_the_blocks_own_thread(model):
    # Issue 9 item 5: the forward is a fiber on the caller's thread (a read is a stack switch, not a
    # thread wake-up); a pre-registered edit sees the thread that runs the block, in every thread.
    seen = []

    def edit(v):
        seen.append(threading.get_ident())
        return v

    def block():
        with model.trace(ids(5), edits={"layers.0.layer_input": edit}):
            model.layers[0].layer_output
        return threading.get_ident()

    assert seen == [] and block() == seen[-1]
    result = []
    th = threading.Thread(target=lambda: result.append(block()))
    th.start()
    th.join(60)
    assert result and result[0] == seen[-1] and result[0] != threading.get_ident()


def test_a_paused_forward_dropped_in_another_thread_unwinds(model):
    # The forward is paused on this thread's fiber; the tracer's last reference goes away in another
    # thread, whose close() resumes the fiber there so it unwinds (no hang, the model is free again).
    holder = [model.trace(ids(5))]
    holder[0].__enter__()
    model.layers[0].layer_input

    def drop():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            holder.clear()
            gc.collect()

    th = threading.Thread(target=drop)
    th.start()
    th.join(60)
    assert not th.is_alive() and not holder
    with model.trace(ids(5)) as tr:
        model.logits
    assert tr.logits.shape[1] == 5


class _CtrlC:
    """Simulates Ctrl-C (``_thread.interrupt_main``) `seconds` after entering, unless the block already ended
    (a signal arriving after the call returned would surface somewhere else in the test run)."""

    def __init__(self, seconds: float):
        self.seconds, self.sent, self.done = seconds, None, threading.Event()

    def _fire(self):
        if not self.done.wait(self.seconds):
            self.sent, self.sent_cpu = time.monotonic(), time.process_time()
            _thread.interrupt_main()

    def __enter__(self):
        threading.Thread(target=self._fire, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        return False

    def latency(self) -> float:
        return time.monotonic() - self.sent

    def prompt_enough(self) -> bool:
        """Within a second of wall time, or, on a machine so loaded that a second of wall time buys this
        process little CPU, within 0.75 CPU-seconds (all threads: well under the rest of the forward)."""
        return self.latency() < 1.0 or time.process_time() - self.sent_cpu < 0.75


def test_ctrl_c_interrupts_a_long_generation_within_a_second(model):
    with pytest.raises(KeyboardInterrupt):
        with _CtrlC(0.3) as c:
            model.generate(ids(4), max_new_tokens=10**9, eos_token_id=-1).run()
    assert c.prompt_enough(), f"interrupt took {c.latency():.2f} s"
    with model.trace(ids(4)):  # usable afterwards
        model.logits


def test_ctrl_c_interrupts_a_long_forward_within_a_second():
    # 60k tokens: each of the 3 layers takes ~0.25 s here, the forward ~0.8 s; the flag is checked
    # between layers (where the forward, on the caller's thread, also polls for signals every 50 ms).
    model = mixlens.load(str(REPO / "tests" / "fixtures" / "mamba2" / "g1_chunks"))
    long_prompt = [i % 90 for i in range(60_000)]
    for run in (lambda: model.run(long_prompt), lambda: model.trace(long_prompt).run()):
        try:
            with _CtrlC(0.15) as c:
                run()
        except KeyboardInterrupt:
            assert c.prompt_enough(), f"interrupt took {c.latency():.2f} s"
        else:
            assert c.sent is None, "the interrupt arrived but the call did not raise"
            pytest.skip("the forward finished before the interrupt on this machine")



def test_an_interrupt_while_a_block_exits_never_leaves_the_model_locked(monkeypatch):
    """A Ctrl-C landing in the tracer's release (here: unmounting torch's `.save`, its first step) left the
    model's lock held with no open tracer: every later trace waited forever. The lock is released in a
    `finally`, and by the tracer's __del__ when it dies still holding it."""
    import mixlens._tracer as mm  # the tracer module releases the model (mixlens._model re-exports Tracer)

    m = mixlens.load(str(REPO / "tests" / "fixtures" / "mamba2" / "g1_chunks"))
    original = mm.unmount_tensor_save

    def interrupted():
        monkeypatch.setattr(mm, "unmount_tensor_save", original)
        raise KeyboardInterrupt

    monkeypatch.setattr(mm, "unmount_tensor_save", interrupted)
    tr = m.trace(ids(4))
    with pytest.raises(KeyboardInterrupt):
        with tr:
            tr._save_mounted = True  # whatever the output type, the release starts with the unmount
            m.logits
    assert not m._trace_lock.locked()
    # A release cut short later still (the flag set, the lock held): the tracer's __del__ releases it.
    assert m._trace_lock.acquire(blocking=False)
    tr._holds_model = True
    del tr
    gc.collect()
    done = []
    t = threading.Thread(target=lambda: done.append(m.trace(ids(4)).run().logits.shape), daemon=True)
    t.start()
    t.join(30)
    assert done, "a trace after the interrupted exit waited for the model's lock"


def test_reading_or_writing_outside_a_block_says_which_and_where():
    m = mixlens.load(str(REPO / "tests" / "fixtures" / "mamba2" / "g1_chunks"))
    with pytest.raises(mixlens.InputError, match=r"'layers.1.layer_output' can only be written inside a `with "):
        m.layers_output[1] = np.zeros((1, 4, m.hidden_size), np.float32)
    with m.trace(ids(4)):
        m.layers_output[1]
    with pytest.raises(mixlens.InputError, match=r"can only be read inside .* no trace is open"):
        m.layers_output[1]


def test_steer_names_the_argument_that_does_not_fit():
    m = mixlens.load(str(REPO / "tests" / "fixtures" / "mamba2" / "g1_chunks"))
    d = m.hidden_size
    with m.trace(ids(4)):
        with pytest.raises(mixlens.InputError, match=r"steering_vector of shape \[17\] does not broadcast"):
            m.steer(1, np.ones(17, np.float32))
    with m.trace(ids(4)):
        with pytest.raises(mixlens.InputError, match=r"token_positions \[10\] / batch_index None do not fit"):
            m.steer(1, np.ones(d, np.float32), token_positions=[10])
    with m.trace(ids(4)):  # a per-position vector broadcasts as it does in nnterp
        before = np.array(m.layers_output[1], dtype=np.float32)
        m.steer(1, np.stack([np.full(d, 1, np.float32), np.full(d, 2, np.float32)]), token_positions=[0, 2])
        after = np.array(m.layers_output[1], dtype=np.float32)
    np.testing.assert_allclose(after[:, 0], before[:, 0] + 1, rtol=1e-6)
    np.testing.assert_allclose(after[:, 2], before[:, 2] + 2, rtol=1e-6)
    np.testing.assert_array_equal(after[:, [1, 3]], before[:, [1, 3]])


def test_a_padded_batch_over_a_cache_says_why_and_what_to_do_instead():
    m = mixlens.load(str(REPO / "tests" / "fixtures" / "mamba2" / "g1_chunks"))
    cache = m.new_cache(2)
    padded = {"input_ids": np.array([[0, 0, 5, 6], [5, 6, 7, 8]]), "attention_mask": np.array([[0, 0, 1, 1], [1, 1, 1, 1]])}
    with pytest.raises(mixlens.InputError, match=r"a fresh one included.*without cache=.*new_cache\(1\)"):
        m.forward(padded, cache=cache)
    with pytest.raises(mixlens.InputError, match=r"a fresh one included.*without a cache.*new_cache\(1\)"):
        m.forward([[5, 6], [5, 6, 7, 8]], cache=cache)
