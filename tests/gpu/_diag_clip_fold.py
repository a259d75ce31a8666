"""Diagnosis of the exact clip fold on a GPU (not a test: ``python tests/gpu/_diag_clip_fold.py``).

1. The probe's verdict for Adam/AdamW, weight decay 0 and 0.1, a float and a tensor
   lr, maximize off and on (MATCH: a variant matched torch bitwise, and which).
2. For Adam with L2 weight decay (not matched on torch 2.11): the first elements whose
   exp_avg differs, with their inputs and both results as float32 hex, and which of
   a few float32 orderings of ``grad = clip(grad) + weight_decay * param`` followed by
   the exp_avg update gives torch's value (computed here with torch float32 ops on the
   CPU; ``fma`` as a float64 product (exact) and sum, rounded to float32: one double
   rounding, which rarely differs from a true fma). Run on 2 H100s (23a0dcf): for the
   first six elements the float32 unfused decay gave torch's value, but the kernel's
   unfused variant is off elsewhere (85 of 4077), as were three double-precision
   roundings of the decay tried in ecd35f8 (kept in benchmarks/results/gpu-tests/).
   Replaying the probe's inputs on the CPU then found torch's rule (the decay unfused
   in the first ILP lane of its kernel, fused in the others): decay mode 2, 3a494ad.
"""
import torch

from graphcomp.optim import clip_fold


def verdicts() -> None:
    # MATCH prints the probe's table: hyper-parameters -> the variant kept (the
    # weight decay's rounding: clip_fold._VARIANTS)
    for cls in (torch.optim.AdamW, torch.optim.Adam):
        for wd in (0.0, 0.1):
            for lr in (3e-3, torch.tensor(3e-3, device="cuda")):
                for maximize in (False, True):
                    p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
                    o = cls([p], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, maximize=maximize,
                            fused=True, capturable=True)
                    clip_fold._probed.clear()
                    r = clip_fold.probe(o, torch.device("cuda"))
                    print(cls.__name__, wd, type(lr).__name__, f"maximize={maximize}", "->",
                          r if r else f"MATCH {clip_fold._probed}", flush=True)


def _f(x: torch.Tensor) -> float:
    return float(x.to(torch.float32))


def _fma(a: float, b: float, c: float) -> float:
    return _f(torch.tensor(a, dtype=torch.float64) * b + c)


def adam_l2() -> None:
    n, wd, b1 = 4096, 0.1, 0.9
    gen = torch.Generator().manual_seed(7)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 3
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    coef = torch.tensor(0.3712)
    lists = [[t.clone().cuda()] for t in (p, g, m, v)] + [[torch.tensor(1.0, device="cuda")]]
    ref = [[t.clone().cuda()] for t in (p, g, m, v)] + [[torch.tensor(0.0, device="cuda")]]
    torch._foreach_mul_(ref[1], coef.cuda())
    torch._foreach_add_(ref[4], 1)
    torch._fused_adam_(ref[0], ref[1], ref[2], ref[3], [], ref[4], lr=3e-3, beta1=b1, beta2=0.95, weight_decay=wd,
                       eps=1e-8, amsgrad=False, maximize=False)
    key = (False, "float", b1, 0.95, wd, 1e-8, False)
    clip_fold.launch(lists, key, 0, coef.cuda(), 3e-3, None)  # mode 0: the fused decay
    bad = (ref[2][0].cpu().view(torch.int32) != lists[2][0].cpu().view(torch.int32)).nonzero().flatten()[:6]
    print(f"Adam L2: exp_avg differs in {int((ref[2][0] != lists[2][0]).sum())} of {n}", flush=True)
    wd32, b132 = _f(torch.tensor(wd)), _f(torch.tensor(b1))
    for i in bad.tolist():
        gi = _f(g[i] * coef)  # the clipped gradient (float32 product)
        pi, mi = float(p[i]), float(m[i])
        cands = {
            "fma(p, wd, g)": _fma(pi, wd32, gi),
            "g + f32(p * wd)": _f(torch.tensor(gi) + torch.tensor(pi) * torch.tensor(wd32)),
            "g + p * wd (fp64 wd)": _f(torch.tensor(gi, dtype=torch.float64) + pi * wd),
        }
        got = {}
        for name, gr in cands.items():
            inner = _fma(-b132, gr, gr)
            got[name] = _fma(b132, mi, inner)
        print(f"  [{i}] p={pi.hex()} g={float(g[i]).hex()} m={mi.hex()} torch={float(ref[2][0][i]).hex()} "
              f"kernel={float(lists[2][0][i]).hex()}; " +
              ", ".join(f"{k}: {'==torch' if v == float(ref[2][0][i]) else v.hex()}" for k, v in got.items()),
              flush=True)


if __name__ == "__main__":
    verdicts()
    adam_l2()
