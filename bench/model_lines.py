"""The lines a model adds beyond its plain modules: the measure of the Qwen-Image target (<= 300).

    python -m bench.model_lines [--out bench/results/cpu-2026-12-02-model-lines.json]

Per model, the code lines of what it writes to run through the framework: its loader (the
adapter for `dtgen.build` and `load`), its server adapter, its registry spec, its pipeline
(the request type, the steps, the phases) and its plans. A code line is a line holding a
token of code: blank lines, comment-only lines and docstrings are not counted (a statement
spread over three lines counts three).

Not counted: the plain modules (the transformer, the text encoder, the VAE, the vision
tower: module trees with no framework in them, as a reference implementation writes them),
the model's own configuration and sequence formats (config readers, tokenizers, prompt
templates, resolution tables), and tiny.py (the tiny test checkpoint's maker). HunyuanImage-3
splits its pipeline over several files (its AR phase, denoise phase, edit condition, decoder
stack and request type, which Wan and Qwen-Image keep in pipeline.py): all of them count as
its pipeline.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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


def docstring_lines(tree: ast.AST) -> set[int]:
    """The lines of every module, class and function docstring."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(path: Path) -> int:
    """Lines holding a code token, docstrings left out."""
    source = path.read_text()
    docs = docstring_lines(ast.parse(source, str(path)))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def count(root: Path = ROOT) -> dict:
    """Per model: each counted file's code lines by role, and the total."""
    out = {}
    for model, roles in COUNTED.items():
        files = {path: {"role": role, "lines": code_lines(root / path)} for role, paths in roles for path in paths}
        out[model] = {"files": files, "total": sum(f["lines"] for f in files.values())}
        if model in TARGETS:
            out[model]["target"] = TARGETS[model]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the counts here as JSON")
    args = parser.parse_args(argv)
    models = count()
    for model, m in models.items():
        target = f" (target <= {m['target']})" if "target" in m else ""
        print(f"{model}: {m['total']} lines{target}")
        for path, f in m["files"].items():
            print(f"  {f['lines']:5d}  {path}  ({f['role']})")
    if args.out:
        report = {"what": "code lines a model adds beyond its plain modules: not blank, not "
                          "comment-only, not docstrings",
                  "command": "python -m bench.model_lines " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "models": models}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
