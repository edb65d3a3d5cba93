"""Several ``tracer.invoke(prompt)`` blocks in one trace, batched into one forward (nnsight's invokes).

    with model.trace() as tracer:                 # no inputs: the invokes bring them
        with tracer.invoke("The Eiffel Tower is in"):
            h = model.layers_output[3][:, -1]      # rows of this invoke only
        with tracer.invoke("The Colosseum is in"):
            model.layers_output[3][:, -1] = h      # its own rows; h from the invoke above
            probs = model.next_token_probs

How: like nnsight, an invoke's body does not run where it is written. ``__enter__`` records the prompt,
takes the body's source from the file (``ast``), and skips it; when the trace block ends, the prompts
form one left-padded batch and one Session runs it. Each body then runs on its own thread, one thread
at a time: the coordinator always serves the earliest pending request in forward order (ties go to
the earlier invoke), so every invoke sees each value in forward order and after the writes of the
invokes before it. A read returns the invoke's rows of the value; a write replaces those rows. The
bodies share one namespace (the trace's globals and locals), and names they assign are written back
to the frame of the ``with`` block when the trace ends.

Limits: the body must be in a file (not typed at an interactive prompt), must not ``return``/``yield``
out of the function, and reads happen at the first step (``tracer.iter`` inside an invoke raises).
"""

from __future__ import annotations

import ast
import ctypes
import linecache
import sys
import threading
from typing import Any, Optional

import numpy as np

from ._convert import as_float32, to_output
from ._inplace import LiveValues
from .errors import InputError

class _Local(threading.local):
    # A class default: getattr(local, name, None) on a missing name raises and catches an
    # AttributeError, ~1 us of every value read (issue 9 item 5).
    invoke: Optional["_Invoke"] = None


_local = _Local()


def current() -> Optional["_Invoke"]:
    """The invoke whose body runs on this thread, if any."""
    return _local.invoke


class _SkipBody(Exception):
    pass


def _find_with(tree: ast.AST, line: int) -> Optional[ast.With]:
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                e = item.context_expr
                if e.lineno <= line <= (e.end_lineno or e.lineno):
                    if best is None or node.lineno >= best.lineno:
                        best = node
    return best


def _assigned_names(body: list) -> set:
    names = set()
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


class _Invoke:
    def __init__(self, tracer, rows: list, single: bool):
        self.tracer, self.rows, self.single = tracer, rows, single
        self.first_row = 0
        self.code = None
        self.names: set = set()
        self.frame = None
        self.request: Optional[tuple] = None  # ("read" | "write", path, value) or ("done",) / ("error", exc)
        self.response: Any = None
        self.response_exc: Optional[BaseException] = None
        self.go = threading.Semaphore(0)
        self.posted = threading.Semaphore(0)
        self.live = LiveValues(lambda step, path, arr: self._submit("write", path, arr, raw=True))

    # -- capture, on the caller's thread ------------------------------------------------------
    def __enter__(self):
        frame = sys._getframe(1)
        filename = frame.f_code.co_filename
        source = "".join(linecache.getlines(filename, frame.f_globals))
        if not source:
            raise InputError("tracer.invoke: the block's source is not available (invoke blocks must be in a file)")
        node = _find_with(ast.parse(source, filename), frame.f_lineno)
        if node is None or not node.body:
            raise InputError("tracer.invoke: could not find the `with tracer.invoke(...)` block in the source")
        if len(node.items) != 1 or node.items[0].optional_vars is not None:
            raise InputError("tracer.invoke: write the block as `with tracer.invoke(prompt):` on its own")
        wrapper = ast.Module(body=node.body, type_ignores=[])
        self.code = compile(wrapper, filename, "exec")
        self.names = _assigned_names(node.body)
        self.frame = frame
        self.tracer._invokes.append(self)
        self.trivial = all(isinstance(st, ast.Pass) for st in node.body)
        if self.trivial:  # `pass`: nothing to skip (and no line event inside the block to skip it with)
            return self
        # Skip the body here: the next line event in that frame raises, and __exit__ swallows it.
        self._old_trace = sys.gettrace()
        sys.settrace(self._old_trace or (lambda *a: None))
        frame.f_trace = self._skip
        return self

    def _skip(self, frame, event, arg):
        raise _SkipBody

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.trivial:
            return False
        sys.settrace(self._old_trace)
        self.frame.f_trace = None
        if exc_type is None:
            raise InputError("tracer.invoke: the body was not skipped (write its first statement on its own line)")
        return issubclass(exc_type, _SkipBody)

    # -- the body's thread ---------------------------------------------------------------------
    def run(self, namespace: dict) -> None:
        self.requests_made = 0

        def body():
            _local.invoke = self
            self.go.acquire()
            try:
                exec(self.code, namespace)
                self.live.settle()
                self.live.check_released()  # what the body still holds (settle checks only dropped values)
                self.request = ("done",)
            except NameError as e:
                # Before its first request a body may need a name an earlier invoke has yet to assign
                # (nnsight: `model.x.output = h` with h read in the invoke above): retried later.
                self.request = ("retry", e) if self.requests_made == 0 else ("error", e)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self.request = ("error", e)
            finally:
                _local.invoke = None
                self.posted.release()

        self.thread = threading.Thread(target=body, name="mixlens-invoke", daemon=True)
        self.thread.start()

    def resume(self) -> None:
        """Caller side: let the body run until its next request (or its end)."""
        self.go.release()
        self.posted.acquire()

    def _submit(self, kind: str, path: str, value=None, raw: bool = False):
        """Body side: post a request and wait for the coordinator's answer."""
        self.request = (kind, path, value)
        self.requests_made += 1
        self.response, self.response_exc = None, None
        self.posted.release()
        self.go.acquire()
        if self.response_exc is not None:
            e, self.response_exc = self.response_exc, None
            raise e
        return self.response

    # -- the API the tracer routes to, on the body's thread -----------------------------------------
    def read(self, path: str):
        self.live.settle()
        value = self._submit("read", path)
        value = to_output(value, self.tracer._fmt)
        self.live.track(self.tracer._step, path, value, read_only=path.endswith(".states"))
        return value

    def write(self, path: str, value) -> None:
        self.live.settle(keep=(self.tracer._step, path))
        self._submit("write", path, as_float32(value, path))
        self.live.wrote(self.tracer._step, path)


def run_invokes(tracer, invokes: list, frame_locals_target) -> None:
    """Runs every invoke body against the tracer's open session (caller's thread). Raises the first error a
    body raised (after stopping the others)."""
    sess = tracer._session
    step = tracer._step
    order = tracer._model._order()
    first = invokes[0].frame
    namespace = dict(first.f_globals)
    namespace.update(first.f_locals)
    for inv in invokes:  # started in order, before the forward moves (nnsight starts them at the first site)
        inv.run(namespace)
        inv.resume()
    error: Optional[BaseException] = None
    served, tried = 0, {id(inv): 0 for inv in invokes}
    while True:
        for inv in invokes:  # bodies that lacked a name: try again once something has been served
            if inv.request[0] == "retry" and tried[id(inv)] < served:
                tried[id(inv)] = served
                inv.run(namespace)
                inv.resume()
        pending = [(order.get(inv.request[1], -1), k, inv) for k, inv in enumerate(invokes)
                   if inv.request[0] in ("read", "write")]
        failed = [inv for inv in invokes if inv.request[0] == "error"]
        if failed and error is None:
            error = failed[0].request[1]
        if error is None and not pending:
            waiting = [inv for inv in invokes if inv.request[0] == "retry"]
            if waiting:
                error = waiting[0].request[1]
        if error is not None or not pending:
            break
        _, _, inv = min(pending, key=lambda p: (p[0], p[1]))
        kind, path, value = inv.request
        r0, r1 = inv.first_row, inv.first_row + len(inv.rows)
        try:
            full = sess.read(step, path)
            if kind == "read":
                inv.response = None if full is None else np.ascontiguousarray(full[r0:r1])
            else:
                if full is None:
                    raise InputError(f"write to '{path}' inside an invoke: the value is None at this step (state_input "
                                     "of a fresh prompt); write it outside invokes")
                full = np.array(full, copy=True)
                try:
                    full[r0:r1] = np.broadcast_to(value, full[r0:r1].shape)
                except ValueError:
                    raise tracer_write_error(path, full[r0:r1].shape, value.shape) from None
                sess.write(step, path, np.ascontiguousarray(full, dtype=np.float32))
        except BaseException as e:  # noqa: BLE001 - raised in the body that asked
            inv.response_exc = e
        served += 1
        inv.resume()
    try:
        if error is not None:
            # Unblock the other bodies with the error so their threads end.
            for inv in invokes:
                while inv.request[0] in ("read", "write"):
                    inv.response_exc = InputError("another invoke of this trace failed")
                    inv.resume()
            raise error
    finally:
        # Every value of the bodies is an ordinary array again (numpy ones were read-only once released).
        for inv in invokes:
            inv.live.close(check=False)
        # Names the bodies assigned go back to the `with` block's frame (also after tracer.stop()).
        for inv in invokes:
            f = inv.frame
            updates = {n: namespace[n] for n in inv.names if n in namespace}
            if f.f_locals is f.f_globals:
                f.f_globals.update(updates)
            else:
                f.f_locals.update(updates)
                ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(f), ctypes.c_int(0))


def tracer_write_error(path: str, rows_shape: tuple, given: tuple):
    from .errors import WriteError

    return WriteError(f"write to '{path}' inside an invoke: expected this invoke's rows, shape "
                      f"[{', '.join(map(str, rows_shape))}], got [{', '.join(map(str, given))}]")
