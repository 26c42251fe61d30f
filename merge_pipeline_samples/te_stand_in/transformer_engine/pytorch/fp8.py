"""FP8 state as TransformerEngine reports it with no FP8 recipe active: never enabled."""

from contextlib import contextmanager


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def with_fp8_parameters() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


@contextmanager
def fp8_autocast(enabled: bool = False, **kwargs):
    if enabled:
        raise NotImplementedError("the TransformerEngine stand-in has no FP8")
    yield


@contextmanager
def fp8_model_init(enabled: bool = False, **kwargs):
    if enabled:
        raise NotImplementedError("the TransformerEngine stand-in has no FP8")
    yield


autocast = fp8_autocast
quantized_model_init = fp8_model_init
