"""Cache storage (design.md §3.2): the transformers ``Cache`` classes that run the cache policies.

- :mod:`.progress`: `Progress`, the one counter class (a layer's counts, or a static phase's group of rows);
- :mod:`.policy_layer`: `PolicyLayer`, one layer's entries, positions, query window, statistics and counters (a
  policy's `LayerView`); :mod:`.append_buffers`: where its appends go (`AppendBuffers`: its own buffers with free
  slots, or lent ones); :mod:`.layout`: the reads that depend on its entries' layout (rectangular, or ragged);
- :mod:`.policy_cache`: `PolicyCache`, the ``Cache`` of every policy, and its hand-over methods;
- :mod:`.latent_kv`: `LatentKVCache`, the paper's latent eviction configured by an `EntropyConfig`;
- :mod:`.static_latent`: `StaticLatentKVCache`, the latent cache with static shapes after its first eviction
  (captured decoding): the transformers-facing facade over its current phase (:mod:`.phase`: `CachePhase`, the reads
  and writes both phases offer);
- :mod:`.dynamic_phase`: `DynamicPhase`, its layers (the prompt, phase 1, a later turn) and the way into the static
  phase;
- :mod:`.static_phase`: `StaticPhase`, the static phase (entering, deciding, rows, leaving, the step's layers);
- :mod:`.static_buffers`: its buffers (`StaticBuffers`) and a layer's step (`StepLayer`, `step_attention`);
- :mod:`.batch_rows`: its batch rows (`BatchRows`): one `Progress` per group of rows, and the device's copy of the
  counts;
- :mod:`.factory`: `make_cache`, a cache by policy name;
- :mod:`.keywords`: the cache's keyword across transformers versions.
"""

from __future__ import annotations

from flexentropy.caches.factory import make_cache
from flexentropy.caches.latent_kv import LatentKVCache
from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.caches.policy_layer import PolicyLayer
from flexentropy.caches.static_latent import StaticLatentKVCache

__all__ = ["LatentKVCache", "PolicyCache", "PolicyLayer", "StaticLatentKVCache", "make_cache"]
