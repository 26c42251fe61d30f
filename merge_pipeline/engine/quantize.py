"""``--quantize SCHEME``: linear weights written in a compressed-tensors format on their way to disk.

Each quantized ``<module>.weight`` becomes what compressed-tensors' compressor of the scheme writes for
it (``weight_packed`` or ``weight``, then ``weight_scale``, and ``weight_zero_point``, ``weight_shape``,
``weight_global_scale`` where the format has them), in the same shard; everything else is bfloat16.

The numbers are compressed-tensors' own: for one band of rows at a time, the band is a ``Linear`` set
up by ``initialize_module_for_quantization``, its scales come from ``calculate_qparams`` on the band's
per-group min and max (what llm-compressor's weight observer takes), and ``compress_module`` quantizes
and packs it, as ``model_free_ptq`` does for the whole tensor. Every scheme's groups lie within rows
(blocks within bands of their height), so the bands' outputs, stacked, are the whole tensor's. A
per-tensor statistic a scheme needs before its first band (NVFP4's global scale, shared by a fused set
such as q/k/v) is gathered by a read pass of its own over the set's sources: memory holds one band group.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from merge_pipeline.engine import fp4_tables
from merge_pipeline.engine.outputs import KeptFromPass, Quantized
from merge_pipeline.engine.safetensors_writer import OutputTensor
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.quantization import QuantDecisions, decide
from merge_pipeline.plan import READ_PIECE_BYTES, PlannedTensor

QUANTIZED_FROM = torch.bfloat16  # model_free_ptq's input: the bf16 merge of the same checkpoint
BAND_ROWS = 128  # a multiple of every scheme's row grouping: FP8_BLOCK's block, a packed zero point's 32 rows
# Fused sets whose members share one global scale: llm-compressor's microscale mappings (the last name part differs).
_FUSED = (
    re.compile(r"^(?P<prefix>.*(attn|attention)\.)(q_proj|k_proj|v_proj)\.weight$"),
    re.compile(r"^(?P<prefix>.*(attn|attention)\.)(wq_a|wkv_a_with_mqa)\.weight$"),
    re.compile(r"^(?P<prefix>.*mlp\.)(gate_proj|up_proj)\.weight$"),
    re.compile(r"^(?P<prefix>.*)(w1|w3)\.weight$"),
)
_FUSED_SIZES = (3, 2, 2, 2)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
# Rows quantized in one call: an eighth of a read piece (1 MiB of bfloat16). Measured on the 248M weights, one
# thread: NVFP4A16 and W8A16 take about half the CPU time of whole 8 MiB pieces (the call's float32 temporaries stay
# in the cache and below malloc's mmap threshold, so no page faults), and per-call overhead is still small.
_GROUPS_A_PIECE = 8
# Band groups quantized at once: the intra-op threads torch would have used (its default, the cores it may use;
# one under torchrun and Ray, whose workers start with OMP_NUM_THREADS=1), at least 2 and at most 8.
BAND_WORKERS = min(8, max(2, torch.get_num_threads()))
_FOLDED_GROUP = 128  # measured: halving beats amin/amax up to groups of 128 columns, loses on whole rows


def scheme_quantizer(
    model: list[PlannedTensor], scheme: str, ignore: tuple[str, ...], where: Path, args=None
) -> tuple[QuantDecisions, Quantized]:
    """What ``model`` quantizes with the scheme, and the writer of each such weight and its parameters;
    ``args``: the QuantizationScheme of a config group named ``scheme`` (the base's), instead of a preset."""
    decisions = decide(model, scheme, ignore, where, args)
    if not decisions.quantized:
        raise MergeError(
            where,
            f"--quantize {decisions.scheme_name} would quantize nothing (ignored: {', '.join(decisions.ignore) or 'none'};"
            f" off the scheme's groups: {len(decisions.off_grid)}): the folder would claim a format no weight is in",
        )
    by_name = {t.name: t for t in model}
    global_sets = _global_scale_sets(decisions, by_name)
    layouts: dict[tuple[int, ...], list] = {}  # by shape: a model repeats a few shapes in every layer
    scales: dict[tuple[str, ...], torch.Tensor | None] = {}  # by fused set: its members' passes share one read

    def quantized(weight: PlannedTensor):
        if weight.name not in global_sets:
            return None
        return _quantized(weight, decisions, global_sets[weight.name], layouts, scales)

    return decisions, quantized


def _global_scale_sets(decisions: QuantDecisions, by_name: dict[str, PlannedTensor]) -> dict[str, list[PlannedTensor]]:
    """Each quantized weight -> the weights its global scale is taken over (itself, or its quantized fused set;
    only for schemes with a global scale). A set counts when all its members exist, as llm-compressor pairs them."""
    sets = {name: [by_name[name]] for name in decisions.quantized}
    if decisions.scheme.weights.strategy != "tensor_group":
        return sets
    groups: dict[tuple[int, str], list[str]] = {}
    for name in by_name:
        for index, pattern in enumerate(_FUSED):
            match = pattern.match(name)
            if match:
                groups.setdefault((index, match["prefix"]), []).append(name)
                break
    quantized = set(decisions.quantized)
    for (index, _), members in groups.items():
        if len(members) == _FUSED_SIZES[index]:
            fused = [by_name[m] for m in members if m in quantized]
            for member in fused:
                sets[member.name] = fused
    return sets


def _quantized(
    weight: PlannedTensor,
    decisions: QuantDecisions,
    global_set: list[PlannedTensor],
    layouts: dict,
    scales: dict | None = None,
):
    """The leading output (``weight_packed`` or ``weight``) and its followers, all from one pass over the rows;
    ``scales``: the global scales already read, by set (``None``: read for this weight)."""
    bands = _Bands(weight, decisions.scheme, global_set, {} if scales is None else scales)
    module = weight.name.removesuffix(".weight")
    if weight.shape not in layouts:
        layouts[weight.shape] = bands.layout()
    lead, *rest = layouts[weight.shape]
    decisions.format = str(decisions.scheme.format.value)
    leader = OutputTensor(PlannedTensor(f"{module}.{lead[0]}", lead[1], lead[2], bands), lead[2])
    followers = tuple(
        OutputTensor(
            PlannedTensor(f"{module}.{key}", shape, dtype, KeptFromPass(bands, functools.partial(bands.take, key))),
            dtype,
        )
        for key, shape, dtype in rest
    )
    return leader, followers


def quantize_band(band: torch.Tensor, scheme, global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """What compressed-tensors writes for ``band`` (rows of a weight) quantized with ``scheme``: its compressed
    state dict, the scales taken as llm-compressor's memoryless min-max observer takes them."""
    from compressed_tensors.compressors import compress_module
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import initialize_module_for_quantization
    from compressed_tensors.quantization.utils import calculate_qparams

    fp4_tables.register()
    rows, cols = band.shape
    module = torch.nn.Linear(cols, rows, bias=False, device="meta", dtype=band.dtype)
    module.weight = torch.nn.Parameter(band, requires_grad=False)
    initialize_module_for_quantization(module, scheme, force_zero_point=False)
    low, high = _extremes(_observed(band, scheme.weights))
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        raise ValueError("holds inf or NaN")  # they reach every min or max they are in: no pass over the band
    scale, zero_point = calculate_qparams(low, high, scheme.weights, global_scale)
    for key, value in (
        ("weight_scale", scale),
        ("weight_zero_point", zero_point),
        ("weight_global_scale", global_scale),
    ):
        if value is not None and hasattr(module, key):
            update_offload_parameter(module, key, value)
    compress_module(module)
    return dict(module.state_dict())


@contextlib.contextmanager
def quantizing_pass() -> Iterator[None]:
    """What a pass that writes quantized outputs runs under: torch on one intra-op thread in this thread, as on
    the band workers. The quantizer's work is many short ops: with two intra-op threads each wakes a pool that
    then spins beside the band workers, the reader and the writer (measured on the 248M NVFP4A16 merge: 10.7 s
    of CPU against 8.0 s on one thread, the same wall on an idle machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _band_workers() -> ThreadPoolExecutor:
    """The threads that quantize band groups while the pass reads the next ones and writes the last ones: torch
    lets go of the GIL in its ops, so bands are quantized side by side (the 248M NVFP4A16 merge: 8.2 -> 6.9 s on
    two cores). Made once per process, each on one torch thread."""
    return ThreadPoolExecutor(
        BAND_WORKERS, thread_name_prefix="merge-quantize", initializer=torch.set_num_threads, initargs=(1,)
    )


def global_scale_of(absmax: torch.Tensor) -> torch.Tensor:
    """NVFP4's global scale of a (fused) set whose largest magnitude is ``absmax``: compressed-tensors' ``generate_gparam``."""
    from compressed_tensors.quantization.utils import generate_gparam

    return generate_gparam(-absmax.reshape(1), absmax.reshape(1))


def _extremes(observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max of each group of ``observed`` (``(1, *qparam_shape, group)``), as ``amin`` and ``amax`` over
    its first and last dims take them. Torch reduces a short last dim element by element, so a group of up to
    ``_FOLDED_GROUP`` is first halved with elementwise minimum and maximum, which pick the same values: 2-3x
    faster on groups of 16 and 32 (NVFP4, MXFP4)."""
    low = high = observed[0]
    while 1 < low.shape[-1] <= _FOLDED_GROUP and low.shape[-1] % 2 == 0:
        half = low.shape[-1] // 2
        low = torch.minimum(low[..., :half], low[..., half:])
        high = torch.maximum(high[..., :half], high[..., half:])
    return torch.amin(low, dim=-1), torch.amax(high, dim=-1)


def _observed(value: torch.Tensor, args) -> torch.Tensor:
    """The weight as llm-compressor's observer reduces it (``flatten_for_calibration``): ``(1, *qparam_shape, group)``."""
    if args.strategy == "channel":
        return value.unsqueeze(-2).unsqueeze(0)
    if args.strategy in ("group", "tensor_group"):
        return value.unflatten(-1, (-1, args.group_size)).unsqueeze(0)
    if args.strategy == "block":
        from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

        height, width = args.block_structure
        value = maybe_pad_tensor_for_block_quant(value, args.block_structure)
        rows, cols = value.shape
        return value.reshape(rows // height, height, cols // width, width).transpose(1, 2).flatten(-2, -1).unsqueeze(0)
    raise MergeError(None, f"weight strategy {args.strategy} is not supported by --quantize")


class _Bands:
    """A ``TensorSource`` of the leading quantized output: the source's rows gathered into bands of
    ``BAND_ROWS`` (as many as fit in one read piece), each quantized as it completes; the followers'
    bands are kept for the tensors written right after it."""

    def __init__(self, weight: PlannedTensor, scheme, global_set: list[PlannedTensor], scales: dict):
        self.weight, self.scheme, self.global_set, self.scales = weight, scheme, global_set, scales
        self.kept: dict[str, torch.Tensor] | None = None

    def layout(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(key, shape, dtype) of each output, the leading one first: what compressed-tensors writes for
        a band of zeros of each height the pass uses, stacked as the pass stacks them."""
        rows, cols = self.weight.shape
        full, rest = divmod(rows, BAND_ROWS)
        global_scale = torch.ones(1) if self.scheme.weights.strategy == "tensor_group" else None
        heights = [(count, height) for count, height in ((full, BAND_ROWS), (1, rest)) if count and height]
        states = [
            (count, quantize_band(torch.zeros(height, cols, dtype=QUANTIZED_FROM), self.scheme, global_scale))
            for count, height in heights
        ]
        first = states[0][1]
        lead = "weight_packed" if "weight_packed" in first else "weight"
        layout = []
        for key in [lead, *(k for k in first if k != lead)]:
            if key in ("weight_shape", "weight_global_scale"):  # one per tensor
                shape = tuple(first[key].shape)
            else:
                shape = (sum(count * state[key].shape[0] for count, state in states), *first[key].shape[1:])
            layout.append((key, shape, first[key].dtype))
        return layout

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        rows, cols = self.weight.shape
        per_group = (
            max(1, READ_PIECE_BYTES // _GROUPS_A_PIECE // (BAND_ROWS * cols * QUANTIZED_FROM.itemsize)) * BAND_ROWS
        )
        _temporaries_unmapped_when_freed()
        global_scale = self._global_scale()
        kept: dict[str, list[torch.Tensor]] = {}
        done = 0
        # Band groups are quantized in order on the band workers, at most BAND_WORKERS ahead of the one written:
        # each band's outputs are its own, so the bytes are those of one band at a time.
        ahead: collections.deque[Future] = collections.deque()
        for band in _row_groups(self.weight, per_group):
            ahead.append(_band_workers().submit(self._quantized_band, band, global_scale))
            done += len(band)
            if len(ahead) > BAND_WORKERS:
                yield self._lead(ahead.popleft().result(), kept)
        while ahead:
            yield self._lead(ahead.popleft().result(), kept)
        if done != rows:
            raise RuntimeError(f"{self.weight.name}: source gave {done} of {rows} rows")
        self.kept = {key: self._whole(key, values) for key, values in kept.items()}

    def _quantized_band(self, band: torch.Tensor, global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        try:
            return quantize_band(band, self.scheme, global_scale)
        except ValueError as exc:
            raise MergeError(None, f"{self.weight.name} {exc}: it cannot be quantized") from None

    @staticmethod
    def _lead(state: dict[str, torch.Tensor], kept: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """The band's leading output; its followers added to ``kept``."""
        lead = state.pop("weight_packed" if "weight_packed" in state else "weight")
        for key, value in state.items():
            kept.setdefault(key, []).append(value)
        return lead

    def take(self, key: str) -> torch.Tensor | None:
        """The follower ``key`` the last pass kept, once (``None`` before a pass)."""
        return None if self.kept is None else self.kept.pop(key, None)

    def _whole(self, key: str, bands: list[torch.Tensor]) -> torch.Tensor:
        """A follower of the whole weight from its bands': per-row ones stacked, per-tensor ones taken once."""
        if key == "weight_shape":
            return torch.tensor(self.weight.shape)
        if key == "weight_global_scale":
            return bands[0]
        return torch.cat(bands)

    def _global_scale(self) -> torch.Tensor | None:
        """NVFP4: the set's largest magnitude, from a read pass over its members' rows before its first member's
        first band (the others take it from ``scales``)."""
        if self.scheme.weights.strategy != "tensor_group":
            return None
        key = tuple(member.name for member in self.global_set)
        if key not in self.scales:
            # The largest magnitude in bfloat16, from the pieces as they come: rounding to bfloat16 is monotone, so
            # the rounded extremes are the extremes of the rounded values, and negation is exact (no copy of a piece).
            absmax = torch.zeros((), dtype=QUANTIZED_FROM)
            for member in self.global_set:
                for piece in member.source.pieces():
                    low, high = torch.aminmax(piece.reshape(-1)) if piece.numel() else (absmax, absmax)
                    absmax = torch.maximum(absmax, torch.maximum(high.to(QUANTIZED_FROM), -low.to(QUANTIZED_FROM)))
            self.scales[key] = global_scale_of(absmax)
        return self.scales[key]


@functools.cache
def _temporaries_unmapped_when_freed() -> None:
    """glibc's malloc: buffers of 4 MiB and up taken from (and given back to) the system directly. By default
    its threshold rises to 32 MiB once such buffers are freed, after which the quantizer's 8-16 MiB temporaries
    (each band group's casts and packing) are carved from the heap, which fragments and keeps them: the 248M
    W4A16 merge peaked at 0.61-0.72 GB that way, 0.47 GB with the threshold fixed. Fixing it also fixes the
    heap's trim threshold at 128 KiB, which hands each band group's freed temporaries back to the system, to be
    faulted in again by the next group; 32 MiB keeps them (the 1.1B W8A16 and NVFP4A16 merges: 10-50 % fewer page
    faults, the same peak RSS, the wall within the machine's noise). Elsewhere: nothing."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 4 * 1024 * 1024)
        mallopt(_M_TRIM_THRESHOLD, 32 * 1024 * 1024)


def _row_groups(weight: PlannedTensor, rows_per_group: int) -> Iterator[torch.Tensor]:
    """The weight's rows in bfloat16, ``rows_per_group`` at a time (the last group may be shorter)."""
    cols = weight.shape[1]
    wanted = rows_per_group * cols
    group = torch.empty(wanted, dtype=QUANTIZED_FROM)
    filled = 0
    for piece in weight.source.pieces():
        piece = piece.reshape(-1)
        while piece.numel():
            n = min(wanted - filled, piece.numel())
            group[filled : filled + n].copy_(piece[:n])
            filled, piece = filled + n, piece[n:]
            if filled == wanted:
                yield group.view(rows_per_group, cols)
                group, filled = torch.empty(wanted, dtype=QUANTIZED_FROM), 0
    if filled:
        yield group[:filled].view(-1, cols)
