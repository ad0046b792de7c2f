"""Hierarchical token pooling at inference: fewer vectors per document for a smaller index.

A document's token vectors are clustered by Ward linkage on their cosine distances and each
cluster is replaced by its mean, as sentence-transformers 6.2's ``HierarchicalTokenPooling`` and
PyLate (> 1.3.4) do:

- the first ``num_protected_tokens`` vectors (the ``[CLS]``) are kept as they are, ahead of the
  pooled ones;
- the rest (``n`` vectors) go into ``max(floor(n / pool_factor), 1)`` clusters (the cluster count
  rounds *down*, in sentence-transformers, PyLate and colpali-engine alike), cut from the Ward
  tree with scipy's ``fcluster(criterion="maxclust")``; nothing is pooled when that count is not
  smaller than ``n``;
- the pooled vectors come in the order of the cluster labels, and (``normalize``, the default
  of sentence-transformers) every output vector is L2-normalised again.

colpali-engine's ``HierarchicalTokenPooler`` differs (it runs the linkage on the rows of the
distance matrix as observations, has no protected tokens): with ``num_protected_tokens=0`` and
``normalize=True`` this is sentence-transformers' closest setting to it, not the same clusters.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def cluster_count(n: int, pool_factor: float) -> int:
    """How many vectors ``n`` poolable vectors become: ``max(floor(n / pool_factor), 1)``."""
    if pool_factor < 1:
        raise ValueError(f"pool_factor must be >= 1, got {pool_factor}")
    return max(int(n // pool_factor), 1)


def cluster_labels(vectors: torch.Tensor, clusters: int) -> np.ndarray:
    """Ward-linkage cluster labels (0-based, dense) of unit ``vectors`` ``[n, D]`` cut into at
    most ``clusters`` clusters, on the cosine distance ``clamp(1 - u.v, 0, 2)``."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    x = vectors.detach().float().cpu()
    distances = (1.0 - x @ x.T).clamp_(0.0, 2.0).numpy()
    tree = linkage(squareform(distances, checks=False), method="ward")
    labels = fcluster(tree, t=clusters, criterion="maxclust")
    return np.unique(labels, return_inverse=True)[1].reshape(-1)


def pool_tokens(vectors: torch.Tensor, pool_factor: float, *, num_protected_tokens: int = 1,
                normalize: bool = True) -> torch.Tensor:
    """Pool one document's present token vectors ``[L, D]`` into ``[k, D]``.

    Args:
        vectors: the document's kept token vectors (L2-normalised, no padding rows).
        pool_factor: keep about ``1 / pool_factor`` of the vectors (``1``: no pooling; fractions
            such as ``1.5`` allowed).
        num_protected_tokens: leading vectors not pooled (sentence-transformers' default 1:
            the ``[CLS]``).
        normalize: L2-normalise the output vectors (cluster means are shorter than 1).

    Returns:
        The protected vectors, then one mean per cluster (in label order); gradients flow
        through the means (the clustering itself is not differentiated).
    """
    if num_protected_tokens < 0:
        raise ValueError(f"num_protected_tokens must be >= 0, got {num_protected_tokens}")
    protected, rest = vectors[:num_protected_tokens], vectors[num_protected_tokens:]
    n = rest.shape[0]
    clusters = cluster_count(n, pool_factor)
    out = vectors
    if n and clusters < n:
        labels = torch.from_numpy(cluster_labels(rest, clusters)).to(rest.device)
        k = int(labels.max()) + 1
        sums = torch.zeros(k, rest.shape[1], dtype=rest.dtype, device=rest.device).index_add(0, labels, rest)
        counts = torch.bincount(labels, minlength=k).to(rest.dtype).unsqueeze(1)
        out = torch.cat([protected, sums / counts])
    if normalize:
        out = F.normalize(out.float(), dim=-1).to(vectors.dtype)
    return out


def pool_batch(output: torch.Tensor, pool_factor: float, **options) -> list[torch.Tensor]:
    """:func:`pool_tokens` on each row of a late-interaction output ``[N, L, D]`` (present
    tokens: the nonzero vectors): a list of ``[k_i, D]``."""
    present = output.ne(0).any(-1)
    return [pool_tokens(row[m], pool_factor, **options) for row, m in zip(output, present)]
