"""Real servers started on 127.0.0.1 for the tests and the benchmarks: a Hub-compatible server
(``fake_hub``) and a multi-node Ray cluster (``ray_cluster``). They import nothing of this repository, so the
benchmarks reach them without the tests' package (and through it, the CLI)."""
