"""mamba-ssm's SSD scan kernels, named only: each raises if called (see the package's docstring)."""


def _kernel(name):
    def raises(*args, **kwargs):
        raise NotImplementedError(f"mamba-ssm stand-in: {name} is a GPU kernel, not stood in")

    raises.__name__ = name
    return raises


mamba_chunk_scan_combined = _kernel("mamba_chunk_scan_combined")
mamba_split_conv1d_scan_combined = _kernel("mamba_split_conv1d_scan_combined")
