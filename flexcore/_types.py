"""Public type aliases for mods."""
from __future__ import annotations

from typing import Callable

from torch import Tensor

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``; every argument is a tensor.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``; True keeps the position.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
