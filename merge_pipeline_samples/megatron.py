"""Sample Megatron-Core role folders laid out the way verl writes them, with reference weights.

    <out>/<variant>/actor/dist_ckpt/          torch_dist DCP: metadata.json, common.pt, .metadata, *.distcp
    <out>/<variant>/actor/transformer_config.json
    <out>/<variant>/actor/huggingface/        config.json (+ tokenizer), or HF safetensors weights
    <out>/<variant>/reference/                model.safetensors + config.json: what a merge must produce
    <out>/<variant>/megatron_logits.pt        megatron-core's own forward on ``sample_tokens()``

That is verl's legacy layout (schema v1). ``layout="v2"`` writes what verl 0.9 writes instead
(``ckpt_contents.json``, ``model/dist_ckpt/``, ``model/huggingface/``, ``optimizer/``, ``extra/``): with
``use_dist_checkpointing`` (megatron-core shards, and then no HF files in the checkpoint at all: the
config and tokenizer are in ``<out>/<variant>/hf_model/``, the trainer's original model folder), or
with the bridge for ``hf_weights`` variants. ``arrange_v2`` copies a v1 sample into any v2 mode.
``layout="megatron_lm"`` writes what Megatron-LM's ``save_checkpoint`` writes (``megatron_worker``'s
``_save_as_megatron_lm``): ``<out>/<variant>/save/iter_0000100/`` and the tracker
``save/latest_checkpointed_iteration.txt``; the HF config and tokenizer are in ``hf_model/``.

Most variants are written by megatron-core itself (``megatron_worker``, two ranks under torchrun, gloo,
CPU), DeepSeek-V3's multi-latent attention and multi-token prediction included (local layer spec;
its core attention is megatron-core's own, given the value width that only TransformerEngine's takes).
Layouts it cannot write on CPU are written with ``torch.distributed.checkpoint.save`` directly, with
the key names and shapes of the real format: the TransformerEngine spec's names for MLA (norms fused
into the linears), vision-language models, and the HF-safetensors layout.

Every stored tensor gets values that depend only on its checkpoint key (``global_values``). The
reference is built from those whole tensors by ``reference_weights``, a separate, deliberately
plain transcription of the mapping ``formats/megatron/names.py`` describes, so a reader bug cannot hide in shared code.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from merge_pipeline.families import FAMILIES, Family

_TINY = dict(
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    ffn=96,
    vocab=128,
    experts=4,
    experts_per_token=2,
    moe_ffn=32,
    shared_ffn=48,
    norm_eps=1e-6,
    rope_theta=10000.0,
    max_positions=64,
)
SIZE_PRESETS = {
    "tiny": _TINY,
    # ~247M parameters: the benchmark model (benchmarks/megatron_probe.py).
    "250m": {
        **_TINY,
        "layers": 12,
        "hidden": 1024,
        "heads": 16,
        "kv_heads": 16,
        "head_dim": 64,
        "ffn": 3584,
        "vocab": 32000,
    },
    # ~1.1B parameters, TinyLlama's shapes: the benchmark's 1B Megatron model.
    "1b": {
        **_TINY,
        "layers": 22,
        "hidden": 2048,
        "heads": 32,
        "kv_heads": 4,
        "head_dim": 64,
        "ffn": 5632,
        "vocab": 32000,
    },
    # TP=8 x PP=8 (megatron_fake_pg): heads, query groups, widths and vocab divisible by 8, two layers per stage.
    "tiny_tp8_pp8": {**_TINY, "layers": 16, "heads": 8, "kv_heads": 8, "head_dim": 8, "ffn": 128},
    "tiny_8_experts": {**_TINY, "experts": 8},  # EP=8
    # Many small experts (the benchmark's MoE at EP=8): megatron saves one chunk per layer and expert.
    "tiny_128_experts": {**_TINY, "layers": 16, "experts": 128},
    # ~258M parameters in 16 layers (PP=8 needs the layers divisible by 8): the at-scale benchmark model.
    "250m_16_layers": {
        **_TINY,
        "layers": 16,
        "hidden": 1024,
        "heads": 16,
        "kv_heads": 16,
        "head_dim": 64,
        "ffn": 2560,
        "vocab": 32000,
    },
    # Qwen2-MoE with shared_expert_intermediate_size 0: megatron-core builds no shared expert.
    "tiny_no_shared_expert": {**_TINY, "shared_ffn": 0},
}
# DeepSeek-V3 (multi-latent attention): layer 0 dense, layer 1 MoE (and so are multi-token-prediction layers).
MLA_SIZES = dict(layers=2, q_lora_rank=48, kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16, shared_experts=1)
# Sigmoid routers (DeepSeek-V3, GLM-4.5): the routed experts' weights scaled by routed_scaling_factor.
ROUTED_SCALING = 2.5
GLM_ROTARY_FRACTION = 0.5  # GLM-4.5's partial_rotary_factor: rotary on the first half of each head
SWIGLU_LIMIT = 7.0  # gpt-oss: gate and up clamped to this before its activation
# Qwen2.5-VL vision tower.
VISION_SIZES = dict(depth=2, hidden=32, heads=2, ffn=48, patch=14, temporal_patch=2, merge=2)


@dataclass(frozen=True)
class Variant:
    name: str
    family: str  # a key of families.FAMILIES: the model's names and layout
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages: each PP rank holds this many chunks of layers, saved as model0, model1, ...
    ep: int = 1
    tied: bool = False
    value_model: bool = False
    per_layer_keys: bool = False  # singleton_local_shards: decoder.layers.<i>.…, fc1 as weight_w / weight_v
    dtype: str = "float32"
    logits: bool = False  # record megatron-core's forward pass (TP/EP only: PP needs a schedule)
    hf_weights: bool = False  # verl's default: weights as HF safetensors, dist_ckpt without model tensors
    size: str = "tiny"  # a key of SIZE_PRESETS
    te_spec: bool = False  # key names of the TransformerEngine layer spec, which megatron-core cannot run on CPU
    mtp_layers: int = 0  # DeepSeek-V3 multi-token-prediction modules (megatron-core's mtp_num_layers)
    seed: int = 0  # another seed: other values for every key (several "steps" of one model, to average)

    @property
    def sizes(self) -> dict:
        return SIZE_PRESETS[self.size]

    @property
    def record(self) -> Family:
        return FAMILIES[self.family]

    @property
    def handmade(self) -> bool:
        # megatron-core cannot write a vision-language model on CPU
        return self.record.vision_prefix is not None or self.te_spec or self.hf_weights

    @property
    def num_layers(self) -> int:
        return MLA_SIZES["layers"] if self.record.latent_attention else self.sizes["layers"]


VARIANTS = {
    v.name: v
    for v in (
        Variant("qwen2_tp2", "qwen2", tp=2, logits=True),
        Variant("qwen3_tp2", "qwen3", tp=2, logits=True),
        Variant("llama_tied_pp2", "llama", pp=2, tied=True, dtype="bfloat16"),
        Variant("qwen2_pp2_vpp2", "qwen2", pp=2, vpp=2),  # 4 layers: rank 0 holds layers 0 and 2, rank 1 1 and 3
        Variant("qwen2_moe_ep2", "qwen2_moe", ep=2, logits=True),
        Variant("qwen3_moe_tp2_per_layer", "qwen3_moe", tp=2, per_layer_keys=True, logits=True),
        Variant("qwen2_value", "qwen2", value_model=True),
        Variant("deepseek_v3_mla", "deepseek_v3", te_spec=True),
        Variant("deepseek_v3_mtp", "deepseek_v3", ep=2, mtp_layers=1, logits=True),
        Variant("mixtral_ep2", "mixtral", ep=2, logits=True),
        Variant("qwen2_5_vl", "qwen2_5_vl"),
        Variant("qwen2_hf_weights", "qwen2", hf_weights=True),
        Variant("qwen2_moe_no_shared_expert", "qwen2_moe", logits=True, size="tiny_no_shared_expert"),
        Variant("glm4_moe_mtp", "glm4_moe", ep=2, mtp_layers=1, logits=True),
        Variant("gpt_oss_ep2", "gpt_oss", ep=2, logits=True),
        Variant("gpt_oss_tp2_per_layer", "gpt_oss", tp=2, per_layer_keys=True, logits=True),
    )
}


@dataclass(frozen=True)
class MegatronSample:
    variant: Variant
    role_dir: Path
    reference_dir: Path
    original_dir: Path | None = None  # the trainer's model.path (config, tokenizer), when the checkpoint has none

    @property
    def logits_path(self) -> Path:
        return self.role_dir.parent / "megatron_logits.pt"


def global_values(key: str, shape: Iterable[int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The whole tensor stored under ``key``: seeded by the key alone (and the variant's seed), so every rank agrees."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()) + (seed << 32))
    values = torch.randn(tuple(shape), generator=generator)
    values = 1.0 + 0.1 * values if re.search(r"norm", key) else 0.1 * values
    return values.to(dtype)


def sample_tokens() -> torch.Tensor:
    return torch.tensor([3, 17, 42, 5, 99, 64, 7, 120, 33, 8, 71, 2])


def write_megatron_samples(
    root: Path, variants: Iterable[Variant], *, timeout: float = 600, layout: str = "v1"
) -> dict[str, MegatronSample]:
    """Write each variant under ``root/<name>``; megatron-core variants share one torchrun job."""
    variants = list(variants)
    role = "save" if layout == "megatron_lm" else "actor"
    samples = {v.name: MegatronSample(v, root / v.name / role, root / v.name / "reference") for v in variants}
    dist_dirs = {v.name: _dist_dir(samples[v.name].role_dir, v, layout) for v in variants}
    written = [v for v in variants if not v.handmade]
    if written:
        _run_megatron_job(root, {v: dist_dirs[v.name] for v in written}, timeout, layout)
    for v in variants:
        sample = samples[v.name]
        full = _handmade_weights(v) if v.handmade else _gathered_weights(root / v.name)
        if v.handmade:
            _write_handmade(v, dist_dirs[v.name], full)
        config = _hf_config(v)
        if layout == "v1":
            hf_dir = sample.role_dir / "huggingface"
        elif v.hf_weights:
            hf_dir = sample.role_dir / "model" / "huggingface"
        else:  # use_dist_checkpointing without hf_model: verl writes no HF files into the checkpoint
            hf_dir = root / v.name / "hf_model"
            samples[v.name] = replace(sample, original_dir=hf_dir)
        config.save_pretrained(hf_dir)
        if v.family == "qwen2":
            from merge_pipeline_samples.tokenizer import write_tokenizer

            write_tokenizer(hf_dir, vocab_size=v.sizes["vocab"])
        reference = reference_weights(full, v)
        _write_reference(sample.reference_dir, config, reference, v)
        if layout == "v1":
            if v.hf_weights:
                _write_hf_weights(hf_dir, reference)
            continue
        if v.hf_weights:
            write_bridge_weights(sample.reference_dir, hf_dir)
        if layout == "v2":
            _finish_v2(sample.role_dir, "bridge" if v.hf_weights else "dist", v)
    return samples


MEGATRON_LM_ITERATION = 100  # the iteration the Megatron-LM sample is saved at


def _dist_dir(role_dir: Path, v: Variant, layout: str) -> Path:
    if layout == "megatron_lm":  # role_dir is Megatron-LM's --save folder
        return role_dir / f"iter_{MEGATRON_LM_ITERATION:07d}"
    if layout == "v1":
        return role_dir / "dist_ckpt"
    # v2: the optimizer state of a bridge save goes to optimizer/dist_ckpt; model/dist_ckpt stays empty.
    return role_dir / ("optimizer" if v.hf_weights else "model") / "dist_ckpt"


# ---- megatron-core job ---------------------------------------------------------------------------


def _run_megatron_job(root: Path, dist_dirs: dict[Variant, Path], timeout: float, layout: str) -> None:
    iteration = MEGATRON_LM_ITERATION if layout == "megatron_lm" else None
    entries = [
        {
            "variant": dataclasses.asdict(v),
            "out_dir": str(root / v.name),
            "dist_dir": str(dist_dir),
            "megatron_lm_iteration": iteration,
        }
        for v, dist_dir in dist_dirs.items()
    ]
    run_torchrun_job(
        root,
        "merge_pipeline_samples.megatron_worker",
        {"timeout": int(timeout), "variants": entries},
        nproc=2,
        timeout=timeout,
    )


def run_torchrun_job(root: Path, module: str, job: dict, *, nproc: int, timeout: float) -> None:
    """``torchrun -m module JOB.json`` on ``nproc`` local ranks; its log is ``root/megatron_job.log``."""
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch, socket.socket() as probe:
        job_path = Path(scratch) / "job.json"
        job_path.write_text(json.dumps(job))
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            module,
            str(job_path),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }
        log_path = root / "megatron_job.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # A saver whose helper process died waits forever: kill the whole job.
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise TimeoutError(f"megatron-core job still running after {timeout} s; log: {log_path}") from None
        if code != 0:
            raise RuntimeError(f"megatron-core job failed (exit {code}):\n{log_path.read_text()[-4000:]}")


def _gathered_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    """The union of what the ranks filled: the whole tensor of every checkpoint key."""
    full: dict[str, torch.Tensor] = {}
    for path in sorted(out_dir.glob("full_weights_rank*.pt")):
        full.update(torch.load(path, weights_only=True))
        path.unlink()
    return full


# ---- Hugging Face side ---------------------------------------------------------------------------


def _hf_config(v: Variant):
    from transformers import AutoConfig

    model_type, architecture = v.record.model_type, v.record.architectures[0]
    text = dict(
        vocab_size=v.sizes["vocab"],
        hidden_size=v.sizes["hidden"],
        intermediate_size=v.sizes["ffn"],
        num_hidden_layers=v.num_layers,
        num_attention_heads=v.sizes["heads"],
        num_key_value_heads=v.sizes["kv_heads"],
        max_position_embeddings=v.sizes["max_positions"],
        rms_norm_eps=v.sizes["norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": v.sizes["rope_theta"]},
        tie_word_embeddings=v.tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    moe = dict(
        num_experts=v.sizes["experts"],
        num_experts_per_tok=v.sizes["experts_per_token"],
        moe_intermediate_size=v.sizes["moe_ffn"],
    )
    if v.family == "qwen2_moe":
        text.update(
            moe,
            shared_expert_intermediate_size=v.sizes["shared_ffn"],
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif v.family == "qwen3_moe":
        text.update(moe, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif v.family in ("mixtral", "gpt_oss"):  # every layer MoE; intermediate_size is the width of one expert
        text.update(
            num_local_experts=v.sizes["experts"],
            num_experts_per_tok=v.sizes["experts_per_token"],
            intermediate_size=v.sizes["moe_ffn"],
            head_dim=v.sizes["head_dim"],
        )
        if v.family == "mixtral":
            text.update(sliding_window=None)
        else:  # gpt-oss keeps its alternating 128-token windows: longer than the sample, so no mask differs
            text.update(swiglu_limit=SWIGLU_LIMIT)
    elif v.family == "deepseek_v3":
        text.update(
            n_routed_experts=v.sizes["experts"],
            num_experts_per_tok=v.sizes["experts_per_token"],
            moe_intermediate_size=v.sizes["moe_ffn"],
            n_shared_experts=MLA_SIZES["shared_experts"],
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=MLA_SIZES["q_lora_rank"],
            kv_lora_rank=MLA_SIZES["kv_lora_rank"],
            qk_nope_head_dim=MLA_SIZES["qk_nope"],
            qk_rope_head_dim=MLA_SIZES["qk_rope"],
            v_head_dim=MLA_SIZES["v_head"],
            num_key_value_heads=v.sizes["heads"],
            num_nextn_predict_layers=v.mtp_layers,
        )
    elif v.family == "glm4_moe":  # as GLM-4.5's config.json: layer 0 dense, the others MoE; half the head rotated
        text.update(
            n_routed_experts=v.sizes["experts"],
            num_experts_per_tok=v.sizes["experts_per_token"],
            moe_intermediate_size=v.sizes["moe_ffn"],
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=ROUTED_SCALING,
            attention_bias=True,
            use_qk_norm=True,
            num_nextn_predict_layers=v.mtp_layers,
            rope_parameters={**text["rope_parameters"], "partial_rotary_factor": GLM_ROTARY_FRACTION},
        )
    if v.record.qk_norm:  # the q/k norms are one head wide: Qwen3's own default head_dim (128) would not fit
        text.update(head_dim=v.sizes["head_dim"])
    if v.record.vision_prefix is not None:
        vs = VISION_SIZES
        vision = dict(
            depth=vs["depth"],
            hidden_size=vs["hidden"],
            num_heads=vs["heads"],
            intermediate_size=vs["ffn"],
            out_hidden_size=v.sizes["hidden"],
            patch_size=vs["patch"],
            temporal_patch_size=vs["temporal_patch"],
            spatial_merge_size=vs["merge"],
            fullatt_block_indexes=[vs["depth"] - 1],
        )
        config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=v.tied)
    else:
        config = AutoConfig.for_model(model_type, **text)
    config.architectures = [architecture]
    return config


def _write_reference(out_dir: Path, config, weights: dict[str, torch.Tensor], v: Variant) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = config.__class__.from_dict(config.to_dict())
    if v.value_model:
        config.architectures = [config.architectures[0].replace("ForCausalLM", "ForTokenClassification")]
        config.num_labels = 1
    config.save_pretrained(out_dir)
    save_file({k: t.contiguous() for k, t in weights.items()}, out_dir / "model.safetensors")


def _write_hf_weights(hf_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    """verl's default Megatron layout: the weights as sharded HF safetensors with an index."""
    from safetensors.torch import save_file

    names = sorted(weights)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves):
        filename = f"model-{i + 1:05d}-of-{len(halves):05d}.safetensors"
        save_file({k: weights[k].contiguous() for k in part}, hf_dir / filename)
        weight_map.update({k: filename for k in part})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
        "weight_map": weight_map,
    }
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---- hand-built dist checkpoints -----------------------------------------------------------------


def _handmade_weights(v: Variant) -> dict[str, torch.Tensor]:
    shapes = _handmade_shapes(v)
    return {key: global_values(key, shape, getattr(torch, v.dtype), v.seed) for key, shape in shapes.items()}


def _handmade_shapes(v: Variant) -> dict[str, tuple[int, ...]]:
    s = v.sizes
    H, L, V = s["hidden"], v.num_layers, s["vocab"]
    if v.record.latent_attention:
        return _mla_shapes(s)
    vision = v.record.vision_prefix is not None
    lm = "language_model." if vision else ""
    qkv_rows = s["kv_heads"] * (s["heads"] // s["kv_heads"] + 2) * s["head_dim"]
    shapes = {
        f"{lm}embedding.word_embeddings.weight": (V, H),
        f"{lm}decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
        f"{lm}decoder.layers.self_attention.linear_qkv.weight": (L, qkv_rows, H),
        f"{lm}decoder.layers.self_attention.linear_qkv.bias": (L, qkv_rows),
        f"{lm}decoder.layers.self_attention.linear_proj.weight": (L, H, s["heads"] * s["head_dim"]),
        f"{lm}decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
        f"{lm}decoder.layers.mlp.linear_fc1.weight": (L, 2 * s["ffn"], H),
        f"{lm}decoder.layers.mlp.linear_fc2.weight": (L, H, s["ffn"]),
        f"{lm}decoder.final_layernorm.weight": (H,),
        f"{lm}output_layer.weight": (V, H),
    }
    if vision:
        shapes.update(_vision_shapes(s))
    return shapes


def _mla_shapes(s: dict) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3 as the TransformerEngine spec saves it: one key per layer (dense and MoE layers
    differ), fused q/kv norms, experts stacked within a layer, router expert bias."""
    m = MLA_SIZES
    H, E = s["hidden"], s["experts"]
    shapes: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (s["vocab"], H),
        "decoder.final_layernorm.weight": (H,),
        "output_layer.weight": (s["vocab"], H),
    }
    for i in range(m["layers"]):
        p = f"decoder.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "self_attention.linear_q_down_proj.weight": (m["q_lora_rank"], H),
                p + "self_attention.linear_q_up_proj.layer_norm_weight": (m["q_lora_rank"],),
                p + "self_attention.linear_q_up_proj.weight": (
                    s["heads"] * (m["qk_nope"] + m["qk_rope"]),
                    m["q_lora_rank"],
                ),
                p + "self_attention.linear_kv_down_proj.weight": (m["kv_lora_rank"] + m["qk_rope"], H),
                p + "self_attention.linear_kv_up_proj.layer_norm_weight": (m["kv_lora_rank"],),
                p + "self_attention.linear_kv_up_proj.weight": (
                    s["heads"] * (m["qk_nope"] + m["v_head"]),
                    m["kv_lora_rank"],
                ),
                p + "self_attention.linear_proj.weight": (H, s["heads"] * m["v_head"]),
            }
        )
        if i == 0:
            shapes.update(
                {
                    p + "mlp.linear_fc1.layer_norm_weight": (H,),
                    p + "mlp.linear_fc1.weight": (2 * s["ffn"], H),
                    p + "mlp.linear_fc2.weight": (H, s["ffn"]),
                }
            )
        else:
            shared = s["moe_ffn"] * m["shared_experts"]
            shapes.update(
                {
                    p + "pre_mlp_layernorm.weight": (H,),
                    p + "mlp.router.weight": (E, H),
                    p + "mlp.router.expert_bias": (E,),
                    p + "mlp.experts.experts.linear_fc1.weight": (E, 2 * s["moe_ffn"], H),
                    p + "mlp.experts.experts.linear_fc2.weight": (E, H, s["moe_ffn"]),
                    p + "mlp.shared_experts.linear_fc1.weight": (2 * shared, H),
                    p + "mlp.shared_experts.linear_fc2.weight": (H, shared),
                }
            )
    return shapes


def _vision_shapes(s: dict) -> dict[str, tuple[int, ...]]:
    """Qwen2.5-VL's vision tower as verl's Megatron model names it (mbridge layout)."""
    vs = VISION_SIZES
    L, H, F = vs["depth"], vs["hidden"], vs["ffn"]
    merged = H * vs["merge"] ** 2
    p = "vision_model.decoder.layers."
    return {
        "vision_model.patch_embed.proj.weight": (H, 3, vs["temporal_patch"], vs["patch"], vs["patch"]),
        p + "self_attention.linear_qkv.layer_norm_weight": (L, H),
        p + "self_attention.linear_qkv.weight": (L, 3 * H, H),
        p + "self_attention.linear_qkv.bias": (L, 3 * H),
        p + "self_attention.linear_proj.weight": (L, H, H),
        p + "self_attention.linear_proj.bias": (L, H),
        p + "mlp.linear_fc1.layer_norm_weight": (L, H),
        p + "mlp.linear_fc1.weight": (L, 2 * F, H),
        p + "mlp.linear_fc1.bias": (L, 2 * F),
        p + "mlp.linear_fc2.weight": (L, H, F),
        p + "mlp.linear_fc2.bias": (L, H),
        "vision_model.decoder.final_layernorm.weight": (H,),
        "vision_model.projection.encoder.linear_fc1.weight": (merged, merged),
        "vision_model.projection.encoder.linear_fc1.bias": (merged,),
        "vision_model.projection.encoder.linear_fc2.weight": (s["hidden"], merged),
        "vision_model.projection.encoder.linear_fc2.bias": (s["hidden"],),
    }


def _write_handmade(v: Variant, dist_dir: Path, full: dict[str, torch.Tensor]) -> None:
    """A torch_dist folder as megatron-core lays it out, written by DCP without a process group."""
    import torch.distributed.checkpoint as dcp

    dist_dir.mkdir(parents=True, exist_ok=True)
    if v.hf_weights:
        # Optimizer state only: Adam moments under megatron's "optimizer.state." keys.
        state = {
            f"optimizer.state.{kind}.{key}": torch.zeros_like(t, dtype=torch.float32)
            for key, t in full.items()
            for kind in ("exp_avg", "exp_avg_sq")
        }
    else:
        state = dict(full)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dist_dir)), no_dist=True)
    torch.save({}, dist_dir / "common.pt")
    backend = {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    (dist_dir / "metadata.json").write_text(json.dumps(backend))


# ---- verl's layout schema v2 --------------------------------------------------------------------

# mode -> (has_bridge, use_dist_checkpointing, peft, save_contents), the settings verl 0.9 saves under
V2_MODES = {
    "bridge": (True, False, False, ["model", "optimizer", "extra"]),  # verl's default
    "dist": (False, True, False, ["model", "optimizer", "extra"]),
    "hybrid": (True, True, False, ["model", "hf_model", "optimizer", "extra"]),
    "bridge_peft": (True, False, True, ["model", "optimizer", "extra"]),
}
V2_HF, V2_DIST, V2_OPTIMIZER, V2_EXTRA = (
    "model/huggingface",
    "model/dist_ckpt",
    "optimizer/dist_ckpt",
    "extra/dist_ckpt",
)


def verl_manifest(mode: str, *, role: str, arch: str, global_step: int = 1, world_size: int = 2) -> dict:
    """``ckpt_contents.json`` as verl 0.9.1's MegatronCheckpointManager composes it for ``mode``."""
    bridge, dist, peft, save_contents = V2_MODES[mode]
    hf_weights = "hf_model" in save_contents or ("model" in save_contents and not dist)
    dist_weights = "model" in save_contents and dist
    contents: dict[str, dict] = {}
    if hf_weights:
        model = {"path": V2_HF, "format": "huggingface", "backend": "mbridge"}
        if peft:
            model["peft_adapter_path"] = f"{V2_HF}/adapter"
        if not dist_weights:
            contents["model"] = model
        if "hf_model" in save_contents:
            # verl's note is a one-element tuple (a trailing comma), so JSON has a list
            note = (
                "HF export alongside Megatron model shards under model/dist_ckpt/"
                if dist_weights
                else "deduplicated with 'model' on the HF path"
            )
            contents["hf_model"] = {"path": V2_HF, "format": "huggingface", "note": [note]}
    if dist_weights:
        contents["model"] = {"path": V2_DIST, "format": "megatron_dist_checkpoint", "backend": "dist_checkpointing"}
    if hf_weights and peft:
        contents["peft_adapters"] = {
            "path": V2_DIST,
            "format": "megatron_dist_checkpoint",
            "note": "PEFT adapter shards sit next to base-model HF weights, under model/dist_ckpt/.",
        }
    if "optimizer" in save_contents:
        contents["optimizer"] = {"path": V2_OPTIMIZER, "format": "megatron_dist_checkpoint"}
        contents["lr_scheduler"] = {"path": V2_OPTIMIZER, "format": "megatron_dist_checkpoint", "key": "lr_scheduler"}
    if "extra" in save_contents:
        contents["rng_state"] = {"path": V2_EXTRA, "format": "megatron_dist_checkpoint", "key": "rng_state"}
        contents["transformer_config"] = {"path": "transformer_config.json", "format": "json"}
    directories = {}
    if hf_weights:
        contents["hf_config"] = {
            "path": V2_HF,
            "format": "huggingface",
            "note": "config.json, tokenizer, and optional generation_config.json",
        }
        contents["tokenizer"] = {"path": V2_HF, "format": "huggingface"}
        directories[V2_HF] = (
            "HuggingFace-format artifacts written via mbridge: model weights, config.json, tokenizer files, and optional generation_config.json."
        )
    if dist_weights or (hf_weights and peft):
        directories[V2_DIST] = (
            "Megatron dist_checkpointing shards for model weights (or PEFT adapter shards when mbridge is enabled)."
        )
    if "optimizer" in save_contents:
        directories[V2_OPTIMIZER] = (
            "Megatron dist_checkpointing shards for the optimizer state (includes lr_scheduler when present)."
        )
    if "extra" in save_contents:
        directories[V2_EXTRA] = "Megatron dist_checkpointing shards for extra state (rng_state)."
    return {
        "schema_version": 2,
        "framework": "megatron",
        "role": role,
        "arch": arch,
        "global_step": global_step,
        "world_size": world_size,
        "backend": {"has_bridge": bridge, "use_dist_checkpointing": dist, "peft": peft},
        "save_contents": save_contents,
        "contents": contents,
        "directories": directories,
        "saved_any_dist_ckpt": True,
    }


def arrange_v2(sample: MegatronSample, role_dir: Path, mode: str) -> MegatronSample:
    """Copy a v1 sample into the v2 tree verl writes in ``mode``; the checkpoint's HF folder doubles
    as the trainer's original model folder (``original_dir``)."""
    bridge, dist, peft, save_contents = V2_MODES[mode]
    source_hf = sample.role_dir / "huggingface"
    role_dir.mkdir(parents=True)
    if dist:
        shutil.copytree(sample.role_dir / "dist_ckpt", role_dir / V2_DIST)
    if bridge:
        hf_dir = role_dir / V2_HF
        shutil.copytree(source_hf, hf_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        if peft:  # Megatron-Bridge exports the adapter only; the base is the unchanged original model
            write_peft_adapter(sample.reference_dir, hf_dir / "adapter")
        else:
            write_bridge_weights(sample.reference_dir, hf_dir)
    _finish_v2(role_dir, mode, sample.variant, transformer_config=sample.role_dir / "transformer_config.json")
    return replace(sample, role_dir=role_dir, original_dir=source_hf)


def _finish_v2(role_dir: Path, mode: str, v: Variant, *, transformer_config: Path | None = None) -> None:
    """The folders verl creates even when empty, transformer_config.json, and the manifest, last."""
    for folder in (V2_DIST, V2_OPTIMIZER, V2_EXTRA):
        (role_dir / folder).mkdir(parents=True, exist_ok=True)
    if transformer_config is not None and transformer_config.is_file():
        shutil.copy2(transformer_config, role_dir / "transformer_config.json")
    manifest = verl_manifest(mode, role=role_dir.name, arch=v.record.architectures[0])
    partial = role_dir / "ckpt_contents.json.tmp"
    partial.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    partial.replace(role_dir / "ckpt_contents.json")


def _reference_model(reference_dir: Path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(reference_dir)
    return getattr(transformers, config.architectures[0]).from_pretrained(reference_dir)


def write_bridge_weights(reference_dir: Path, hf_dir: Path) -> None:
    """The trained weights as verl's bridge leaves them: written by transformers' ``save_pretrained``,
    one ``model.safetensors``, no index, no ``format`` metadata in its header, mode 600."""
    with tempfile.TemporaryDirectory() as scratch:
        _reference_model(reference_dir).save_pretrained(scratch)
        written = sorted(Path(scratch).glob("*.safetensors"))
        assert [p.name for p in written] == ["model.safetensors"], written
        path = hf_dir / "model.safetensors"
        shutil.move(written[0], path)
    _drop_header_metadata(path)
    path.chmod(0o600)


def _drop_header_metadata(path: Path) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


LORA_R, LORA_ALPHA, LORA_TARGETS = 4, 8, ["q_proj", "v_proj"]


def write_peft_adapter(reference_dir: Path, adapter_dir: Path, *, seed: int = 7) -> None:
    """A PEFT LoRA adapter for the reference model, as the bridge exports it (``save_hf_adapter``),
    with seeded non-zero A and B so that a merge changes every targeted weight."""
    import peft

    with warnings.catch_warnings():  # peft calls a transformers method deprecated in 5.x
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(
            _reference_model(reference_dir),
            peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"),
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(adapter_dir)


# ---- the reference: formats/megatron/names.py's mapping, applied to whole tensors ------------------------


def reference_weights(full: dict[str, torch.Tensor], v: Variant) -> dict[str, torch.Tensor]:
    """The HF state dict of the model in the checkpoint."""
    family = v.record
    if family.vision_prefix is not None:
        return {
            **_reference_text(full, v, "language_model.", family.text_prefix),
            **_reference_vision(full, family.vision_prefix),
        }
    return _reference_text(full, v, "", family.text_prefix)


def _reference_text(full: dict[str, torch.Tensor], v: Variant, src: str, dst: str) -> dict[str, torch.Tensor]:
    def layer(i: int, *names: str) -> torch.Tensor | None:
        """Layer i of a parameter, stacked ([L, ...]) or one key per layer; first spelling found."""
        for name in names:
            if f"{src}decoder.layers.{name}" in full:
                return full[f"{src}decoder.layers.{name}"][i]
            if f"{src}decoder.layers.{i}.{name}" in full:
                return full[f"{src}decoder.layers.{i}.{name}"]
        return None

    def mtp_layer(k: int, *names: str) -> torch.Tensor | None:
        """The decoder layer of multi-token-prediction module k."""
        return next((full[key] for n in names if (key := f"mtp.layers.{k}.transformer_layer.{n}") in full), None)

    out = {
        f"{dst}embed_tokens.weight": full[f"{src}embedding.word_embeddings.weight"],
        f"{dst}norm.weight": full[f"{src}decoder.final_layernorm.weight"],
    }
    head = full.get(f"{src}output_layer.weight")
    if v.value_model:
        out["score.weight"] = head
        out["score.bias"] = torch.zeros(1, dtype=head.dtype)
    elif head is not None:
        out["lm_head.weight"] = head
    for i in range(v.num_layers):
        out.update(_reference_layer(functools.partial(layer, i), f"{dst}layers.{i}.", v))
    for k in range(v.mtp_layers):
        # DeepSeek-V3 names: HF layer num_hidden_layers + k, with copies of the shared embedding and head.
        p, m = f"{dst}layers.{v.num_layers + k}.", f"mtp.layers.{k}."
        out.update(_reference_layer(functools.partial(mtp_layer, k), p, v))
        out[p + "enorm.weight"] = full[m + "enorm.weight"]
        out[p + "hnorm.weight"] = full[m + "hnorm.weight"]
        out[p + "eh_proj.weight"] = full[m + "eh_proj.weight"]
        out[p + "shared_head.norm.weight"] = full[m + "final_layernorm.weight"]
        out[p + "shared_head.head.weight"] = full["output_layer.weight"].clone()  # a second copy on disk
        out[p + "embed_tokens.weight"] = full["embedding.word_embeddings.weight"].clone()
    return {k: t for k, t in out.items() if t is not None}


def _reference_layer(get: Callable[..., torch.Tensor | None], p: str, v: Variant) -> dict[str, torch.Tensor]:
    """One decoder layer; ``get(*spellings)`` finds a parameter of it."""
    out = {
        p + "input_layernorm.weight": get("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
        p + "post_attention_layernorm.weight": get("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
        p + "self_attn.o_proj.weight": get("self_attention.linear_proj.weight"),
        p + "self_attn.o_proj.bias": get("self_attention.linear_proj.bias"),
        p + "self_attn.sinks": get("self_attention.core_attention.softmax_offset"),
    }
    if v.record.latent_attention:
        out.update(_reference_mla(get, p))
    else:
        out.update(_reference_gqa(get, p, v))
    out.update(_reference_mlp(get, p, v))
    return out


def _reference_gqa(get: Callable[[str], torch.Tensor | None], p: str, v: Variant) -> dict[str, torch.Tensor]:
    s = v.sizes
    groups, per_group, d = s["kv_heads"], s["heads"] // s["kv_heads"], s["head_dim"]
    out = {}
    for kind in ("weight", "bias") if v.record.qkv_bias else ("weight",):
        qkv = get(f"self_attention.linear_qkv.{kind}")
        grouped = qkv.reshape(groups, per_group + 2, d, *qkv.shape[1:])
        out[p + f"self_attn.q_proj.{kind}"] = grouped[:, :per_group].reshape(groups * per_group * d, *qkv.shape[1:])
        out[p + f"self_attn.k_proj.{kind}"] = grouped[:, per_group].reshape(groups * d, *qkv.shape[1:])
        out[p + f"self_attn.v_proj.{kind}"] = grouped[:, per_group + 1].reshape(groups * d, *qkv.shape[1:])
    if v.record.qk_norm:
        out[p + "self_attn.q_norm.weight"] = get("self_attention.q_layernorm.weight")
        out[p + "self_attn.k_norm.weight"] = get("self_attention.k_layernorm.weight")
    return out


def _reference_mla(get: Callable[..., torch.Tensor | None], p: str) -> dict[str, torch.Tensor]:
    """The compressed q / kv norms: fused into the up projections (TransformerEngine spec) or separate."""
    a = "self_attention."
    return {
        p + "self_attn.q_a_proj.weight": get(a + "linear_q_down_proj.weight"),
        p + "self_attn.q_a_layernorm.weight": get(a + "linear_q_up_proj.layer_norm_weight", a + "q_layernorm.weight"),
        p + "self_attn.q_b_proj.weight": get(a + "linear_q_up_proj.weight"),
        p + "self_attn.kv_a_proj_with_mqa.weight": get(a + "linear_kv_down_proj.weight"),
        p + "self_attn.kv_a_layernorm.weight": get(
            a + "linear_kv_up_proj.layer_norm_weight", a + "kv_layernorm.weight"
        ),
        p + "self_attn.kv_b_proj.weight": get(a + "linear_kv_up_proj.weight"),
    }


def _gate_up(
    get: Callable[[str], torch.Tensor | None], fc1: str, kind: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor] | None:
    fused = get(f"{fc1}.{kind}")
    if fused is not None:
        gate, up = fused.chunk(2, dim=0)
        return gate, up
    gate = get(f"{fc1}.{kind}_w")
    return None if gate is None else (gate, get(f"{fc1}.{kind}_v"))


def _reference_mlp(get: Callable[..., torch.Tensor | None], p: str, v: Variant) -> dict[str, torch.Tensor]:
    out = {}
    dense = _gate_up(get, "mlp.linear_fc1")
    if dense is not None:
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = dense
        out[p + "mlp.down_proj.weight"] = get("mlp.linear_fc2.weight")
        return out
    moe, (w_gate, w_up, w_down) = v.record.moe_block, v.record.expert_linears
    out[p + f"{moe}.{v.record.router}.weight"] = get("mlp.router.weight")
    out[p + f"{moe}.{v.record.router}.bias"] = get("mlp.router.bias")
    out[p + "mlp.gate.e_score_correction_bias"] = get("mlp.router.expert_bias")
    shared_name = v.record.shared_experts
    shared = _gate_up(get, "mlp.shared_experts.linear_fc1")
    if shared is not None:
        out[p + f"mlp.{shared_name}.gate_proj.weight"], out[p + f"mlp.{shared_name}.up_proj.weight"] = shared
        out[p + f"mlp.{shared_name}.down_proj.weight"] = get("mlp.shared_experts.linear_fc2.weight")
    gate_weight = get("mlp.shared_experts.gate_weight")
    if gate_weight is not None:
        out[p + "mlp.shared_expert_gate.weight"] = gate_weight
    experts = [functools.partial(_expert, get, e) for e in range(v.sizes["experts"])]
    if v.record.grouped_experts:
        return {**out, **_reference_grouped_experts(experts, f"{p}{moe}.experts.")}
    for e, expert in enumerate(experts):
        hf = f"{p}{moe}.experts.{e}."
        out[hf + f"{w_gate}.weight"], out[hf + f"{w_up}.weight"] = _gate_up(expert, "linear_fc1")
        out[hf + f"{w_down}.weight"] = expert("linear_fc2.weight")
    return out


def _expert(get: Callable[..., torch.Tensor | None], e: int, name: str) -> torch.Tensor | None:
    """Expert e's parameter: [L, E, ...] stacked, [E, ...] per layer, or one key per layer and expert."""
    stacked = get(f"mlp.experts.experts.{name}")
    return stacked[e] if stacked is not None else get(f"mlp.experts.experts.{e}.{name}")


def _reference_grouped_experts(experts: list[Callable[[str], torch.Tensor | None]], p: str) -> dict:
    """gpt-oss: a layer's experts stacked, each matrix as ``x @ W`` uses it (a Linear weight
    transposed), gate and up interleaved (gate j at 2j, up j at 2j + 1)."""

    def fc1(expert: Callable[[str], torch.Tensor | None], kind: str) -> torch.Tensor:
        gate, up = _gate_up(expert, "linear_fc1", kind)
        return torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])

    return {
        p + "gate_up_proj": torch.stack([fc1(expert, "weight").t() for expert in experts]),
        p + "gate_up_proj_bias": torch.stack([fc1(expert, "bias") for expert in experts]),
        p + "down_proj": torch.stack([expert("linear_fc2.weight").t() for expert in experts]),
        p + "down_proj_bias": torch.stack([expert("linear_fc2.bias") for expert in experts]),
    }


def _reference_vision(full: dict[str, torch.Tensor], dst: str) -> dict[str, torch.Tensor]:
    vs = VISION_SIZES
    src = "vision_model."
    out = {
        dst + "patch_embed.proj.weight": full[src + "patch_embed.proj.weight"],
        dst + "merger.ln_q.weight": full[src + "decoder.final_layernorm.weight"],
    }
    for kind in ("weight", "bias"):
        out[dst + f"merger.mlp.0.{kind}"] = full[src + f"projection.encoder.linear_fc1.{kind}"]
        out[dst + f"merger.mlp.2.{kind}"] = full[src + f"projection.encoder.linear_fc2.{kind}"]
    layers = src + "decoder.layers."
    for i in range(vs["depth"]):
        p = f"{dst}blocks.{i}."
        out[p + "norm1.weight"] = full[layers + "self_attention.linear_qkv.layer_norm_weight"][i]
        out[p + "norm2.weight"] = full[layers + "mlp.linear_fc1.layer_norm_weight"][i]
        for kind in ("weight", "bias"):
            qkv = full[layers + f"self_attention.linear_qkv.{kind}"][i]
            # Megatron: rows per head [q_h; k_h; v_h]. HF: [all q; all k; all v].
            per_head = qkv.reshape(vs["heads"], 3, -1, *qkv.shape[1:])
            out[p + f"attn.qkv.{kind}"] = per_head.transpose(0, 1).reshape(qkv.shape)
            out[p + f"attn.proj.{kind}"] = full[layers + f"self_attention.linear_proj.{kind}"][i]
            gate, up = full[layers + f"mlp.linear_fc1.{kind}"][i].chunk(2, dim=0)
            out[p + f"mlp.gate_proj.{kind}"], out[p + f"mlp.up_proj.{kind}"] = gate, up
            out[p + f"mlp.down_proj.{kind}"] = full[layers + f"mlp.linear_fc2.{kind}"][i]
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m merge_pipeline_samples.megatron",
        description="Write sample Megatron-Core role folders as verl lays them out.",
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="repeatable; default: all")
    parser.add_argument(
        "--layout",
        choices=("v1", "v2"),
        default="v2",
        help="v2: verl 0.9 (ckpt_contents.json, model/...); v1: legacy dist_ckpt/ + huggingface/",
    )
    args = parser.parse_args(argv)
    samples = write_megatron_samples(
        args.out, [VARIANTS[name] for name in args.variant or sorted(VARIANTS)], layout=args.layout
    )
    for sample in samples.values():
        print(
            f"{sample.variant.name}: {sample.role_dir}"
            + (f" (original model: {sample.original_dir})" if sample.original_dir else "")
        )


if __name__ == "__main__":
    main()
