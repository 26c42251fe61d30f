"""Store -> store merge against the store's own floor, on an S3 server you point it at.

    AWS_ENDPOINT_URL=http://127.0.0.1:8333 AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
        python -m benchmarks.object_store --size large --bucket bench

The checkpoint (``benchmarks.checkpoints``) is uploaded once to ``s3://BUCKET/ckpt-<size>``. Then, each
timed in a fresh process (wall time, peak RSS of the process tree's largest member):
- floor: GET every input byte and PUT every output byte with the same client (s3fs, its own
  concurrency: ``cat`` of all rank files, ``put`` of the merged folder), nothing else;
- the store -> store merge (``merge --local_dir s3://... --target_dir s3://...``);
- the same merge on local disk;
- ``upload`` of the merged folder from the store to a Hub-compatible server started here on 127.0.0.1 (the
  tests' ``local_servers.fake_hub.FakeHub``), against reading its weight files once from the store (s3fs ``cat``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, ensure_checkpoint
from local_servers.fake_hub import FakeHub, User

FLOOR = r"""
import sys, s3fs, time
from pathlib import Path
fs = s3fs.S3FileSystem()
source, folder, target = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
keys = [k for k in fs.find(source) if k.endswith(".pt")]
started = time.monotonic()
got = sum(len(v) for v in fs.cat(keys).values())  # every input byte, concurrently
fs.put(str(folder) + "/", target + "/", recursive=True)  # every output byte
print(got, time.monotonic() - started)
"""


READ_ONCE = r"""
import sys, s3fs, time
fs = s3fs.S3FileSystem()
started = time.monotonic()
got = sum(len(v) for v in fs.cat([k for k in fs.find(sys.argv[1]) if k.endswith(".safetensors")]).values())
print(got, time.monotonic() - started)
"""
HUB_TOKEN = "hf_benchWRITERtoken"


# Runs the command as its only child and prints that child's peak RSS (getrusage of children, in KiB).
_PEAK = "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"


def timed(command: list[str], env: dict) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of ``command``, in a fresh process."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _PEAK, *command], env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    peak = int(done.stderr.rsplit("peak_kib", 1)[1].split()[0]) * 1024
    return seconds, peak, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.object_store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="large")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    import s3fs

    checkpoint = ensure_checkpoint(args.size, args.cache)
    fs = s3fs.S3FileSystem()
    if not fs.exists(args.bucket):
        fs.mkdir(args.bucket)
    root = checkpoint.role_dir.parent.parent
    source_prefix = f"{args.bucket}/ckpt-{args.size}"
    if not fs.exists(source_prefix):
        fs.put(str(root) + "/", source_prefix + "/", recursive=True)
    source = f"s3://{source_prefix}/{checkpoint.role_dir.relative_to(root).as_posix()}"
    merge = [sys.executable, "-m", "merge_pipeline", "merge", "--no-progress", *checkpoint.merge_flags]
    results = {"load_before": open("/proc/loadavg").read().split()[:3]}
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "MERGE_PIPELINE_SCRATCH": f"{scratch}/twin"}
        local = Path(scratch) / "local"
        seconds, rss, _ = timed([*merge, "--local_dir", str(checkpoint.role_dir), "--target_dir", str(local)], env)
        results["local_to_local"] = {"seconds": seconds, "peak_rss_mb": rss >> 20}
        fs.rm(f"{args.bucket}/floor-out", recursive=True) if fs.exists(f"{args.bucket}/floor-out") else None
        seconds, rss, out = timed(
            [sys.executable, "-c", FLOOR, source.removeprefix("s3://"), str(local), f"{args.bucket}/floor-out"], env
        )
        results["floor"] = {
            "seconds": seconds,
            "inner_seconds": float(out.split()[1]),
            "bytes_in": int(out.split()[0]),
            "peak_rss_mb": rss >> 20,
        }
        results["bytes_out"] = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        target = f"s3://{args.bucket}/merged-{args.size}"
        seconds, rss, _ = timed([*merge, "--local_dir", source, "--target_dir", target, "--overwrite"], env)
        results["store_to_store"] = {"seconds": seconds, "peak_rss_mb": rss >> 20}
        seconds, rss, out = timed([sys.executable, "-c", READ_ONCE, target.removeprefix("s3://")], env)
        results["read_weights_once"] = {"seconds": seconds, "inner_seconds": float(out.split()[1])}
        with FakeHub({HUB_TOKEN: User("bench", ("org",))}) as hub:
            hub_env = {**env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": HUB_TOKEN, "HF_HUB_DISABLE_XET": "1"}
            hub_env["HF_HOME"] = f"{scratch}/hf_home"
            upload = [sys.executable, "-m", "merge_pipeline", "upload", target, f"org/bench-{args.size}"]
            seconds, rss, _ = timed(upload, hub_env)
        results["upload_from_the_store"] = {"seconds": seconds, "peak_rss_mb": rss >> 20}
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    results["ratio_to_floor"] = results["store_to_store"]["seconds"] / results["floor"]["seconds"]
    results["upload_to_reading_once"] = (
        results["upload_from_the_store"]["seconds"] / results["read_weights_once"]["seconds"]
    )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
