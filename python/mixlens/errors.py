"""mixlens exception classes. Every error the C++ library raises arrives as one of these.

All derive from :class:`MixlensError`; where a builtin fits they also derive from it, so
``except KeyError``-style code keeps working (``UnknownValueError`` is a ``LookupError``, ``WriteError``
and ``InputError`` are ``ValueError``).
"""

from __future__ import annotations

__all__ = [
    "MixlensError",
    "CheckpointError",
    "ConfigError",
    "TokenizerError",
    "UnknownValueError",
    "UnknownAttributeError",
    "WriteError",
    "UnsupportedError",
    "InputError",
    "OutOfOrderError",
    "ResourceError",
    "NumericError",
    "InterruptedRunError",
]


class MixlensError(Exception):
    """Base of every mixlens error."""


class CheckpointError(MixlensError):
    """A checkpoint folder / file is missing, truncated or corrupt, or lacks / mis-shapes a tensor;
    also a hub id that is not in the local HuggingFace cache."""


class ConfigError(MixlensError):
    """config.json is missing, not JSON, or a field is absent, of the wrong type or inconsistent."""


class TokenizerError(MixlensError):
    """tokenizer.json is missing or malformed, or uses a component mixlens does not support."""


class UnknownValueError(MixlensError, LookupError):
    """A value path that does not exist for this model. The message suggests the nearest valid path,
    or names the block's kind when a block lacks the component (``self_attn`` on a Mamba block)."""


class UnknownAttributeError(UnknownValueError, AttributeError):
    """An attribute of ``model.layers[i].linear_attn`` (or another envoy) that names no value there. Both an
    :class:`UnknownValueError` and an ``AttributeError``, so ``hasattr(envoy, "nonexistent")`` is False."""


class WriteError(MixlensError, ValueError):
    """A write of the wrong shape or dtype, with NaN, out of range (``betas < 0``, ``decays > 0``), or to
    a read-only value (``states``). Nothing is applied when it is raised."""


class UnsupportedError(MixlensError):
    """An architecture / model_type / feature mixlens does not implement."""


class InputError(MixlensError, ValueError):
    """Bad arguments: empty prompt, token id outside the vocabulary, bad generation options, a step the
    run never makes."""


class OutOfOrderError(InputError):
    """Inside a ``with model.trace(...)`` block: a value the forward has already computed and consumed
    was asked for. Values are served in forward order; the message names the value asked for and the
    one the forward is at."""


class ResourceError(MixlensError, MemoryError):
    """A size beyond mixlens' documented limits (safetensors entries, chunk length, the saved-values
    budget ``MIXLENS_SAVE_BUDGET_MB``, ...) or an allocation that failed (out of memory)."""


class NumericError(MixlensError, ArithmeticError):
    """A forward produced NaN / inf logits. The message names the first value of that call that went
    non-finite (e.g. ``layers.3.linear_attn.attention_output = NaN at [0, 2, 17]``); usually a written value
    of extreme magnitude. Greedy decoding and sampling also refuse NaN logits with this error."""


class InterruptedRunError(MixlensError):
    """A run stopped by its cancellation flag (C++ ``mixlens::InterruptedError``). Ctrl-C itself arrives as
    ``KeyboardInterrupt`` within about 50 ms of the signal (the forward stops at its next layer)."""
