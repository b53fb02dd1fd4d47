"""``pyramidkv``: SnapKV with layer budgets decreasing linearly from the bottom layer to the top one
(PyramidKV, Cai et al., 2024: "pyramidal information funneling")."""

from __future__ import annotations

from dataclasses import dataclass

from flexentropy._checks import check_number
from flexentropy.policies.cache.snapkv import SnapKV
from flexentropy.policies.layer_view import LayerView


def pyramid_budgets(budget: int, window: int, num_layers: int, beta: float, prompt_length: int | None = None
                    ) -> list[int]:
    """Entries per KV head of each layer, bottom to top (PyramidKV's allocation).

    Beyond the window, the top layer keeps ``(budget - window) // beta`` entries and the bottom one
    ``2 * (budget - window) - top``, the layers in between on the straight line (floored), so the mean is ``budget``
    up to rounding (PyramidKV's released code floors the *step* instead, which lifts the mean above the uniform
    budget by up to half a step per layer). When the prompt is too short for the bottom budget, the bottom is capped
    at what the prompt holds beyond the window and the top raised to keep the mean (as the released code does).
    """
    spare = budget - window
    low = int(spare // beta)
    high = 2 * spare - low
    if prompt_length is not None and high >= prompt_length - window:
        high = max(prompt_length - window, 0)
        low = 2 * spare - high
    if num_layers == 1:
        return [budget]
    return [window + high + (layer * (low - high)) // (num_layers - 1) for layer in range(num_layers)]  # exact floor


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV scoring and schedule; layer ``l`` keeps `pyramid_budgets` ``[l]`` entries per KV head (mean ``budget``).

    Knobs: SnapKV's plus ``beta`` (20, PyramidKV's default: the top layer keeps ``1/beta`` of the bottom's share).
    Needs the number of layers: build the cache with ``model=`` or ``num_layers=``.
    """

    name = "pyramidkv"
    paper = "PyramidKV (Cai et al., 2024)"
    keeps = "SnapKV's set with a per-layer budget, linear from 2*budget-ish (bottom) to budget/beta (top)"
    decides = "once, right after the prompt's forward"

    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(type(self).__name__, "beta", self.beta, 1.0)

    def layer_budget(self, layer: LayerView) -> int:
        if layer.num_layers is None:
            raise ValueError("PyramidKV needs the number of layers: build the cache with make_cache('pyramidkv', "
                             "model=model) or num_layers=")
        budgets = pyramid_budgets(self.budget, self.window, layer.num_layers, self.beta, layer.prompt_length)
        return max(budgets[layer.layer_idx], self.window)
