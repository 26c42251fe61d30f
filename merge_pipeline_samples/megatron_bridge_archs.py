"""verl Megatron checkpoints of many architectures, each built through Megatron-Bridge 0.6 itself: run with
the bridge venv's python.

    .venv-bridge/bin/python merge_pipeline_samples/megatron_bridge_archs.py OUT ARCHITECTURE...

For each HF architecture (a name Megatron-Bridge registers; ``<architecture>+<variant>`` for another form of one,
``Gemma4ForCausalLM+moe``: ``megatron_bridge_save._hf_config``): rank 0 saves a tiny transformers model of
it (its config class, ``AutoConfig.for_model``, with the small sizes below) into ``OUT/<arch>/hf/``; two
gloo ranks load it with ``AutoBridge.from_hf_pretrained`` and the bridge's own model provider, tensor
parallel 2 and, where the bridge's provider has experts, expert parallel 2 (expert tensor parallel 1), and save what
verl saves with the bridge and ``use_dist_checkpointing=True``: ``dist_checkpointing.save`` of the
model's ``sharded_state_dict`` into ``OUT/<arch>/actor/model/dist_ckpt/``. Rank 0 writes the bridge's
``export_hf_weights`` of the same model as ``OUT/<arch>/expected/model.safetensors``: the reference;
``OUT/<arch>/layout.txt`` says the parallel layout (``TP=2`` or ``TP=2, EP=2``).

The bridge's own layer spec is built: TransformerEngine's, through the CPU stand-in ``scripts/setup_bridge.sh``
installs in ``.venv-bridge`` (``merge_pipeline_samples/te_stand_in/``, whose docstring says what it stands in and
how it was checked against TE's source), so the shards carry the names verl's GPU runs save
(``linear_qkv.layer_norm_weight``, grouped ``experts.linear_fc1.weight<N>``). megatron-core's Mamba mixer (Nemotron-H,
Falcon-H1) builds through the mamba-ssm stand-in installed likewise (``merge_pipeline_samples/mamba_stand_in/``: its
gated norm's parameters, its kernels named only). TransformerEngine's fused MoE
permutation and router kernels are turned off (the stand-in has none); saving runs no forward. Gated DeltaNet layers
(Qwen3-Next, Qwen3.5), which megatron-core refuses to build without flash-linear-attention, are built with the real
one: its core (``fla-core``, Triton kernels in pure Python, which import on CPU) is installed in ``.venv-bridge``,
nothing stood in; none of its kernels runs. The writer itself is
``megatron_bridge_save._save``. With ``--each`` every architecture gets ranks of its own and one that fails is
recorded in ``OUT/<arch>/failed.txt`` (its error, one line) while the writer goes on: how the refusals in
``merge_pipeline/families.py`` were found.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.multiprocessing as mp

# Run as a script, its own folder comes first on the path, where megatron.py would hide megatron-core.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from merge_pipeline_samples.gloo_ranks import spawn_gloo_ranks  # noqa: E402  (after its path)
from merge_pipeline_samples.megatron_bridge_save import _patch_for_cpu, _release, _save  # noqa: E402


def _save_all(rank: int, world_size: int, out: str, architectures: list[str]) -> None:
    _patch_for_cpu()
    for architecture in architectures:
        # megatron-core records each model's attention backend in TransformerEngine's environment variables and
        # refuses a model of another backend in the same process: each architecture starts without them.
        for variable in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(variable, None)
        _bridge, model = _save(rank, Path(out) / architecture, architecture, world_size, local_spec=False)
        _release(model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("architectures", nargs="+")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--each",
        action="store_true",
        help="ranks of their own per architecture; one that fails is recorded in OUT/<arch>/failed.txt",
    )
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.each:  # one set of ranks for all: any failure fails the run
        spawn_gloo_ranks(_save_all, (str(args.out_dir), args.architectures), args.world_size)
        return
    import transformers

    for architecture in args.architectures:
        folder = args.out_dir / architecture
        if not hasattr(transformers, architecture.partition("+")[0]):  # no model to build it from: no ranks needed
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "failed.txt").write_text(
                f"transformers {transformers.__version__} does not ship {architecture}\n"
            )
            continue
        try:
            spawn_gloo_ranks(_save_all, (str(args.out_dir), [architecture]), args.world_size)
        except (
            mp.ProcessRaisedException,
            mp.ProcessExitedException,
        ) as exc:  # a rank's traceback (the error, then where it was raised) or its exit
            lines = str(exc).strip().splitlines()
            frames = [line.strip() for line in lines if line.strip().startswith("File ")]
            error = f"{lines[-1]} ({frames[-1].split('site-packages/')[-1]})" if frames else lines[-1]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "failed.txt").write_text(error + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
