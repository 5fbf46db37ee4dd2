"""The compile-cache key: four factors, each kept readable so two keys can be compared.

    env       kiln-relevant environment variables (not logging, paths, caches or threads)
    config    what changes the compiled code: compile settings (graph passes by their uuid),
              model class and architecture, parameter shapes, dtype, device type, custom ops,
              max tokens; no paths
    code      the contents of every source file Dynamo traced
    compiler  torch, triton and Python versions, Inductor's settings (environment, changes in
              this process), device and capability

A warm start does not run Dynamo, so it cannot ask Dynamo which files it would trace. The
list from the last capture is kept under a pre-key (the other three factors), and the code
factor hashes those files as they are now: an edited model source gives a new key.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

import torch

FACTORS = ("env", "config", "code", "compiler")
ENV_PREFIXES = ("KILN_", "TORCHINDUCTOR_")
# A variable whose name has one of these words changes where things go or what is printed,
# not the code: KILN_LOG_LEVEL, KILN_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, ...
ENV_IGNORED_WORDS = ("LOG", "VERBOSE", "DEBUG", "TRACE", "CACHE", "DIR", "PATH", "ROOT", "THREADS")
# The other variables Inductor's config reads (torch 2.11-2.13), for the compiler factor.
INDUCTOR_ENV_PREFIXES = ("AOT_INDUCTOR_", "AOTINDUCTOR_", "INDUCTOR_", "CUTLASS_", "CUTEDSL_", "TORCH_COMPILE_")
INDUCTOR_ENV_NAMES = ("CXX", "ENABLE_PERSISTENT_TMA_MATMUL", "ENABLE_TEMPLATE_TMA_STORE",
                      "ENABLE_TMA_LOAD_FOR_TEMPLATE_EPILOGUE")


def digest(value) -> str:
    """sha256 of a JSON-able value, keys sorted: equal values give equal digests."""
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def key_of(factors: dict) -> str:
    return digest({name: factors[name] for name in FACTORS})[:16]


def prekey_of(factors: dict) -> str:
    return digest({name: factors[name] for name in FACTORS if name != "code"})[:16]


def env_factor(environ=None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {name: value for name, value in sorted(environ.items())
            if name.startswith(ENV_PREFIXES) and not any(w in name for w in ENV_IGNORED_WORDS)}


def compiler_factor(device: torch.device) -> dict:
    import torch._functorch.config

    factor = {"torch": torch.__version__, "torch_git": torch.version.git_version,
              "triton": _version("triton"), "python": platform.python_version(),
              "machine": platform.machine(), "device": device.type,
              # Inductor's settings are its defaults (torch's version), the environment and what this
              # process changed: a start that has not imported Inductor changed nothing, and needs
              # no import to say so (one that loads only AOT packages never imports it).
              "inductor_env": {name: value for name, value in sorted(os.environ.items())
                               if name.startswith(INDUCTOR_ENV_PREFIXES) or name in INDUCTOR_ENV_NAMES},
              "inductor_changes": _inductor_changes(),
              "aot_autograd_config": _portable(torch._functorch.config)}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        factor["device_name"] = torch.cuda.get_device_name(index)
        factor["capability"] = ".".join(map(str, torch.cuda.get_device_capability(index)))
        factor["cuda"] = torch.version.cuda
    else:
        # The ISA the C++ kernels are built for: an entry from an AVX-512 machine must not
        # be loaded on one without it.
        factor["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return factor


def _inductor_changes() -> dict:
    """Inductor's settings whose value this process changed from the default (or from what a
    variable set: inductor_env and the env factor hold those); nothing if it has not imported
    Inductor. Values, not Inductor's own override flags: a config.patch leaves those set; and
    outside kiln's own patches (inductor_patches)."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return {}
    try:
        from torch.utils._config_module import _UNSET_SENTINEL

        from kiln.compile.inductor_patches import value_outside

        changes = {}
        for name, value in _portable(config).items():
            entry = config._config.get(name)
            if entry is None:
                continue
            base = next((v for v in (entry.env_value_force, entry.env_value_default) if v is not _UNSET_SENTINEL),
                        entry.default)
            value = _plain(value_outside(name, value))
            if _plain(base) != value:
                changes[name] = value
        return changes
    except (ImportError, AttributeError):  # a torch whose config module is built otherwise: all of it
        return {"all": _portable(config)}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _portable(config_module) -> dict:
    """A config module's settings that change code (Inductor leaves out the rest), no paths."""
    values = config_module.save_config_portable()
    return {k: _plain(v) for k, v in sorted(values.items()) if not k.endswith("dir") and not k.endswith("path")}


def _plain(value):
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    text = repr(value)
    # An object's default repr carries its address, which differs on every run.
    return type(value).__name__ if " at 0x" in text else text


def _module_files() -> dict[str, str]:
    return {file: name for name, module in list(sys.modules.items())
            if isinstance(file := getattr(module, "__file__", None), str)}


def source_name(path: str, module_files: dict[str, str] | None = None) -> str:
    """A traced file's name that survives moving the install: its module's name if it was
    imported as one, else its path relative to the sys.path entry it is under, else the path."""
    module = (module_files if module_files is not None else _module_files()).get(path)
    if module is not None:
        return module
    resolved = os.path.realpath(path)
    best = None
    for entry in sys.path:
        base = os.path.realpath(entry or os.getcwd())
        if resolved.startswith(base + os.sep) and (best is None or len(base) > len(best)):
            best = base
    return Path(os.path.relpath(resolved, best)).as_posix() if best else resolved


def resolve_source(name: str) -> Path | None:
    if os.path.isabs(name):
        return Path(name) if os.path.isfile(name) else None
    if "/" not in name:  # a module name
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None) or _module_source(name)
        if file is None:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                return None
            file = spec.origin if spec is not None else None
        return Path(file) if file and os.path.isfile(file) else None
    for entry in sys.path:
        candidate = Path(entry or os.getcwd()) / name
        if candidate.is_file():
            return candidate
    return None


def _module_source(name: str) -> str | None:
    """The source file of module `name`, found under its nearest imported package's folders
    without importing anything: find_spec imports every parent package (for a traced
    torch._dynamo.polyfills module, all of Dynamo: ~1 s of a start that needs no Dynamo)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        package = sys.modules.get(".".join(parts[:i]))
        if package is not None and getattr(package, "__path__", None):
            folders, rest = [Path(p) for p in package.__path__], parts[i:]
            break
    else:
        return None
    for k, part in enumerate(rest):
        last = k == len(rest) - 1
        for folder in folders:
            if (folder / part / "__init__.py").is_file():
                if last:
                    return str(folder / part / "__init__.py")
                folders = [folder / part]
                break
            if last and (folder / f"{part}.py").is_file():
                return str(folder / f"{part}.py")
        else:
            return None
    return None


def traced_sources(filenames) -> list[str]:
    """Source names of the files behind Dynamo's traced code objects (real files only)."""
    modules = _module_files()
    return sorted({source_name(f, modules) for f in filenames if f and not f.startswith("<") and os.path.isfile(f)})


def code_factor(names: list[str]) -> dict[str, str] | None:
    """sha256 of every listed source file as it is now; None if one is gone."""
    hashes = {}
    for name in names:
        path = resolve_source(name)
        if path is None:
            return None
        hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes
