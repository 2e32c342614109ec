"""The library reads in short functions: none in src/ longer than 80 lines (ruff checks complexity and statements)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_LINES = 80


def _long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_src_is_longer_than_80_lines() -> None:
    assert _long_functions(SRC) == []


def test_the_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n", encoding="utf-8")
    assert _long_functions(tmp_path) == [f"long.py:1 long ({MAX_LINES + 1} lines)"]
