"""The generation engine. Not implemented yet: the GLM-5.3 target model (issue #3) and
speculative decoding (issue #4) come next. Until then constructing an Engine raises
UnsupportedError (a NotImplementedError) that says so, rather than failing obscurely."""
from __future__ import annotations

from ._core import UnsupportedError


class Engine:
    def __init__(self, target=None, draft=None, method: str = "dflash2", device: str = "cpu", **kwargs):
        raise UnsupportedError(
            "dflash2_rt.Engine is not implemented yet: this build has checkpoint I/O, tensors and the op "
            "interface (CPU backend + CUDA RMSNorm); the GLM-5.3 target and DFlash 2 decoding are the next "
            "milestones (see README, 'Status')."
        )
