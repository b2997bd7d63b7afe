"""What an install holds: every package of the tree, subpackages included (pyproject.toml
`[tool.setuptools.packages.find]`), so a wheel or a non-editable install runs as the checkout
does. Fast."""
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent


def test_the_install_finds_every_package_of_the_tree():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(str(ROOT), include=cfg["include"]))
    tree = {".".join(p.parent.relative_to(ROOT).parts) for top in ("proxy", "worker", "shared")
            for p in (ROOT / top).rglob("__init__.py")}
    assert tree and found == tree, (sorted(tree - found), sorted(found - tree))
    assert {"shared.checkpoint", "shared.data", "shared.run", "proxy.commands"} <= found
