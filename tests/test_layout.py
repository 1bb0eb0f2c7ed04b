"""The layout's import directions hold: the core stands alone, the app never reaches for an
array library, and the drafter factory is the one place that lists drafter kinds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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


def test_backends_never_import_the_user_surfaces():
    for path in modules("backends"):
        for name in imports(path):
            assert not name.startswith(("app.ui", "app.serve", "app.bench")), \
                f"{path.relative_to(ROOT)} imports {name}"


def test_the_drafter_factory_is_the_only_place_that_lists_kinds():
    # a tuple or set literal naming two or more kinds is a list of kinds
    pattern = re.compile(r"[(\[{]\s*\"(none|ngram|draft|chain)\",\s*\"(ngram|draft|chain|auto)\"")
    offenders = [str(path.relative_to(ROOT)) for path in modules("app") + modules("backends")
                 if path != ROOT / "app/drafters/__init__.py"
                 and pattern.search(path.read_text(encoding="utf-8"))]
    assert offenders == []
