"""FP8 training: linear layers whose matmuls run in FP8, their weights gathered in FP8.

    graphcomp.shard(model, param_dtype=torch.bfloat16, fp8="tensorwise")   # or "rowwise"

converts the model's large ``nn.Linear`` layers (:func:`convert` with its default
filter) before sharding it; the compiled step then casts each of their weight shards to
FP8 before the all-gather (pass ``fp8_allgather``). Master weights and optimizer state
stay fp32. ``convert`` itself is for choosing layers by hand (``module_filter``,
``min_features``) or for an unsharded model; :func:`stats` reads the layers' scales
and saturation counts. See docs/fp8.md.
"""

from graphcomp.fp8.linear import (  # noqa: F401
    DEFAULT_MIN_FEATURES, HEAD_NAMES, RECIPE_NAMES, Float8Linear, convert, default_filter, stats,
)
from graphcomp.fp8.scaling import RECIPES, Cast, Recipe  # noqa: F401

__all__ = ["Cast", "DEFAULT_MIN_FEATURES", "Float8Linear", "HEAD_NAMES", "RECIPES", "RECIPE_NAMES", "Recipe",
           "convert", "default_filter", "stats"]
