"""The lines a model adds beyond its plain modules and tests: its glue, counted by a rule.

    python -m bench.glue_lines [--json PATH]

For each model in models/registry.py (its folder is its spec module's package: the registry
name `hunyuan-image3` comes from `models.hunyuan_image3.spec`, so models/hunyuan_image3/):

  glue = the lines of every .py file under models/<m>/ that is not an nn.Module definition
       + the lines of placements/<m>.py
       + the lines of examples/<family>*.py, <family> the folder name up to its first "_"
         (hunyuan, wan, qwen: examples/hunyuan_t2i.py and examples/hunyuan_serve.py count
         for HunyuanImage-3; the model-neutral examples/serve.py counts for none)

"Lines" are wc -l's: newline characters, blank lines, comments and docstrings included.

"An nn.Module definition" is decided from the file's AST alone: a file that defines a class
(at any depth) deriving from torch.nn.Module, directly (a base that names `nn.Module`,
`torch.nn.Module` or another torch.nn class that is a Module, such as `nn.GroupNorm`, through
whatever `import` names the file gives torch and torch.nn) or through another class defined in
the same file. A base imported from elsewhere in the project (`SplitDecoder`, `DecoderStack`)
does not make a file a module definition, even when that class is one: the rule reads one file.

What the rule makes of models/*/model.py:
- hunyuan_image3/model.py holds HunyuanImage3ForCausalMM, the whole module tree (plus a few
  helpers that swap its MoE / FP8 implementations): not counted, as it should be. The
  model's loader and adapter live in loading.py, which is counted.
- wan/model.py and qwen_image/model.py each hold a small container module (WanT2V,
  QwenImageT2I: the components side by side) next to the model's ModelAdapter, its config
  readers and `load`. The container makes the whole file a module definition, so their
  adapter and loader lines (the glue bench/model_lines.py counts as "loader") are NOT in
  these totals: for Wan and Qwen-Image this rule undercounts by that file. The JSON lists
  every excluded file with its lines and the Module classes that excluded it, so the
  difference can be read off.
Files with no module in them count whatever they hold: configs, tokenizers and prompt
templates, resolution tables, the tiny test checkpoint's maker (tiny.py), the registry spec,
the pipeline and the server adapter.

Also measured: the lines of examples/hunyuan_t2i.py, and the longest function in
dtgen/serve/ (its routes/ package too): a `def` (method or function, async too) not nested in another function,
from its `def` line to its last line (decorators not included); a nested def is part of its
enclosing function's span, not a candidate of its own.

`--json PATH` writes {command, date, models: per model its total and files (counted and
excluded, each with its lines), hunyuan_example_lines, longest_serve_function}.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HUNYUAN_EXAMPLE = "examples/hunyuan_t2i.py"
SERVE_GLOB = "dtgen/serve/**/*.py"   # its routes/ package too


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
    """Everything the report holds but the command and the date."""
    folders = model_folders() if folders is None else folders
    example = root / HUNYUAN_EXAMPLE
    return {"models": {name: count_model(root, folder) for name, folder in folders.items()},
            "hunyuan_example_lines": wc_lines(example) if example.is_file() else None,
            "longest_serve_function": longest_function(sorted(root.glob(SERVE_GLOB)), root)}


def table(report: dict) -> str:
    rows = [f"{'model':16s} {'glue lines':>10s}  {'files':>5s}  {'excluded (nn.Module files)':>26s}"]
    for name, m in report["models"].items():
        excluded = sum(f["lines"] for f in m["excluded_module_files"].values())
        rows.append(f"{name:16s} {m['total']:10d}  {len(m['files']):5d}  "
                    f"{excluded:9d} lines in {len(m['excluded_module_files']):2d} files")
    rows.append(f"{HUNYUAN_EXAMPLE}: {report['hunyuan_example_lines']} lines")
    f = report["longest_serve_function"]
    if f:
        rows.append(f"longest function in {SERVE_GLOB}: {f['file']}:{f['name']} "
                    f"({f['lines']} lines, {f['first_line']}-{f['last_line']})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the report here as JSON")
    parser.add_argument("--per-file", action="store_true", help="also print every counted file's lines")
    args = parser.parse_args(argv)
    report = measure()
    print(table(report))
    if args.per_file:
        for name, m in report["models"].items():
            print(f"\n{name} ({m['folder']}):")
            for path, lines in m["files"].items():
                print(f"  {lines:5d}  {path}")
            for path, f in m["excluded_module_files"].items():
                print(f"  {f['lines']:5d}  {path}  (not counted: {', '.join(f['module_classes'])})")
    if args.json:
        argv = sys.argv[1:] if argv is None else argv
        out = {"command": " ".join(["python -m bench.glue_lines", *argv]),
               "date": datetime.date.today().isoformat(), **report}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
