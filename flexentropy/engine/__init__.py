"""The decode engine: the one owner of a decode step over a `StaticLatentKVCache`, and the loops that run it.

- :mod:`.driver`: `begin_step` and `end_step` (the host's and the device's parts around a forward), `StepDriver` (a
  whole step: prepared, run, recorded and replayed, advanced), `step_driver` (each model's drivers, in one table)
  and `observe_steps` (an observer around every step of a model's drivers);
- :mod:`.compiled_layer`: the static step's decoder layers, all in one compiled function;
- :mod:`.loops`: `greedy_generate`, the plain loop of a transformers model;
- :mod:`.batch`: `generate_batch`, the batch scheduler;
- :mod:`.warm_up`: `warm_up`, what a server runs compiled and recorded before its first request, and
  `compiled_work`, what the compiled work kept in its ``compiled_dir`` did.
"""

from flexentropy.engine.batch import generate_batch
from flexentropy.engine.driver import StepDriver, begin_step, end_step, observe_steps, step_driver
from flexentropy.engine.loops import greedy_generate
from flexentropy.engine.warm_up import compiled_work, warm_up

__all__ = ["StepDriver", "begin_step", "compiled_work", "end_step", "generate_batch", "greedy_generate",
           "observe_steps", "step_driver", "warm_up"]
