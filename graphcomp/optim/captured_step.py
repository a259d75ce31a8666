"""CapturedStep: the step callable of :func:`graphcomp.optim.capture` (its design is
described in ``graphcomp/optim/__init__.py``): plan each call on the host, warm up,
capture, replay, or run eagerly.

(Over graphcomp's ~500-line guideline: one class whose host-side checks, capture and
replay share the same bound state -- gradient addresses, hyper-parameter tensors, the
norm and skip buffers; split across modules, each half would reach into the other's
fields.)"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from graphcomp import _compat
from graphcomp.sharding.prefetch import PREFETCH
from graphcomp.runtime import capture
from graphcomp.runtime.manager import RUNTIME
from graphcomp.session import SESSION
from graphcomp.optim import clip_fold

log = logging.getLogger(__name__)

SUPPORTED = ("Adam", "AdamW", "SGD")
_MOVES_BEFORE_COPY = 2  # gradient-address moves that re-capture before static buffers are used
_WARMUP_FILTER = "This instance was constructed with capturable=True"  # torch's warning for eager capturable steps


def _replicated(total: torch.Tensor) -> torch.Tensor:
    """A DTensor norm with partial placements (an inf-norm is ``Partial(max)``)
    reduced to replicated: the one collective of the step, before the update."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(total, DTensor) and not all(p.is_replicate() for p in total.placements):
        total = total.redistribute(total.device_mesh, [Replicate()] * total.device_mesh.ndim)
    return total

def fused_adam(opt: torch.optim.Optimizer) -> bool:
    """A fused Adam/AdamW (every group ``fused=True``): its kernel takes ``found_inf``
    and ``grad_scale``, as torch.amp's GradScaler passes them."""
    return type(opt) in (torch.optim.Adam, torch.optim.AdamW) and all(g.get("fused") for g in opt.param_groups)


class CapturedStep:
    """The callable :func:`capture` returns. ``step()`` runs one clip + optimizer
    step and returns the global norm. For sequences of graph replays without Python
    between them: ``ready()`` does this step's host-side work (lr refresh, checks) and
    says whether ``replay()`` (the bare graph replay; the norm is left in
    ``last_norm``, overwritten by the next step) may run instead of ``step()``."""

    def __init__(self, opt: torch.optim.Optimizer, *, max_norm: float | None, norm_type: float, error_if_nonfinite: bool,
                 skip_nonfinite: bool, foreach: bool | None, cudagraphs: str, check_always: bool, max_recaptures: int,
                 fold_clip: bool | str = "auto", prefetch: bool = True):
        self.opt = opt
        self.prefetch = prefetch
        self._prefetch_event: Any = None  # marks "the prefetched shards are updated" on the device
        self._marked: frozenset[int] = frozenset()  # ids of the shards updated before the mark this step recorded
        self._graph_marks: frozenset[int] = frozenset()  # ids of the shards a captured graph updates before its mark
        self.max_norm, self.norm_type, self.foreach = max_norm, norm_type, foreach
        self.fold_clip = fold_clip
        self._fold_keep: list[Any] = []  # the exact fold's tables, which captured graphs read at every replay
        self._fold_why: str | None = "(not decided)"  # why the exact fold is not taken (the last reason said)
        self.clip_folded = False  # whether the latest step (or capture) clipped inside the fused kernel
        self.error_if_nonfinite, self.skip = error_if_nonfinite, skip_nonfinite or error_if_nonfinite
        # how a captured step skips a non-finite update on the device: a conditional (IF)
        # graph node, or the fused optimizer's own found_inf (see _static_reason)
        self.skip_by = "if_node" if RUNTIME.device.supports_if_nodes() else "found_inf"
        self.require, self.check_always, self.max_recaptures = cudagraphs == "require", check_always, max_recaptures
        self.name = f"optim/{type(opt).__name__}"
        self.mode = "warmup"  # warmup | captured | eager (the captured path run eagerly, for good) | reference
        self.reason: str | None = None  # why the step is eager, if it is
        self.decisions: list[str] = []  # every decision, in order (also logged)
        self._graph: Any = None
        self._adopted = False
        self._released = False
        self._initialized: set[int] = set()  # ids of params an eager step has updated (their state exists)
        self._params: list[torch.Tensor] = []
        self._with_grad: list[torch.Tensor] = []  # the params the captured step updates
        self._step_params: list[torch.Tensor] = []  # the params the running body updates
        self._pool: Any = None  # the captured graph's private pool
        self._eager_now = False
        self._inline_now = False  # recording into a whole-step capture (gradients read in place)
        self._grad_ptrs: tuple[int, ...] = ()
        self._static_ptrs: tuple[int, ...] = ()
        self._replays_checked = 0
        self._moves = 0
        self._recaptures = 0
        self._copy_mode = False
        self._grad_bufs: list[torch.Tensor] = []  # copy mode: static local gradient buffers
        self._grad_views: list[torch.Tensor] = []  # ... and the DTensors (or tensors) over them
        self._lr: list[torch.Tensor | None] = []
        self._lr_host: list[Any] = []
        self._hyper: Any = None
        self._inline_hyper: Any = None  # the options a whole-step capture recorded
        self._skipped_seen = 0
        self._norm = self._finite = self._skipped = None
        self._state_obj: Any = None
        self._groups_obj: Any = None
        if prefetch:
            PREFETCH.add_provider(self)
        if cudagraphs == "off":
            self._to_reference("cudagraphs='off'", warn=False)
        else:
            why = self._static_reason()
            if why is not None:
                self._fall_back(why, warn=why != "no CUDA device")

    # ------------------------------------------------------------ decisions
    def _decide(self, msg: str, level: int = logging.INFO) -> None:
        self.decisions.append(msg)
        log.log(level, "graphcomp.optim: %s: %s", self.name, msg)

    def _static_reason(self) -> str | None:
        """Why this optimizer cannot be captured at all (None: it can)."""
        opt, dev = self.opt, RUNTIME.device
        kind = type(opt).__name__
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
            return f"optimizer {kind} is not supported (supported: {', '.join(SUPPORTED)})"
        for i, g in enumerate(opt.param_groups):
            if g.get("differentiable"):
                return f"param_groups[{i}] has differentiable=True"
            if kind == "SGD" and isinstance(g["lr"], torch.Tensor) and g["lr"].device.type != "cpu":
                return f"param_groups[{i}]: SGD holds its lr as a graph constant; a device-tensor lr needs a host sync"
        params = [p for g in opt.param_groups for p in g["params"]]
        if not dev.available():
            return "no CUDA device"
        bad = [p.device for p in params if p.device.type != dev.device_type]
        if bad:
            return f"parameters on {bad[0]}, CUDA graphs capture {dev.device_type} work only"
        if self.skip and not dev.supports_if_nodes() and not self._fused_found_inf():
            return ("skipping a non-finite step on the device needs conditional CUDA graph nodes (this torch has "
                    "none: torch 2.11 does not expose them) or a fused Adam/AdamW (its kernel skips on found_inf); "
                    "use fused=True, or pass skip_nonfinite=False to capture without the skip")
        return None

    def _fused_found_inf(self) -> bool:
        """A fused Adam/AdamW skips a step on the device by itself when given
        ``found_inf`` (as torch.amp's GradScaler does): no conditional node needed."""
        return fused_adam(self.opt)

    def _fall_back(self, why: str, warn: bool = True) -> None:
        if self.require:
            raise ValueError(f"graphcomp.optim.capture(cudagraphs='require'): cannot capture the step of "
                             f"{type(self.opt).__name__}: {why}")
        SESSION.counters.add("optimizer_fallbacks")
        msg = f"graphcomp.optim: {self.name}: {why}; running clipping and the optimizer step eagerly"
        if warn:
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
        if self._adopted:
            self._go_eager(why, warned=True)
        else:
            self._to_reference(why, warn=False)
            self.decisions[-1] = msg

    def _to_reference(self, why: str, warn: bool) -> None:
        self.mode, self.reason = "reference", why
        self._decide(f"eager clip + step (torch's own, unchanged optimizer): {why}", logging.WARNING if warn else logging.INFO)

    def _go_eager(self, why: str, warned: bool = False) -> None:
        """The captured path, run eagerly from now on (same numerics as its replays)."""
        if self.mode != "eager":
            if not warned:
                SESSION.counters.add("optimizer_fallbacks")
                warnings.warn(f"graphcomp.optim: {self.name}: {why}; running the step eagerly from now on",
                              RuntimeWarning, stacklevel=4)
            self.mode, self.reason = "eager", why
            self._decide(f"eager from now on: {why}", logging.WARNING)
        self._drop_graph()

    # ------------------------------------------------------------- adoption
    def _adopt(self) -> None:
        """Switch the optimizer to its graph-safe form (in place) and allocate the
        step's device tensors; runs again after ``load_state_dict`` / ``add_param_group``."""
        opt = self.opt
        adam = type(opt) is not torch.optim.SGD
        _compat.register_fused_optimizer_meta()  # a fused step with a tensor lr on DTensors: no FakeTensor fallback
        self._params = list(dict.fromkeys(p for g in opt.param_groups for p in g["params"]))
        device = self._params[0].device
        moved = 0
        for g in opt.param_groups:
            if adam and not g.get("capturable"):
                g["capturable"] = True  # torch's graph-safe path (the health check asks it of fused too)
            for p in g["params"]:
                st = opt.state.get(p, {})
                step = st.get("step") if isinstance(st, dict) else None
                if adam and isinstance(step, torch.Tensor) and step.device != p.device:
                    st["step"] = step.to(device=p.device, dtype=torch.float32)  # as load_state_dict does for capturable
                    moved += 1
        self._lr, self._lr_host = [], []
        for g in opt.param_groups:
            tensor_lr = g["params"] and adam
            self._lr.append(torch.zeros((), dtype=torch.float32, device=device) if tensor_lr else None)
            self._lr_host.append(None)
        if self._norm is None:
            self._norm = torch.zeros((), dtype=torch.float32, device=device)
            self._finite = torch.ones((), dtype=torch.bool, device=device)
            self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._state_obj, self._groups_obj = opt.state, opt.param_groups
        self._shape = [len(g["params"]) for g in opt.param_groups]
        # the first adoption always warms up (lazy initialisation: state, NCCL); after a
        # load_state_dict, parameters with state capture at once
        self._initialized = {id(p) for p in self._params if opt.state.get(p)} if self._adopted else set()
        self._hyper = None
        self._drop_graph()
        self._adopted = True
        self._decide(f"adopted {type(opt).__name__} ({len(self._params)} parameters, {len(opt.param_groups)} group(s)): "
                     f"{'capturable=True, ' if adam else ''}lr as a device tensor in "
                     f"{sum(t is not None for t in self._lr)} group(s), {moved} step count(s) moved to {device}")

    def _hyper_key(self) -> tuple[Any, ...]:
        """Everything the graph holds as a constant: every group's options but the
        (device-tensor) lr, and the parameter lists."""
        out = []
        for g, lr_t in zip(self.opt.param_groups, self._lr):
            items = []
            for k, v in g.items():
                if k in ("params", "initial_lr") or (k == "lr" and lr_t is not None):
                    continue
                if isinstance(v, torch.Tensor):  # a host tensor by value; a device tensor is read in the graph
                    v = ("tensor", v.tolist()) if v.device.type == "cpu" else ("tensor", id(v))
                items.append((k, v))
            out.append(tuple(items))
        return tuple(out)

    def _sync_lr(self) -> None:
        for i, (g, t) in enumerate(zip(self.opt.param_groups, self._lr)):
            if t is None:
                continue
            v = g["lr"]
            if isinstance(v, torch.Tensor):
                if v.device.type != "cpu":
                    t.copy_(v.detach().reshape(()))  # a device-tensor lr: copied every step (no sync)
                    continue
                v = float(v)
            if v != self._lr_host[i]:
                t.fill_(v)
                self._lr_host[i] = v

    # ------------------------------------------------------------ the step
    @contextlib.contextmanager
    def _bound(self) -> Iterator[list[torch.Tensor]]:
        """While the step runs: each group's lr is its device tensor, and in copy
        mode each ``param.grad`` is the static buffer; yields the gradients."""
        swapped = []
        for g, t in zip(self.opt.param_groups, self._lr):
            if t is not None:
                swapped.append((g, g["lr"]))
                g["lr"] = t
        grads_swapped = []
        if self._copy_mode and not self._eager_now and not self._inline_now:
            for p, gv in zip(self._step_params, self._grad_views):
                grads_swapped.append((p, p.grad))
                p.grad = gv
        try:
            yield [p.grad for p in self._step_params]
        finally:
            for g, v in swapped:
                g["lr"] = v
            for p, gr in grads_swapped:
                p.grad = gr

    def _body(self, boxed: list[Any]) -> list[Any]:
        """The step: what warm-up runs, what is captured, what an eager step runs."""
        boxed.clear()
        nn_utils = torch.nn.utils
        with self._bound() as grads:
            total = _replicated(nn_utils.get_total_norm(grads, self.norm_type, False, self.foreach))
            local = _compat.dtensor_local(total)
            if self._norm.dtype != local.dtype:  # (the first, eager, step of bf16 gradients)
                self._norm = torch.zeros((), dtype=local.dtype, device=local.device)
            self._norm.copy_(local)

            phases, early = self._phases(self._step_params, total)

            def update() -> None:
                self._run_phases(phases, early)

            if self.skip:
                self._finite.copy_(torch.isfinite(local))
                self._skipped.add_(torch.logical_not(self._finite))
                into = capture.recording()  # the graph being captured (this step's or a whole step's)
                if into is not None and self.skip_by == "if_node":
                    # one IF node per phase: the mark (an event record node) between them, in
                    # the graph itself (a conditional body holds kernels only)
                    self._run_phases(phases, early,
                                     lambda phase: RUNTIME.device.run_if(into.graph, self._finite, phase))
                elif into is not None:
                    # the fused kernel leaves parameters and state alone, and undoes its step
                    # count, where found_inf is 1 (the gradients are clipped by a non-finite
                    # coefficient then, as the step is skipped they are only read by the user)
                    self.opt.found_inf = torch.logical_not(self._finite).to(torch.float32)
                    try:
                        update()
                    finally:
                        del self.opt.found_inf
                elif bool(self._finite):  # eager: a host sync
                    update()
            else:
                update()
            del total, local
        return []

    def _run_eager(self, warmup: bool) -> None:
        """The step on the gradients ``param.grad`` holds now, without a graph (warm-up:
        under ``is_capturing()``, as the capture runs)."""
        self._step_params = [p for p in self._params if p.grad is not None]
        ctx = RUNTIME.capturing() if warmup else contextlib.nullcontext()
        self._eager_now = True
        try:
            with ctx, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_WARMUP_FILTER)
                self._body([])
        finally:
            self._eager_now = False
        ran = bool(self._finite) if self.skip else True
        if ran:
            self._initialized.update(id(p) for p in self._step_params)
        SESSION.counters.add("optimizer_steps_eager")
        self.sync_counters()

    def _reference_step(self) -> None:
        """torch's eager clip + step on the optimizer as the user built it (the
        fallback): the same skip semantics, decided on the host."""
        params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        nn_utils = torch.nn.utils
        total = _replicated(nn_utils.get_total_norm([p.grad for p in params], self.norm_type, False, self.foreach))
        local = _compat.dtensor_local(total)
        if self._norm is None or self._norm.device != local.device:
            self._norm = torch.zeros((), dtype=local.dtype, device=local.device)
        self._norm.copy_(local)
        SESSION.counters.add("optimizer_steps_eager")
        if self.skip and not bool(torch.isfinite(local)):
            SESSION.counters.add("optimizer_steps_skipped_nonfinite")
            return
        self._run_phases(*self._phases(params, total))

    def _phases(self, params: list[torch.Tensor], total: torch.Tensor) -> tuple[list[Any], frozenset[int]]:
        """The update as callables run in order. With shards whose gathers the next
        forward takes from :data:`graphcomp.sharding.prefetch.PREFETCH` among ``params``: clip,
        step those shards; then (after the mark) step the rest. Otherwise one phase.
        Each parameter's update is the one a single ``opt.step()`` makes (Adam, AdamW
        and SGD update each parameter on its own). Also returns the early shards' ids."""
        early, rest = self._split(params)
        exact = self._exact_fold(params, [early, rest] if early else [params])
        if not early:
            return [lambda: self._clip_and_step(params, total, exact=exact)], frozenset()
        ids = frozenset(id(p) for p in early)
        return [lambda: self._clip_and_step(params, total, only=early, exact=exact),
                lambda: self._clip_and_step(params, total, only=rest, clipped=True, exact=exact)], ids

    def _split(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the shards stepped before the prefetch mark, the others); ([], params) without."""
        early = self._early(params)
        ids = {id(p) for p in early}
        return early, [p for p in params if id(p) not in ids]

    def _run_phases(self, phases: list[Any], early: frozenset[int], run: Any = None) -> None:
        """Run ``phases`` in order (each through ``run``, e.g. into an IF node), with the
        prefetch mark between the first and the second."""
        for i, phase in enumerate(phases):
            if i:
                self._mark(early)
            if run is None:
                phase()
            else:
                run(phase)

    def _early(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The shards to update before the prefetch mark (none: no prefetch this step)."""
        if not self.prefetch or self._inline_now or _compat.optimizer_step_hooks(self.opt):
            return []  # (hooks would run once per phase)
        early = PREFETCH.shards_for(params)
        return early if len(early) < len(params) else []

    def _mark(self, early: frozenset[int]) -> None:
        """On the device, after the early phase (the shards ``early``): their prefetch may
        start (inside a capture an external event record node, which a stream outside
        the graph can wait for)."""
        dev = RUNTIME.device
        self._marked = early
        params = self._step_params or [p for g in self.opt.param_groups for p in g["params"]]
        if not params or _compat.dtensor_local(params[0]).device.type != "cuda":
            return  # (CPU: collectives and updates run in issue order; nothing to mark)
        if self._prefetch_event is None:
            self._prefetch_event = dev.new_event(external=True)
        dev.record_event(self._prefetch_event)

    def _issue_prefetch(self, params: list[torch.Tensor], captured: bool) -> None:
        """After the step (host): launch the next forward's prefetched gathers; those
        whose shards were updated before the mark wait for it only (they run beside
        the rest of the step), any other after the whole step."""
        if not self.prefetch or not PREFETCH.recipes:
            return
        if captured:
            early = self._graph_marks if _compat.supports_external_events() else frozenset()
        else:
            early = self._marked
        first = [p for p in params if id(p) in early]
        if first:
            PREFETCH.issue(first, after=self._prefetch_event)
        PREFETCH.issue([p for p in params if id(p) not in early], after=None)
        self._marked = frozenset()

    def _exact_fold(self, params: list[torch.Tensor], subsets: list[list[torch.Tensor]]) -> bool:
        """Whether this step clips and steps through :mod:`clip_fold`'s kernel
        (``fold_clip="auto"``): a fused Adam/AdamW whose kernel the probe matched bitwise,
        float32 state already created, the kernel's tables for each of ``subsets`` (the
        phases' parameters) built (outside a capture: built now; inside: before it, by
        :meth:`_capture`), outside the reference mode. Says why not once per reason."""
        if self.fold_clip != "auto" or self.max_norm is None or self.mode == "reference":
            return False
        why = clip_fold.refusal(self.opt)
        if why is None and params:
            device = _compat.dtensor_local(params[0]).device
            why = clip_fold.device_refusal(device)
            if why is None:  # (no probe inside a capture: only its verdict)
                why = clip_fold.probed(self.opt) if RUNTIME.device.capture_active() else clip_fold.probe(self.opt, device)
        if why is None:  # (the state, dtypes and layouts of each subset's tensors; their tables)
            why = clip_fold.prepare(self.opt, subsets)
        self.clip_folded = why is None
        if why != self._fold_why:
            self._fold_why = why
            if why is None:
                SESSION.counters.add("optimizer_clip_folds")
                self._decide("clip folded into the fused optimizer kernel (graphcomp/optim/clip_fold.py: "
                             "bitwise clip_grads_with_norm_ + opt.step(), one pass over the gradients fewer)")
            else:
                self._decide(f"clip apart from the optimizer step: {why}")
        return why is None

    def _clip_and_step(self, params: list[torch.Tensor], total: torch.Tensor,
                       only: list[torch.Tensor] | None = None, clipped: bool = False, exact: bool = False) -> None:
        """``clip_grads_with_norm_`` + ``opt.step()``. ``exact`` (see :meth:`_exact_fold`):
        one kernel multiplies ``only`` (or ``params``)'s gradients by the clip
        coefficient and steps them, bitwise the two calls. ``fold_clip=True``: the fused
        kernel divides each gradient by ``1 / clip coefficient`` (its ``grad_scale``,
        as for torch.amp's GradScaler) instead of a separate pass multiplying them:
        the same coefficient as ``clip_grads_with_norm_`` (``max_norm / (norm + 1e-6)``,
        at most 1); the kernel stores the scaled gradients, as clipping leaves them.
        ``only``: step just these parameters (clipping still covers ``params``, unless
        ``clipped`` says an earlier phase did; the exact fold clips ``only``)."""
        step = self.opt.step if only is None else (lambda: self._step_only(only))
        if self.max_norm is None:
            step()
            return
        if exact:
            # the coefficient as clip_grads_with_norm_ computes it, on the local norm
            coef = torch.clamp(self.max_norm / (_compat.dtensor_local(total) + 1e-6), max=1.0)
            why = clip_fold.step(self.opt, params if only is None else only, coef,
                                 getattr(self.opt, "found_inf", None), self._fold_keep)
            if why is None:
                return
            raise RuntimeError(f"graphcomp.optim: the exact clip fold refused a step it was planned for: {why}")
        if self.fold_clip is not True:
            if not clipped:
                torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, total, self.foreach)
            step()
            return
        coef = torch.clamp(self.max_norm / (_compat.dtensor_local(total) + 1e-6), max=1.0)
        self.opt.grad_scale = torch.reciprocal(coef).to(torch.float32)
        try:
            step()
        finally:
            del self.opt.grad_scale

    def _step_only(self, params: list[torch.Tensor]) -> None:
        """``opt.step()`` on ``params`` alone: every other parameter's gradient is
        hidden (None, which the optimizer skips) for the call and put back after."""
        keep = {id(p) for p in params}
        hidden = [(p, p.grad) for g in self.opt.param_groups for p in g["params"]
                  if id(p) not in keep and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            self.opt.step()
        finally:
            for p, gr in hidden:
                p.grad = gr

    # ------------------------------------------------------------ capture
    def _local_grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [_compat.dtensor_local(p.grad) for p in params]

    def _static_tensors(self) -> list[torch.Tensor]:
        out = []
        for p in self._with_grad:
            out.append(_compat.dtensor_local(p))
            st = self.opt.state.get(p)
            if st:
                out.extend(_compat.dtensor_local(v) for v in st.values() if isinstance(v, torch.Tensor))
        return out

    def _drop_graph(self) -> None:
        capture.release(self._graph)
        self._graph = None

    def _capture(self, with_grad: list[torch.Tensor]) -> bool:
        """Capture the step for ``with_grad``; False (and eager from now on) when the
        capture fails in ``cudagraphs="auto"``."""
        RUNTIME.ensure()
        RUNTIME.register_owner(self)
        self._with_grad = self._step_params = with_grad
        if self._copy_mode:
            self._make_grad_buffers()
        if self.fold_clip == "auto" and self.max_norm is not None:
            # the exact fold's probe and tables, which a capture cannot make (its copies
            # would run only at replay), on the gradients the body will see
            with self._bound():
                early, rest = self._split(with_grad)
                self._exact_fold(with_grad, [early, rest] if early else [with_grad])
        try:
            # a private pool (temporaries never overlap the shared pool's tensors), new for
            # every capture: torch asserts (CachingHostAllocator / CUDACachingAllocator,
            # "it->second->use_count > 0" in beginAllocateToPool) when a capture reuses a
            # pool id whose graphs were all reset while its blocks are still held (the
            # previous capture's norm and skip buffers), as a re-capture after the gradients
            # moved would. The previous pool goes back once its tensors die.
            rec = capture.capture("optimizer", self._body, pool=capture.PRIVATE)
        except Exception as e:
            if self.require:
                raise
            self._go_eager(f"capture failed: {type(e).__name__}: {e}")
            return False
        self._graph, self._pool = rec.graph, rec.pool
        self._graph_marks, self._marked = self._marked, frozenset()
        self._grad_ptrs = self._grad_key(_compat.grads_of(self._params))
        self._static_ptrs = tuple(t.data_ptr() for t in self._static_tensors())
        self._replays_checked = 0
        self._hyper = self._hyper_key()
        SESSION.counters.add("optimizer_captures")
        self.mode = "captured"
        self._decide(f"captured ({len(with_grad)} parameters with gradients; gradients "
                     f"{'copied into static buffers' if self._copy_mode else 'read in place'})")
        return True

    def _make_grad_buffers(self) -> None:
        from torch.distributed.tensor import DTensor

        self._grad_bufs, self._grad_views = [], []
        for p in self._with_grad:
            local = _compat.dtensor_local(p.grad)
            buf = torch.empty_like(local, memory_format=torch.contiguous_format)
            buf.copy_(local)
            self._grad_bufs.append(buf)
            if isinstance(p.grad, DTensor):
                gd = p.grad
                self._grad_views.append(DTensor.from_local(buf, gd.device_mesh, gd.placements, run_check=False,
                                                           shape=gd.shape, stride=gd.stride()))
            else:
                self._grad_views.append(buf)

    # -------------------------------------------------------------- calling
    def _plan(self, check_grads: bool = True, sync_lr: bool = True) -> str:
        """This step's host-side work; returns "reference", "eager", "warmup",
        "capture" or "replay"."""
        if self.mode == "reference":
            return "reference"
        if self.mode != "eager" and _compat.optimizer_step_hooks(self.opt):
            self._fall_back("optimizer step hooks are registered (a captured step would run them once, at capture)")
            return self._plan(check_grads)
        opt = self.opt
        if (not self._adopted or opt.state is not self._state_obj or opt.param_groups is not self._groups_obj
                or [len(g["params"]) for g in opt.param_groups] != self._shape):
            if self._graph is not None:
                self._invalidate("the optimizer's state or param_groups were replaced (load_state_dict, add_param_group)")
            self._adopt()
        if sync_lr:  # (not while a whole-step capture records: the refresh would become part of its graph)
            self._sync_lr()
        if self.mode == "eager" or self._released:
            return "eager"
        hyper = self._hyper_key()
        if self._graph is not None and hyper != self._hyper:
            changed = [k for a, b in zip(hyper, self._hyper) for k, v in a if (k, v) not in b] or ["param_groups"]
            self._invalidate(f"hyper-parameter {changed[0]!r} changed")
        grads = _compat.grads_of(self._params)
        if self._graph is not None and (not check_grads or self._grad_key(grads) == self._grad_ptrs):
            return self._check_static(with_grad=None)  # the common case: nothing moved
        with_grad = [p for p, g in zip(self._params, grads) if g is not None]
        del grads
        if not with_grad or any(id(p) not in self._initialized for p in with_grad):
            return "warmup"
        if self._graph is None:
            return self._capture_plan(with_grad)
        if len(with_grad) != len(self._with_grad) or any(a is not b for a, b in zip(with_grad, self._with_grad)):
            self._invalidate("the set of parameters with a gradient changed")
            return self._capture_plan(with_grad)
        if not self._copy_mode:
            self._moves += 1
            if self._moves > _MOVES_BEFORE_COPY:
                self._copy_mode = True
                self._decide(f"gradients moved {self._moves} times: static gradient buffers from now on "
                             f"({sum(t.numel() * t.element_size() for t in self._local_grads(with_grad))} bytes, "
                             f"one copy per step)")
            self._invalidate("a gradient is at a new address")
            return self._capture_plan(with_grad)
        return self._check_static(with_grad)

    def _grad_key(self, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
        """What a replay compares with the capture: every parameter's gradient address
        (None: no gradient); in copy mode only which parameters have one."""
        if self._copy_mode:
            return tuple(g is not None for g in grads)
        return _compat.local_data_ptrs(grads)

    def _check_static(self, with_grad: list[torch.Tensor] | None) -> str:
        """Parameters and optimizer state where they were at capture (on the first
        replays, or always with ``check_static_inputs="always"``)."""
        if self.check_always or self._replays_checked < 2:
            self._replays_checked += 1
            if tuple(t.data_ptr() for t in self._static_tensors()) != self._static_ptrs:
                self._invalidate("a parameter or optimizer-state tensor is at a new address")
                return self._capture_plan(with_grad if with_grad is not None else self._with_grad)
        return "replay"

    def _invalidate(self, why: str) -> None:
        self._decide(f"re-capture: {why}")
        self._drop_graph()
        self._recaptures += 1
        SESSION.counters.add("optimizer_recaptures")

    def _capture_plan(self, with_grad: list[torch.Tensor]) -> str:
        if self._recaptures > self.max_recaptures:
            self._go_eager(f"more than max_recaptures={self.max_recaptures} re-captures (last: {self.decisions[-1]})")
            return "eager"
        self._with_grad = with_grad
        return "capture"

    def ready(self, check_grads: bool = True) -> bool:
        """Do this step's host-side work (lr refresh, checks); True when the step can
        be the bare graph replay :meth:`replay` (then call it, not ``step()``).
        ``check_grads=False`` skips the gradient-address check (the caller vouches
        that the gradients are where they were at capture)."""
        return self._plan(check_grads) == "replay"

    def replay(self) -> None:
        """Replay the captured step (after :meth:`ready` returned True)."""
        self._step_params = self._with_grad  # (a stand-in device's graph runs the body again)
        if self._copy_mode:
            src = self._local_grads(self._with_grad)
            torch._foreach_copy_(self._grad_bufs, src)
            SESSION.counters.add("optimizer_grad_copy_bytes", sum(t.numel() * t.element_size() for t in src))
        self._graph.replay()
        SESSION.counters.add("optimizer_steps_captured")
        self._issue_prefetch(self._with_grad, captured=True)

    @property
    def last_norm(self) -> torch.Tensor | None:
        """The latest step's global norm (a static device tensor: the next step
        overwrites it; ``step()`` returns a copy)."""
        return self._norm

    def __call__(self) -> torch.Tensor:
        outer = capture.recording("step")
        if outer is not None:
            return self._inline(outer)
        plan = self._plan()
        if plan == "reference":
            self._reference_step()
            self._issue_prefetch([p for g in self.opt.param_groups for p in g["params"] if p.grad is not None],
                                 captured=False)
            return self._norm.clone()
        if plan in ("warmup", "eager"):
            self._run_eager(warmup=plan == "warmup")
            self._issue_prefetch(self._step_params, captured=False)
            self._raise_if_nonfinite()
            return self._norm.clone()
        if plan == "capture":
            if not self._capture(self._with_grad):
                self._run_eager(warmup=False)
                self._issue_prefetch(self._step_params, captured=False)
                self._raise_if_nonfinite()
                return self._norm.clone()
        self.replay()
        self._raise_if_nonfinite()
        return self._norm.clone()

    def _inline(self, outer: Any) -> torch.Tensor:
        """Called while ``graphcomp.capture_step`` captures the whole step: record the
        clip + update into that graph (as this step's own capture would record it) and
        register the host work each replay of it needs (:meth:`_outer_hook`).

        Nothing here may touch this step's own graph: the gradients are the outer
        graph's (new addresses, read in place, never through the copy-mode buffers),
        and resetting a graph while another is being captured breaks that capture
        (on CUDA the error surfaces at the next kernel launch, not at the reset). The
        own graph stays as it is for the calls that run the step uncaptured."""
        if self.error_if_nonfinite:
            raise RuntimeError(f"graphcomp.optim: {self.name} has error_if_nonfinite=True, which reads the norm on the "
                               f"host every step: a whole-step graph cannot raise (use error_if_nonfinite=False; "
                               f"skipped steps are still counted)")
        why = self._not_recordable()
        if why is None:
            with_grad = [p for p, g in zip(self._params, _compat.grads_of(self._params)) if g is not None]
            if not with_grad:
                why = "no parameter has a gradient (call it after backward)"
            elif any(id(p) not in self._initialized for p in with_grad):
                why = ("it is in its warm-up phase (a parameter has no optimizer state yet): warm the step up for "
                       "more calls first (capture_step(warmup=...))")
        if why is not None:
            raise RuntimeError(f"graphcomp.optim: {self.name} cannot be recorded into a whole-step capture: {why}")
        self._step_params = with_grad
        self._inline_hyper = self._hyper_key()  # (not _hyper: that is the own graph's)
        self._inline_now = True
        try:
            self._body([])
        finally:
            self._inline_now = False
        outer.add_hook(self._outer_hook)
        SESSION.counters.add("optimizer_steps_in_step_graph")
        self._decide("recorded inline into a whole-step capture (graphcomp.capture_step)")
        return self._norm.clone()

    def _not_recordable(self) -> str | None:
        """Why the step cannot be (or no longer is) part of a whole-step graph; None: it can."""
        opt = self.opt
        if self.mode in ("eager", "reference") or self._released:
            return f"the optimizer step {self.name} runs eagerly ({self.reason or 'released'})"
        if not self._adopted:
            return f"the optimizer step {self.name} has not run yet (it adopts the optimizer on its first call)"
        if (opt.state is not self._state_obj or opt.param_groups is not self._groups_obj
                or [len(g["params"]) for g in opt.param_groups] != self._shape):
            return "the optimizer's state or param_groups were replaced (load_state_dict, add_param_group)"
        if _compat.optimizer_step_hooks(opt):
            return "optimizer step hooks are registered"
        return None

    def prepare_for_step_capture(self) -> None:
        """Before ``graphcomp.capture_step`` captures a step holding this one: the lr
        refresh, outside the capture (inside, its copy would become part of the graph
        and reset the lr to the capture's value at every replay)."""
        if self._adopted and self.mode not in ("eager", "reference"):
            self._sync_lr()
            if self.fold_clip == "auto" and self.max_norm is not None and not clip_fold.refusal(self.opt):
                # the whole step's backward writes the gradients in that graph's own pool, at
                # addresses no table was built for: pinned buffers the capture fills
                clip_fold.reserve(self.opt, [p for p in self._params if p.requires_grad])

    def _outer_hook(self) -> str | None:
        """Before a replay of a whole-step graph holding this step: the lr refresh,
        and why the recorded step no longer holds (None: it holds)."""
        why = self._not_recordable()
        if why is not None:
            return why
        self._sync_lr()
        if self._hyper_key() != self._inline_hyper:
            return "an optimizer hyper-parameter changed"
        return None

    def _raise_if_nonfinite(self) -> None:
        if self.error_if_nonfinite and not bool(self._finite):
            self.sync_counters()
            raise RuntimeError(
                f"The total norm of order {self.norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped; graphcomp skipped this update. To skip such steps without this error, pass "
                "error_if_nonfinite=False to graphcomp.optim.capture")

    # ----------------------------------------------------------- counters
    def sync_counters(self) -> int:
        """Read the device's count of skipped (non-finite) steps (a host sync), add
        what is new to ``graphcomp.counters['optimizer_steps_skipped_nonfinite']``;
        returns this step's total."""
        if self._skipped is None or self.mode == "reference":
            return 0
        n = int(self._skipped)
        SESSION.counters.add("optimizer_steps_skipped_nonfinite", n - self._skipped_seen)
        self._skipped_seen = n
        return n

    def stats(self) -> dict[str, Any]:
        """What ran and why: mode, captures, gradient handling, decisions."""
        return {
            "name": self.name, "mode": self.mode, "reason": self.reason, "captured": self._graph is not None,
            "recaptures": self._recaptures, "gradients": "copied" if self._copy_mode else "in place",
            "grad_buffer_bytes": sum(b.numel() * b.element_size() for b in self._grad_bufs) if self._copy_mode else 0,
            "skip_by": self.skip_by if self.skip else None, "clip_folded": self.clip_folded,
            "decisions": list(self.decisions),
        }

    def release(self, final: bool = False) -> int:
        """Drop the captured graph (``graphcomp.runtime.teardown()`` calls this with
        ``final=True``: later steps then run eagerly). Returns graphs released."""
        n = int(self._graph is not None)
        self._drop_graph()
        if final and self.mode != "reference":
            self._released = True
            if n:
                self._decide("released by teardown: eager from now on")
        return n
