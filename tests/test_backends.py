"""Backend selection: a missing backend is refused with a pip command that works here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import backends
import backends.extras
from app.core.types import SpecdeckError


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=;! ]", requirement.strip(), maxsplit=1)[0].lower()


@pytest.mark.parametrize("system", ["Linux", "Darwin"])
def test_a_missing_mlx_names_packages_pip_can_find(monkeypatch, system):
    monkeypatch.setattr(backends.platform, "system", lambda: system)
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(SpecdeckError) as caught:
        backends.load_backend("mlx")
    message = str(caught.value)
    # specdeck is not on PyPI: `pip install 'specdeck[mlx]'` would fetch nothing usable
    assert "pip install 'specdeck[" not in message
    assert "pip install" in message and "mlx-lm" in message
    assert ("mlx[cpu]" in message) == (system == "Linux")  # Linux has only the CPU build


def test_the_install_hints_name_the_packages_of_pyprojects_extras():
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for extra, packages in backends.extras.EXTRAS.items():
        assert {_name(p) for p in packages} == {_name(r) for r in extras[extra]}, extra
