"""kiln's compile pipeline: capture once, split at opaque ops, compile pieces per token shape.

    compiled = compile_model(model, CompilationConfig(), max_num_batched_tokens=2048,
                             cache=CompileCache.from_env({"arch": ...}))  # optional: keep artifacts
    compiled.warm_up(lambda n: (input_ids[:n], positions[:n]))  # optional: compile before serving
    hidden = compiled(input_ids, positions)

Usable on any nn.Module whose class is decorated with @compile_dynamic; an undecorated
model, or mode 0, runs eagerly. This package imports nothing from models, engine or server.
"""

from __future__ import annotations

import importlib

# Names are resolved on first use: kiln.ops imports kiln.compile.split to declare split
# points, and importing all of Dynamo for that would add a second to every start.
_EXPORTS = {
    "CompileCache": "kiln.compile.cache",
    "CompiledModel": "kiln.compile.compiled_model",
    "compile_model": "kiln.compile.compiled_model",
    "CaptureError": "kiln.compile.capture",
    "compile_dynamic": "kiln.compile.opt_in",
    "dynamic_arg_dims": "kiln.compile.opt_in",
    "repeated_layer": "kiln.compile.opt_in",
    "SplitOp": "kiln.compile.split",
    "effective_split_ops": "kiln.compile.split",
    "split_op": "kiln.compile.split",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln.compile' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
