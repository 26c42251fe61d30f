"""The blocking checks' imports (transformers, the model's modeling module) run on their own thread
while the weights are written, not on the main thread after the last byte (issue 19: a fixed cost
every merge paid at its end). A fresh interpreter is needed: this one has imported them already.
"""

from __future__ import annotations

import json
import subprocess
import sys

from merge_pipeline_samples.fsdp import FsdpSpec

# Records which thread first looks for each module (import statements and importlib.import_module,
# which transformers' lazy attributes use, alike), then runs the CLI as ``python -m merge_pipeline`` would.
_RECORDING_CLI = """
import json, sys, threading
loaded = {}
class Record:
    def find_spec(self, name, path=None, target=None):
        loaded.setdefault(name, threading.current_thread().name)
sys.meta_path.insert(0, Record())
from merge_pipeline.cli import main
try:
    main(sys.argv[1:])
finally:
    print(json.dumps(loaded))
"""


def test_the_checks_modules_are_imported_on_their_thread_while_the_weights_are_written(tmp_path, fsdp_checkpoint):
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
    assert (target / "model.safetensors").is_file()
    assert loaded["merge_pipeline.hf.folder_checks"] == "check-imports"
    assert loaded["transformers.models.qwen2.modeling_qwen2"] == "check-imports"  # the config names Qwen2ForCausalLM
    assert loaded["transformers.conversion_mapping"] == "check-imports"
