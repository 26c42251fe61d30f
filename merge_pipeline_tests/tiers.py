"""The tiers, decided by what a test does: ``slow`` marks every test whose own body or any fixture it
uses writes a sample checkpoint or starts a process, and every ``torchrun`` or ``e2e`` test.

What a function does is read from its bytecode at collection: the names it loads (``subprocess.run``,
``write_fsdp_checkpoint``, a helper of the suite) are resolved in its module, and the suite's own
functions and the sample writers' are followed into, nested functions and lambdas included. It is
slow when it reaches a ``write_*`` function of ``merge_pipeline_samples`` or anything that starts a
process (``subprocess``, ``multiprocessing``, ``torch.multiprocessing``, ``os.fork``...). So a new
fixture is tiered by what it calls, wherever it is defined and whatever its name.

What bytecode cannot show (a writer reached through an object's method, a name built at run time)
the fast tier catches as it runs: while a test that is not ``slow`` is set up or runs, sample code
that creates a folder, opens a file for writing or starts a process raises, naming the test, so a
miss fails loudly instead of slowing the fast tier silently.
"""

from __future__ import annotations

import contextlib
import dis
import os
import sys
import types
from pathlib import Path

import pytest

import merge_pipeline_samples

SAMPLES = "merge_pipeline_samples"
_SAMPLES_DIR = str(Path(merge_pipeline_samples.__file__).parent) + os.sep
# Whose functions are read in turn, by their files (test modules are imported under rootdir-relative names).
_FOLLOWED = (str(Path(__file__).parent) + os.sep, _SAMPLES_DIR)
_PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process")
_PROCESS_FUNCTIONS = {
    getattr(os, name) for name in dir(os) if name.startswith(("fork", "spawn", "posix_spawn", "exec"))
}
_PROCESS_FUNCTIONS |= {os.system, os.popen}
_ATTRIBUTE_LOADS = {"LOAD_ATTR", "LOAD_METHOD"}

_why_cache: dict[types.CodeType, str | None] = {}


def why_slow(function) -> str | None:
    """What makes calling ``function`` slow (``writes a sample checkpoint (write_x)``, ``starts a
    process (subprocess.run)``), or None."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    if code not in _why_cache:
        _why_cache[code] = _why_code(code, function.__globals__, set())
    return _why_cache[code]


def _why_code(code: types.CodeType, namespace: dict, seen: set) -> str | None:
    if code in _why_cache:
        return _why_cache[code]
    if code in seen:  # a cycle: what it reaches is found where it was entered first
        return None
    seen.add(code)
    why = None
    for value in _loaded(code, namespace):
        why = _why_value(value, seen)
        if why:
            break
    else:
        for inner in code.co_consts:  # nested functions, lambdas, comprehensions
            if isinstance(inner, types.CodeType):
                why = _why_code(inner, namespace, seen)
                if why:
                    break
    if why is not None:  # a None is final only for the whole walk (a cycle may have cut this one short)
        _why_cache[code] = why
    return why


def _loaded(code: types.CodeType, namespace: dict):
    """Every value ``code`` loads by a global name, and each attribute taken on it in a chain
    (``subprocess`` then ``subprocess.run``)."""
    builtins = namespace.get("__builtins__", {})
    builtins = builtins if isinstance(builtins, dict) else vars(builtins)
    value, missing = None, object()
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            value = namespace.get(instruction.argval, builtins.get(instruction.argval, missing))
        elif instruction.opname in _ATTRIBUTE_LOADS and value is not None:
            try:
                value = getattr(value, instruction.argval, missing)
            except Exception:  # noqa: BLE001 - a property that needs its object set up: nothing to read
                value = missing
        else:
            value = None
            continue
        if value is missing:
            value = None
        else:
            yield value


def _why_value(value, seen: set) -> str | None:
    if type(value) in (dict, list, tuple):  # a table of writers (one level: tables of tables are data)
        values = value.values() if type(value) is dict else value
        return next((w for v in values if type(v) not in (dict, list, tuple) and (w := _why_value(v, seen))), None)
    module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None) or ""
    if module.startswith(_PROCESS_MODULES) and callable(value) or _is_process_function(value):
        return f"starts a process ({module}.{getattr(value, '__qualname__', type(value).__qualname__)})"
    if isinstance(value, types.FunctionType) and value.__code__.co_filename.startswith(_FOLLOWED):
        if value.__code__.co_filename.startswith(_SAMPLES_DIR) and value.__name__.startswith("write_"):
            return f"writes a sample checkpoint ({module}.{value.__qualname__})"
        return _why_code(value.__code__, value.__globals__, seen)
    if isinstance(value, type) and value.__module__ in sys.modules:  # a helper class: what its methods do
        methods = [m for m in vars(value).values() if isinstance(m, types.FunctionType)]
        return next((w for m in methods if (w := _why_value(m, seen))), None)
    return None


def _is_process_function(value) -> bool:
    try:
        return value in _PROCESS_FUNCTIONS
    except TypeError:  # unhashable
        return False


def why_test_is_slow(item: pytest.Item) -> str | None:
    """Why this collected test belongs in the slow tier (the first reason found), or None."""
    if any(item.iter_markers("torchrun")) or any(item.iter_markers("e2e")):
        return "launches torchrun or Dagster's processes"
    if (why := why_slow(getattr(item, "function", None))) is not None:
        return f"its body {why}"
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        for definition in definitions:
            if (why := why_slow(definition.func)) is not None:
                return f"fixture {name} {why}"
    return None


def pytest_collection_modifyitems(items):
    for item in items:
        if why_test_is_slow(item) is not None:
            item.add_marker(pytest.mark.slow)


# The fast tier's tripwire: the fast test running now (None outside a fast test's setup and call).
_fast_test: str | None = None
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND
_WATCHED = {"os.mkdir", "subprocess.Popen", "os.fork", "os.posix_spawn", "os.system", "os.exec", "open"}


class SlowWorkInFastTest(RuntimeError):
    """Sample code wrote or started a process inside a test the tier rule left in the fast tier."""


def _tripwire(event: str, args: tuple) -> None:
    if _fast_test is None or event not in _WATCHED:
        return
    if event == "open" and not _opens_for_writing(args):
        return
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_SAMPLES_DIR):
            raise SlowWorkInFastTest(
                f"{_fast_test}: {frame.f_code.co_name} of {SAMPLES} ({event}) runs in a test of the fast tier: "
                "merge_pipeline_tests/tiers.py did not see it (make the writer a write_* function the test or "
                "its fixture calls by name, or mark the test slow)"
            )
        frame = frame.f_back


def _opens_for_writing(args: tuple) -> bool:
    _, mode, flags = (*args, None, None)[:3]
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


sys.addaudithook(_tripwire)


@contextlib.contextmanager
def watching(test: str | None):
    """Sample code that writes or starts a process raises while this runs, naming ``test`` (None: not
    watched). Nests: a fast test running pytest in this process is watched again once it returns."""
    global _fast_test
    outer, _fast_test = _fast_test, test
    try:
        yield
    finally:
        _fast_test = outer


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with watching(None if any(item.iter_markers("slow")) else item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with watching(None if any(item.iter_markers("slow")) else item.nodeid):
        return (yield)
