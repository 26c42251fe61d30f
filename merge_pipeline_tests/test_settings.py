"""The variables the engine, the stores and the CLI read (``merge_pipeline.settings``): read where they are
used, never at import; sizes with their units; junk or a huge value one line naming the variable, its unit and
bounds (before: ``int()`` at import broke every command, ``inspect`` of a local folder included, and ``1e300``
seconds passed its check to overflow later)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from merge_pipeline import settings
from merge_pipeline.errors import MergeError
from merge_pipeline.hub.upload import check_upload_settings
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli

VARIABLES = [v for v in vars(settings).values() if isinstance(v, settings.Setting)]


@pytest.mark.parametrize(("text", "expected"), [("32MiB", 32 << 20), ("33554432", 32 << 20), ("4GB", 4 * 10**9)])
def test_a_part_size_is_taken_with_its_unit(monkeypatch, text, expected):
    monkeypatch.setenv("MERGE_PIPELINE_PART_BYTES", text)
    assert settings.PART_BYTES.value() == expected


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("MERGE_PIPELINE_PART_BYTES", "junk", "expected a size in bytes (33554432, 32MiB, 64MB) from 5MiB to 5GiB"),
        ("MERGE_PIPELINE_PART_BYTES", "1KB", "expected a size in bytes (33554432, 32MiB, 64MB) from 5MiB to 5GiB"),
        ("MERGE_PIPELINE_PARALLEL_UPLOADS", "1e300", "expected a whole number of files >= 1 and <= 64"),
        ("MERGE_PIPELINE_LIST_PAGE_KEYS", "2.5", "expected a whole number of keys >= 1 and <= 1000"),
        ("MERGE_PIPELINE_HUB_TIMEOUT", "1e300", "expected a finite number of seconds > 0 and <= 86400"),
        ("MERGE_PIPELINE_DIST_TIMEOUT", "nan", "expected a finite number of seconds > 0 and <= 604800"),
    ],
)
def test_junk_or_a_huge_value_is_one_line_naming_the_variable(monkeypatch, variable, value, expected):
    [read] = [v for v in VARIABLES if v.variable == variable]
    monkeypatch.setenv(variable, value)
    with pytest.raises(MergeError) as refused:
        read.value()
    assert str(refused.value) == f"{variable} is {value!r}: {expected}"


@pytest.mark.parametrize("read", VARIABLES, ids=lambda v: v.variable)
def test_every_default_passes_its_own_check(monkeypatch, read):
    monkeypatch.delenv(read.variable, raising=False)
    read.value()


def test_a_huge_hub_timeout_is_refused_before_any_work(monkeypatch):
    """Before: 1e300 passed the check and overflowed in the upload."""
    monkeypatch.setenv("MERGE_PIPELINE_HUB_TIMEOUT", "1e300")
    with pytest.raises(MergeError) as refused:
        check_upload_settings("org/model", None, None)
    assert (
        str(refused.value)
        == "MERGE_PIPELINE_HUB_TIMEOUT is '1e300': expected a finite number of seconds > 0 and <= 86400"
    )


def test_weights_whose_sum_overflows_are_one_line(capsys, tmp_path):
    """Before: an OverflowError traceback from the sum."""
    code, _, err = run_cli(
        capsys,
        "average",
        "--inputs",
        tmp_path / "a",
        tmp_path / "b",
        "--weights",
        "1e308",
        "1e308",
        "--target_dir",
        tmp_path / "out",
    )
    assert code == 1 and error_lines(err) == [
        "error: --weights [1e+308, 1e+308]: their sum overflows: scale them down (only their ratios count)"
    ]


@pytest.mark.parametrize("value", ["32MiB", "junk"])
def test_a_command_that_uploads_nothing_runs_whatever_the_upload_settings(fsdp_checkpoint, value):
    """``inspect`` of a local folder reads no store setting: it runs with junk in one (before: int() at
    import failed every command with a traceback, 32MiB included)."""
    role_dir = fsdp_checkpoint(FsdpSpec()).role_dir
    done = subprocess.run(
        [sys.executable, "-m", "merge_pipeline", "inspect", str(role_dir)],
        env={"PATH": "/usr/bin:/bin", "MERGE_PIPELINE_PART_BYTES": value, "MERGE_PIPELINE_PREFETCH_BYTES": value},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


PACKAGE = Path(settings.__file__).parent


def _environment_reads(tree: ast.AST) -> list[ast.AST]:
    """``os.environ.get(...)``, ``os.environ[...]``, ``os.getenv(...)`` and ``... in os.environ`` of a module."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    return [
        node
        for node in ast.walk(tree)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "getenv"))
        and (is_environ(node.func.value) or node.func.attr == "getenv")
        or isinstance(node, ast.Subscript)
        and is_environ(node.value)
    ]


def test_every_knob_variable_is_read_in_one_module():
    """A setting's variable is read by ``Setting.value`` only: the engine's, the CLI's and the code location's
    alike, so each is checked the one way (one line naming it) wherever it is used."""
    readers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in _environment_reads(ast.parse(path.read_text())):
            text = ast.unparse(node)
            if "MERGE_PIPELINE_" in text or ".variable" in text:
                readers.add(str(path.relative_to(PACKAGE)))
    assert readers == {"settings.py"}


def test_no_setting_is_looked_up_by_its_name():
    """Settings are read through their records (``settings.value(OUTPUT_ROOT)``), typed, never by a string a
    typo turns into a KeyError at run time."""
    by_name = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "value"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ]
    assert by_name == []
