"""The merge, start to end: the only package that uses both the readers (``formats``) and the writer (``engine``).

prepare   open and validate the checkpoint, decide every output file (no tensor data read)
folder    side files, then (after the weights) index, configs, the manifest and the blocking checks
merge     THE sequence: check the target, prepare, lock and stage, side files, weights, folder, checks, publish
inspect   ``describe`` and ``compare``, for the CLI's ``inspect`` and ``test``

Each name is imported from the module that defines it; this package hands none on.
"""
