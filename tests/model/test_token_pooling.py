"""Hierarchical token pooling (mmembed.model.token_pooling) against sentence-transformers 6.2's
``HierarchicalTokenPooling`` on the same vectors: the same pooled vectors to 1e-6, over pool
factors (integer and fractional), protected-token counts and normalisation, and on the padded
output of a late-interaction batch."""

import pytest
import torch
import torch.nn.functional as F

from mmembed.model.token_pooling import cluster_count, pool_batch, pool_tokens


def _vectors(n: int, dim: int = 24, centres: int = 5, seed: int = 0) -> torch.Tensor:
    """Unit vectors around a few centres (so the clustering has structure), some far off."""
    g = torch.Generator().manual_seed(seed)
    base = F.normalize(torch.randn(centres, dim, generator=g), dim=-1)
    picks = torch.randint(0, centres, (n,), generator=g)
    return F.normalize(base[picks] + 0.3 * torch.randn(n, dim, generator=g), dim=-1)


@pytest.mark.parametrize("pool_factor", [1, 1.5, 2, 3, 7, 100])
@pytest.mark.parametrize("protected", [0, 1, 3])
@pytest.mark.parametrize("normalize", [True, False])
def test_same_as_sentence_transformers(pool_factor, protected, normalize):
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling

    reference = HierarchicalTokenPooling(pool_factor, num_protected_tokens=protected, normalize_embeddings=normalize)
    for seed, n in ((0, 37), (1, 12), (2, 2)):
        vectors = _vectors(n, seed=seed)
        ours = pool_tokens(vectors, pool_factor, num_protected_tokens=protected, normalize=normalize)
        theirs = reference.pool_one(vectors)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
        if pool_factor > 1 and n - protected > 1:
            assert len(ours) == protected + cluster_count(n - protected, pool_factor) < n


def test_cluster_count_rounds_down():
    assert [cluster_count(n, 2) for n in (1, 2, 3, 9)] == [1, 1, 1, 4]
    assert cluster_count(10, 1.5) == 6
    with pytest.raises(ValueError):
        cluster_count(10, 0.5)


def test_pool_batch_reads_present_tokens():
    """On a padded [N, L, D] output (absent tokens exactly zero), the same as s-t's ``pool`` with
    the mask."""
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling

    rows = [_vectors(20, seed=3), _vectors(9, seed=4)]
    padded = torch.zeros(2, 25, 24)
    mask = torch.zeros(2, 25, dtype=torch.bool)
    padded[0, :20], mask[0, :20] = rows[0], True
    padded[1, 3:12], mask[1, 3:12] = rows[1], True  # left-padded row
    ours = pool_batch(padded, 2)
    theirs = HierarchicalTokenPooling(2).pool(padded, attention_mask=mask)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b[: len(a)], atol=1e-6, rtol=0)
        assert not b[len(a):].any()
    assert [len(x) for x in ours] == [1 + 9, 1 + 4]


def test_gradient_flows_through_the_means():
    vectors = _vectors(16).requires_grad_(True)
    pool_tokens(vectors, 4).sum().backward()
    assert vectors.grad is not None and vectors.grad.abs().sum() > 0
