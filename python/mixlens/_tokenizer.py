"""The checkpoint's tokenizer (``model.tokenizer``), run natively by the C++ Tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import numpy as np

from . import _core
from ._args import as_index as _as_index, check_bool as _check_bool, check_int as _check_int
from ._convert import is_torch
from ._inputs import _INT32_MAX, _check_rows
from .errors import InputError


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

    def token_to_id(self, token: str) -> Optional[int]:
        if not isinstance(token, str):
            raise InputError(f"token_to_id takes a token string, got {token!r} ({type(token).__name__})")
        return self._core.token_to_id(token)

    def id_to_token(self, id: int) -> str:
        return self._core.id_to_token(_check_int("token id", id, 0, _INT32_MAX))

    @property
    def vocab_size(self) -> int:
        return self._core.tokenizer_vocab_size
