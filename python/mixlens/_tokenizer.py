"""The checkpoint's tokenizer (``model.tokenizer``) and its streaming decoder, run natively by the C++
Tokenizer (mixlens/tokenizer.h)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import numpy as np

from . import _core
from ._args import as_index as _as_index, check_bool as _check_bool, check_int as _check_int
from ._convert import is_torch
from ._inputs import _INT32_MAX, _check_rows
from .errors import InputError


def _id_list(ids, what: str) -> list[int]:
    """One id or a sequence of ids (list / array / 1-d tensor) as a list of ints in [0, 2^31)."""
    try:
        return [_check_int(what, _as_index(ids), 0, _INT32_MAX)]
    except TypeError:
        pass
    if is_torch(ids) or isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InputError(f"{what} must be an int or a list of ints, got {ids!r} ({type(ids).__name__})")
    return _check_rows([list(ids)], what)[0]


class DecodeStream:
    """Incremental decoding for generation (``tokenizer.stream()``), as HF tokenizers'
    ``tokenizers.decoders.DecodeStream``: :meth:`step` takes the next token id and returns the text of
    the ids since the last piece, or None while that text would end in U+FFFD (a UTF-8 character split
    across byte tokens is held back until its last byte arrives; an invalid byte until a token follows
    it), piece for piece as HF's. A piece never holds part of a character, and the pieces of a stream
    joined (with :meth:`flush` at the end) equal ``tokenizer.decode(ids)``. The C++
    ``Tokenizer::StreamDecoder`` does the work; the stream stays usable after its model is gone."""

    __slots__ = ("_core",)

    def __init__(self, core: "_core.StreamDecoder"):
        self._core = core

    def step(self, id) -> Optional[str]:
        """Add token `id` (an int, or a list / array of ids, as HF's ``step``) and return the text that
        became complete, None when there is none yet (also for an id skipped as a special token, or one
        with no token, which decodes to nothing as in ``decode``). InputError for an id that is not an
        integer in [0, 2^31)."""
        return self._core.push(_id_list(id, "token id")) or None

    def flush(self) -> Optional[str]:
        """End of the stream: the bytes held back (an incomplete character becomes U+FFFD, as ``decode``
        writes it), or None when nothing is held; the stream then starts over as a new one. HF's
        DecodeStream has no flush (it keeps an incomplete character back for good)."""
        return self._core.flush() or None

    def __repr__(self) -> str:
        return "<mixlens DecodeStream>"


class Tokenizer:
    """The checkpoint's tokenizer.json, run natively (matches HF ``tokenizers``)."""

    def __init__(self, core: "_core.Model"):
        self._core = core

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (HF ``Tokenizer.encode(text).ids``). TokenizerError without tokenizer.json;
        InputError for text that is not valid Unicode (a lone surrogate such as '\\ud800') or not a string."""
        if not isinstance(text, str):
            raise InputError(f"encode takes one string, got {text!r} ({type(text).__name__})")
        add_special_tokens = _check_bool("add_special_tokens", add_special_tokens)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            # nanobind cannot convert it and would raise a TypeError about the argument types.
            raise InputError(f"text is not valid Unicode: {e.reason} at character {e.start} "
                             f"({text[e.start:e.end]!r}); it cannot be encoded as UTF-8") from None
        return self._core.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids: a list / array / 1-d tensor of ids, or one id (as HF's tokenizers)."""
        try:
            ids = [_as_index(ids)]
        except TypeError:
            if is_torch(ids) or isinstance(ids, np.ndarray):
                ids = ids.tolist()
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise InputError(f"decode takes token ids (a list of ints, or one int), got {type(ids).__name__}") from None
        return self._core.decode(_check_rows([list(ids)])[0], _check_bool("skip_special_tokens", skip_special_tokens))

    def stream(self, ids: Optional[Sequence[int]] = None, skip_special_tokens: bool = False) -> DecodeStream:
        """A :class:`DecodeStream` for decoding generated ids one at a time (HF's
        ``DecodeStream(ids, skip_special_tokens)``; here ``stream.step(id)`` needs no tokenizer argument).
        `ids`: a prompt already shown, fed first as one step without output, so a step's text is
        what follows it; where the prompt ends inside a character, the first complete piece repeats the
        prompt's held-back text, as HF's does. `skip_special_tokens` drops special tokens as in :meth:`decode`. TokenizerError
        without tokenizer.json; InputError for ids that are not integers in [0, 2^31)."""
        skip = _check_bool("skip_special_tokens", skip_special_tokens)
        prompt = [] if ids is None else _id_list(ids, "ids")
        stream = DecodeStream(self._core.stream_decoder(skip))
        if prompt:
            stream._core.push(prompt)
        return stream

    def token_to_id(self, token: str) -> Optional[int]:
        if not isinstance(token, str):
            raise InputError(f"token_to_id takes a token string, got {token!r} ({type(token).__name__})")
        return self._core.token_to_id(token)

    def id_to_token(self, id: int) -> str:
        return self._core.id_to_token(_check_int("token id", id, 0, _INT32_MAX))

    @property
    def vocab_size(self) -> int:
        return self._core.tokenizer_vocab_size
