"""``tokenizer.stream()`` (issue 23 item 4): the C++ Tokenizer::StreamDecoder in Python, against HF
tokenizers' ``tokenizers.decoders.DecodeStream`` step by step, on emoji, CJK, combining marks and
byte-fallback strings, with the committed tokenizer fixtures (tests/fixtures/tokenizer/) and the shipped
models' tokenizer.json."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

import mixlens

tokenizers = pytest.importorskip("tokenizers")
from tokenizers.decoders import DecodeStream  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "tokenizer"
MODELS = REPO / "models"

TEXTS = [
    # emoji: 4-byte characters, ZWJ families, skin tones, flags, keycaps, variation selectors
    "Hello 👋 world 🌍!", "👨‍👩‍👧‍👦 family", "👍🏽👍🏿", "🇯🇵🇫🇷🏳️‍🌈", "1️⃣ #️⃣ ❤️",
    # CJK and other multi-byte scripts
    "東京は日本の首都です。", "我爱自然语言处理", "한국어 문장입니다", "ｶﾀｶﾅ と ひらがな", "𠜎𠜱𠝹 (CJK ext. B)",
    # combining marks: decomposed accents, stacked diacritics, Devanagari / Thai vowel signs
    "e\u0301cole cafe\u0301 n\u0303", "Z\u0364\u0351\u0313\u0324\u0354a\u0308\u0301", "नमस्ते दुनिया", "สวัสดีครับ",
    "a\u0300\u0301\u0302\u0303\u0304\u0305\u0306\u0307",
    # mixed, with ASCII between
    "Once upon a time, 小猫 met 🐉 at the café.",
]
# Characters outside tiny-unk's vocabulary become <0xNN> byte tokens (byte_fallback, for the few bytes it has;
# with no decoder they decode as their text, as HF's). Byte-level BPE splits the rest into byte tokens.
BYTE_FALLBACK_TEXTS = ["é", "日本", "🙂 ok", "ab\u0301c", "x€y"]


def model_with_tokenizer(tmp: Path, tokenizer_json: Path) -> mixlens.StandardizedTransformer:
    """The shipped Mamba-2's weights with another tokenizer.json: the tokenizer is what is tested."""
    tmp.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(MODELS / "mamba2-tinystories" / f, tmp / f)
    shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
    return mixlens.load(str(tmp))


TOKENIZER_FILES = {name: FIX / name / "tokenizer.json" for name in ("gpt-neox-20b", "qwen3", "gpt2", "tiny-unk")}
TOKENIZER_FILES.update({m: MODELS / m / "tokenizer.json"
                        for m in ("mamba2-tinystories", "mamba-tinystories", "qwen3_5-tinystories")})


@pytest.fixture(scope="module", params=sorted(TOKENIZER_FILES))
def pair(request, tmp_path_factory):
    """(mixlens tokenizer, HF tokenizer) of one tokenizer.json."""
    path = TOKENIZER_FILES[request.param]
    mine = model_with_tokenizer(tmp_path_factory.mktemp(request.param), path).tokenizer
    return request.param, mine, tokenizers.Tokenizer.from_file(str(path))


def streams(mine, hf, ids, skip=False, prompt=None):
    """Each step's piece from mixlens and from HF."""
    ours = mine.stream(ids=prompt, skip_special_tokens=skip)
    theirs = DecodeStream(ids=prompt, skip_special_tokens=skip) if prompt else DecodeStream(skip_special_tokens=skip)
    return [ours.step(i) for i in ids], [theirs.step(hf, i) for i in ids], ours


def check_text(name, mine, hf, text, skip=False):
    ids = hf.encode(text).ids
    got, want, stream = streams(mine, hf, ids, skip)
    assert got == want, f"{name} {text!r}: ids {ids}\n mixlens {got}\n HF      {want}"
    whole = "".join(p for p in got if p is not None) + (stream.flush() or "")
    assert whole == mine.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    return ids, got


def test_stream_matches_hf_decode_stream_on_multibyte_text(pair):
    name, mine, hf = pair
    held = 0
    for text in TEXTS + BYTE_FALLBACK_TEXTS:
        ids, got = check_text(name, mine, hf, text)
        held += got.count(None)
    if name != "tiny-unk":  # byte-level BPE: some character of these texts is split across tokens
        assert held > 0, f"{name}: no step held a split character back (the texts test nothing)"


def test_byte_fallback_tokens_stream_as_hf(pair):
    name, mine, hf = pair
    if name != "tiny-unk":
        pytest.skip("byte_fallback tokenizer only")
    byte_tokens = 0
    for text in BYTE_FALLBACK_TEXTS:
        ids, got = check_text(name, mine, hf, text)
        byte_tokens += sum(hf.id_to_token(i).startswith("<0x") for i in ids)
    assert byte_tokens >= 2, "no byte-fallback token in these texts (the test tests nothing)"


def test_special_tokens_are_kept_or_skipped_as_hf(pair):
    name, mine, hf = pair
    specials = [t.content for t in hf.get_added_tokens_decoder().values() if t.special]
    if not specials:
        pytest.skip("no special token")
    text = f"{specials[0]}日本 👋{specials[-1]} é"
    for skip in (False, True):
        check_text(name, mine, hf, text, skip)


def test_a_prompt_given_first_is_not_repeated(pair):
    name, mine, hf = pair
    prompt = hf.encode("The prompt 東京").ids
    ids = hf.encode(" then 👋 café").ids
    got, want, _ = streams(mine, hf, ids, prompt=prompt)
    assert got == want
    assert "".join(p for p in got if p) == mine.decode(prompt + ids)[len(mine.decode(prompt)):]


def test_random_ids_never_split_a_character_and_join_to_decode(pair):
    """Any ids, valid UTF-8 or not: the pieces equal HF's (an invalid byte is held back as HF holds it),
    and the pieces plus flush() equal decode()."""
    name, mine, hf = pair
    rng = random.Random(23)
    vocab = hf.get_vocab_size(with_added_tokens=True)
    for _ in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        got, want, stream = streams(mine, hf, ids)
        for p in got:
            assert p is None or (isinstance(p, str) and p.encode("utf-8").decode("utf-8") == p)
        whole = "".join(p for p in got if p is not None) + (stream.flush() or "")
        decoded = mine.decode(ids)
        assert whole == decoded == hf.decode(ids, skip_special_tokens=False)
        assert got == want, f"{name} ids {ids}"


def test_step_takes_a_list_and_flush_ends_the_stream(pair):
    name, mine, hf = pair
    ids = hf.encode("日本 👋").ids
    s = mine.stream()
    assert s.step(ids) == DecodeStream(skip_special_tokens=False).step(hf, ids) == mine.decode(ids)
    assert s.flush() is None
    # A character cut short: flush() writes what decode() writes for it (U+FFFD), then starts over.
    cut = hf.encode("🙂", add_special_tokens=False).ids
    if len(cut) > 1 and mine.decode(cut[:1]).endswith("\ufffd"):  # byte-level: the emoji is split
        s = mine.stream()
        assert s.step(cut[0]) is None
        assert s.flush() == mine.decode(cut[:1])
        assert s.step(cut) == "🙂"


def test_stream_arguments_are_checked(pair):
    _, mine, _ = pair
    s = mine.stream()
    for bad in ("a", 1.5, -1, 2**31, [1, "x"], None):
        with pytest.raises(mixlens.InputError):
            s.step(bad)
    with pytest.raises(mixlens.InputError):
        mine.stream(skip_special_tokens="yes")
    with pytest.raises(mixlens.InputError):
        mine.stream(ids="abc")


def test_a_stream_outlives_its_model(tmp_path):
    m = model_with_tokenizer(tmp_path / "m", TOKENIZER_FILES["gpt-neox-20b"])
    ids = m.tokenizer.encode("東京 👋")
    s = m.tokenizer.stream()
    del m
    import gc

    gc.collect()
    assert "".join(p for p in (s.step(i) for i in ids) if p) == "東京 👋"


def _cut_points(hf, text):
    """The ids of `text` and every split point k at which ids[:k] ends inside a character."""
    ids = hf.encode(text, add_special_tokens=False).ids
    return ids, [k for k in range(1, len(ids)) if hf.decode(ids[:k]).endswith("\ufffd")]


def test_a_list_step_ending_inside_a_character_is_held_back_whole_as_hf(pair):
    """HF's step with a list decodes the ids as one step: text that ends inside a character is held back
    whole (None), not the part before it (found by a fresh-user trial: 'Hello ' came out early)."""
    name, mine, hf = pair
    ids, cuts = _cut_points(hf, "Hello 😀 world 日本")
    if not cuts:
        pytest.skip(f"{name}: no character split across tokens")
    for k in cuts:
        ours, theirs = mine.stream(), DecodeStream(skip_special_tokens=False)
        got = [ours.step(ids[:k]), ours.step(ids[k:])]
        want = [theirs.step(hf, ids[:k]), theirs.step(hf, ids[k:])]
        assert got == want, f"{name}: split at {k} of {ids}: mixlens {got}, HF {want}"
        assert got[0] is None


def test_a_prompt_ending_inside_a_character_streams_as_hf(pair):
    """A prompt cut inside a character: the first complete piece holds the prompt's held-back text, as HF's."""
    name, mine, hf = pair
    ids, cuts = _cut_points(hf, "Hello 😀 world")
    if not cuts:
        pytest.skip(f"{name}: no character split across tokens")
    for k in cuts + [1]:
        got, want, _ = streams(mine, hf, ids[k:], prompt=ids[:k])
        assert got == want, f"{name}: prompt {ids[:k]}, then {ids[k:]}: mixlens {got}, HF {want}"
