"""TransformerEngine's recipe classes by name: megatron-core subclasses ``DelayedScaling`` at import."""

import enum


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


class Recipe:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("the TransformerEngine stand-in has no FP8 recipes")


class DelayedScaling(Recipe):
    pass


class Float8CurrentScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


class NVFP4BlockScaling(Recipe):
    pass
