"""
mixlens native core: models, traces and the interleaving Session (use the `mixlens` package)
"""

from collections.abc import Callable, Sequence
from typing import Annotated

import numpy
from numpy.typing import NDArray

from mixlens.errors import (
    CheckpointError as CheckpointError,
    ConfigError as ConfigError,
    InputError as InputError,
    InterruptedRunError as InterruptedRunError,
    MixlensError as MixlensError,
    NumericError as NumericError,
    OutOfOrderError as OutOfOrderError,
    ResourceError as ResourceError,
    TokenizerError as TokenizerError,
    UnknownValueError as UnknownValueError,
    UnsupportedError as UnsupportedError,
    WriteError as WriteError
)


def default_model_path() -> str:
    """
    The model used when none is given: $MIXLENS_MODEL, else the models/mamba2-tinystories shipped in an installed package next to the running executable's prefix, else the source tree's (mixlens::default_model_path; mixlens.default_model_path() looks in this package first).
    """

def resolve_hub_id(hub_id: str, cache_dir: str = '') -> str:
    """
    Snapshot folder of 'owner/name[@revision]' in the local HuggingFace cache (the C++ resolver Model.load uses; never leaves the cache). CheckpointError when absent.
    """

def hub_cache_dir() -> str:
    """The HuggingFace cache resolve_hub_id uses by default, read now."""

def convert_checkpoint(path: str, out_dir: str, dtype: str = 'bfloat16') -> dict:
    """
    mixlens::convert_checkpoint: writes out_dir with the matmul weights in dtype; returns a dict {out_dir, converted, kept, bytes_before, bytes_after, copied_files}.
    """

def split_step(key: str) -> tuple[str, int, int]:
    """
    mixlens::split_step: 'path@step3' -> (path, 3, 3), 'path' -> (path, 0, 2**31 - 1) (every step); the one parser of the '@step<k>' suffix (InputError when malformed).
    """

def route_kernels(family: str, route: str) -> None:
    """
    Force the recurrent-mixer algorithm of a family process-wide: 'recurrent', 'chunked' or 'default'.
    """

def kernel_route(family: str) -> str: ...

def set_chunk_size(model: Model, chunk_size: int) -> None:
    """
    Mamba-2 chunk size override (1 = chunk_per_token); 0 restores config.chunk_size.
    """

class Cache:
    """
    Cached recurrent state of a batch (conv windows and SSM states per layer).
    """

    @property
    def batch(self) -> int: ...

    @property
    def seen_tokens(self) -> int: ...

    @property
    def steps(self) -> int:
        """forward calls made with this cache (the next call's step index)"""

    @property
    def broken(self) -> str:
        """
        '' while consistent; else why not (a forward over it stopped midway). A broken cache refuses forward and copy (InputError) until restore(snapshot).
        """

    def copy(self) -> Cache:
        """
        An independent deep copy (conv windows, recurrent states, KV entries, counters), bitwise.
        """

    def restore(self, snapshot: Cache) -> None:
        """
        Make this cache bitwise equal to `snapshot` (a copy() of a cache of the same model and batch).
        """

class StreamDecoder:
    """Incremental decoding (mixlens/tokenizer.h Tokenizer::StreamDecoder)."""

    def push(self, ids: Sequence[int]) -> str:
        """
        One step of `ids`: the text of the ids since the last non-empty return, or '' while it would end in U+FFFD (a split UTF-8 character held back; HF DecodeStream's rule); an id with no token decodes to nothing.
        """

    def flush(self) -> str:
        """
        What is held back (an incomplete character as U+FFFD); the stream starts over.
        """

class Model:
    @staticmethod
    def load(path: str, dtype: str = 'float32', deterministic: bool | None = None) -> Model:
        """
        Load a checkpoint; dtype: 'float32' (default), 'bfloat16', 'float16' or 'auto' (LoadOptions::dtype); deterministic: batch-invariant numerics (LoadOptions::deterministic; None: MIXLENS_DETERMINISTIC).
        """

    @property
    def info(self) -> dict: ...

    def values(self, batch: int = 1, seq: int = 1) -> list: ...

    def support(self) -> dict[str, dict[int, str]]: ...

    @property
    def has_tokenizer(self) -> bool: ...

    @property
    def pad_token_id(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """
        A Tokenizer::StreamDecoder of this model's tokenizer (TokenizerError without tokenizer.json).
        """

    def token_to_id(self, arg: str, /) -> int | None: ...

    def id_to_token(self, arg: int, /) -> str: ...

    @property
    def tokenizer_vocab_size(self) -> int: ...

    def mixer_identity(self, layer: int, prompt_seq: int) -> dict:
        """
        mixlens::mixer_identity (mixlens/trace.h): {kind, prompt_kernel, step_kernel, state_op} of a layer's recurrent mixer.
        """

    def set_chunk_size(self, chunk_size: int) -> None: ...

    @property
    def prefill_chunk(self) -> int:
        """
        Chunked prefill length in tokens (0 = off); see Model::set_prefill_chunk.
        """

    @prefill_chunk.setter
    def prefill_chunk(self, arg: int, /) -> None: ...

    def project_on_vocab(self, hidden: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)]) -> object:
        """Model::project_on_vocab: final norm + LM head, [..., D] -> [..., V]."""

    def head_weight(self, role: str) -> object:
        """A copy of the 'embed_tokens', 'ln_final' or 'lm_head' weight."""

    def new_cache(self, batch: int) -> Cache: ...

    def run(self, prompts: Sequence[Sequence[int]], saves: Sequence[tuple[str, int, int]] = [], edits: Sequence[tuple[str, int, int, object]] = [], embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, mask: Sequence[int] = [], all_logits: bool = True) -> tuple:
        """
        One forward of token rows (left-padded here, or already padded with a 0/1 left-padding mask) or of inputs_embeds [B,T,hidden] with an optional 0/1 mask: (logits [B,T,V] or, all_logits=False, [B,1,V], {'path@step0': array}). Ctrl-C stops it between layers.
        """

    def token_mixing(self, prompts: Sequence[Sequence[int]], mask: Sequence[int], layer: int, rows: tuple[int, int], cols: tuple[int, int], heads: tuple[int, int]) -> tuple:
        """
        mixlens::token_mixing (include/mixlens/mixing.h): (mixing [B,h,r,c], skip [B,r,h,P], skip meaning); each range (begin, end) as a Python slice, end 2**63-1 = to the end.
        """

    def state_contributions(self, prompts: Sequence[Sequence[int]], mask: Sequence[int], layer: int, t: int, cols: tuple[int, int], heads: tuple[int, int]) -> object:
        """
        mixlens::state_contributions: [B,h,c,*state] per source token of the state after token t.
        """

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, greedy: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id: int | None = None, saves: Sequence[tuple[str, int, int]] = [], edits: Sequence[tuple[str, int, int, object]] = [], embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, mask: Sequence[int] = []) -> tuple:
        """
        (new tokens per prompt, steps, {'path@step{k}': array}). Ctrl-C stops it between layers.
        """

    def forward(self, rows: Sequence[Sequence[int]], cache: Cache, saves: Sequence[tuple[str, int, int]] = [], edits: Sequence[tuple[str, int, int, object]] = [], all_logits: bool = True, embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None) -> tuple:
        """
        One forward call continuing `cache` (updated in place): (logits, saved). Ctrl-C stops it between layers (the cache is then unspecified: restore a copy()).
        """

class Session:
    """
    A forward run as a fiber on the caller's thread, paused where read()/write() ask (mixlens/session.h).
    """

    def read(self, step: int, path: str) -> object: ...

    def set_output(self, cls: object, from_dlpack: object | None, error: object, released_cls: object | None = None, watch_limit: int = 16777216, watch_copy_limit: int = 262144) -> None:
        """
        Output type for read_value: cls (ValueArray / ValueTensor), a DLPack capsule -> torch tensor function (torch._C._from_dlpack) or None for numpy, error(step, path) -> the WriteError for an edit of a released value, released_cls: the class a released torch value over watch_limit bytes takes (mixlens._inplace; None: checked at every move instead); torch values up to watch_limit bytes are checked by their bytes instead (a copy up to watch_copy_limit bytes, a checksum above).
        """

    def read_value(self, step: int, path: str) -> object:
        """
        read() whose value is live (Session::read_live): in-place edits reach the forward when the block moves on; values the forward has passed are released (numpy: read-only; torch: checked).
        """

    def write_value(self, step: int, path: str, value: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)]) -> None: ...

    def settle(self) -> None:
        """
        Apply in-place edits of the live value now and release it (the block moves on).
        """

    def close_values(self, check: bool = False) -> None:
        """
        The block ends: values read become ordinary arrays again (check: raise for released torch edits first).
        """

    def write(self, step: int, path: str, value: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)]) -> None: ...

    def reach_step(self, step: int) -> bool: ...

    def finish(self) -> dict: ...

    def close(self) -> None:
        """Abort the run if it is still going (idempotent)."""

    def set_reader(self, ctx: object | None, step: int) -> None:
        """
        The open tracer's state for envoy reads in C (value_attr): ctx is _OPENED's value in the context that entered the block (None: envoy reads take the Python path), step the step they read at.
        """

    @property
    def in_forward(self) -> bool:
        """True inside this session's forward (a pre-registered edit function)."""

    @property
    def first_step(self) -> int: ...

    @property
    def last_step(self) -> int: ...

    @property
    def calls(self) -> list: ...

    @property
    def where(self) -> str: ...

    def backward(self, dlogits: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)], paths: Sequence[str] = [], positions: Sequence[int] = []) -> None: ...

    def logits_at(self, positions: Sequence[int]) -> object: ...

    def grad(self, path: str) -> object: ...

    def grad_paths(self) -> list[str]: ...

def value_attr(name: str, fallback: object) -> object:
    """
    A descriptor reading envoy.<name> through the open tracer's session in C (issue 9 item 5); other cases call fallback(envoy, name). Needs value_attr_env first.
    """

def value_attr_env(opened: object, unknown_value: object, unknown_attr: object) -> None:
    """
    value_attr's context: the ContextVar of the tracers a context opened, UnknownValueError, UnknownAttributeError.
    """

def session_run(model: Model, prompts: Sequence[Sequence[int]], saves: Sequence[tuple[str, int, int]] = [], edits: Sequence[tuple[str, int, int, object]] = [], embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, mask: Sequence[int] = [], all_logits: bool = True, grad: bool = False) -> Session: ...

def session_generate(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int, greedy: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id: int | None = None, saves: Sequence[tuple[str, int, int]] = [], edits: Sequence[tuple[str, int, int, object]] = [], embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, mask: Sequence[int] = []) -> Session: ...

def session_teacher_forced(model: Model, prompts: Sequence[Sequence[int]], forced: Sequence[Sequence[int]], saves: Sequence[tuple[str, int, int]] = [], edits: Sequence[tuple[str, int, int, object]] = []) -> Session: ...

def session_forward(model: Model, rows: Sequence[Sequence[int]], cache: Cache, saves: Sequence[tuple[str, int, int]] = [], edits: Sequence[tuple[str, int, int, object]] = [], all_logits: bool = True, embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, grad: bool = False) -> Session: ...

def read_prompts_file(path: str, text_field: str = 'text', mask_field: str = '') -> list[tuple[str, list[int], list[int]]]:
    """
    mixlens::read_prompts_file: [(text, ids=[], mask)] from a .jsonl or plain-text prompts file.
    """

class ExtractPlan:
    """mixlens::ExtractPlan: tokens, rows and shards decided before a run."""

    @property
    def total_bytes(self) -> int: ...

    @property
    def total_rows(self) -> int: ...

    @property
    def num_prompts(self) -> int: ...

    @property
    def num_shards(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def values(self) -> list[str]: ...

def plan_extraction(model: Model, prompts: Sequence[tuple[str, Sequence[int], Sequence[int]]], values: Sequence[str], batch_size: int, positions: str, shard_bytes: int, max_bytes: int, store_prompts: bool) -> ExtractPlan:
    """
    mixlens::plan_extraction (ResourceError past max_bytes, naming both numbers).
    """

def extract(model: Model, plan: ExtractPlan, out: str, only_shards: Sequence[int] | None = None, write_index: bool = True, on_progress: object | None = None) -> dict:
    """
    mixlens::extract: runs the plan into folder `out` (resumes; Ctrl-C stops it between layers).
    """

class ResidStack:
    """mixlens::ResidStack (mixlens/attribution.h)"""

    @property
    def kind(self) -> str: ...

    @property
    def components(self) -> object: ...

    @property
    def labels(self) -> list[str]: ...

    @property
    def sources(self) -> list[str]: ...

    @property
    def layers(self) -> list[int]: ...

    @property
    def positions(self) -> list[int]: ...

    @property
    def resid(self) -> object: ...

    @property
    def logits(self) -> object: ...

    @property
    def max_rel_error(self) -> float: ...

def decompose_resid(model: Model, prompts: Sequence[Sequence[int]], embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, mask: Sequence[int] = [], positions: Sequence[int] = [-1]) -> object:
    """mixlens::decompose_resid / accumulated_resid -> ResidStack."""

def accumulated_resid(model: Model, prompts: Sequence[Sequence[int]], embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, mask: Sequence[int] = [], positions: Sequence[int] = [-1]) -> object:
    """mixlens::decompose_resid / accumulated_resid -> ResidStack."""

def apply_ln_to_stack(model: Model, stack: ResidStack) -> object:
    """mixlens::apply_ln_to_stack: [C,B,P,hidden]."""

def logit_attrs(model: Model, stack: ResidStack, tokens: Sequence[int], incorrect: Sequence[int] = [], exact: bool = False) -> object:
    """mixlens::logit_attrs: [C,B,P]."""

def attribution_patching(model: Model, clean: Sequence[Sequence[int]], corrupt: Sequence[Sequence[int]], metric: Callable, nodes: Sequence[str], mask: Sequence[int] = [], clean_embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, corrupt_embeds: Annotated[NDArray[numpy.float32], dict(order='C', device='cpu', writable=False)] | None = None, positions: Sequence[int] = [], metric_positions: Sequence[int] = [], ig_steps: int = 0) -> dict:
    """
    mixlens::attribution_patching: {nodes, layers, positions, estimates [N,B,P], clean_metric, corrupt_metric, ranked [(node, position, estimate)]}. metric(logits [B,P,V]) -> (value, dlogits).
    """

def version() -> str:
    """
    mixlens::version(): CMakeLists.txt's project(VERSION), the one version source.
    """
