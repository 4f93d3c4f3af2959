"""sdiloco: Streaming DiLoCo (arXiv 2501.18512) in JAX + Equinox + Optax.

The public API, re-exported explicitly. Each name lives in a one-concept module:
fragments (`fragments.py`), the sync schedule (`schedule.py`), outer-gradient
compressors, composable as stages (`compression/`), plug-ins that act around the
exchange with state of their own (`plugins.py`; the merges in `merging.py`), how
the senders' outer gradients become one (`aggregation.py`), the algorithm (`streaming.py`, on the interfaces of
`base.py`) and its Data-Parallel
baseline (`data_parallel.py`); who takes part in a step, for elastic training
(`participation.py`); the step compiled once (`jit.py`); diagnostics of a state
(`analysis.py`).
"""

from . import aggregation as aggregation, plugins as plugins
from .analysis import (
    global_params as global_params,
    outer_gradient_cosine as outer_gradient_cosine,
    per_replica_bytes as per_replica_bytes,
    replica_average as replica_average,
    replica_params as replica_params,
)
from .base import (
    Algorithm as Algorithm,
    AlgorithmState as AlgorithmState,
    Exchange as Exchange,
    PostedExchange as PostedExchange,
    replica_fields as replica_fields,
)
from .compression import (
    FORMATS as FORMATS,
    Compressor as Compressor,
    Quantized as Quantized,
    Quantizer as Quantizer,
    chain as chain,
    chunked_top_k as chunked_top_k,
    dare as dare,
    fed_dropout as fed_dropout,
    min_max as min_max,
    quantizer as quantizer,
    top_k as top_k,
)
from .data_parallel import (
    DataParallelState as DataParallelState,
    data_parallel as data_parallel,
)
from .fedpart import freeze_unsynced as freeze_unsynced
from .fragments import (
    Fragments as Fragments,
    fragments_by_layer as fragments_by_layer,
    fragments_from_labels as fragments_from_labels,
    fragments_from_masks as fragments_from_masks,
    fragments_from_path as fragments_from_path,
    single_fragment as single_fragment,
)
from .jit import jit_step as jit_step
from .merging import (
    AlphaMerge as AlphaMerge,
    Eager as Eager,
    alpha_merge as alpha_merge,
    eager as eager,
)
from .participation import (
    Participation as Participation,
    everyone as everyone,
)
from .plugins import (
    Plugin as Plugin,
    error_feedback as error_feedback,
)
from .schedule import (
    Schedule as Schedule,
    default_first_send as default_first_send,
    make_schedule as make_schedule,
)
from .streaming import (
    StreamingSpec as StreamingSpec,
    StreamingState as StreamingState,
    diloco as diloco,
    offload as offload,
    streaming_diloco as streaming_diloco,
)


__version__ = "0.1.0"
