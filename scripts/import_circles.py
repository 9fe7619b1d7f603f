"""Prints how many of mxrefit's module-to-module imports lie on an import circle (must be 0).

The import contract (pyproject [tool.importlinter], ``lint-imports``) enforces the same rule;
this is the plain graph check behind the figure in docs/design.md. Exit status 1 on a circle.
"""

from __future__ import annotations

import sys

import grimp


def main() -> int:
    graph = grimp.build_graph("mxrefit", include_external_packages=False)
    edges = [(m, i) for m in sorted(graph.modules) for i in sorted(graph.find_modules_directly_imported_by(m))]
    circles = [(a, b) for a, b in edges if graph.chain_exists(importer=b, imported=a)]
    print(f"{len(graph.modules)} modules, {len(edges)} direct imports, {len(circles)} imports on a circle")
    for a, b in circles:
        back = graph.find_shortest_chain(importer=b, imported=a) or ()
        print(f"  {a} -> {' -> '.join(back)}")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main())
