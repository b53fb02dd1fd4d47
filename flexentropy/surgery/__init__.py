"""Model surgery: rewrites of a loaded model's modules that keep every forward's result (torch only).

- :mod:`.fusion`: `fuse_projections`, each attention's q/k/v and each gated MLP's gate/up as one matrix product;
- :mod:`.chunked_mlp`: `chunk_mlp`, the MLPs of a long forward run over chunks of tokens.
"""

from flexentropy.surgery.chunked_mlp import chunk_mlp
from flexentropy.surgery.fusion import fuse_projections

__all__ = ["chunk_mlp", "fuse_projections"]
