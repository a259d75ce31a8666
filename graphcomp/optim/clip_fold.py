"""The clip folded exactly into a fused Adam/AdamW step: one Triton kernel.

``clip_grads_with_norm_`` + a fused ``opt.step()`` read and write every gradient
twice: the clip multiplies each by the coefficient and stores it, then torch's fused
kernel reads it again with the parameter and both moments. This kernel multiplies
each gradient by the coefficient, stores it (as the clip leaves it) and makes the
update torch's fused Adam/AdamW kernel makes, operation for operation in float32
(the same fused multiply-adds, IEEE divisions and square roots; ``beta ** step`` for
the bias corrections from ``torch.pow``, which calls the same ``powf`` as torch's
kernel): parameters, moments and gradients are bitwise those of the two calls, with
one pass over the gradients fewer.

That the arithmetic matches is checked, not assumed. Before the first use for a
set of hyper-parameters, :func:`probe` runs torch's clip + ``_fused_adam(w)_`` and
each variant of the kernel on random tensors with those hyper-parameters (the only
place where builds differ is how the weight decay's multiply-add is rounded, even
from one element to the next: see ``_VARIANTS``); the variant whose parameters,
moments and gradients are bitwise equal is kept. Where none is (another torch's
kernel), the step clips apart and says why.

Scope: Adam/AdamW with ``fused=True``, float32 parameters, gradients and moments,
contiguous, on CUDA, no ``amsgrad``, float betas; ``lr`` a float or a device tensor;
``found_inf`` as torch's kernel takes it (a step it skips leaves the gradients as
they were). Everything else clips apart (:func:`refusal` says why).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from graphcomp import _compat
from graphcomp.runtime.manager import RUNTIME

# elements per program and warps per program: the fastest of the shapes tried (up to
# 8192 x 8) on a large step, and faster there than clip + torch's fused AdamW; larger
# blocks launch fewer programs but leave the step slower
BLOCK = 1024
WARPS = 4
# How the weight decay's multiply-add is rounded, by mode: 0 fused (one fma), 1 unfused
# (the product rounded, then the add), 2 as torch 2.11's compiled fused Adam does it for
# L2 decay without maximize: unfused in the first of the 4 elements a thread handles per
# iteration, fused in the other three (nvcc contracts three of the four unrolled
# copies; the probe's mismatch counts show it, and this mode reproduces them). The
# probe tries them in order per hyper-parameters; AdamW and maximize match mode 0.
_VARIANTS = {True: (0, 1), False: (0, 1, 2)}  # by AdamW
_VARIANT_NAMES = {0: "fused decay", 1: "unfused decay", 2: "decay unfused in torch's first ILP lane"}
# torch's multi_tensor_apply layout (ATen/native/cuda/MultiTensorApply.cuh), which mode 2
# follows: chunks of 65536 elements, 512 threads, 4 elements a thread per iteration, as
# 4 contiguous elements where the tensor's numel is a multiple of 4 and its four
# pointers are 16-byte aligned, else strided by the block size
TORCH_CHUNK, TORCH_THREADS, TORCH_ILP = 65536, 512, 4

_kernel: Any = None
_probed: dict[tuple, Any] = {}  # hyper-parameters -> the matching variant, or a str: why none


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def clip_adam_kernel(table, blocks, n_tensors, pow1_ptr, pow2_ptr, coef_ptr, lr_ptr, found_inf_ptr,
                         lr_value, beta1, beta2, weight_decay, eps,
                         BLOCK: tl.constexpr, LR_PTR: tl.constexpr, FOUND_INF: tl.constexpr,
                         ADAMW: tl.constexpr, DECAY: tl.constexpr, DECAY_MODE: tl.constexpr,
                         T_CHUNK: tl.constexpr, T_THREADS: tl.constexpr, T_ILP: tl.constexpr,
                         MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(blocks + pid)
        b = tl.load(blocks + tl.num_programs(0) + pid)
        n = tl.load(table + 5 * n_tensors + t)
        p_ptr = tl.load(table + t).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(table + n_tensors + t).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(table + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(table + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if FOUND_INF:  # torch's kernel returns at once: nothing is read or written
            mask = mask & (tl.load(found_inf_ptr) != 1.0)
        coef = tl.load(coef_ptr)
        if LR_PTR:
            lr = tl.load(lr_ptr)
        else:
            lr = lr_value

        grad = tl.load(g_ptr + offs, mask=mask) * coef  # the clip: grads *= coefficient
        tl.store(g_ptr + offs, grad, mask=mask)
        if MAXIMIZE:
            grad = -grad
        param = tl.load(p_ptr + offs, mask=mask)
        exp_avg = tl.load(m_ptr + offs, mask=mask)
        exp_avg_sq = tl.load(v_ptr + offs, mask=mask)
        if DECAY:
            if ADAMW:  # param -= lr * weight_decay * param
                lr_wd = lr * weight_decay
                if DECAY_MODE == 0:
                    param = tl.fma(-lr_wd, param, param)
                else:
                    param = param - lr_wd * param
            else:  # grad += param * weight_decay (the kernel is built without contraction)
                if DECAY_MODE == 0:
                    grad = tl.fma(param, weight_decay, grad)
                elif DECAY_MODE == 1:
                    grad = grad + param * weight_decay
                else:
                    # the lane of torch's kernel that handles each element: its offset in
                    # its chunk, modulo 4 on the vectorized path, else by block-size stride
                    vec = tl.load(table + 6 * n_tensors + t) != 0
                    c = offs % T_CHUNK
                    lane = tl.where(vec, c % T_ILP, (c % (T_THREADS * T_ILP)) // T_THREADS)
                    grad = tl.where(lane == 0, grad + param * weight_decay, tl.fma(param, weight_decay, grad))
        exp_avg = tl.fma(beta1, exp_avg, tl.fma(-beta1, grad, grad))
        grad_sq = grad * grad
        exp_avg_sq = tl.fma(beta2, exp_avg_sq, tl.fma(-beta2, grad_sq, grad_sq))
        # beta ** step from torch's own pow kernel (see launch): the CUDA math library torch
        # was built with, not the libdevice Triton carries (their powf differ in the last bit)
        bias_correction1 = 1.0 - tl.load(pow1_ptr + t)
        bias_correction2 = 1.0 - tl.load(pow2_ptr + t)
        bias_correction2_sqrt = tl.sqrt_rn(bias_correction2)
        step_size = tl.div_rn(lr, bias_correction1)
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
        param = param - tl.div_rn(step_size * exp_avg, denom)
        tl.store(p_ptr + offs, param, mask=mask)
        tl.store(m_ptr + offs, exp_avg, mask=mask)
        tl.store(v_ptr + offs, exp_avg_sq, mask=mask)

    return clip_adam_kernel


def _get_kernel() -> Any:
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    return _kernel


def _f32(x: Any) -> float:
    """A Python number as the float32 torch's kernel casts it to (round to nearest)."""
    return float(torch.tensor(float(x), dtype=torch.float64).to(torch.float32))


def hyper_key(opt: torch.optim.Optimizer, group: dict) -> tuple:
    lr = group["lr"]
    return (type(opt) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay")),
            "tensor" if isinstance(lr, torch.Tensor) else "float",
            float(group["betas"][0]), float(group["betas"][1]), float(group["weight_decay"]),
            float(group["eps"]), bool(group.get("maximize", False)))


def refusal(opt: torch.optim.Optimizer) -> str | None:
    """Why this optimizer's step cannot take the fold at all (None: it can, subject to
    the probe and to each step's tensors, see :func:`group_tensors`)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(opt).__name__} is not Adam or AdamW"
    for i, g in enumerate(opt.param_groups):
        if not g.get("fused"):
            return f"param group {i} is not fused (fused=True)"
        if g.get("amsgrad"):
            return f"param group {i} uses amsgrad"
        if g.get("differentiable"):
            return f"param group {i} is differentiable"
        if any(isinstance(b, torch.Tensor) for b in g["betas"]):
            return f"param group {i} has tensor betas"
    if _compat.optimizer_step_hooks(opt):
        return "the optimizer has step hooks (the fold does not call opt.step())"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not triton_available():
        return "Triton is not installed"
    return None


def device_refusal(device: torch.device) -> str | None:
    """Why parameters on ``device`` cannot take the kernel (None: CUDA)."""
    return None if device.type == "cuda" else f"parameters on {device.type}, not CUDA"


def _local(t: torch.Tensor) -> torch.Tensor:
    return _compat.dtensor_local(t)


def group_tensors(opt: torch.optim.Optimizer, group: dict, params: list[torch.Tensor]
                  ) -> tuple[list[list[torch.Tensor]] | None, str | None]:
    """The local (P, G, M, V, step) lists of ``params`` (this group's, with gradients),
    or None and why they cannot take the kernel (state not created yet, a dtype, a
    layout)."""
    lists: list[list[torch.Tensor]] = [[], [], [], [], []]
    for p in params:
        st = opt.state.get(p)
        if not st or "exp_avg" not in st or "exp_avg_sq" not in st or "step" not in st:
            return None, "optimizer state not created yet"
        ts = (_local(p), _local(p.grad), _local(st["exp_avg"]), _local(st["exp_avg_sq"]), _local(st["step"]))
        for j, t in enumerate(ts):
            if t.dtype != torch.float32:
                return None, f"a {('parameter', 'gradient', 'exp_avg', 'exp_avg_sq', 'step')[j]} is {t.dtype}, not float32"
            if t.device.type != "cuda":
                return None, "a tensor is not on CUDA"
            if j < 4 and not t.is_contiguous():
                return None, "a tensor is not contiguous"
            lists[j].append(t)
        if not (ts[0].shape == ts[1].shape == ts[2].shape == ts[3].shape):
            return None, "a gradient or moment's shape differs from its parameter's"
    return lists, None


def block_table(numels: list[int], block: int) -> torch.Tensor:
    """int32 [2, B]: for each program, the tensor it updates and its block in that
    tensor (``ceil(numel / block)`` programs a tensor, in order)."""
    counts = (torch.tensor(numels, dtype=torch.int64) + block - 1) // block
    first = torch.cumsum(counts, 0) - counts  # each tensor's first program
    which = torch.repeat_interleave(torch.arange(len(numels)), counts)
    return torch.stack([which, torch.arange(int(counts.sum())) - first[which]]).to(torch.int32)


_TABLES_CACHED = 16  # recent tables, by addresses (rebuilding them costs an eager step milliseconds of host time)
_cache: dict[tuple, tuple[Any, ...]] = {}


def _table(lists: list[list[torch.Tensor]], block: int, take_spare: bool = True) -> tuple[Any, ...] | None:
    """Device tables: int64 [7, T] (pointers of P, G, M, V, step; numels; whether
    torch's kernel takes the tensor's vectorized path, see ``TORCH_ILP``) and int32
    [2, B] (each program's tensor and block), copied from pinned memory (a copy a
    capture can record; a captured graph reads its host and device tables at every
    replay, so whoever captures keeps the tuple alive). Returns (table, blocks,
    number of blocks, aligned, host table, host blocks). Cached by the addresses and
    sizes, which are all the tables hold.

    Inside a capture nothing is cached (the copy runs only at the graph's replays, and
    a later eager step finding it cached would read unwritten memory): tables built
    before the capture are used, else one of the pinned buffers :func:`reserve` set
    aside for these sizes is filled with the addresses the capture sees (a whole-step
    capture: its backward writes the gradients in the graph's own pool) and belongs to
    that graph. None when neither exists. ``take_spare=False`` (inside a capture): only
    whether a set-aside buffer is there, nothing taken (an empty tuple if it is)."""
    numels = [t.numel() for t in lists[0]]
    key = (block, *(t.data_ptr() for lst in lists for t in lst), *numels)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    capturing = RUNTIME.device.capture_active()
    spare = _reserved.get((block, *numels)) if capturing else None
    if capturing and not spare:
        return None
    if capturing and not take_spare:
        return ()
    dev = lists[0][0].device
    vec = [int(n % TORCH_ILP == 0 and all(lst[i].data_ptr() % (4 * TORCH_ILP) == 0 for lst in lists[:4]))
           for i, n in enumerate(numels)]
    rows = torch.tensor([[t.data_ptr() for t in lst] for lst in lists] + [numels, vec], dtype=torch.int64)
    if capturing:
        host, host_blocks = spare.pop()
        host.copy_(rows)  # (host memory: not part of the graph; the graph's copy reads it at every replay)
    else:
        host, host_blocks = rows.pin_memory(), block_table(numels, block).pin_memory()
    table = torch.empty(host.shape, dtype=host.dtype, device=dev).copy_(host, non_blocking=True)
    blocks = torch.empty(host_blocks.shape, dtype=host_blocks.dtype, device=dev).copy_(host_blocks, non_blocking=True)
    aligned = all(t.data_ptr() % 16 == 0 for lst in lists[:4] for t in lst)
    out = (table, blocks, int(host_blocks.shape[1]), aligned, host, host_blocks)
    if not capturing:
        while len(_cache) >= _TABLES_CACHED:
            _cache.pop(next(iter(_cache)))
        _cache[key] = out
    return out


_reserved: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def reserve(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Outside a capture: one pair of pinned host buffers per group of ``params``
    (their tables' sizes), for a capture to fill with the gradient addresses it sees
    (see :func:`_table`); a pair already set aside for the same sizes is reused."""
    want = {id(p) for p in params}
    for group in opt.param_groups:
        numels = [_local(p).numel() for p in group["params"] if id(p) in want]
        if numels and not _reserved.get((BLOCK, *numels)):
            _reserved[(BLOCK, *numels)] = [(torch.empty((7, len(numels)), dtype=torch.int64).pin_memory(),
                                            block_table(numels, BLOCK).pin_memory())]


def launch(lists: list[list[torch.Tensor]], key: tuple, variant: int, coef: torch.Tensor,
           lr: Any, found_inf: torch.Tensor | None, keep: list | None = None,
           block: int | None = None, warps: int | None = None) -> None:
    """The kernel over the local tensors ``lists`` (P, G, M, V, step), the step counts
    already incremented (as torch does before its kernel). While a capture records
    it, its tables are appended to ``keep`` (the graph reads them at every replay)."""
    adamw, _, beta1, beta2, wd, eps, maximize = key
    block = block or BLOCK
    tables = _table(lists, block)
    if tables is None:
        raise RuntimeError("graphcomp.optim.clip_fold: the kernel's tables were not prepared before the capture")
    table, blocks, n_blocks, aligned = tables[:4]
    if keep is not None and RUNTIME.device.capture_active():
        keep.append(tables)
    if n_blocks == 0:
        return
    lr_is_tensor = isinstance(lr, torch.Tensor)
    # torch's kernel computes pow(beta, step) per tensor with the CUDA math library's
    # powf: torch.pow on float32 tensors calls the same function
    steps = torch.stack(lists[4])
    pow1 = torch.pow(torch.full((), beta1, dtype=torch.float32, device=steps.device).expand_as(steps), steps)
    pow2 = torch.pow(torch.full((), beta2, dtype=torch.float32, device=steps.device).expand_as(steps), steps)
    _get_kernel()[(n_blocks,)](
        table, blocks, len(lists[0]), pow1, pow2, coef, lr if lr_is_tensor else coef, found_inf if found_inf is not None else coef,
        0.0 if lr_is_tensor else _f32(lr), _f32(beta1), _f32(beta2), _f32(wd), _f32(eps),
        BLOCK=block, LR_PTR=lr_is_tensor, FOUND_INF=found_inf is not None, ADAMW=adamw, DECAY=wd != 0.0,
        DECAY_MODE=variant, T_CHUNK=TORCH_CHUNK, T_THREADS=TORCH_THREADS, T_ILP=TORCH_ILP,
        MAXIMIZE=maximize, ALIGNED=aligned, num_warps=warps or WARPS, enable_fp_fusion=False)


def _subsets(opt: torch.optim.Optimizer, params: list[torch.Tensor]):
    want = {id(p) for p in params}
    for group in opt.param_groups:
        ps = [p for p in group["params"] if id(p) in want and p.grad is not None]
        if ps:
            yield group, ps


def prepare(opt: torch.optim.Optimizer, subsets: list[list[torch.Tensor]]) -> str | None:
    """Outside a capture: build (and cache) the tables of each of ``subsets`` (the
    parameter lists the step will pass to :func:`step`), so that a capture finds them.
    Inside one: None only if each is cached or has a buffer :func:`reserve` set aside.
    Else why not."""
    for params in subsets:
        for group, ps in _subsets(opt, params):
            lists, why = group_tensors(opt, group, ps)
            if lists is None:
                return why
            if _table(lists, BLOCK, take_spare=False) is None:
                return ("the kernel's tables were not built before this capture and no buffer was set aside for "
                        "them (the gradients moved?)")
    return None


def step(opt: torch.optim.Optimizer, params: list[torch.Tensor], coef: torch.Tensor,
         found_inf: torch.Tensor | None = None, keep: list | None = None) -> str | None:
    """Clip (multiply by ``coef``, a float32 0-dim device tensor) and step ``params``
    (those of ``opt`` with gradients) with the kernel. Returns None when done, else
    why not (nothing was changed then: the caller clips apart)."""
    todo = []
    for group, ps in _subsets(opt, params):
        key = hyper_key(opt, group)
        variant = _probed.get(key)
        if variant is None or isinstance(variant, str):
            return variant or "the kernel was not probed for these hyper-parameters"
        lists, why = group_tensors(opt, group, ps)
        if lists is None:
            return why
        todo.append((group, key, variant, lists))
    for group, key, variant, lists in todo:
        torch._foreach_add_(lists[4], 1)
        launch(lists, key, variant, coef, group["lr"], found_inf, keep)
        if found_inf is not None:
            torch._foreach_sub_(lists[4], [found_inf] * len(lists[4]))
    return None


def probed(opt: torch.optim.Optimizer) -> str | None:
    """None when every param group's hyper-parameters have a matching variant, else why not."""
    for group in opt.param_groups:
        got = _probed.get(hyper_key(opt, group))
        if got is None:
            return "the kernel was not probed for these hyper-parameters (a probe cannot run inside a capture)"
        if isinstance(got, str):
            return got
    return None


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def probe(opt: torch.optim.Optimizer, device: torch.device) -> str | None:
    """For each param group's hyper-parameters not probed yet: torch's clip + fused
    kernel and each variant of this kernel on the same random tensors (five tensors:
    tails, more than one chunk of torch's kernel, both of its paths, one parameter not
    16-byte aligned; steps 1 and 7; weight decay and maximize as the group has them);
    keeps the first variant bitwise equal in parameters, moments and gradients.
    Returns None when every group has one, else why not. Must run outside a capture."""
    for group in opt.param_groups:
        key = hyper_key(opt, group)
        if key not in _probed:
            _probed[key] = _probe_one(opt, group, key, device)
        if isinstance(_probed[key], str):
            return _probed[key]
    return None


def _probe_one(opt: torch.optim.Optimizer, group: dict, key: tuple, device: torch.device) -> Any:
    adamw, _, beta1, beta2, wd, eps, maximize = key
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        lr = lr.detach().to(device=device, dtype=torch.float32).clone()
    # both of torch's paths (numel a multiple of 4 or not; a parameter 4 bytes off a 16-byte
    # boundary), over more than one of its chunks, and a tail for this kernel's blocks
    sizes = (3 * BLOCK + 5, 1000, TORCH_CHUNK + 4464, TORCH_CHUNK + 4465, 4096)
    offset = (0, 0, 0, 0, 1)  # elements before the parameter in its buffer

    def make() -> list[list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(1234)
        p = [torch.randn(n, generator=gen) for n in sizes]
        g = [torch.randn(n, generator=gen) * 3 for n in sizes]
        m = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
        v = [torch.rand(n, generator=gen) * 0.01 for n in sizes]
        s = [torch.tensor(6.0 if i % 2 else 0.0) for i in range(len(sizes))]
        p = [torch.empty(n + k, device=device)[k:].copy_(t) for t, n, k in zip(p, sizes, offset)]
        return [p] + [[t.to(device) for t in lst] for lst in (g, m, v, s)]

    coef = torch.tensor(0.3712, dtype=torch.float32, device=device)
    ref = make()
    torch._foreach_mul_(ref[1], coef)
    torch._foreach_add_(ref[4], 1)
    fn = torch._fused_adamw_ if adamw else torch._fused_adam_
    fn(ref[0], ref[1], ref[2], ref[3], [], ref[4], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
       eps=eps, amsgrad=False, maximize=maximize)
    seen = []
    for variant in _VARIANTS[adamw] if wd else (0,):
        got = make()
        torch._foreach_add_(got[4], 1)
        try:
            launch(got, key, variant, coef, lr, None)
        except Exception as e:  # (a Triton that cannot build it: clip apart, say why)
            return f"the kernel failed to build or run: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        diff = _differences(ref, got)
        if not diff:
            return variant
        seen.append(f"{_VARIANT_NAMES[variant]}: {diff}")
    return (f"no variant of the kernel is bitwise torch's fused {'AdamW' if adamw else 'Adam'} on this torch "
            f"({torch.__version__}): " + "; ".join(seen))


def _differences(ref: list[list[torch.Tensor]], got: list[list[torch.Tensor]]) -> str:
    """Which of parameter, gradient, exp_avg, exp_avg_sq differ: elements, largest
    difference in units of the last place, and the first one (reference, kernel)."""
    out = []
    for j, name in enumerate(("param", "grad", "exp_avg", "exp_avg_sq")):
        a = torch.cat([t.reshape(-1) for t in ref[j]])
        b = torch.cat([t.reshape(-1) for t in got[j]])
        bad = a.view(torch.int32) != b.view(torch.int32)
        n = int(bad.sum())
        if n:
            i = int(bad.nonzero()[0])
            ulp = int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())
            out.append(f"{name} {n}/{a.numel()} (max {ulp} ulp; first [{i}] {float(a[i])!r} vs {float(b[i])!r})")
    return ", ".join(out)
