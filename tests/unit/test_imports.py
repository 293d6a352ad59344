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


# The layers (design: "Imports point one way"): a module may import its own layer or one below.
LAYERS = {"errors": 0, "settings": 0, "images": 0, "tracing": 0, "lru": 0, "durable": 0,
          "families": 1, "adapters": 1, "trainer_layouts": 1,
          "engine": 2, "tiny": 2,
          "server": 3, "scaleout": 3, "fullsize": 3,
          "cli": 4, "testing": 4, "__init__": 4}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 and parts[0] == "hotlora" else None


def test_imports_point_one_way():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        own = LAYERS[path.relative_to(SRC).parts[0].removesuffix(".py")]
        for module in imported_modules(path, package_of(path)):
            target = layer_of(module)
            if target is not None and target > own:
                upward.append(f"{path.relative_to(SRC)} imports {module}")
    assert not upward, "imports against the layers (errors, settings <- families, adapters <- engine <- server, " \
                       "scaleout <- cli):\n" + "\n".join(sorted(set(upward)))


def test_every_top_level_module_has_a_layer():
    assert {p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()} \
        <= set(LAYERS)
