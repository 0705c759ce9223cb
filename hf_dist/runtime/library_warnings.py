"""Library warnings a run would otherwise print on every step: said once per process instead.

DeepSpeed (0.19) calls ``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor``, which torch 2.13
deprecates with a ``FutureWarning``. Python shows a warning once per call site only until some library enters
``warnings.catch_warnings()``, which resets that memory: a 20-step ZeRO-3 run on 2 ranks printed it 84 times. The calls
are DeepSpeed's, not the user's, so :func:`quiet_deprecated_collectives` says it once and ignores the two messages.
"""

from __future__ import annotations

import warnings

DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
_quieted = False


def quiet_deprecated_collectives() -> None:
    """Warn once that DeepSpeed's collectives are deprecated in torch, then ignore torch's own warnings of them."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    warnings.warn(
        "DeepSpeed calls torch.distributed.all_gather_into_tensor / reduce_scatter_tensor, which this torch deprecates "
        "(FutureWarning); hf_dist says it once per process instead of at every step",
        FutureWarning,
        stacklevel=2,
    )
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning)
