"""Layout: imports point one way (core <- client <- server; core <- model stack <- worker),
the leader client imports no torch, and no module imports itself back through a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "celerytp"
MODEL_STACK = ("models", "layers", "quant", "loading", "distributed")

# What each part may not import (top-level packages of celerytp, plus third-party names).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core": ("client", "worker", "server", "cluster", "cli", "app", *MODEL_STACK, "torch"),
    "client": ("worker", "server", "cluster", "cli", "app", *MODEL_STACK, "torch"),
    "server": ("worker", "cluster", "cli", *MODEL_STACK, "torch"),
    "worker": ("client", "server", "cluster", "cli"),
    **{part: ("client", "worker", "server", "cluster", "cli", "app") for part in MODEL_STACK},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, runtime_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; `runtime_only` skips `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for n in ast.walk(node)}
    found = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def part_of(module: str) -> str | None:
    """`celerytp.client.leader` -> "client"; third-party `torch.nn` -> "torch"."""
    parts = module.split(".")
    if parts[0] == "celerytp":
        return parts[1] if len(parts) > 1 else None
    return parts[0]


def test_imports_point_one_way() -> None:
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(module_name(path))
        forbidden = FORBIDDEN.get(part or "", ())
        for line, module in imports(path):
            if part_of(module) in forbidden and not (module.startswith("celerytp.") and part_of(module) == part):
                offences.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {part} imports {module}")
    assert not offences, "imports that go up the layering:\n" + "\n".join(sorted(set(offences)))


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, path in modules.items():
        graph[name] = {m for _, m in imports(path, runtime_only=True) if m in modules and m != name}
    # A package's __init__ importing its own submodules is not a cycle worth reporting.
    for name in graph:
        graph[name] = {m for m in graph[name] if not (m.startswith(name + ".") and modules[name].name == "__init__.py")}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_client_imports_no_torch() -> None:
    code = (
        "import sys, celerytp, celerytp.client\n"
        "from celerytp import Leader, CeleryTPError\n"
        "heavy = {'.'.join(m.split('.')[:2]) for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.startswith(('celerytp.worker', 'celerytp.models', 'celerytp.layers', 'celerytp.loading'))}\n"
        "print(','.join(sorted(heavy)[:10]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"the client pulled in: {out.stdout.strip()}"
