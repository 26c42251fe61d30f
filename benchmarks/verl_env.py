"""A separate virtual environment with verl's model merger, for side-by-side runs.

verl is installed from the package index *without* its dependencies (they include ray[default],
wandb, datasets, vllm-era pins, ...). The environment reuses this project's torch through a
``.pth`` file pointing at our site-packages, and gets only the packages ``verl.model_merger``
imports, at the versions verl itself declares:

* ``ray``, ``tensordict``: imported by ``verl/protocol.py``, which ``verl/__init__.py`` imports;
* ``omegaconf``: imported by ``verl/utils/config.py`` (verl gets it through hydra-core);
* ``transformers``: verl pins ``<5.11``; ours is newer, so verl's own pin goes in its venv, ahead
  of ours on ``sys.path``;
* ``codetiming``: imported by the Megatron merger only (``verl/utils/profiler/performance.py``).

Nothing in verl is patched. verl 0.9.1's *Megatron* merger cannot run on a CPU-only machine: with no
accelerator it falls back to the CUDA platform and calls ``init_process_group("nccl")`` ("Distributed
package doesn't have NCCL built in"); the benchmark records that failure instead of a figure. It also
expects the "v2" layout (``actor/model/dist_ckpt``, ``actor/model/huggingface``), which
``verl_layout`` presents with symlinks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from benchmarks.checkpoints import REPO_ROOT

DEFAULT_VENV = REPO_ROOT / "benchmarks" / ".verl-venv"
DEFAULT_VERL = "0.9.1"
MERGER_IMPORTS = ("ray", "tensordict", "omegaconf", "transformers", "codetiming")
# Found through our site-packages otherwise, in a release verl's transformers does not know: transformers
# 5.10 imports `kernels` whenever it is installed, and kernels 0.19 (ours, for transformers 5.25) refuses
# the layer repositories 5.10 declares ("Either a revision or a version must be specified"). The venv gets
# the release that transformers declares for itself (its extra of the same name).
TRANSFORMERS_COMPANIONS = ("kernels",)
_MARKER = ".merge-pipeline-bench.json"


def verl_python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


def ensure_verl_venv(venv: Path = DEFAULT_VENV, verl_version: str = DEFAULT_VERL, *, log=print) -> Path:
    """The venv's python, after creating the venv if it is missing or was made for another verl."""
    venv = Path(venv).absolute()
    marker = venv / _MARKER
    wanted = {
        "verl": verl_version,
        "imports": list(MERGER_IMPORTS),
        "companions": list(TRANSFORMERS_COMPANIONS),
        "host_site": _our_site_packages(),
    }
    if marker.is_file() and json.loads(marker.read_text()) == wanted and verl_python(venv).exists():
        return verl_python(venv)
    log(f"creating {venv} with verl=={verl_version} (no dependencies) + {', '.join(MERGER_IMPORTS)} ...")
    subprocess.run([sys._base_executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = verl_python(venv)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "_merge_pipeline_host.pth").write_text(_our_site_packages() + "\n")  # our torch, appended after its own
    _pip(python, "install", "--no-deps", f"verl=={verl_version}")
    requires = json.loads(
        _run(python, "-c", "import importlib.metadata as m, json; print(json.dumps(m.requires('verl')))")
    )
    _pip(python, "install", *_pinned(MERGER_IMPORTS, requires))
    declared_by_transformers = json.loads(
        _run(python, "-c", "import importlib.metadata as m, json; print(json.dumps(m.requires('transformers')))")
    )
    _pip(python, "install", *_pinned(TRANSFORMERS_COMPANIONS, declared_by_transformers, extras=True))
    # verl, its FSDP merger and the model code it loads: fails loudly if short of a package or at odds with one
    _run(python, "-c", "import verl.model_merger.fsdp_model_merger, transformers.models.llama.modeling_llama")
    marker.write_text(json.dumps(wanted, indent=2))
    return python


def _pinned(names: tuple[str, ...], requires: list[str], *, extras: bool = False) -> list[str]:
    """Each name with the version specifier the package declares for it (``extras``: also in an extra)."""
    from packaging.requirements import Requirement

    declared = {}
    for line in requires or []:
        req = Requirement(line)
        if extras or req.marker is None or "extra" not in str(req.marker):
            declared.setdefault(req.name.lower(), str(req.specifier))
    return [f"{name}{declared.get(name, '')}" for name in names]


def _our_site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _pip(python: Path, *args: str) -> None:
    _run(python, "-m", "pip", "--disable-pip-version-check", "-q", *args)


def _run(python: Path, *args: str) -> str:
    done = subprocess.run([str(python), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{python} {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return done.stdout


def verl_layout(role_dir: Path, scratch: Path) -> Path:
    """A view of a Megatron role folder in verl 0.9's v2 layout (symlinks only; nothing is copied)."""
    view = Path(scratch) / "verl-layout" / Path(role_dir).name
    if view.parent.exists():
        shutil.rmtree(view.parent)
    (view / "model").mkdir(parents=True)
    for name in ("dist_ckpt", "huggingface"):
        (view / "model" / name).symlink_to(Path(role_dir).absolute() / name)
    for extra in Path(role_dir).iterdir():
        if extra.is_file():
            (view / extra.name).symlink_to(extra.absolute())
    return view


def verl_merge_command(python: Path, backend: str, role_dir: Path, target_dir: Path) -> list[str]:
    return [
        str(python),
        "-m",
        "verl.model_merger",
        "merge",
        "--backend",
        backend,
        "--local_dir",
        str(role_dir),
        "--target_dir",
        str(target_dir),
    ]


def verl_import_command(python: Path) -> list[str]:
    """An interpreter that imports what verl's FSDP merger imports, and nothing else."""
    return [str(python), "-c", "import verl.model_merger.fsdp_model_merger"]
