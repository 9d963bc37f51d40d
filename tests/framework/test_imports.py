"""The import boundaries: plans load no attention code, the installed packages import no test
support, and no package module imports itself in a circle."""
import ast
import re
import subprocess
import sys
from pathlib import Path

from dtgen.plan import ATTENTION_KINDS
from dtgen.sp import SP_KINDS

ROOT = Path(__file__).resolve().parents[2]
# The installed packages: pyproject's `[tool.setuptools.packages.find] include` ("dtgen*", ...).
_FIND = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include\s*=\s*\[([^]]*)\]",
                  (ROOT / "pyproject.toml").read_text())
PACKAGES = tuple(name.rstrip("*") for name in re.findall(r'"([^"]+)"', _FIND.group(1)))


def test_every_attention_kind_a_plan_may_name_has_one_core():
    assert list(SP_KINDS) == list(ATTENTION_KINDS)
    assert all(core.name == name for name, core in SP_KINDS.items())


def test_reading_plans_loads_no_attention_code_and_no_triton():
    # A fresh interpreter: this one has loaded everything already.
    placements = sorted(p.stem for p in (ROOT / "placements").glob("*.py") if p.stem != "__init__")
    code = ("import sys, importlib, dtgen.plan\n"
            f"for m in {placements!r}: importlib.import_module('placements.' + m)\n"
            "print('\\n'.join(sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "triton", "kernels") or m.startswith("dtgen.sp")]
    assert heavy == [], ("importing dtgen.plan and the plans loads "
                         f"{sorted({m if m.startswith('dtgen.') else m.split('.')[0] for m in heavy})}")


def test_installed_packages_import_no_test_support():
    # tests/ (the golden harness in tests/support/ included) is not installed: a wheel has none.
    assert "tests" not in PACKAGES and "dtgen" in PACKAGES
    found = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert found == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that `name` imports anywhere in its file: at the top, in functions
    and under TYPE_CHECKING alike (a circle through any of them is still a circle to read)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets.add(base)
            targets.update(f"{base}.{a.name}" for a in node.names)   # `from pkg import submodule`
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py too; a module's own
        # packages are loaded before it in any case, so they are no edge.
        parts = target.split(".") if target else []
        for i in range(1, len(parts) + 1):
            up = ".".join(parts[:i])
            if up in modules and up != name and not name.startswith(up + "."):
                found.add(up)
    return found


def test_no_import_circle_among_package_modules():
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {name: _imports(name, path, set(files)) for name, path in files.items()}
    # Depth-first search; a grey module met again closes a circle.
    state: dict[str, str] = {}
    circles = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "grey"
        for dep in sorted(graph[name]):
            if state.get(dep) == "grey":
                circles.append(trail[trail.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, trail + [dep])
        state[name] = "black"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


# The `dtgen` command sits above the server and the core alike (`dtgen serve` starts the server).
COMMAND_MODULES = ("dtgen.cli", "dtgen.__main__")


def test_the_core_never_imports_the_server():
    # dtgen.serve needs fastapi and uvicorn (the `serve` extra); the core checks requests, runs
    # pipelines and launches ranks without them. The server's RequestError is the core's.
    from dtgen.requests import RequestError
    from dtgen.serve.errors import RequestError as ServedRequestError
    assert ServedRequestError is RequestError
    files = {_module_name(p): p for p in (ROOT / "dtgen").rglob("*.py")}
    core = {name: path for name, path in files.items()
            if not (name + ".").startswith("dtgen.serve.") and name not in COMMAND_MODULES}
    found = sorted(f"{name} -> {dep}" for name, path in core.items() for dep in _imports(name, path, set(files))
                   if (dep + ".").startswith("dtgen.serve."))
    assert found == []
