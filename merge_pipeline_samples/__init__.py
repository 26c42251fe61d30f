"""Sample checkpoints written by the real training libraries, for tests, the demo and benchmarks."""
