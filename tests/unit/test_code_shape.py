"""The project's size rules, read from the tree: no module of src/ over 400 lines, and no function
over 60 unless a comment right above it (or its decorators) says why it is long."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "hotlora"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def long_functions(path: Path) -> list[tuple[str, int, bool]]:
    """(name, lines, explained) for each function of ``path`` over the limit; explained: a comment
    line naming why it is long (it holds the word "long") just above the def or its decorators."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                above = lines[max(0, first - 4):first - 1]
                explained = any(line.strip().startswith("#") and "long" in line.lower() for line in above)
                found.append((node.name, length, explained))
    return found


def test_modules_and_functions_stay_small():
    modules = sorted(SRC.rglob("*.py"))
    assert modules
    big = [f"{p.relative_to(SRC)}: {n}" for p in modules if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"
    unexplained = [f"{p.relative_to(SRC)}:{name} ({n} lines)" for p in modules
                   for name, n, explained in long_functions(p) if not explained]
    assert not unexplained, f"functions over {MAX_FUNCTION_LINES} lines without a comment saying why: {unexplained}"


def test_the_audit_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n\n\n# Long: one table, kept in one place.\ndef g():\n{body}\n")
    assert long_functions(tmp_path / "m.py") == [("f", MAX_FUNCTION_LINES + 1, False), ("g", MAX_FUNCTION_LINES + 1, True)]
