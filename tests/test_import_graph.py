"""The shape of the house, read from the imports (every `import` and `from ... import` in
kiln/, at module level or inside a function): no import circles, the compile package
imports nothing of kiln's but itself, kiln/config.py only the compile settings, and no
module imports the command line."""

import ast
from pathlib import Path

import kiln

ROOT = Path(kiln.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kiln_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The kiln modules `path` imports (a name imported from a package counts as its
    submodule when there is one)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found - {module_name(path)}


def graph() -> dict[str, set[str]]:
    modules = kiln_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(graph()) == []


def test_the_compile_package_imports_only_itself():
    outside = {name: sorted(i for i in deps if not i.startswith("kiln.compile"))
               for name, deps in graph().items() if name.startswith("kiln.compile")}
    assert {k: v for k, v in outside.items() if v} == {}


def test_the_engine_config_imports_only_the_compile_settings():
    assert graph()["kiln.config"] == {"kiln.compile.config"}


def test_nothing_imports_the_command_line():
    assert [name for name, deps in graph().items() if "kiln.cli" in deps] == []


def test_the_checker_sees_a_circle_and_a_stray_import():
    # The checks above pass on the real tree; here they must fail on a made-up one.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    modules = kiln_modules()
    assert "kiln.compile.config" in imports_of(ROOT / "config.py", modules)
    assert "kiln.engine.llm" in imports_of(ROOT / "engine" / "__init__.py", modules)


def test_an_eager_engine_never_imports_dynamo_or_sympy():
    """Importing kiln and running an eager engine (build, KV cache, a generate) leaves Dynamo and
    Inductor unimported: a second of every eager start. kiln's ops are called straight outside a
    compile (kiln.ops.custom_op.call); through torch.library their first call imports Dynamo.
    Nor sympy and torch's symbolic shapes (0.2-0.3 s on a CPU core): the graph-pass registry
    and Module.to_empty imported them."""
    import subprocess
    import sys

    script = ("import sys\nfrom kiln import LLM, SamplingParams\n"
              "llm = LLM('tiny-llama', device='cpu', enforce_eager=True)\n"
              "llm.generate([{'prompt_token_ids': [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True))\n"
              "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy',\n"
              "                         'torch.fx.experimental.symbolic_shapes') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout
