"""mamba-ssm's Triton operations: see the package's docstring."""
