import re, torch
from graphcomp.optim import clip_fold
allv = clip_fold._VARIANTS
for wd in (0.0, 0.1):
    p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    o = torch.optim.AdamW([p], lr=torch.tensor(3e-3, device="cuda"), betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, fused=True, capturable=True)
    for v in allv:
        if wd == 0.0 and not v[0]:
            continue
        clip_fold._VARIANTS = (v,)
        clip_fold._probed.clear()
        r = clip_fold.probe(o, torch.device("cuda"))
        short = "MATCH" if r is None else "; ".join(re.findall(r"(\w+ \d+/\d+ \(max \d+ ulp)", r)) or r[:200]
        print("wd", wd, v, short, flush=True)
