"""The python examples in docs/ run as written, and a block that opens with `# <path>` is
that file of the tree, as it stands (the docs show the code the tests run on). The `dtgen run`
and `dtgen serve` commands in README and docs/ take only their model's flags and plans; README
stays a short page that links the docs by topic, and every relative link resolves."""
import re
import shlex
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


# ---- README and the docs by topic ---------------------------------------------------------------
README = ROOT / "README.md"


def _shell_commands(path) -> list[str]:
    """The `dtgen run|serve` commands of a page's bash blocks, continuation lines joined, comments cut."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ", 1)[0].split("   #", 1)[0]
            if re.search(r"\bdtgen (run|serve)\b", line):
                commands.append(line.strip())
    return commands


def _known_flags(command: str, argv: list[str]) -> tuple[set[str], set[str]]:
    """(the flags of the model `argv` names, its plans) for `dtgen run` or `dtgen serve`."""
    from dtgen.cli import add_server_flags
    from models import registry
    model = argv[argv.index("--model") + 1] if "--model" in argv else registry.default().name
    assert model in registry.names(), f"--model {model} is not a registered model"
    spec = registry.spec(model)
    parser = spec.load("cli").build_parser(cli=command == "run")
    if command == "serve":
        add_server_flags(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    if command == "run":
        flags.add("--model")
    return flags, set(spec.load("plans").PLANS)


PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Their commands run the plan the reader has just added ("Adding a plan"), not a shipped one.
PAGES_ADDING_PLANS = {"placements.md"}


@pytest.mark.parametrize("page", [p.name for p in PAGES if _shell_commands(p)])
def test_the_commands_shown_take_only_their_models_flags_and_plans(page):
    path = README if page == README.name else DOCS / page
    for line in _shell_commands(path):
        words = shlex.split(line)
        at = next(i for i, w in enumerate(words) if w in ("run", "serve") and words[i - 1].endswith("dtgen"))
        command, argv = words[at], words[at + 1:]
        flags, plans = _known_flags(command, argv)
        unknown = [w for w in argv if w.startswith("--") and w.split("=", 1)[0] not in flags]
        assert not unknown, f"{page}: `{line}`: {unknown} not flags of its model"
        if "--plan" in argv and page not in PAGES_ADDING_PLANS:
            assert argv[argv.index("--plan") + 1] in plans, f"{page}: `{line}`: no such plan"


def test_the_readme_is_short_and_links_the_docs_by_topic():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert re.search(r"## Quickstart\n\n```bash\nmake demo\nmake test\n```", text)
    assert "<!-- table:headline -->" in text and "<!-- /table:headline -->" in text
    for topic in ("running", "models", "serving", "step-caches", "memory-fp8", "compiling", "placements",
                  "design", "requests", "performance"):
        assert f"(docs/{topic}.md)" in text, f"README links no docs/{topic}.md"


@pytest.mark.parametrize("page", [p.name for p in PAGES])
def test_every_relative_link_resolves(page):
    path = README if page == README.name else DOCS / page
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
        assert (path.parent / target).exists(), f"{page}: link to {target} resolves to nothing"
