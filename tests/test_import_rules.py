"""The package rules of DESIGN.md, read from the imports themselves (ast): no upward import between packages,
serving code never imports training/, the engine only wire/ and assets/, no import cycle, and no torch,
transformers or engine module behind `import gateway.app`."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "quotas", "cache", "tiers", "engine", "wire", "assets", "training", "bench")
HEAVY = ("torch", "transformers", "sentence_transformers")

# package → our packages it may never import, wherever the import stands (a function body included)
NEVER = {
    "wire": set(PACKAGES) - {"wire"},
    "assets": set(PACKAGES) - {"assets"},
    "engine": set(PACKAGES) - {"engine", "wire", "assets"},
    "cache": {"gateway", "tiers", "engine", "training", "bench"},
    "quotas": {"gateway", "tiers", "engine", "training", "bench"},
    "tiers": {"gateway", "engine", "training", "bench"},
    "training": {"gateway", "bench"},
    "gateway": {"bench"},
}
# package → what it may import only inside a function: the gateway's CLI runs an engine or a build on command
NOT_AT_MODULE_LEVEL = {"gateway": {"engine", "training"}}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # what it imports, dotted (a module, or the package a name comes from)
    line: int
    module_level: bool  # False inside a function body (runs only when called)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, known: dict[str, Path]) -> list[Import]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = module_level and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                out.extend(Import(name, a.name, child.lineno, inside) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                for alias in child.names:  # `from pkg import module` imports the module
                    sub = f"{base}.{alias.name}"
                    out.append(Import(name, sub if sub in known else base, child.lineno, inside))
            visit(child, inside)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return out


def all_imports() -> list[Import]:
    known = our_modules()
    return [imp for path in known.values() for imp in imports_of(path, known)]


def test_no_package_imports_what_lies_above_it() -> None:
    bad = []
    for imp in all_imports():
        src, dst = imp.module.split(".")[0], imp.target.split(".")[0]
        if dst in NEVER.get(src, ()) or (imp.module_level and dst in NOT_AT_MODULE_LEVEL.get(src, ())):
            bad.append(f"{imp.module}:{imp.line} imports {imp.target}")
        if src == "assets" and imp.module_level and dst in HEAVY:
            bad.append(f"{imp.module}:{imp.line} imports {imp.target} at module level")
    assert not bad, "imports against the package rules:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    """Module-level imports (TYPE_CHECKING blocks included) between our modules form no cycle."""
    known = our_modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for imp in all_imports():
        if imp.module_level and imp.target in known and imp.target != imp.module:
            graph[imp.module].add(imp.target)
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()
    cycles: list[list[str]] = []

    def walk(node: str) -> None:  # depth-first: an edge back into the current path closes a cycle
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in done:
                walk(nxt)
        on_path.discard(path.pop())
        done.add(node)

    for module in sorted(graph):
        if module not in done:
            walk(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_gateway_app_loads_no_engine_training_or_torch() -> None:
    code = ("import sys, gateway.app; print(' '.join(sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {(*HEAVY, 'engine', 'training')!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []
