"""bench/model_lines.py: what it counts as a code line, and the Qwen-Image target (<= 300 lines) held."""
from bench.model_lines import COUNTED, ROOT, TARGETS, code_lines, count


def test_code_lines_leave_out_blanks_comments_and_docstrings(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""A module docstring\nover two lines."""\n\n# a comment\nx = [1,\n     2]   # two code lines\n\n'
                    'def f():\n    """Its docstring."""\n    return "not a docstring"\n')
    assert code_lines(path) == 4   # x = [1, / 2] / def f(): / return


def test_every_counted_file_exists_once():
    paths = [p for roles in COUNTED.values() for _, files in roles for p in files]
    assert len(paths) == len(set(paths)) and all((ROOT / p).is_file() for p in paths)


def test_the_targets_hold():
    models = count()
    over = {m: models[m]["total"] for m, target in TARGETS.items() if models[m]["total"] > target}
    assert not over, f"code lines over the target: {over} (targets: {TARGETS})"
