"""llm-compressor's ``model_free_ptq`` on a bf16 HF folder, once per scheme: run with ``.venv-llmcompressor``'s python
(``scripts/setup_llmcompressor.sh``), the reference ``--quantize`` is compared with byte for byte.

    .venv-llmcompressor/bin/python merge_pipeline_samples/model_free_ptq.py OUT BF16_FOLDER IGNORE_JSON SCHEME...

writes ``OUT/<SCHEME>/`` for each scheme, on the CPU, with the ``ignore`` list given (a JSON list). A SCHEME
ending in ``.json`` is a file holding a base model's ``quantization_config``: written to ``OUT/<its stem>/`` from
that config (its own groups and ignore list), as ``--quantize as-base`` is compared with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from compressed_tensors.quantization import QuantizationConfig
from llmcompressor import model_free_ptq

if __name__ == "__main__":
    out, folder, ignore, *schemes = sys.argv[1:]
    for scheme in schemes:
        if scheme.endswith(".json"):
            config = QuantizationConfig.model_validate(json.loads(Path(scheme).read_text()))
            model_free_ptq(folder, Path(out) / Path(scheme).stem, config=config, device="cpu")
        else:
            model_free_ptq(folder, Path(out) / scheme, scheme=scheme, ignore=json.loads(ignore), device="cpu")
