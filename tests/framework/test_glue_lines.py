"""bench/glue_lines.py: which files its rule counts, on a synthetic tree, and its report; what its role
count counts as a code line, and the Qwen-Image target (<= 300 lines) held."""
import json

from bench.glue_lines import (COUNTED, ROOT, TARGETS, code_lines, count_model, count_roles, longest_function, main,
                              measure, module_classes, wc_lines)


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _tree(root):
    """models/foo_bar/ with each kind of file, its placement, examples of its family and another's."""
    _write(root, "models/foo_bar/net.py", "import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    pass\n")
    _write(root, "models/foo_bar/plain.py", "import json\n\n\ndef read(path):\n    return json.load(path)\n")
    _write(root, "models/foo_bar/derived.py",
           "import torch\n\n\nclass Base(torch.nn.Module):\n    pass\n\n\nclass Child(Base):\n    pass\n")
    _write(root, "models/foo_bar/aliased.py", "import torch.nn as tnn\n\n\nclass Norm(tnn.GroupNorm):\n    pass\n")
    # Not modules: a local base that is no Module, a base imported from elsewhere, a config class.
    _write(root, "models/foo_bar/adapter.py",
           "from dtgen.build import ModelAdapter\nfrom .net import Net\n\n\nclass Mixin:\n    pass\n\n\n"
           "class Adapter(ModelAdapter, Mixin):\n    pass\n\n\nclass Wrapped(Net):\n    pass\n")
    _write(root, "models/foo_bar/nested.py", "from torch import nn\n\n\ndef make():\n    class Inner(nn.Module):\n"
                                             "        pass\n    return Inner\n")
    _write(root, "placements/foo_bar.py", "PLANS = {}\n")
    _write(root, "placements/other.py", "PLANS = {}\n")
    _write(root, "examples/foo_run.py", "print(1)\nprint(2)\n")
    _write(root, "examples/food.py", "x = 1\n")          # the family is a prefix: food* is foo*
    _write(root, "examples/bar_run.py", "x = 1\n")


def test_the_rule_excludes_module_files_and_counts_the_rest(tmp_path):
    _tree(tmp_path)
    m = count_model(tmp_path, "foo_bar")
    assert m["family"] == "foo"
    modules = ("net", "derived", "aliased", "nested")
    assert set(m["excluded_module_files"]) == {f"models/foo_bar/{f}.py" for f in modules}
    assert m["excluded_module_files"]["models/foo_bar/derived.py"] == {"lines": 9, "module_classes": ["Base", "Child"]}
    assert m["files"] == {"models/foo_bar/adapter.py": 14, "models/foo_bar/plain.py": 5,
                          "placements/foo_bar.py": 1, "examples/food.py": 1, "examples/foo_run.py": 2}
    assert m["total"] == 23


def test_module_classes_follow_same_file_bases_only():
    src = ("from torch.nn import Module\nimport torch\n\n"
           "class A(Module): pass\nclass B(A): pass\nclass C(B): pass\n"
           "class D(torch.nn.Parameter): pass\n"          # a torch.nn name that is no Module
           "class E(Elsewhere): pass\nclass F: pass\n")
    assert module_classes(src) == ["A", "B", "C"]
    assert module_classes("class Base:\n    pass\n\n\nclass Child(Base):\n    pass\n") == []


def test_wc_lines_counts_newlines(tmp_path):
    assert wc_lines(_write(tmp_path, "a.py", "x = 1\n\n# c\n")) == 3
    assert wc_lines(_write(tmp_path, "b.py", "x = 1\ny = 2")) == 1      # as wc -l: no final newline


def test_longest_function_counts_nested_defs_in_their_parent(tmp_path):
    short = _write(tmp_path, "dtgen/serve/a.py", "def short():\n    return 1\n")
    app = _write(tmp_path, "dtgen/serve/b.py",
                 "class App:\n    @staticmethod\n    def run(x):\n        def inner():\n            return x\n\n"
                 "        return inner()\n\n\nasync def other():\n    pass\n")
    got = longest_function([short, app], tmp_path)
    assert got == {"file": "dtgen/serve/b.py", "name": "App.run", "lines": 5, "first_line": 3, "last_line": 7}


def test_measure_on_a_synthetic_tree(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "examples/hunyuan_t2i.py", "a\nb\nc\n")
    _write(tmp_path, "dtgen/serve/app.py", "def create():\n    def route():\n        pass\n    return route\n")
    report = measure(tmp_path, {"foo-bar": "foo_bar"})
    assert report["models"]["foo-bar"]["total"] == 23 and report["hunyuan_example_lines"] == 3
    assert report["longest_serve_function"]["name"] == "create" and report["longest_serve_function"]["lines"] == 4


def test_the_report_on_this_tree(tmp_path, capsys):
    out = tmp_path / "glue.json"
    assert main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"] == f"python -m bench.glue_lines --json {out}"
    assert set(report["models"]) == {"hunyuan-image3", "wan", "qwen-image"}
    hunyuan = report["models"]["hunyuan-image3"]
    assert hunyuan["folder"] == "models/hunyuan_image3" and "examples/hunyuan_t2i.py" in hunyuan["files"]
    assert "models/hunyuan_image3/model.py" in hunyuan["excluded_module_files"]
    assert "models/hunyuan_image3/loading.py" in hunyuan["files"]
    assert report["hunyuan_example_lines"] == hunyuan["files"]["examples/hunyuan_t2i.py"] > 0
    assert report["longest_serve_function"]["file"].startswith("dtgen/serve/")
    assert "hunyuan-image3" in capsys.readouterr().out
    assert report["code_lines_by_role"]["qwen-image"]["target"] == 300


def test_code_lines_leave_out_blanks_comments_and_docstrings(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""A module docstring\nover two lines."""\n\n# a comment\nx = [1,\n     2]   # two code lines\n\n'
                    'def f():\n    """Its docstring."""\n    return "not a docstring"\n')
    assert code_lines(path) == 4   # x = [1, / 2] / def f(): / return


def test_every_role_counted_file_exists_once():
    paths = [p for roles in COUNTED.values() for _, files in roles for p in files]
    assert len(paths) == len(set(paths)) and all((ROOT / p).is_file() for p in paths)


def test_the_targets_hold():
    models = count_roles()
    over = {m: models[m]["total"] for m, target in TARGETS.items() if models[m]["total"] > target}
    assert not over, f"code lines over the target: {over} (targets: {TARGETS})"
