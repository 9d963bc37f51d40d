"""The python examples in docs/ run as written, and a block that opens with `# <path>` is
that file of the tree, as it stands (the docs show the code the tests run on)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _file_blocks(path) -> dict[str, str]:
    """path in the tree -> the block's code after its `# path` line."""
    found = {}
    for code in _blocks(path):
        first, _, rest = code.partition("\n")
        if re.fullmatch(r"# [\w/]+\.py", first):
            found[first[2:]] = rest
    return found


@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md") if _blocks(p)))
def test_python_blocks_run(doc):
    for code in _blocks(DOCS / doc):
        exec(compile(code, f"docs/{doc}", "exec"), {})


@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md") if _file_blocks(p)))
def test_file_blocks_are_the_files(doc):
    for path, code in _file_blocks(DOCS / doc).items():
        assert (ROOT / path).is_file() and (ROOT / path).read_text() == code, f"docs/{doc}: {path} differs"


def test_the_walkthrough_shows_the_tiny_dit_as_it_is():
    assert set(_file_blocks(DOCS / "placements.md")) == {"models/tiny_dit/model.py", "models/tiny_dit/pipeline.py",
                                                      "models/tiny_dit/spec.py"}
