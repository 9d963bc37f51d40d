"""DTGEN_REQUIRE_GOLDEN=1 (CI's setting): a missing or empty golden folder fails the run
with one line naming it, for every case kind (`discover_cases` is where each kind looks)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.golden import DEFAULT_ROOT, GoldenDataMissing, discover_cases

ROOT = Path(__file__).resolve().parents[2]


def _case(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "golden.json").write_text("{}")
    return folder


def test_required_folders_must_hold_cases(tmp_path, monkeypatch):
    monkeypatch.setenv("DTGEN_REQUIRE_GOLDEN", "1")
    monkeypatch.delenv("DTGEN_TEST_DIRS", raising=False)
    with pytest.raises(GoldenDataMissing, match=f"{tmp_path / 'nowhere'} \\(the default golden folder\\) does not "
                                                "exist") as err:
        discover_cases(tmp_path / "nowhere", "DTGEN_TEST_DIRS")
    assert "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(GoldenDataMissing, match="empty .*holds no golden case"):
        discover_cases(tmp_path / "empty", "DTGEN_TEST_DIRS")
    case = _case(tmp_path / "root" / "a")
    assert discover_cases(tmp_path / "root", "DTGEN_TEST_DIRS") == [case]
    monkeypatch.setenv("DTGEN_TEST_DIRS", str(tmp_path / "typo"))   # an extra folder is required too
    with pytest.raises(GoldenDataMissing, match="typo \\(listed in \\$DTGEN_TEST_DIRS\\) does not exist"):
        discover_cases(tmp_path / "root", "DTGEN_TEST_DIRS")


def test_without_the_requirement_missing_folders_give_no_cases(tmp_path, monkeypatch):
    monkeypatch.setenv("DTGEN_TEST_DIRS", str(tmp_path / "typo"))
    for value in ("0", ""):
        monkeypatch.setenv("DTGEN_REQUIRE_GOLDEN", value)
        assert discover_cases(tmp_path / "nowhere", "DTGEN_TEST_DIRS") == []
    monkeypatch.setenv("DTGEN_REQUIRE_GOLDEN", "yes")
    with pytest.raises(ValueError, match="DTGEN_REQUIRE_GOLDEN must be 0 or 1, got 'yes'"):
        discover_cases(tmp_path / "nowhere", "DTGEN_TEST_DIRS")


def test_a_missing_folder_stops_collection_with_one_line(tmp_path):
    """The whole pytest run ends at collection (usage error, exit 4) with the one line, as CI
    would see it in a clone without ../shared: the first missing folder, the default one in
    such a clone, else the listed extra folder."""
    env = dict(os.environ, DTGEN_REQUIRE_GOLDEN="1", DTGEN_GOLDEN_DIRS=str(tmp_path / "missing"))
    if DEFAULT_ROOT.is_dir() and any((c / "golden.json").is_file() for c in DEFAULT_ROOT.iterdir()):
        expected = f"{tmp_path / 'missing'} (listed in $DTGEN_GOLDEN_DIRS) does not exist"
    else:
        expected = f"{DEFAULT_ROOT} (the default golden folder)"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider",
                          "tests/hunyuan_image3/test_golden.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 4, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if "DTGEN_REQUIRE_GOLDEN" in line]
    assert len(lines) == 1 and expected in lines[0], lines
