"""The layout's import directions hold: the core stands alone, the app never reaches for an
array library, backends reach only for the core and the drafters, no module imports one that
imports it back (function-level imports included), and the table of kinds
(app/drafters/kinds.py) is the one place that lists drafter kinds."""

from __future__ import annotations

import ast
from pathlib import Path

from app.drafters import kinds

ROOT = Path(__file__).resolve().parent.parent
STDLIB_OK = {"numpy", "__future__"}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of app/ and backends/ -> the project modules it imports, at any depth of
    its code. `from package import name` points at package.name where that is a module."""
    paths = {module_name(p): p for p in modules("app") + modules("backends")}

    def known(name: str) -> str | None:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in paths:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(package[:len(package) - node.level + 1]
                                 + ([node.module] if node.module else []))
                        if node.level else node.module or "")
                for alias in node.names:
                    child = f"{base}.{alias.name}"
                    targets.add(child if child in paths else base)
        graph[name] = {m for m in map(known, targets) if m and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                work.append((step, iter(sorted(graph[step]))))
            elif step in stack:
                low[node] = min(low[node], index[step])
    return found


def test_the_core_imports_only_itself_numpy_and_the_standard_library():
    import sys
    for path in modules("app/core"):
        for name in imports(path):
            top = name.split(".")[0]
            assert (name.startswith("app.core") or top in STDLIB_OK
                    or top in sys.stdlib_module_names), f"{path.name} imports {name}"


def test_nothing_under_app_imports_torch_or_mlx():
    for path in modules("app"):
        for name in imports(path):
            assert name.split(".")[0] not in {"torch", "mlx", "mlx_lm", "transformers"}, \
                f"{path.relative_to(ROOT)} imports {name}"


def test_backends_import_only_the_core_and_the_drafters_of_the_app():
    reaching = {name: sorted(m for m in targets if m.startswith("app")
                             and not m.startswith(("app.core", "app.drafters")))
                for name, targets in import_graph().items() if name.startswith("backends")}
    assert {name: found for name, found in reaching.items() if found} == {}


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_walk_sees_imports_inside_functions():
    assert "backends.torch.backend" in import_graph()["backends"]


# the places allowed to name several kinds: the records, each backend's table of builders,
# the factory's builders of the kinds that need nothing, other engines' names for kinds
LISTS_KINDS = {"app/drafters/kinds.py", "backends/torch/__init__.py", "backends/mlx/__init__.py",
               "app/drafters/__init__.py", "app/catalogue/recipe.py"}


def kind_lists(source: str, names: frozenset[str]) -> list[int]:
    """The lines of collection literals (tuple, list, set, dict keys) that name two or more
    kinds, as strings or as the first argument of a constructor (`Rank("mtp", ...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None]
        else:
            continue
        named = {value for value in map(_kind_named, items) if value in names}
        if len(named) >= 2:
            found.append(node.lineno)
    return found


def _kind_named(item: ast.expr) -> object:
    if isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.args:
        item = item.args[0]
    return item.value if isinstance(item, ast.Constant) else None


def test_the_table_of_kinds_is_the_only_place_that_lists_kinds():
    names = frozenset(kinds.NAMES)
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for path in modules("app") + modules("backends")
                 if str(path.relative_to(ROOT)) not in LISTS_KINDS
                 for line in kind_lists(path.read_text(encoding="utf-8"), names)]
    assert offenders == []


def test_the_kind_list_finder_sees_literals_and_rows_of_records():
    names = frozenset({"draft", "mtp", "ngram"})
    assert kind_lists('BUILDS = frozenset({"draft", "mtp"})', names) == [1]
    assert kind_lists('ORDER = (Rank("mtp", 1), Rank("ngram", 2))', names) == [1]
    assert kind_lists('TABLE = {"mtp": 1, "draft": 2}', names) == [1]
    assert kind_lists('ONE = ("mtp", "other")\nSWAP = (k.index("mtp"), k.index("ngram"))',
                      names) == []
