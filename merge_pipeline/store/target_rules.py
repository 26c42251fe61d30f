"""What a merge may write to: one set of rules for a folder and a store prefix (``s3://bucket/prefix``).

1. The target is not, lies not inside and contains no input (the checkpoint, every averaged input, the
   ``--hf_model_path`` folder): publishing replaces the target, so an overlap could destroy the only copy of
   a training run. Folders are compared with symlinks and ``..`` resolved, store URLs by protocol, bucket
   and key parts (a trailing or doubled ``/`` changes nothing); a folder never overlaps a prefix.
2. A target that is not empty is replaced only if this tool wrote it: a folder holding our manifest
   (``engine.publish``, which swaps the whole folder), a prefix whose every object is named by our
   manifest or by the record of a merge publishing into it (``record.written_names``); anything else is
   refused, even with ``--overwrite``, in the same words. Publishing deletes only objects named so.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.store.asking import asking
from merge_pipeline.store.published_prefix import complete_target
from merge_pipeline.store.record import MANIFEST, written_names
from merge_pipeline.store.url import is_store_url, location
from merge_pipeline.store.view import listed

SHOWN_FOREIGN = 3  # names of objects we did not write, in the refusal


def refuse_overlap(target: str | Path, inputs: Iterable[str | Path]) -> None:
    """Refuse a target equal to, inside or containing any of ``inputs``."""
    for source in inputs:
        problem = _overlap(target, source)
        if problem:
            raise _refusal(target, f"{problem} {source}: choose a --target_dir outside it")


def _overlap(target: str | Path, source: str | Path) -> str | None:
    a, b = _parts(target), _parts(source)
    if a == b:
        return "is the input checkpoint"
    if a[: len(b)] == b:
        return "lies inside the input checkpoint"
    if b[: len(a)] == a:
        return "contains the input checkpoint"
    return None


def within(inner: str | Path, outer: str | Path) -> bool:
    """Whether ``inner`` is ``outer`` or lies inside it, compared as the overlap rule compares."""
    return _parts(inner)[: len(_parts(outer))] == _parts(outer)


def _parts(location: str | Path) -> tuple[str, ...]:
    """A folder's parts, symlinks and ``..`` resolved; a URL's protocol and non-empty key parts
    (``s3://b//p/`` and ``s3://b/p`` name one prefix). A folder's start with ``/``, a URL's with its
    protocol: a folder never overlaps a prefix."""
    if not is_store_url(location):
        return Path(os.path.realpath(location)).parts
    protocol, _, rest = str(location).partition("://")
    return (protocol.lower(), *(part for part in rest.split("/") if part))


def _refusal(target: str | Path, problem: str) -> MergeError:
    return (
        MergeError(None, f"{str(target).rstrip('/')}: {problem}")
        if is_store_url(target)
        else MergeError(target, problem)
    )


def not_ours(target: str | Path) -> MergeError:
    """The refusal of a non-empty target without our manifest, folder or prefix alike."""
    return _refusal(
        target,
        f"is not empty and has no {MANIFEST} from merge_pipeline: not replaced, even with --overwrite (move it away or choose another --target_dir)",
    )


def check_store_target(url: str, *, overwrite: bool) -> None:
    """Refuse, before any work, a prefix that holds objects this tool did not write (with or without
    ``--overwrite``) and a complete merged model without ``--overwrite``; a missing bucket and wrong
    credentials are refused here too. An empty prefix, or one a killed merge left, may be written."""
    store = location(url)
    with asking(url):
        objects = listed(store)
        if not objects:
            return
        ours = written_names(store)
    if ours is None:
        raise not_ours(url)
    foreign = sorted(set(objects) - ours)
    if foreign:
        shown = ", ".join(foreign[:SHOWN_FOREIGN]) + (", ..." if len(foreign) > SHOWN_FOREIGN else "")
        raise _refusal(
            url,
            f"holds {len(foreign)} object(s) that no {MANIFEST} from merge_pipeline names ({shown}): not replaced, "
            "even with --overwrite (move them away or choose another --target_dir)",
        )
    if not overwrite and complete_target(url) is not None:
        raise _refusal(url, "already holds a merged model (pass --overwrite to replace it)")
