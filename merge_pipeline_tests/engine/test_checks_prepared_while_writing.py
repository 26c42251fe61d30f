"""The blocking checks that need transformers run in a worker process started as the weights start
being written (a thread of the merging process did it before, holding the GIL its writer
needs): the merging process itself never imports transformers or ``hf.folder_checks`` for a FSDP
merge, and the checks still ran and passed. A fresh interpreter is needed: this one has imported them.
"""

from __future__ import annotations

import json
import subprocess
import sys

from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_samples.fsdp import FsdpSpec

# Records every module the merging process looks for (import statements and importlib.import_module,
# which transformers' lazy attributes use, alike), then runs the CLI as ``python -m merge_pipeline`` would.
_RECORDING_CLI = """
import json, sys
loaded = set()
class Record:
    def find_spec(self, name, path=None, target=None):
        loaded.add(name)
sys.meta_path.insert(0, Record())
from merge_pipeline.cli import main
try:
    main(sys.argv[1:])
finally:
    print(json.dumps(sorted(loaded)))
"""


def test_the_merging_process_imports_no_transformers_and_the_worker_runs_the_checks(tmp_path, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(FsdpSpec(world_size=2, with_optimizer=False)).role_dir
    target = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", _RECORDING_CLI, "merge", "--local_dir", str(role_dir), "--target_dir", str(target)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m.split(".")[0] in ("transformers", "peft")] == []
    assert "merge_pipeline.hf.folder_checks" not in loaded  # what runs the checks: imported in the worker only
    assert f"blocking checks passed ({', '.join(CHECK_NAMES)})" in done.stderr
    assert "running them in this process" not in done.stderr
    assert json.loads((target / MANIFEST).read_text())["checks_before_publishing"] == CHECK_NAMES
