"""graphcomp's exception types (one module every layer may import)."""

from __future__ import annotations


class CudaGraphsRequired(RuntimeError):
    """``Config.cudagraphs="require"`` and a piece cannot be captured: the message
    names the piece (stage/piece_<i>) and the reason."""


class StaticAddressError(RuntimeError):
    """A parameter/buffer input of a captured piece moved since capture (the message
    names the input and the fix)."""


class CaptureFailed(Exception):
    """Warm-up or the trial capture of a piece raised (its ``__cause__``); the
    call's inputs are intact."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase}: {cause}")
        self.phase = phase


def failing_source(e: BaseException | None) -> str | None:
    """The innermost traceback frame of ``e`` outside torch's own files (the
    generated piece code or the op that raised), as ``file:line``. The warm-up's
    collective stand-in (``graphcomp._compat.collectives``, a dispatch mode every op of a
    warm-up or trial capture passes through) is skipped too: its frame would hide
    the piece's line that names the op."""
    import os
    import traceback

    if e is None or e.__traceback__ is None:
        return None
    frames = traceback.extract_tb(e.__traceback__)
    for f in reversed(frames):
        if f.filename.endswith(os.path.join("_compat", "collectives.py")):
            continue
        if "/torch/" not in f.filename or "torchinductor" in f.filename:
            return f"{f.filename}:{f.lineno} ({f.line.strip() if f.line else f.name})"
    return None


class RankDivergence(RuntimeError):
    """Ranks of one process group are about to issue different collectives (or one
    rank never publishes its sequence): raised on every rank that sees it, naming the
    group, the first differing collective and the source line that issued it, long
    before the process-group timeout would end the hang."""


class CollectiveVerifyError(RuntimeError):
    """A pass changed which parameters are gathered or which gradients are
    reduce-scattered (or their dtype or group): the message names the pass."""


class OptimizerParamsError(ValueError):
    """The optimizer given to ``graphcomp.train_step`` holds tensors that are not the
    model's parameters (typically: built before ``graphcomp.shard(model)``, which
    replaces every parameter with its shard): it would update tensors the model no
    longer uses."""


class TrainerConfigError(ValueError):
    """A ``transformers`` Trainer configuration that
    ``graphcomp.integrations.hf_trainer.GraphcompTrainer`` would train wrong (another
    system sharding or wrapping the model, fp16 without its loss scaler, ranks that
    would each read the whole dataset, ...): the message names the option and what
    to use instead."""


class ShardedModelError(RuntimeError):
    """A model sharded by ``graphcomp.shard`` was changed in a way its shards cannot
    follow: a shard's ``.data`` replaced with another shape, the model moved to
    another device, or trainable parameters added after ``shard`` (their gradients
    would not be reduced across ranks). The message names the parameter and the fix."""
