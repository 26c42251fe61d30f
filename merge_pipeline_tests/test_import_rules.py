"""The package's arrows point one way: every import, function-level ones included, read with ast.

Layers, lowest first: shared leaves (errors, files, options, the plan types) < ``hf`` (the Hugging Face
folder format) < ``formats`` (readers, one package per format beside the helpers they share) and ``engine``
(the writer), which know nothing of each other < ``pipeline`` (the one package using both) and ``workers``
(who writes the weights: in process, torchrun, Ray; the sequence and its workers import each other's modules,
never in a cycle) < ``hub`` < ``cli`` and ``dagster``. Only ``workers`` starts Ray or torch.distributed.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "merge_pipeline"

# Layer of each top-level part of the package; an import may only go to the same layer or a lower one.
LAYERS = {
    "__init__": 0,
    "errors": 0,
    "files": 0,
    "options": 0,
    "progress": 0,
    "plan": 0,
    "ray_settings": 0,
    "settings": 0,
    "checkpoint_name": 0,
    "store": 0,
    "webserver": 0,
    "hf": 1,
    "families": 1,
    "formats": 2,
    "engine": 2,
    "pipeline": 3,
    "workers": 3,
    "hub": 4,
    "watch": 4,
    "cli": 5,
    "defs": 5,
    "dagster": 5,
    "definitions": 5,
    "__main__": 6,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports anywhere in its body (``from a import b`` counts a.b if a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            )
    return found


# The one import that goes up: ``merge_pipeline.MergeCheckpoints``, the Dagster component's type name
# in a user's defs.yaml, is resolved by a PEP 562 ``__getattr__`` on first access only, so
# ``import merge_pipeline`` (the CLI) loads nothing of defs or dagster (test_the_package_import_stays_light).
LAZY_EXPORTS = {("merge_pipeline", "merge_pipeline.dagster.component")}


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {
        name: {m for m in imports_of(path, modules) if m in modules and m != name and (name, m) not in LAZY_EXPORTS}
        for name, path in modules.items()
    }


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


# The watching side's questions, answered by the readers' registry and defined there: which folders are step
# folders, whether one holds a save itself, whether a save is complete (``formats``), the answer's type and a
# step's age (``formats.step_folders``). Dagster imports them where they are defined; no reader, no writer.
STEP_FOLDER_QUESTIONS = {"merge_pipeline.formats", "merge_pipeline.formats.step_folders"}


def violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for importer, imported in sorted(edges.items()):
        for target in sorted(imported):
            a, b = part(importer), part(target)
            if LAYERS[b] > LAYERS[a]:
                found.append(f"upward: {importer} -> {target}")
            if a in ("engine", "formats") and b in ("pipeline", "workers", "cli", "dagster", "definitions", "hub"):
                found.append(f"{a} imports {b}: {importer} -> {target}")
            if {a, b} == {"engine", "formats"}:
                found.append(f"engine and formats are independent: {importer} -> {target}")
            if (
                a in ("cli", "dagster", "definitions")
                and b in ("formats", "engine")
                and target not in STEP_FOLDER_QUESTIONS
            ):
                found.append(f"{a} must go through pipeline: {importer} -> {target}")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def test_every_part_of_the_package_has_a_layer() -> None:
    assert sorted({part(m) for m in all_modules()} - LAYERS.keys()) == []


def test_imports_point_down_and_through_pipeline() -> None:
    assert violations(graph()) == []


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def third_party_importers(library: str) -> set[str]:
    """The package's modules that import ``library`` (or one of its modules) anywhere in their body."""
    return {
        name
        for name, path in all_modules().items()
        if any(m == library or m.startswith(f"{library}.") for m in imports_of(path, {}))
    }


def test_ray_and_dagster_are_imported_by_their_own_rooms_only() -> None:
    """The engine, the formats and the merge sequence run without Ray or Dagster installed: Ray is the Ray
    launcher's (and its head probe's, which reads Ray's gRPC stubs), Dagster the code location's (``dagster/`` and the location's ``definitions``)."""
    assert third_party_importers("ray") == {"merge_pipeline.workers.ray_tasks", "merge_pipeline.workers.ray_probe"}
    dagster_rooms = {part(m) for m in third_party_importers("dagster") | third_party_importers("dagster_pipes")}
    assert dagster_rooms == {"dagster", "definitions"}


# A format is a package of ``formats`` (its reader and its own helpers); the helpers several formats share sit
# at the top. Nothing enters a format's package from outside it but the registry (by name, not by import),
# except the hf reader's planning of an HF folder: Megatron's bridge export and a LoRA-only base model are one.
FORMAT_CROSSINGS = {
    ("merge_pipeline.formats.megatron.reader", "merge_pipeline.formats.safetensors_folder.reader"),
    ("merge_pipeline.formats.base_model", "merge_pipeline.formats.safetensors_folder.reader"),
}


def format_package(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "formats" else None


def test_a_format_package_is_entered_only_from_itself() -> None:
    crossings = {
        (importer, target)
        for importer, imported in graph().items()
        for target in imported
        if format_package(target) and format_package(target) != format_package(importer)
    }
    assert crossings == FORMAT_CROSSINGS


def private_imports() -> set[tuple[str, str]]:
    """(importer, name) for each private name (``_x``) a module of the package imports from another."""
    found = set()
    for name, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("merge_pipeline"):
                found.update(
                    (name, f"{node.module}.{a.name}")
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                )
    return found


# A module's private names are its own: what two modules share is public in one of them (the Hub's
# endpoint, token, timeout and error rules: hub/connection.py). These are left to be made public.
PRIVATE_IMPORTS_LEFT = {
    ("merge_pipeline.engine.averaging", "merge_pipeline.engine.outputs._split_shards"),
    ("merge_pipeline.hf.quantization", "merge_pipeline.hf.fp8._KEPT_NAMES"),
    ("merge_pipeline.hf.quantization", "merge_pipeline.hf.fp8._tower"),
}


def test_no_module_imports_another_modules_private_names() -> None:
    assert sorted(private_imports() - PRIVATE_IMPORTS_LEFT) == []


# The Dagster side's rooms: the location is this project's definitions folder, which names the
# component by its type in defs.yaml; the component (dagster/component.py) is the one module that puts the
# definition modules together; what several of them share sits below them (keys, settings, names).
DEFINITION_MODULES = {f"merge_pipeline.dagster.{m}" for m in ("assets", "report", "hub_model")}
SHARED_BELOW = {
    "merge_pipeline.watch.keys",
    "merge_pipeline.watch.location_settings",
    "merge_pipeline.dagster.instance_names",
}


def test_the_dagster_side_keeps_its_rooms() -> None:
    edges = graph()
    assert edges["merge_pipeline.definitions"] == {"merge_pipeline.defs"}  # the defs folder, never the component
    assert {m for m, imported in edges.items() if imported & DEFINITION_MODULES} == {"merge_pipeline.dagster.component"}
    assert {m: edges[m] & DEFINITION_MODULES for m in SHARED_BELOW} == {m: set() for m in SHARED_BELOW}
    assert edges["merge_pipeline.watch.keys"] == set()  # plain names: importable by every module


def test_every_dagster_module_imports_dagster() -> None:
    """``dagster/`` is the glue: what runs without Dagster (watching roots, settings, the webserver client)
    lives in plain modules that the CLI can import without climbing above the code location."""
    glue = {name for name in all_modules() if name.startswith("merge_pipeline.dagster.")}
    assert sorted(glue - third_party_importers("dagster") - third_party_importers("dagster_pipes")) == []


@pytest.mark.slow  # imports every Dagster module, torch with them
def test_no_module_builds_a_definition_when_imported() -> None:
    """Definitions are built by the component, for its prefix, when a location loads: a module-level copy
    (once the unprefixed instance, for tests) would be one more thing built at import and kept in step."""
    import dagster as dg

    kinds = (dg.AssetsDefinition, dg.AssetSpec, dg.SensorDefinition, dg.ScheduleDefinition, dg.JobDefinition)
    built = [
        f"{name}.{attribute}"
        for name in all_modules()
        if name.startswith("merge_pipeline.dagster")
        for attribute, value in vars(importlib.import_module(name)).items()
        if isinstance(value, kinds)
    ]
    assert built == []


# A run launcher implements Dagster's RunLauncher interface, whose health-check result types exist only
# there (Dagster's own launchers, dagster-docker and dagster-k8s, import them from the same module).
RUN_LAUNCHER_TYPES = {"dagster._core.launcher"}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_dagster_api(path: Path) -> None:
    private = [
        name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        if name.startswith("dagster._") or name.startswith("dagster_pipes._")
    ]
    allowed = RUN_LAUNCHER_TYPES if path.parent.name == "dagster" and path.name == "run_launcher.py" else set()
    assert [name for name in private if name not in allowed] == []


def test_the_package_import_stays_light() -> None:
    code = "import sys, merge_pipeline; print(sorted(m for m in ('dagster', 'torch', 'ray', 'merge_pipeline.dagster') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == "[]"
    assert "MergeCheckpoints" in dir(importlib.import_module("merge_pipeline"))  # dg's registry lists it


def test_the_product_never_imports_the_sample_writers() -> None:
    """merge_pipeline_samples stays in the repo (the demo, tests and benchmarks write checkpoints with it): the
    wheel does not ship it, so nothing in the package may need it."""
    found = {
        name
        for name, path in all_modules().items()
        for m in imports_of(path, {})
        if m.startswith("merge_pipeline_samples")
    }
    assert found == set()


@pytest.mark.slow
def test_the_wheel_ships_the_product_only(tmp_path) -> None:
    from merge_pipeline_tests.dagster.services import clean_copy  # the repo's files, not its build/ leftovers

    source = tmp_path / "src"
    clean_copy(source)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, "."]
    subprocess.run(build, check=True, capture_output=True, timeout=300, cwd=source)  # setuptools builds in the cwd
    names = zipfile.ZipFile(next(tmp_path.glob("merge_pipeline-*.whl"))).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"merge_pipeline"}
    assert "merge_pipeline/dagster/run_launcher.py" in names and "merge_pipeline/pipeline/merge.py" in names
