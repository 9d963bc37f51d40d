"""The lines a model adds beyond its plain modules: its glue, counted by a file rule and by role.

The file rule, for each model of models/registry.py (its folder its spec module's package): wc -l of
every .py file under models/<m>/ that defines no nn.Module, of placements/<m>.py, and of
examples/<family>*.py (<family>: the folder name up to its first "_"). "Defines an nn.Module" is read
from the file's AST alone: a class deriving from torch.nn.Module, directly (through whatever names the
file's imports give torch.nn's Module classes) or through a class of the same file; a base imported from
elsewhere does not count. So wan/model.py and qwen_image/model.py, which hold a small container module
next to their loader, are left out whole: the rule undercounts those two by that file (the JSON lists
every excluded file, its lines and the classes that excluded it).
The role count (`COUNTED`): the code lines (no blank, comment-only or docstring line) of each model's
loader, server adapter, registry spec, pipeline and plans; the Qwen-Image target is <= 300.
Also: the lines of examples/hunyuan_t2i.py, and the longest function in dtgen/serve/ (a def not nested in
another, from its `def` line to its last).
"""
from __future__ import annotations

import ast
import importlib
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HUNYUAN_EXAMPLE = "examples/hunyuan_t2i.py"
SERVE_GLOB = "dtgen/serve/**/*.py"   # its routes/ package too


# model -> (role, files): the roles the measure counts, each file once.
COUNTED = {
    "qwen-image": (("loader", ("models/qwen_image/model.py",)),
                   ("server adapter", ("models/qwen_image/serving.py",)),
                   ("spec", ("models/qwen_image/spec.py",)),
                   ("pipeline", ("models/qwen_image/pipeline.py",)),
                   ("plans", ("placements/qwen_image.py",))),
    "wan": (("loader", ("models/wan/model.py",)),
            ("server adapter", ("models/wan/serving.py",)),
            ("spec", ("models/wan/spec.py",)),
            ("pipeline", ("models/wan/pipeline.py",)),
            ("plans", ("placements/wan.py",))),
    "hunyuan-image3": (("loader", ("models/hunyuan_image3/loading.py",)),
                       ("server adapter", ("models/hunyuan_image3/serving.py",)),
                       ("spec", ("models/hunyuan_image3/spec.py",)),
                       ("pipeline", tuple(f"models/hunyuan_image3/{f}.py" for f in
                                          ("pipeline", "ar", "denoise", "condition", "stack", "requests"))),
                       ("plans", ("placements/hunyuan_image3.py",))),
}
TARGETS = {"qwen-image": 300}


def code_lines(path: Path) -> int:
    """Lines holding a code token, docstrings (module, class, function) left out."""
    source = path.read_text()
    docs = set()
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def count_roles(root: Path = ROOT) -> dict:
    """Per model of `COUNTED`: each file's code lines and role, the total, the target where one is set."""
    out = {}
    for model, roles in COUNTED.items():
        files = {path: {"role": role, "lines": code_lines(root / path)} for role, paths in roles for path in paths}
        out[model] = {"files": files, "total": sum(f["lines"] for f in files.values()),
                      **({"target": TARGETS[model]} if model in TARGETS else {})}
    return out


def wc_lines(path: Path) -> int:
    """wc -l: the number of newline characters."""
    return path.read_bytes().count(b"\n")


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted path it stands for, from the file's imports."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return None if head is None else f"{head}.{expr.attr}"
    if isinstance(expr, ast.Subscript):   # Generic[...] and the like: the subscripted name
        return _dotted(expr.value)
    return None


def _is_torch_module(path: str) -> bool:
    """Whether a dotted path names torch.nn.Module or one of torch.nn's Module classes."""
    if not path.startswith("torch.nn."):
        return False
    import torch.nn
    obj = torch.nn
    for part in path.split(".")[2:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return isinstance(obj, type) and issubclass(obj, torch.nn.Module)


def module_classes(source: str, filename: str = "<source>") -> list[str]:
    """The classes of a file that derive from torch.nn.Module, directly or through a class of
    the same file (to any depth of same-file inheritance)."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    local = {c.name for c in classes}
    direct, via = set(), {}
    for c in classes:
        for base in c.bases:
            name = _dotted(base)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            full = aliases.get(head, head) + (f".{rest}" if rest else "")
            if _is_torch_module(full):
                direct.add(c.name)
            elif name in local:
                via.setdefault(c.name, set()).add(name)
    found, changed = set(direct), True
    while changed:
        changed = False
        for name, bases in via.items():
            if name not in found and bases & found:
                found.add(name)
                changed = True
    return sorted(found)


def model_folders() -> dict[str, str]:
    """Registry name -> its folder under models/, from the spec modules."""
    from models.registry import SPEC_MODULES
    out = {}
    for module in SPEC_MODULES:
        package, _, leaf = module.rpartition(".")
        assert leaf == "spec" and package.startswith("models."), module
        out[importlib.import_module(module).SPEC.name] = package.split(".", 1)[1]
    return out


def count_model(root: Path, folder: str) -> dict:
    """One model's glue: counted files (path -> lines), excluded module files, the total."""
    family = folder.split("_")[0]
    counted, excluded = {}, {}
    for path in sorted((root / "models" / folder).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root).as_posix()
        modules = module_classes(path.read_text(), rel)
        if modules:
            excluded[rel] = {"lines": wc_lines(path), "module_classes": modules}
        else:
            counted[rel] = wc_lines(path)
    placement = root / "placements" / f"{folder}.py"
    if placement.is_file():
        counted[placement.relative_to(root).as_posix()] = wc_lines(placement)
    for path in sorted((root / "examples").glob(f"{family}*.py")):
        counted[path.relative_to(root).as_posix()] = wc_lines(path)
    return {"folder": f"models/{folder}", "family": family, "total": sum(counted.values()),
            "files": counted, "excluded_module_files": excluded}


def longest_function(paths: list[Path], root: Path) -> dict | None:
    """The longest def not nested in another def, over `paths`: file, qualified name, lines."""
    best = None

    def visit(node: ast.AST, prefix: str, rel: str):
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if best is None or lines > best["lines"]:
                    best = {"file": rel, "name": prefix + child.name, "lines": lines,
                            "first_line": child.lineno, "last_line": child.end_lineno}
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", rel)
            else:   # statements that can hold defs (if / try / with at module or class level)
                visit(child, prefix, rel)

    for path in paths:
        rel = path.relative_to(root).as_posix()
        visit(ast.parse(path.read_text(), rel), "", rel)
    return best


def measure(root: Path = ROOT, folders: dict[str, str] | None = None) -> dict:
    """Everything the report holds but the command and the date (the role count: of the registry's models
    only, not of a tree given `folders`)."""
    example = root / HUNYUAN_EXAMPLE
    return {"models": {name: count_model(root, folder) for name, folder in (folders or model_folders()).items()},
            "hunyuan_example_lines": wc_lines(example) if example.is_file() else None,
            "longest_serve_function": longest_function(sorted(root.glob(SERVE_GLOB)), root),
            "code_lines_by_role": count_roles(root) if folders is None else None}


def table(report: dict) -> str:
    rows = [f"{'model':16s} {'glue lines':>10s}  {'files':>5s}  {'excluded (nn.Module files)':>26s}"]
    for name, m in report["models"].items():
        excluded = sum(f["lines"] for f in m["excluded_module_files"].values())
        rows.append(f"{name:16s} {m['total']:10d}  {len(m['files']):5d}  "
                    f"{excluded:9d} lines in {len(m['excluded_module_files']):2d} files")
    for name, m in (report.get("code_lines_by_role") or {}).items():
        target = f" (target <= {m['target']})" if "target" in m else ""
        rows.append(f"{name}: {m['total']} code lines in its loader, server adapter, spec, pipeline, plans{target}")
    rows.append(f"{HUNYUAN_EXAMPLE}: {report['hunyuan_example_lines']} lines")
    f = report["longest_serve_function"]
    if f:
        rows.append(f"longest function in {SERVE_GLOB}: {f['file']}:{f['name']} "
                    f"({f['lines']} lines, {f['first_line']}-{f['last_line']})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from bench.harness import Bench   # its torch import waits until the command runs: the counting needs none
    b = Bench("bench.glue_lines", __doc__, argv)
    b.parser.add_argument("--json", metavar="PATH", help="write the report here as JSON")
    args = b.parser.parse_args(b.argv)
    report = measure()
    print(table(report))
    b.write(report, "cpu", path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
