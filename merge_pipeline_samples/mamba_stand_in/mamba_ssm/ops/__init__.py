"""mamba-ssm's operations: see the package's docstring."""
