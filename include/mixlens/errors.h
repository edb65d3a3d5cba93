// mixlens error types. Every failure a user can cause raises one of these, never a crash.
// Each message names the file / tensor / value / field concerned and what was expected.
#pragma once
#include <stdexcept>
#include <string>

namespace mixlens {

/// Base of all mixlens errors.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A checkpoint file is missing, truncated, corrupt, or lacks / mis-shapes a tensor.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// config.json is missing, not JSON, or a field is absent / of the wrong type / inconsistent.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// tokenizer.json is missing, malformed, or uses a model / component mixlens does not support.
class TokenizerError : public Error {
 public:
  using Error::Error;
};

/// A value path (e.g. "layers.3.linear_attn.betas") that does not exist for this model.
class UnknownValueError : public Error {
 public:
  using Error::Error;
};

/// A write (edit) of the wrong shape, a NaN, or a value outside its allowed range.
class WriteError : public Error {
 public:
  using Error::Error;
};

/// An architecture / model_type / feature mixlens does not implement.
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

/// Bad arguments to an API call (empty prompt batch, token id out of range, bad options).
class InputError : public Error {
 public:
  using Error::Error;
};

/// A size beyond mixlens' documented limits (tensor entries, chunk length, saved steps, ...) or an
/// allocation that failed (std::bad_alloc is mapped to this at the API boundary).
class ResourceError : public Error {
 public:
  using Error::Error;
};

/// A forward produced non-finite logits (NaN / inf). The message names the first value of the call
/// that went non-finite (e.g. "layers.3.linear_attn.attention_output"), where, and what it held.
class NumericError : public Error {
 public:
  using Error::Error;
};

/// An interleaved read / write (Session) of a value the forward has already computed and
/// consumed: values are served in forward order, and the message names where the forward is.
class OutOfOrderError : public InputError {
 public:
  using InputError::InputError;
};

/// A run stopped by its cancellation flag (Ctrl-C in Python, Session::abort, a CancelFlag set by
/// another thread): the forward checks it between layers and between generation steps.
class InterruptedError : public Error {
 public:
  using Error::Error;
};

}  // namespace mixlens
