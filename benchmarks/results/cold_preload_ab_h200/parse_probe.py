# Which Triton JIT function's cache_key (source hash over its dependencies) is slow on this host?
import importlib, pkgutil, time
import triton
from triton.runtime import jit
seen = []
orig = jit.JITCallable.parse
def timed(self):
    t = time.perf_counter(); tree = orig(self); seen.append((time.perf_counter() - t, getattr(self, "_fn_name", "?"), len(self._src))); return tree
jit.JITCallable.parse = timed
import kiln.ops.triton.kernels as pkg
fns = []
for m in pkgutil.iter_modules(pkg.__path__):
    mod = importlib.import_module(f"{pkg.__name__}.{m.name}")
    fns += [(m.name, n, f) for n, f in vars(mod).items() if isinstance(f, jit.JITFunction)]
total = time.perf_counter()
for mod, name, f in fns:
    t = time.perf_counter(); f.cache_key; dt = time.perf_counter() - t
    if dt > 0.005: print(f"cache_key {mod}.{name}: {dt:.3f} s")
print(f"{len(fns)} kernels' cache_key: {time.perf_counter() - total:.3f} s; parses {len(seen)}")
for dt, name, n in sorted(seen, reverse=True)[:6]: print(f"  parse {name}: {dt:.3f} s, {n} chars")
