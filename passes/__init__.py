"""graphcomp's graph passes, one module per pass (shipped as ``graphcomp.passes``).

Importing this package registers every pass with ``graphcomp.pipeline``.
Each module's docstring says what it matches, what it rewrites, and when it is a no-op.
"""
