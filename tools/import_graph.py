"""The package's module structure, drawn from its own imports (CPU, no imports executed).

``python tools/import_graph.py [--mermaid]`` parses every module of ``moe_mxfp8/`` (the API) and
``kernels/`` (installed as ``moe_mxfp8.kernels``) with `ast`, collects the project-internal
imports (module level and inside functions: lazy imports are edges too) and prints the edges,
or a Mermaid graph for docs/structure.md. `check` returns the violations of the layering rule
that tests/test_structure.py enforces: kernels never import the API above them, and no import
cycle exists anywhere.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API, KERNELS = "moe_mxfp8", "moe_mxfp8.kernels"


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, base in ((API, ROOT / "moe_mxfp8"), (KERNELS, ROOT / "kernels")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        pkg = pkg.rsplit(".", 1)[0]
    return f"{pkg}.{node.module}" if node.module else pkg


def edges() -> set[tuple[str, str]]:
    """(importer, imported) pairs between the project's modules."""
    mods = _modules()
    out = set()
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, path, node)
                # `from pkg import sub` names a submodule when one exists
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import moe_mxfp8.kernels.x.y` -> the module
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != mod:
                    out.add((mod, t))
    return out


def _package_edge(a: str, b: str) -> bool:
    """A package importing its own submodule (``__init__`` re-exports) is not layering."""
    return b.startswith(a + ".")


def check() -> list[str]:
    """Violations: a kernel module importing the API, or an import cycle."""
    es = edges()
    bad = [f"{a} imports {b} (kernels must not import the API above them)"
           for a, b in sorted(es) if a.startswith(KERNELS) and not b.startswith(KERNELS)]
    graph: dict[str, set[str]] = {}
    for a, b in es:
        if not _package_edge(a, b) and not _package_edge(b, a):
            graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                bad.append("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return bad


def mermaid() -> str:
    def short(m):
        return m.replace("moe_mxfp8.kernels", "kernels").replace("moe_mxfp8.", "")

    lines = ["flowchart TD"]
    for a, b in sorted(edges()):
        if a in (API, KERNELS) or _package_edge(a, b):
            continue  # package re-exports
        lines.append(f"  {short(a).replace('.', '_')}[{short(a)}] --> "
                     f"{short(b).replace('.', '_')}[{short(b)}]")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mermaid", action="store_true", help="print a Mermaid graph")
    args = ap.parse_args()
    if args.mermaid:
        print(mermaid())
    else:
        for a, b in sorted(edges()):
            print(f"{a} -> {b}")
    problems = check()
    for p in problems:
        print("VIOLATION:", p)
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
