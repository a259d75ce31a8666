"""graphcomp's graph passes, one module per pass (shipped as ``graphcomp.passes``).

Importing this package registers every pass with ``graphcomp.pipeline``; the
import order below is the registration order (ties in the pass order keep it).
Each module's docstring says what it matches, what it rewrites, and when it is a no-op.
"""

from . import chunk_lm_loss  # noqa: F401
from . import fuse_allgather_downcast  # noqa: F401
from . import bucket_collectives  # noqa: F401
from . import schedule_free  # noqa: F401
from . import partition_graph  # noqa: F401
from . import cudagraphs  # noqa: F401
from . import schedule_prefetch  # noqa: F401
