"""The python examples in docs/ run as written."""
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md") if _blocks(p)))
def test_python_blocks_run(doc):
    for code in _blocks(DOCS / doc):
        exec(compile(code, f"docs/{doc}", "exec"), {})
