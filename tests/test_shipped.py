"""Shipped files: a wheel carries every asset and the catalogue, and they are found there."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.catalogue import shipped

ROOT = Path(__file__).resolve().parent.parent


def test_a_wheel_carries_every_asset_and_the_catalogue():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data_files = config["tool"]["setuptools"]["data-files"]
    carried = {name for names in data_files.values() for name in names}
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "assets").rglob("*") if p.is_file()}
    assert carried == on_disk | {"models.yaml"}
    for folder, names in data_files.items():
        for name in names:
            assert folder == str(Path("share/specdeck") / Path(name).parent).rstrip("/.")


def test_shipped_files_are_found_under_the_install_prefix_outside_a_checkout(
        tmp_path, monkeypatch):
    installed = tmp_path / "share" / "specdeck"
    (installed / "assets").mkdir(parents=True)
    (installed / "assets" / "ui.css").write_text("body {}")
    monkeypatch.setattr(shipped, "_CHECKOUT", tmp_path / "site-packages")
    monkeypatch.setattr(shipped, "_INSTALLED", installed)
    assert shipped.shipped_path("assets/ui.css") == installed / "assets" / "ui.css"
    assert shipped.shipped_path("models.yaml") == tmp_path / "site-packages" / "models.yaml"
