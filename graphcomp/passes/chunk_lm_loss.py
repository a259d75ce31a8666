"""chunk_lm_loss (dynamo): the language-model loss in token chunks, so the
``[tokens, vocab]`` logits are never materialized in fp32.

Matches, on the torch-level graph Dynamo hands the backend (before AOTAutograd)::

    h -> linear(h, W) -> [cast up: .float() / .to(fp32)] -> [view / reshape / flatten / contiguous ...]
      -> cross_entropy(., target, ignore_index=i, reduction="mean" | "sum")

and rewrites it to one custom op (``graphcomp/ops/loss.py``), chunked over tokens
by ``Config.loss_chunk_tokens``:

* the logits feed only the loss (the project's Llama, most training loops)::

      h -> reshape(-1, D) -> graphcomp::linear_cross_entropy(h2, W, target, ...)[0]

  One loop over token chunks computes the chunk's logits, loss and the gradients
  of hidden and weight (for an upstream gradient of 1; the op's autograd formula
  scales them). The backward recomputes nothing and needs neither the logits nor
  ``W``: a sharded head weight is not gathered again for the backward, and its
  gradient flows to its reduce-scatter unchanged.

* the logits are also used elsewhere (Hugging Face models return them; an accuracy
  metric)::

      logits -> reshape(-1, V) -> graphcomp::cross_entropy(logits2, target, ...)

  The logits stay (someone reads them); their fp32 copy, the log-probabilities and
  the gradient's fp32 intermediates are chunked, and the backward
  (``graphcomp::cross_entropy_backward``) recomputes each chunk's softmax from the
  logits instead of saving ``[tokens, vocab]`` fp32 log-probabilities.

Why on the Dynamo graph, not the joint graph: with ``codegen="inductor"``
AOTAutograd traces with Inductor's decompositions, so ``log_softmax`` and
``nll_loss`` reach the joint graph as a dozen pointwise/reduction ops whose shape
differs between torch versions; before AOTAutograd the loss is one
``cross_entropy`` call in both codegens and both torch versions, and a custom op
with a registered autograd formula is traced by AOTAutograd like any op (one node
in the forward, our formula in the backward), opaque to decompositions, and run
by Inductor as an extern kernel.

Why the gradients in the forward (form 1): the alternative, saving each row's
log-sum-exp and recomputing the chunk's logits in the backward, costs a second
logits matmul (``2 x tokens x hidden x vocab`` FLOPs, a third of the head's) and a
backward re-gather of the head weight. Computing them in the forward costs neither;
what it holds instead is the weight gradient's fp32 sum (``vocab x hidden``) from
the loss to the start of the backward, where the unrewritten graph holds the fp32
log-probabilities (``tokens x vocab``: more whenever a micro-batch has more tokens
than the hidden size), and it computes the gradients even if no backward follows
(evaluation with grad enabled; under ``torch.no_grad()`` it does not). Chunks are
over tokens, not the vocabulary: a vocabulary chunk needs every token's log-sum-exp
first, i.e. the logits twice.

Numerics: the chunk math is the unrewritten graph's (see ``loss_ops``): fp32 equal
up to summation order; in bf16 the weight gradient is summed over chunks in fp32
and rounded once.

No-op (recorded, counted ``skipped:<reason>``) when: there is no ``cross_entropy``
call; class ``weight=``, ``label_smoothing != 0``, ``reduction="none"``, the legacy
``size_average``/``reduce`` arguments or non-constant arguments; the input is not
``[N, vocab]`` with class-index targets ``[N]`` (probability targets, extra class
dims); DTensor logits (tensor-parallel loss parallel); a symbolic vocabulary size; autocast active around the loss or the whole
frame (autocast would pick the op's dtypes, the custom op would not follow it). A
``linear`` with a bias, one inside an autocast region, or one whose output has
other users gets the second form.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from graphcomp import _compat
from graphcomp.ops.loss import OPS, REDUCTIONS
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

_LINEAR = (F.linear,)  # nn.Linear.forward calls it too
_CE_SIG = inspect.signature(F.cross_entropy)
_VIEW_METHODS = {"view", "reshape", "flatten", "contiguous"}
_VIEW_FUNCS = (torch.reshape, torch.flatten)
_CAST_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


class Skip(Exception):
    """This cross_entropy call cannot be rewritten (``reason`` is counted)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclass
class Match:
    ce: fx.Node
    chain: list[fx.Node]  # cast / view nodes from the cross_entropy input back to the source
    source: fx.Node  # the logits (form 2), or the linear (form 1)
    target: fx.Node
    ignore_index: int
    reduction: str
    loss_dtype: torch.dtype
    rows: Any  # int or SymInt
    vocab: int
    fused: bool  # form 1: linear + cross-entropy in one op


@register_pass("chunk_lm_loss", stages=("dynamo",), default=False)
def chunk_lm_loss(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    ces = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.cross_entropy]
    if not ces:
        return ctx.unchanged(gm, "no cross_entropy call in the graph")
    auto = _compat.autocast_enabled()
    if auto:
        ctx.count("skipped:autocast", len(ces))
        return ctx.unchanged(gm, f"autocast is enabled for {auto} around the whole frame: the loss's dtypes are autocast's")
    in_autocast = _autocast_regions(gm)
    chunk = ctx.config.loss_chunk_tokens
    compiled = ctx.config.loss_chunk_kernels == "inductor"
    done = 0
    for ce in ces:
        try:
            m = _match(ce, in_autocast)
            vals = _fake_values(m, chunk, compiled)
        except Skip as s:
            ctx.count(f"skipped:{s.reason}")
            ctx.note(f"{ce.name}: not chunked ({s.reason}{': ' + s.detail if s.detail else ''})")
            continue
        _rewrite(gm, m, chunk, compiled, vals)
        done += 1
        kind = "linear_cross_entropy" if m.fused else "cross_entropy"
        ctx.count(kind)
        rows = m.rows if isinstance(m.rows, int) else None
        if rows is not None:
            ctx.count("chunks", math.ceil(rows / chunk))
            ctx.count("fp32_logits_bytes", rows * m.vocab * 4)
        ctx.note(f"{ce.name}: {'linear ' + m.source.name + ' + ' if m.fused else ''}cross_entropy -> graphcomp.{kind} "
                 f"(tokens={m.rows}, vocab={m.vocab}, chunk={chunk}, reduction={m.reduction}, "
                 f"ignore_index={m.ignore_index}, loss dtype={str(m.loss_dtype).replace('torch.', '')})")
    ctx.counter("lm_losses_chunked", done)
    if done == 0:
        return ctx.unchanged(gm, f"none of the {len(ces)} cross_entropy call(s) can be chunked (see counts)")
    return ctx.changed(gm)


# ------------------------------------------------------------------ matching
def _val(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _autocast_regions(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes inside a ``torch.autocast`` region traced into the graph."""
    depth, inside = 0, set()
    for n in gm.graph.nodes:
        kind = _compat.is_autocast_marker(n)
        if kind == "enter":
            depth += 1
        elif kind == "exit":
            depth = max(0, depth - 1)
        elif depth:
            inside.add(n)
    return inside


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of a pure dtype cast (``.float()``, ``.to(dtype)``, ``.type(dtype)``)."""
    if node.op != "call_method":
        return None
    if node.target in _CAST_METHODS and len(node.args) == 1 and not node.kwargs:
        return _CAST_METHODS[node.target]
    if node.target in ("to", "type"):
        rest, kw = node.args[1:], dict(node.kwargs)
        if len(rest) == 1 and isinstance(rest[0], torch.dtype) and not kw:
            return rest[0]
        if not rest and set(kw) == {"dtype"} and isinstance(kw["dtype"], torch.dtype):
            return kw["dtype"]
    return None


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCS


def _chain(x: fx.Node, vocab: int) -> tuple[list[fx.Node], fx.Node]:
    """Walk back from the cross_entropy input through single-user casts (never
    narrowing) and reshapes that keep the vocabulary as the last dimension."""
    chain: list[fx.Node] = []
    node = x
    while len(node.users) == 1 and (_is_view(node) or _cast_dtype(node) is not None):
        src = node.args[0]
        v, sv = _val(node), _val(src)
        if not isinstance(src, fx.Node) or not isinstance(v, torch.Tensor) or not isinstance(sv, torch.Tensor):
            break
        if sv.dim() < 1 or sv.shape[-1] != vocab or v.shape[-1] != vocab or sv.device != v.device:
            break
        if _cast_dtype(node) is not None and (not sv.dtype.is_floating_point or sv.dtype.itemsize > v.dtype.itemsize):
            break  # a narrowing cast rounds: keep it (and what follows) out of the op
        chain.append(node)
        node = src
    return chain, node


def _match(ce: fx.Node, in_autocast: set[fx.Node]) -> Match:
    try:
        a = _CE_SIG.bind(*ce.args, **ce.kwargs)
    except TypeError as e:
        raise Skip("unexpected_arguments", str(e)) from None
    a.apply_defaults()
    args = a.arguments
    if args["weight"] is not None:
        raise Skip("class_weights")
    if args["size_average"] is not None or args["reduce"] is not None:
        raise Skip("legacy_reduction_arguments")
    smoothing, reduction, ignore = args["label_smoothing"], args["reduction"], args["ignore_index"]
    if any(isinstance(v, fx.Node) for v in (smoothing, reduction, ignore)):
        raise Skip("non_constant_arguments")
    if smoothing != 0.0:
        raise Skip("label_smoothing", f"label_smoothing={smoothing}")
    if reduction not in REDUCTIONS:
        raise Skip(f"reduction_{reduction}")
    if ce in in_autocast:
        raise Skip("autocast", "cross_entropy inside a torch.autocast region")
    x, target = args["input"], args["target"]
    xv, tv = _val(x), _val(target)
    if not isinstance(x, fx.Node) or not isinstance(target, fx.Node) or not isinstance(xv, torch.Tensor) \
            or not isinstance(tv, torch.Tensor):
        raise Skip("no_tensor_values")
    if _is_dtensor(xv) or _is_dtensor(tv):
        raise Skip("dtensor", "DTensor logits (loss parallel): the chunked op has no sharding rule; "
                              "loss_parallel() already keeps the logits vocabulary-sharded")
    if xv.dim() != 2 or not xv.dtype.is_floating_point:
        raise Skip("input_not_2d", f"input {xv.dtype} {list(xv.shape)}; chunking needs [tokens, vocab]")
    if tv.dim() != 1 or tv.dtype != torch.int64:
        raise Skip("target_not_class_indices", f"target {tv.dtype} {list(tv.shape)}")
    vocab = xv.shape[1]
    if not isinstance(vocab, int):
        raise Skip("symbolic_vocab", f"vocab {vocab}")
    chain, source = _chain(x, vocab)
    fused = _linear_ok(source, in_autocast)
    return Match(ce, chain, source, target, int(ignore), reduction, xv.dtype, xv.shape[0], vocab, fused)


def _is_dtensor(v: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(v, DTensor)


def _linear_ok(node: fx.Node, in_autocast: set[fx.Node]) -> bool:
    """Form 1 applies: a bias-free ``linear`` read only by the loss, outside
    autocast, computing in its inputs' dtype with a static hidden size."""
    if node.op != "call_function" or node.target not in _LINEAR or len(node.users) != 1 or node in in_autocast:
        return False
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    h, w = (list(node.args[:2]) + [node.kwargs.get("input"), node.kwargs.get("weight")])[:2]
    hv, wv, ov = _val(h), _val(w), _val(node)
    if bias is not None or not all(isinstance(v, torch.Tensor) for v in (hv, wv, ov)):
        return False
    if any(_is_dtensor(v) for v in (hv, wv, ov)):  # a tensor-parallel head: its DTensor ops stay
        return False
    return (wv.dim() == 2 and hv.dim() >= 1 and isinstance(hv.shape[-1], int) and hv.dtype == wv.dtype == ov.dtype
            and hv.device == wv.device)


# ------------------------------------------------------------------ rewrite
def _fake_mode(vals: list[Any]) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    for v in vals:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def _fake_values(m: Match, chunk: int, compiled: bool) -> dict[str, Any]:
    """Example values of the nodes the rewrite adds (Inductor's pre-grad passes read
    them); a shape the op refuses shows up here, before the graph is touched."""
    tv = _val(m.target)
    if m.fused:
        h, w = m.source.args[0], m.source.args[1]
        hv, wv = _val(h), _val(w)
        # grad mode as traced: under no_grad the loss does not require grad (inputs may)
        live = bool(getattr(_val(m.ce), "requires_grad", True))
        grads = (live and bool(hv.requires_grad), live and bool(wv.requires_grad))
        mode = _fake_mode([hv, wv, tv])
        if mode is None:
            raise Skip("no_fake_values")
        try:
            with mode:
                h2 = hv if hv.dim() == 2 else hv.reshape(-1, hv.shape[-1])
                out = OPS["linear_cross_entropy"](h2.detach(), wv.detach(), tv, m.ignore_index, m.reduction, chunk,
                                                  m.loss_dtype, *grads, compiled)
        except (ValueError, RuntimeError) as e:
            raise Skip("op_refused", str(e)) from None
        return {"input": h2, "out": out, "loss": out[0], "grads": grads}
    sv = _val(m.source)
    mode = _fake_mode([sv, tv])
    if mode is None:
        raise Skip("no_fake_values")
    try:
        with mode:
            x2 = sv if sv.dim() == 2 else sv.reshape(-1, m.vocab)
            loss = OPS["cross_entropy"](x2.detach(), tv, m.ignore_index, m.reduction, chunk, m.loss_dtype, compiled)
    except (ValueError, RuntimeError) as e:
        raise Skip("op_refused", str(e)) from None
    return {"input": x2, "loss": loss}


def _rewrite(gm: fx.GraphModule, m: Match, chunk: int, compiled: bool, vals: dict[str, Any]) -> None:
    g = gm.graph
    ce = m.ce
    meta = {k: ce.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack") if k in ce.meta}

    def new(node: fx.Node, val: Any) -> fx.Node:
        node.meta.update(meta)
        node.meta["example_value"] = val
        return node

    with g.inserting_before(ce):
        if m.fused:
            h, w = m.source.args[0], m.source.args[1]
            h2 = h if _val(h).dim() == 2 else new(g.call_method("reshape", (h, -1, _val(h).shape[-1])), vals["input"])
            gh, gw = vals["grads"]
            op = new(g.call_function(OPS["linear_cross_entropy"],
                                     (h2, w, m.target, m.ignore_index, m.reduction, chunk, m.loss_dtype, gh, gw,
                                      compiled)),
                     tuple(vals["out"]))
            loss = new(g.call_function(operator.getitem, (op, 0)), vals["loss"])
        else:
            x = m.source
            x2 = x if _val(x).dim() == 2 else new(g.call_method("reshape", (x, -1, m.vocab)), vals["input"])
            loss = new(g.call_function(OPS["cross_entropy"],
                                       (x2, m.target, m.ignore_index, m.reduction, chunk, m.loss_dtype, compiled)),
                     vals["loss"])
    ce.replace_all_uses_with(loss)
    g.erase_node(ce)
    for n in m.chain:
        g.erase_node(n)
    if m.fused:
        g.erase_node(m.source)
