"""Graph passes over Inductor's post-grad graph, and the manager that runs them.

    graph_pass   GraphPass, the base class; passes register by name when imported
    manager      PassManager, installed at Inductor's post_grad_custom_post_pass hook
    target       the piece and token shape being compiled, for per-shape opt-out
    fx_edit      matching ops and adding nodes with fake values

The generic passes live here (noop_elimination, reinplace); passes that know kiln's ops
live next to them (kiln.ops.norm_fusion, kiln.distributed.sequence_parallel). Importing
this package registers the generic ones; it does not import the manager (or Inductor).
"""

from kiln.compile.passes import noop_elimination, reinplace  # noqa: F401  register the generic passes
from kiln.compile.passes.graph_pass import GraphPass, known_passes

__all__ = ["GraphPass", "known_passes"]
