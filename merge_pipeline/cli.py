"""``merge-pipeline merge | average | test | inspect | upload | diff``: verl's ``model_merger`` flags, plus our own.

Every user error ends as one line on stderr (``error: <file>: <problem>``) and a non-zero exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from merge_pipeline.errors import MergeError, os_error, printable
from merge_pipeline.hf.file_names import WEIGHT_SUFFIXES
from merge_pipeline.options import (
    EMA_WEIGHTS,
    GIVEN_WEIGHTS,
    OPTION_FIELDS,
    MergeOptions,
    average_weights,
    cli_flags,
    option_field,
    options_of,
)
from merge_pipeline.progress import human_bytes
from merge_pipeline.ray_settings import RAY_FIELDS, RaySettings
from merge_pipeline.settings import DIST_TIMEOUT, HUB_TIMEOUT
from merge_pipeline.store.url import absolute, as_location
from merge_pipeline.store.view import viewed

log = logging.getLogger("merge_pipeline")

EXIT_ERROR = 1
EXIT_MISMATCH = 3
_FLAG_TYPES = {"int": int, "float": float}


def _option_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per ``MergeOptions`` field that ``command`` takes: spelling, help, default and choices from the schema."""
    for option in options_of(command):
        meta = option.metadata
        if isinstance(option.default, bool):  # off unless given
            parser.add_argument(*cli_flags(option), dest=option.name, action="store_true", help=meta["help"])
        else:
            parser.add_argument(
                *cli_flags(option),
                dest=option.name,
                default=option.default,
                choices=meta["choices"],
                type=int if isinstance(option.default, int) else None,
                metavar=meta.get("metavar"),
                nargs=meta.get("nargs"),
                help=meta["help"],
            )


def _checkpoint_flags(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--local_dir",
        required=True,
        type=as_location,
        help="role folder, e.g. checkpoints/global_step_100/actor, or a store URL (s3://bucket/prefix/actor)",
    )
    _option_flags(parser, command)
    parser.add_argument(
        "--use_cpu_initialization",
        action="store_true",
        help="accepted for verl compatibility; merging always runs on CPU",
    )


def _hub_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument("--revision", help="Hub branch to commit to, created if missing (default main)")
    parser.add_argument("--commit-message", help="Hub commit message (default names the checkpoint)")
    parser.add_argument(
        "--hub-timeout",
        type=float,
        metavar="SECONDS",
        help=f"connect/read timeout of each Hub request (default: {HUB_TIMEOUT.variable}, else {HUB_TIMEOUT.default})",
    )


def _ray_flags(parser: argparse.ArgumentParser) -> None:
    """``--ray-address`` and the write tasks' settings (``RaySettings``): with it, Ray tasks write the weight files."""
    group = parser.add_argument_group("on a Ray cluster (pip install 'merge_pipeline[ray]')")
    for setting in RAY_FIELDS:
        group.add_argument(
            f"--ray-{setting.name.replace('_', '-')}",
            dest=f"ray_{setting.name}",
            type=_FLAG_TYPES.get(setting.type.removesuffix(" | None"), str),
            metavar=setting.metadata.get("metavar"),
            nargs=setting.metadata.get("nargs"),
            help=setting.metadata["help"]
            + ("" if setting.name == "address" or setting.default is None else f" (default {setting.default})"),
        )


def _ray_settings(args: argparse.Namespace) -> RaySettings | None:
    """The Ray settings the flags give, or ``None`` (no ``--ray-address``: the merge runs here)."""
    given = {f.name: value for f in RAY_FIELDS if (value := getattr(args, f"ray_{f.name}")) is not None}
    if given and "address" not in given:
        raise MergeError(None, f"--ray-{next(iter(given)).replace('_', '-')} needs --ray-address")
    return RaySettings(**given) if given else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="merge-pipeline",
        description="Merge sharded FSDP, Megatron-Core, DeepSpeed and torch DCP checkpoints into Hugging Face folders.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    merge = commands.add_parser("merge", help="merge a checkpoint role folder into an HF folder")
    _checkpoint_flags(merge, "merge")
    merge.add_argument(
        "--target_dir",
        required=True,
        type=as_location,
        help="output HF folder (created atomically), or a store URL (published with merge_manifest.json last)",
    )
    merge.add_argument("--hf_upload_path", help="also upload to this Hub repo (ORG/NAME)")
    _hub_flags(merge)
    _writer_flags(merge)
    _ray_flags(merge)
    merge.set_defaults(run=_run_merge)

    average = commands.add_parser(
        "average", help="average the weights of several checkpoints of one model into an HF folder (streamed)"
    )
    average.add_argument(
        "--inputs",
        required=True,
        nargs="+",
        type=as_location,
        metavar="DIR",
        help="checkpoint role folders or merged HF folders (mixed allowed; or their store URLs), oldest first; the last gives config.json and the tokenizer",
    )
    scheme = average.add_mutually_exclusive_group()
    scheme.add_argument(
        "--weights",
        nargs="+",
        type=float,
        metavar="W",
        help=f"{GIVEN_WEIGHTS} (default: equal weights)",
    )
    scheme.add_argument(
        "--ema",
        type=float,
        metavar="DECAY",
        help=f"{EMA_WEIGHTS} (DECAY)",
    )
    accumulate = option_field("average_accumulate")
    average.add_argument(
        "--accumulate",
        choices=accumulate.metadata["choices"],
        default=accumulate.default,
        help=f"{accumulate.metadata['help']} (default {accumulate.default}); --dtype is the output's",
    )
    average.add_argument(
        "--target_dir", required=True, type=as_location, help="output HF folder, or store URL (created atomically)"
    )
    _option_flags(average, "merge")
    _writer_flags(average)
    _ray_flags(average)
    average.set_defaults(run=_run_average)

    test = commands.add_parser("test", help="compare a checkpoint's merged weights with a reference HF folder")
    _checkpoint_flags(test, "test")
    test.add_argument(
        "--test_hf_dir",
        required=True,
        type=as_location,
        help="reference HF folder, or a merged folder in a store (s3://bucket/prefix)",
    )
    test.add_argument("--atol", type=float, default=0.0, help="allowed max abs difference (default 0: bit-exact)")
    test.set_defaults(run=_run_test)

    upload = commands.add_parser("upload", help="upload a merged folder to a Hub repo and verify it")
    upload.add_argument(
        "folder", type=as_location, help="a folder written by `merge`, or its store URL (s3://bucket/prefix)"
    )
    upload.add_argument("repo_id", metavar="ORG/NAME")
    _hub_flags(upload)
    upload.set_defaults(run=_run_upload)

    inspect = commands.add_parser("inspect", help="describe a checkpoint without loading tensor data")
    inspect.add_argument("local_dir", type=as_location)
    _option_flags(inspect, "inspect")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(run=_run_inspect)

    diff = commands.add_parser("diff", help="what changed between two merged folders, tensor by tensor (streamed)")
    diff.add_argument(
        "before", type=as_location, help="a merged folder (or store URL): the previous step, or the base model"
    )
    diff.add_argument("after", type=as_location, help="a merged folder (or store URL) compared with BEFORE")
    diff.set_defaults(run=_run_diff)

    queue = commands.add_parser(
        "queue", help="queue a Dagster merge of one step on a running webserver (behind the sensor's merges)"
    )
    queue.add_argument("partition", help="the step's partition key, e.g. my_run/global_step_5/actor")
    queue.add_argument("--url", default="http://127.0.0.1:3000", help="the Dagster webserver (default %(default)s)")
    queue.add_argument("--job", default="merge_checkpoint", help="a component with a prefix P: P__merge_checkpoint")
    queue.add_argument(
        "--config-json", type=_json_object, default={}, help="run config, as the UI's launchpad takes it"
    )
    queue.set_defaults(run=_run_queue)
    return parser


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _options(args: argparse.Namespace) -> MergeOptions:
    """The options the command's flags give (each command has the flags of its options); defaults for the rest."""
    if getattr(args, "use_cpu_initialization", False):
        log.info("--use_cpu_initialization is accepted for verl compatibility and ignored: merging always runs on CPU")
    return MergeOptions(
        **{option.name: getattr(args, option.name) for option in OPTION_FIELDS if hasattr(args, option.name)}
    )


def _writer_flags(parser: argparse.ArgumentParser) -> None:
    """What every command that writes a folder takes (merge, average): its progress, torchrun's patience."""
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    parser.add_argument(
        "--dist-timeout",
        type=float,
        metavar="SECONDS",
        help=f"torchrun: fail when another rank does not answer for this long (default ${DIST_TIMEOUT.variable} or {DIST_TIMEOUT.default})",
    )


def _workers(args: argparse.Namespace):
    """Who writes the weights (``workers_for``): Ray tasks with ``--ray-address``, torchrun's ranks under
    torchrun, else this process. An unreachable Ray head is refused here, before any work."""
    from merge_pipeline.workers import workers_for
    from merge_pipeline.workers.torchrun import launched_by_torchrun

    ray = _ray_settings(args)
    if ray is not None and launched_by_torchrun():
        raise MergeError(None, "--ray-address under torchrun: run the merge once, Ray starts the workers")
    if ray is None and not launched_by_torchrun() and os.environ.get("WORLD_SIZE", "1") != "1":
        log.warning(
            "WORLD_SIZE=%s is set but torchrun did not start this process: merging in this one process",
            printable(os.environ["WORLD_SIZE"]),
        )
    launcher = "ray" if ray is not None else "torchrun" if launched_by_torchrun() else "inprocess"
    return workers_for(launcher, ray=ray, dist_timeout=args.dist_timeout)


def _merged(args: argparse.Namespace, local_dir: str, options: MergeOptions):
    """The merge sequence into ``--target_dir``, by the workers the flags name; ``None`` on a torchrun rank
    other than 0 (its shards are written, rank 0 reports)."""
    from merge_pipeline.pipeline.merge import merge

    with _workers(args) as workers:
        return merge(local_dir, args.target_dir, options, workers=workers, show_progress=not args.no_progress)


def _run_merge(args: argparse.Namespace) -> int:
    options = _options(args)
    if args.hf_upload_path:  # a bad repo id, branch or timeout is refused now, not after the merge is published
        from merge_pipeline.hub.upload import check_upload_settings

        check_upload_settings(args.hf_upload_path, args.revision, args.hub_timeout)
    result = _merged(args, args.local_dir, options)
    if result is None:
        return 0
    fp8 = result.manifest["decisions"].get("fp8")
    quantization = result.manifest["decisions"].get("quantization")
    print(
        f"merged {result.parameters:,} parameters ({result.tensors} tensors, {human_bytes(result.tensor_bytes)} of tensor data) into {printable(str(result.target_dir))} in {result.seconds:.1f} s"
        + (
            f"; fp8: {fp8['quantized_weights']} weights quantized in {fp8['block']}x{fp8['block']} blocks,"
            f" {len(fp8['kept_modules'])} modules kept in bfloat16 ({len(fp8['off_grid'])} off the block grid)"
            if fp8
            else ""
        )
        + (
            f"; {quantization['scheme']}: {quantization['quantized_weights']} weights quantized ({quantization['format']}),"
            f" {len(quantization['ignore'])} modules kept in bfloat16 ({len(quantization['off_grid'])} off the scheme's groups)"
            + (f"; not loaded by {quantization['not_loaded_by']}" if "not_loaded_by" in quantization else "")
            if quantization
            else ""
        )
    )
    if args.hf_upload_path:
        return _upload(result.target_dir, args.hf_upload_path, args)
    return 0


def _run_average(args: argparse.Namespace) -> int:
    """The merge sequence on the average of ``--inputs``: under torchrun or on Ray too, as ``merge``."""
    inputs = tuple(str(absolute(path)) for path in args.inputs)
    options = dataclasses.replace(
        _options(args),
        average_inputs=inputs,
        average_weights=average_weights(len(inputs), weights=args.weights, ema=args.ema),
        average_accumulate=args.accumulate,
    )
    result = _merged(args, inputs[-1], options)
    if result is None:
        return 0
    weights = ", ".join(f"{w:.4g}" for w in options.average_weights)
    print(
        f"averaged {len(inputs)} checkpoints (weights {weights}, accumulated in {args.accumulate}): {result.parameters:,} parameters"
        f" ({result.tensors} tensors, {human_bytes(result.tensor_bytes)} of tensor data) into {printable(str(result.target_dir))} in {result.seconds:.1f} s"
    )
    return 0


def _run_upload(args: argparse.Namespace) -> int:
    return _upload(args.folder, args.repo_id, args)


def _upload(folder: str | Path, repo_id: str, args: argparse.Namespace) -> int:
    """A folder in a store is uploaded through its view: weight files streamed by ranged GETs, never downloaded."""
    from merge_pipeline.hub.upload import upload_folder_verified

    with viewed(folder, WEIGHT_SUFFIXES, merged=True) as local:
        upload = upload_folder_verified(
            local,
            repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            timeout_s=args.hub_timeout,
        )
    print(
        f"uploaded to {upload.url}: {len(upload.sent)} of {upload.files} files sent, all verified ({upload.commit_url})"
    )
    return 0


def _run_test(args: argparse.Namespace) -> int:
    from merge_pipeline.pipeline.inspect import compare

    result = compare(args.local_dir, args.test_hf_dir, _options(args), atol=args.atol)
    if result.worst:
        print("largest differences (max abs diff, tensor):")
    for diff, name in result.worst:
        print(f"  {diff:.3g}  {printable(name)}")
    for name in result.missing:
        print(f"missing from reference: {printable(name)}")
    for name in result.unexpected:
        print(f"only in reference: {printable(name)}")
    for name, what in result.mismatched:
        print(f"MISMATCH {printable(name)}: {what}")
    if not result.ok:
        print(
            f"FAILED: {len(result.mismatched)} mismatched, {len(result.missing)} missing, {len(result.unexpected)} unexpected of {result.compared} compared",
            file=sys.stderr,
        )
        return EXIT_MISMATCH
    cast = f" after casting to {', '.join(sorted(result.cast_to))}" if result.cast_to else ""
    print(f"OK: {result.compared} tensors match {printable(str(args.test_hf_dir))}{cast}")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from merge_pipeline.pipeline.inspect import describe
    from merge_pipeline.store.incomplete_uploads import describe as described_uploads
    from merge_pipeline.store.incomplete_uploads import incomplete_uploads

    try:  # said before the description, which a prefix of nothing but parts fails
        uploads = incomplete_uploads(args.local_dir)
    except MergeError as exc:  # credentials that may read the checkpoint but not list uploads
        log.debug("incomplete multipart uploads not listed: %s", exc)
        uploads = []
    if uploads:
        log.warning(
            "%s: %s, left by a merge that did not finish (the next merge into it aborts them)",
            str(args.local_dir).rstrip("/"),
            described_uploads(uploads),
        )
    info = describe(args.local_dir, _options(args))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            if key != "files":
                print(f"{key:>20}: {value}")
        print(f"{'files':>20}: {len(info['files'])} ({human_bytes(sum(f['size'] for f in info['files']))})")
    return 0


def _run_diff(args: argparse.Namespace) -> int:
    from merge_pipeline.hf.step_diff import diff_folders, markdown_table, summary_lines

    with (
        viewed(args.before, WEIGHT_SUFFIXES, merged=True) as before,
        viewed(args.after, WEIGHT_SUFFIXES, merged=True) as after,
    ):
        diff = diff_folders(after, {"before": before})
    print("\n".join([*summary_lines(diff), "", markdown_table(diff)]))
    return 0


def _run_queue(args: argparse.Namespace) -> int:
    from merge_pipeline.webserver.client import shown_url
    from merge_pipeline.webserver.queue import queue_merge

    run_id = queue_merge(args.url, args.partition, job=args.job, run_config=args.config_json)
    print(f"queued: {shown_url(args.url.rstrip('/'))}/runs/{printable(run_id)}")
    return 0


_TERMINATED: list[int] = []  # the SIGTERM received, if one was


def _terminated(signum, frame) -> None:
    """SIGTERM (a job scheduler, ``kill``) unwinds the merge as Ctrl-C does, so its staging and lock go.
    As KeyboardInterrupt: Ray's waits turn any other exception raised in them into a SystemError."""
    _TERMINATED.append(signum)
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        return args.run(args)
    except (MergeError, OSError) as exc:
        if args.verbose:
            raise
        # OSError (disk full, permission denied, ...): name the file, skip the traceback.
        print(f"error: {exc if isinstance(exc, MergeError) else os_error(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if _TERMINATED:
            print("terminated (SIGTERM): nothing was published", file=sys.stderr)
            return 128 + signal.SIGTERM
        print("interrupted: nothing was published", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
