"""TE's CUDA RNG tracker, as megatron-core subclasses it; on CPU it forks torch's one generator."""

import contextlib

import torch


class CudaRNGStatesTracker:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states) -> None:
        self.states_ = dict(states)

    def add(self, name, seed) -> None:
        self.states_[name] = seed

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        with torch.random.fork_rng(devices=[]):
            yield


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False):
    """TE marks the forward of a recomputed activation; nothing is recomputed here."""
    yield
