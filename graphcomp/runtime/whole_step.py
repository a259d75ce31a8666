"""``graphcomp.capture_step``: the whole training step as one CUDA graph.

With graphcomp's passes, a compiled step already runs as a few CUDA-graph replays
(forward pieces, backward pieces, ``graphcomp.optim.capture``'s clip + update). What
is left on the host each step is Python: Dynamo's guards, AOTAutograd's wrappers
(every DTensor parameter unwrapped, its gradient wrapped again), the autograd
engine, graphcomp's runners, the optimizer's host checks. On small and medium models
that host time is the step time: the GPU waits for the host.

``capture_step(fn, params=...)`` captures one call of the user's step function ``fn``
(forward, backward, optimizer step) into a single CUDA graph and replays it on later
calls, after copying the call's input tensors into the graph's static buffers::

    step = graphcomp.capture_step(train_step, params=model.parameters())
    for batch in data:
        loss = step(batch)          # warm-up calls run train_step; then one graph replay

How a capture works. The first ``warmup`` calls run ``fn`` as it is (they compile
the frames, capture the pieces, create optimizer state). The next call captures
``fn`` on the capture stream, into a private memory pool, with the runtime in its
capturing state: every piece runner runs its compiled code inline (its kernels and
collectives are recorded into this graph, not replayed as its own), and a captured
optimizer step (``graphcomp.optim.capture``) records its clip + update inline too and
registers its host work (the lr refresh, its checks) to run before each replay. The
call then replays the graph once (a capture executes nothing). Later calls check,
on the host, what the graph cannot see, copy the inputs, replay, and return the
outputs (copies by default: the graph overwrites its own).

What is checked before each replay (anything else that differs runs ``fn`` as it is
for that call and captures again on the next; after ``max_recaptures`` the step runs
uncaptured for good, with one warning):

* the inputs: same tree structure, tensor shapes, dtypes and devices, same
  non-tensor values;
* the gradients of ``params`` as the captured call found them: ``None`` where they
  were ``None``, the same memory where they were tensors (a gradient kept from the
  previous call would be accumulated into by ``fn`` but overwritten by the graph);
* registered host work (the captured optimizer: state or param_groups replaced, a
  hyper-parameter changed, step hooks);
* the memory of ``params`` (and of the optimizer states of ``optimizers``) at the
  capture's addresses: on the first two replays, or every replay with
  ``check_static_inputs="always"``.

What ``fn`` must be (as for any CUDA graph of a whole step): the same device work
every call. Python state ``fn`` changes (a counter, an lr scheduler's ``step()``, a
host-side optimizer step count) changes once, at capture, never at replays: keep such
work outside ``fn``. Ops that synchronize with the host (``.item()``, printing a
tensor, data-dependent shapes) make the capture fail; with ``cudagraphs="auto"`` the
step then runs uncaptured for good with one warning naming the error, with
``"require"`` it raises. On a machine without CUDA (or ``cudagraphs="off"``) ``fn``
runs as it is, every call.

Memory: the graph's private pool holds one step's temporaries and activations, in
addition to the pieces' own pool (their graphs stay valid for uncaptured calls).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcomp import _compat
from graphcomp.runtime import capture
from graphcomp.runtime.manager import RUNTIME
from graphcomp.session import SESSION

log = logging.getLogger("graphcomp.runtime.whole_step")

__all__ = ["StepCapture", "capture_step"]

_CUDAGRAPHS = ("auto", "require", "off")
_CHECK = ("first", "always")
_CHECKED_REPLAYS = 2  # check_static_inputs="first": replays that compare addresses


class StepCapture:
    """The callable :func:`capture_step` returns: ``step(*args, **kwargs)`` runs
    ``fn(*args, **kwargs)`` (warm-up, uncaptured calls) or replays its capture, and
    returns ``fn``'s result (tensors copied, or the graph's own with
    ``clone_outputs=False``). ``stats()`` says what ran and why."""

    def __init__(self, fn: Callable[..., Any], params: list[torch.Tensor], optimizers: list[Any], *, warmup: int,
                 cudagraphs: str, clone_outputs: bool, check_static_inputs: str, max_recaptures: int,
                 prepare: list[Callable[[], None]] = ()):
        self.fn = fn
        self.params = params
        self.optimizers = optimizers  # torch optimizers (their state's addresses are checked)
        self._prepare = list(prepare)  # host work before a capture (captured optimizer steps)
        self.warmup, self.clone_outputs, self.max_recaptures = warmup, clone_outputs, max_recaptures
        self.require = cudagraphs == "require"
        self.check_always = check_static_inputs == "always"
        self.name = f"step/{getattr(fn, '__qualname__', type(fn).__name__)}"
        self.mode = "off" if cudagraphs == "off" else "warmup"  # warmup | captured | uncaptured | off
        self.reason: str | None = "cudagraphs='off'" if cudagraphs == "off" else None
        self.decisions: list[str] = []
        self.calls = self.replays = self.recaptures = 0
        self.graph: Any = None
        self._key: Any = None  # the inputs' structure, shapes, dtypes, devices and non-tensor values
        self._static: list[torch.Tensor] = []  # the graph's input buffers
        self._outs: list[Any] = []  # the graph's outputs (flat)
        self._out_spec: Any = None
        self._grads_key: tuple[int | None, ...] = ()
        self._static_ptrs: tuple[int | None, ...] = ()
        self._checked = 0
        self._hooks: list[Callable[[], str | None]] = []
        self._body_args: list[Any] = []
        self._in_spec: Any = None

    # ------------------------------------------------------------ decisions
    def _decide(self, msg: str, level: int = logging.INFO) -> None:
        self.decisions.append(msg)
        log.log(level, "graphcomp: %s: %s", self.name, msg)

    def _go_uncaptured(self, why: str) -> None:
        self._drop_graph()
        if self.mode != "uncaptured":
            self.mode, self.reason = "uncaptured", why
            SESSION.counters.add("step_capture_fallbacks")
            self._decide(f"{why}; the step runs uncaptured from now on", logging.WARNING)
            warnings.warn(f"graphcomp.capture_step: {self.name}: {why}; the step runs uncaptured from now on",
                          RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------- calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.mode in ("off", "uncaptured"):
            return self._run(args, kwargs)
        if not RUNTIME.device.available():
            self.mode, self.reason = "off", "no CUDA device"
            self._decide("no CUDA device: the step runs as it is, every call")
            return self._run(args, kwargs)
        if self.mode == "warmup" and self.calls <= self.warmup:
            return self._run(args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        key = _key(leaves, spec)
        if self.graph is not None:
            why = self._why_not_replay(key)
            if why is None:
                return self._replay(leaves)
            self._invalidate(why)
            return self._run(args, kwargs)  # (this call as it is; the next one captures)
        if self.recaptures > self.max_recaptures:
            self._go_uncaptured(f"more than max_recaptures={self.max_recaptures} re-captures "
                                f"(last: {self.decisions[-1] if self.decisions else '?'})")
            return self._run(args, kwargs)
        return self._capture(leaves, spec, key, args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        SESSION.counters.add("step_calls_uncaptured")
        return self.fn(*args, **kwargs)

    def _why_not_replay(self, key: Any) -> str | None:
        if key != self._key:
            return "the inputs differ from the captured call's (structure, shape, dtype, device or a non-tensor value)"
        grads = _compat.local_data_ptrs(_compat.grads_of(self.params))
        if grads != self._grads_key:
            return ("the parameters' gradients differ from what the captured call found (a gradient kept from the "
                    "previous call, or one the captured call did not have): zero them with set_to_none=True "
                    "between steps, or inside the step function")
        for hook in self._hooks:
            why = hook()
            if why is not None:
                return why
        if self.check_always or self._checked < _CHECKED_REPLAYS:
            self._checked += 1
            if self._static_key() != self._static_ptrs:
                return "a parameter or optimizer-state tensor is at a new address (replaced or reloaded)"
        return None

    def _invalidate(self, why: str) -> None:
        self._decide(f"re-capture: {why}")
        self._drop_graph()
        self.recaptures += 1
        SESSION.counters.add("step_recaptures")

    def _copy_in(self, leaves: list[Any]) -> None:
        """The call's input tensors into the graph's buffers (one kernel launch)."""
        src = [t for t in leaves if isinstance(t, torch.Tensor)]
        if src:
            torch._foreach_copy_(self._static, src)

    def _replay(self, leaves: list[Any]) -> Any:
        self._copy_in(leaves)
        self.graph.replay()
        self.replays += 1
        SESSION.counters.add("step_replays")
        return self._result()

    def _result(self) -> Any:
        outs = [o.clone() if self.clone_outputs and isinstance(o, torch.Tensor) else o for o in self._outs]
        return tree_unflatten(outs, self._out_spec)

    # ------------------------------------------------------------- capture
    def _static_key(self) -> tuple[int | None, ...]:
        ts: list[torch.Tensor | None] = list(self.params)
        for opt in self.optimizers:
            for st in opt.state.values():
                ts.extend(v for v in st.values() if isinstance(v, torch.Tensor) and v.device.type != "cpu")
        return _compat.local_data_ptrs(ts)

    def _body(self, boxed: list[Any]) -> list[Any]:
        """What the graph holds: ``fn`` on the static inputs, every runner inline."""
        boxed.clear()
        args, kwargs = tree_unflatten(list(self._body_args), self._in_spec)
        out = self.fn(*args, **kwargs)
        leaves, self._out_spec = tree_flatten(out)
        bad = [type(x).__name__ for x in leaves if x is not None and not isinstance(x, torch.Tensor)]
        if bad:
            raise TypeError(f"the step function returned a {bad[0]} (a captured step can only return tensors, "
                            f"or structures of them, or None: anything else would be the capture's value forever)")
        return leaves

    def _capture(self, leaves: list[Any], spec: Any, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        RUNTIME.ensure()
        RUNTIME.register_owner(self)
        grads_before = _compat.grads_of(self.params)
        self._grads_key = _compat.local_data_ptrs(grads_before)
        # the graph's input buffers: contiguous (an expanded input would alias itself)
        self._static = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in leaves if isinstance(t, torch.Tensor)]
        self._copy_in(leaves)
        it = iter(self._static)
        self._body_args = [next(it) if isinstance(t, torch.Tensor) else t for t in leaves]
        self._in_spec = spec
        self._hooks = []
        # host work before the capture (the captured optimizer steps' lr refresh; those the
        # caller passed, and any the runtime knows of)
        owners = [o for o in list(RUNTIME.owners) if hasattr(o, "prepare_for_step_capture")]
        for prepare in dict.fromkeys([*self._prepare, *(o.prepare_for_step_capture for o in owners)]):
            prepare()
        try:  # (a private pool: never overlaps the pieces' shared pool)
            rec = capture.capture("step", self._body, pool=capture.PRIVATE)
        except Exception as e:  # noqa: BLE001 - any failure: uncaptured from now on (or raise)
            # gradients the aborted capture assigned hold memory no kernel wrote: the
            # call that runs now must find the gradients as they were
            for p, gr in zip(self.params, grads_before):
                if _compat.grads_of([p])[0] is not gr:
                    p.grad = gr
            self._static, self._body_args, self._hooks = [], [], []
            SESSION.counters.add("step_capture_failures")
            where = _failing(e)
            if self.require:
                raise RuntimeError(f"graphcomp.capture_step(cudagraphs='require'): capturing {self.name} failed: "
                                   f"{type(e).__name__}: {e}{where}") from e
            self._go_uncaptured(f"capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                                f"{where}")
            return self._run(args, kwargs)  # (a capture executes nothing: this call's step runs now)
        # host work each replay needs (registered while fn was captured: the captured
        # optimizer steps' lr refresh and checks); returns None, or why it cannot replay
        self._hooks = list(rec.hooks)
        self.graph, self._outs, self._key = rec.graph, list(rec.outputs), key
        self._static_ptrs = self._static_key()
        self._checked = 0
        self.mode = "captured"
        SESSION.counters.add("step_captures")
        self._decide(f"captured ({len(self._static)} input tensor(s), {len(self._outs)} output(s), "
                     f"{len(self._hooks)} host hook(s) before each replay)")
        for hook in self._hooks:  # (the host work every replay gets: the lr refresh)
            hook()
        self.graph.replay()  # the capture call's own step
        self.replays += 1
        SESSION.counters.add("step_replays")
        return self._result()

    def _drop_graph(self) -> None:
        capture.release(self.graph)
        self.graph = None
        self._outs, self._static, self._body_args, self._hooks = [], [], [], []

    # ----------------------------------------------------------- reporting
    def stats(self) -> dict[str, Any]:
        """What ran and why: mode, calls, replays, re-captures, decisions."""
        return {"name": self.name, "mode": self.mode, "reason": self.reason, "calls": self.calls,
                "replays": self.replays, "recaptures": self.recaptures, "captured": self.graph is not None,
                "decisions": list(self.decisions)}

    def release(self, final: bool = False) -> int:
        """Drop the graph (``graphcomp.runtime.teardown()`` calls this with
        ``final=True``: later calls then run ``fn`` as it is). Returns graphs released."""
        n = int(self.graph is not None)
        self._drop_graph()
        if final and self.mode not in ("off", "uncaptured"):
            self.mode, self.reason = "uncaptured", "released by teardown"
            self._decide("released by teardown: uncaptured from now on")
        return n


def _key(leaves: list[Any], spec: Any) -> tuple[Any, ...]:
    out: list[Any] = [spec]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
        else:
            out.append(("value", type(x), x))
    return tuple(out)


def _failing(e: BaseException) -> str:
    from graphcomp.errors import failing_source

    where = failing_source(e)
    return f" (at {where})" if where else ""


def capture_step(fn: Callable[..., Any], *, params: Iterable[torch.Tensor], optimizers: Iterable[Any] = (),
                 warmup: int = 2, cudagraphs: str = "auto", clone_outputs: bool = True,
                 check_static_inputs: str = "first", max_recaptures: int = 4) -> StepCapture:
    """Capture the training step ``fn`` (forward, backward, optimizer step) as one
    CUDA graph; returns a :class:`StepCapture` to call instead of ``fn``. See the
    module docstring (``graphcomp.runtime.whole_step``) for what is captured and checked.

    ``params``: the parameters ``fn`` trains (their gradients and memory are checked
    before each replay). ``optimizers``: optimizers whose state ``fn`` updates (their
    state's memory is checked too). ``warmup``: calls run as they are before the
    capture (>= 1: the first call compiles and creates optimizer state).
    ``cudagraphs``: ``"auto"`` (fall back with one warning), ``"require"`` (raise),
    ``"off"``. ``clone_outputs``: return copies of the graph's outputs (False: the
    graph's own tensors, overwritten by the next call). ``check_static_inputs``:
    compare parameter and state addresses on the first replays (``"first"``) or on
    every replay (``"always"``). ``max_recaptures``: re-captures before the step runs
    uncaptured for good."""
    if not callable(fn):
        raise ValueError(f"graphcomp.capture_step: fn must be callable, got {type(fn).__name__}")
    if cudagraphs not in _CUDAGRAPHS:
        raise ValueError(f"graphcomp.capture_step: cudagraphs={cudagraphs!r}; valid: {', '.join(map(repr, _CUDAGRAPHS))}")
    if check_static_inputs not in _CHECK:
        raise ValueError(f"graphcomp.capture_step: check_static_inputs={check_static_inputs!r}; "
                         f"valid: {', '.join(map(repr, _CHECK))}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"graphcomp.capture_step: warmup={warmup!r}; valid: an int >= 1 (the first call compiles "
                         f"and creates optimizer state, which a capture cannot)")
    if not isinstance(max_recaptures, int) or isinstance(max_recaptures, bool) or max_recaptures < 0:
        raise ValueError(f"graphcomp.capture_step: max_recaptures={max_recaptures!r}; valid: an int >= 0")
    plist = list(params)
    if not plist or not all(isinstance(p, torch.Tensor) for p in plist):
        raise ValueError("graphcomp.capture_step: params must be a non-empty iterable of tensors "
                         "(model.parameters())")
    opts = list(optimizers)
    for o in opts:
        inner = getattr(o, "opt", o)  # (a graphcomp.optim.capture step: its optimizer)
        if not hasattr(inner, "state"):
            raise ValueError(f"graphcomp.capture_step: optimizers must be torch optimizers (or graphcomp.optim.capture "
                             f"steps), got {type(o).__name__}")
    return StepCapture(fn, plist, [getattr(o, "opt", o) for o in opts], warmup=warmup, cudagraphs=cudagraphs,
                       clone_outputs=clone_outputs, check_static_inputs=check_static_inputs,
                       max_recaptures=max_recaptures,
                       prepare=[o.prepare_for_step_capture for o in opts if hasattr(o, "prepare_for_step_capture")])
