"""Graph passes over Inductor's post-grad graph, and the manager that runs them.

    registry           every pass by name: kiln's own listed, others registered on definition
    graph_pass         GraphPass, the base class
    manager            PassManager, installed at Inductor's post_grad_custom_post_pass hook
    target             the piece and token shape being compiled, for per-shape opt-out
    fx_edit            matching ops and adding nodes with fake values
    noop_elimination   identity views and no-op dtype conversions
    fuse_add_rms_norm  residual add + RMSNorm -> kiln::fused_add_rms_norm
    sequence_parallel  under TP: reduce-scatter, the norm on 1/TP of the tokens, all-gather
    reinplace          functionalized mutating ops back to in-place calls

Passes match kiln's ops by their torch.ops.kiln names and import none of kiln's other
packages. Importing this package imports neither the passes nor Inductor.
"""
