"""Diagnosis of the exact clip fold on a GPU (not a test: ``python tests/gpu/_diag_clip_fold.py``).

The probe's verdict for Adam/AdamW, weight decay 0 and 0.1, a float and a tensor lr,
maximize off and on (MATCH: a variant matched torch bitwise, and which one of
``clip_fold._VARIANTS``; otherwise the probe's message, with the differing tensors).

It once also printed, for Adam with L2 weight decay, the first differing elements
against a few float32 and float64 orderings of the decay; none was torch's rule,
which only a replay of the probe's inputs on the CPU found (the decay unfused in the
first ILP lane of torch's kernel, fused in the others: decay mode 2, 3a494ad), so
that part went.
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


if __name__ == "__main__":
    verdicts()
