"""graphcomp's graph passes, one module per pass.

Each module defines one function decorated ``@register_pass(...)`` and a docstring
that draws what it matches, what it rewrites, and when it is a no-op. The order in
which the passes run is written once, in ``graphcomp.compiler.pipeline.PASS_ORDER``; the
pipeline imports ``graphcomp.passes.<name>`` for each name there.
"""
