"""The model opt-in: a class decorator naming the dynamic (token) dims of the forward, and
one marking the layer it repeats (traced once: kiln.compile.layer_stamping)."""

from __future__ import annotations

import inspect

import torch


def compile_dynamic(*, dynamic_arg_dims: dict[str, int]):
    """Class decorator: the model's forward may be compiled, with these argument dims dynamic.

    All listed dims are the token dim and share one symbol. The decorator only records the
    dims; `kiln.compile.compile_model` does the rest.
    """

    def register(cls):
        params = inspect.signature(cls.forward).parameters
        unknown = sorted(set(dynamic_arg_dims) - set(params))
        if unknown:
            raise TypeError(f"{cls.__name__}.forward has no argument(s) {', '.join(unknown)}; "
                            f"its arguments are {', '.join(list(params)[1:])}")
        cls._kiln_dynamic_arg_dims = dict(dynamic_arg_dims)
        return cls

    return register


def dynamic_arg_dims(model: torch.nn.Module) -> dict[str, int] | None:
    """The decorator's dims, or None for a model that did not opt in."""
    return getattr(type(model), "_kiln_dynamic_arg_dims", None)


def repeated_layer(cls):
    """Class decorator: a layer the model calls many times with the same code (a transformer
    block). Dynamo traces one call of each kind and kiln stamps its graph for the others.
    Layers alike in structure, called with None in the same arguments, must take inputs of
    the same shapes and dtypes (the capture checks this); strings naming the layer's own
    modules (an attention op's layer name) are renamed for each call."""
    cls._kiln_repeated_layer = True
    return cls


def is_repeated_layer(module: torch.nn.Module) -> bool:
    return getattr(type(module), "_kiln_repeated_layer", False)
