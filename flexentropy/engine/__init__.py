"""The decode engine: the one owner of a decode step over a `StaticLatentKVCache`, and the loops that run it.

- :mod:`.driver`: `StepDriver` (a step prepared, run, recorded and replayed, advanced) and each model's drivers;
- :mod:`.compiled_layer`: the static step's decoder layers, all in one compiled function;
- :mod:`.loops`: `greedy_generate`, `warm_up`, `generate_batch`.
"""

from flexentropy.engine.driver import StepDriver, step_driver
from flexentropy.engine.loops import generate_batch, greedy_generate, warm_up

__all__ = ["StepDriver", "generate_batch", "greedy_generate", "step_driver", "warm_up"]
