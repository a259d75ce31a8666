"""Diagnosis: the clip fold's probe for Adam/AdamW with and without weight decay, a float
and a tensor lr; prints the probe's verdict (None: a variant matched torch bitwise)."""
import torch
from graphcomp.optim import clip_fold
for cls in (torch.optim.AdamW, torch.optim.Adam):
    for wd in (0.0, 0.1):
        for lr in (3e-3, torch.tensor(3e-3, device="cuda")):
            p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
            o = cls([p], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, fused=True, capturable=True)
            clip_fold._probed.clear()
            r = clip_fold.probe(o, torch.device("cuda"))
            print(cls.__name__, wd, type(lr).__name__, "->", r if r else f"MATCH {clip_fold._probed}", flush=True)
