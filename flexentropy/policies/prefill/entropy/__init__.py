"""The ``entropy`` prefill rule and its internals (design.md §1; EntropyInfer, paper sec. 4.2): representatives ->
observation -> entropy -> budgets -> selection, a `SparsePlan` run by the generic kernel of `flexentropy.sparse`.

`policy.py` holds the rules (`EntropyPrefill`, `EntropyPaperPrefill`) and the entropy method's public front doors
(`select_blocks`, `sparse_prefill_attention`); the stages, one module each: `representatives.py` (Alg. 1),
`observation.py` and `probe_mass.py` (Alg. 2 and the probe observations), `entropies.py`, `budgets.py` (Alg. 3),
`selection.py` (the top-k and the plan, compiled on CUDA). The blocks every rule keeps are in
`flexentropy.policies.prefill.fixed`, the ranking helpers in `flexentropy.policies.prefill.ranking`.
"""
