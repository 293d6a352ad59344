"""Import rules read from the tree: nothing the package ships imports the test helpers
(``hotlora.testing`` is for tests; what src/ needs lives in ``hotlora.tiny`` / ``hotlora.trainer_layouts``)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "hotlora"


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, at any depth (function-local imports too), absolute names;
    ``package`` is the dotted package ``path`` is in, for relative imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from hotlora import testing`
    return found


def package_of(path: Path) -> str:
    """The dotted package of a module file (of ``pkg/__init__.py``: ``pkg`` itself)."""
    return ".".join(path.relative_to(SRC.parent).parts[:-1])


def test_nothing_in_src_imports_the_test_helpers():
    importers = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py")) if p != SRC / "testing.py"
                 if any(m == "hotlora.testing" or m.startswith("hotlora.testing.")
                        for m in imported_modules(p, package_of(p)))]
    assert not importers, f"modules under src/hotlora importing hotlora.testing (move what they need out of it): {importers}"


def test_the_audit_sees_every_way_of_importing_them(tmp_path):
    for line in ("import hotlora.testing", "from hotlora.testing import random_lora", "from hotlora import testing",
                 "def f():\n    from hotlora.testing import x", "from ..testing import x"):
        (tmp_path / "m.py").write_text(line + "\n")
        assert "hotlora.testing" in imported_modules(tmp_path / "m.py", "hotlora.fullsize"), line
    (tmp_path / "m.py").write_text("from hotlora.tiny import random_lora\nfrom . import testing_notes\n")
    assert "hotlora.testing" not in imported_modules(tmp_path / "m.py", "hotlora")
