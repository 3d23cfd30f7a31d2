"""docs/concepts/layout.md's claim about imports, read off the source: every import between two of
spikingsail's packages (inside functions too; those only a type checker runs aside) points down
the order the page gives, so no two packages import each other, however indirectly."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "spikingsail"


class _Imports(ast.NodeVisitor):
    def __init__(self) -> None:
        self.names: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.level == 0 and node.module.startswith("spikingsail."):
            self.names.append(node.module)

    def visit_Import(self, node: ast.Import) -> None:
        self.names += [alias.name for alias in node.names if alias.name.startswith("spikingsail.")]


def package_of(module: str) -> str | None:
    """The subpackage a module belongs to (None for the top-level modules, which everyone may use)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


def arrows() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) → the modules that import so."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text()))
        for name in visitor.names:
            source, target = package_of(module), package_of(name)
            if source and target and source != target:
                found.setdefault((source, target), []).append(module)
    return found


def documented_order() -> list[list[str]]:
    """The page's order, top first: `cli` → `diagnostics` → ... (packages of one rank by commas)."""
    text = " ".join((ROOT / "docs" / "concepts" / "layout.md").read_text().split())
    chain = re.search(r"Imports point down, in this order[^:]*: (.*?)\. ", text)
    assert chain, "layout.md no longer gives the order of the packages"
    return [re.findall(r"`(\w+)`", rank) for rank in chain.group(1).split("→")]


def test_imports_between_packages_point_down_the_documented_order() -> None:
    order = documented_order()
    rank = {package: level for level, packages in enumerate(order) for package in packages}
    edges = arrows()
    assert {p for edge in edges for p in edge} <= rank.keys(), "a package the page does not place"
    upward = {
        f"{source} → {target} ({', '.join(sorted(set(modules)))})"
        for (source, target), modules in edges.items()
        if rank[source] >= rank[target]
    }
    assert not upward, upward
