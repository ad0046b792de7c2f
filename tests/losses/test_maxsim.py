"""MaxSim (mmembed.losses.maxsim) and InfoNCE over MaxSim, against independent references:
a written-out MaxSim and a written-out per-anchor InfoNCE loop (plain Python over groups),
sentence-transformers 6.2's MaxSim and its ``MultiVectorMultipleNegativesRankingLoss``
(scale = 1 / T) on the same token vectors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from reference_losses import reference_maxsim
from torch import nn

from mmembed.losses import DOT, InfoNCELoss, LateInteractionInfoNCELoss, MaxSim, build_loss
from mmembed.losses.maxsim import maxsim, maxsim_pairs, present_tokens, trim_tokens

DIM = 6


def tokens(gen: torch.Generator, n: int, length: int, lengths=None, holes: bool = True,
           dtype=torch.float64) -> torch.Tensor:
    """``[n, length, DIM]`` unit token vectors; row ``i`` keeps its first ``lengths[i]`` positions
    (random when None), and with ``holes`` one kept middle token is masked out too."""
    x = F.normalize(torch.randn(n, length, DIM, generator=gen, dtype=dtype), dim=-1)
    if lengths is None:
        lengths = torch.randint(1, length + 1, (n,), generator=gen).tolist()
    for i, keep in enumerate(lengths):
        x[i, keep:] = 0
        if holes and keep >= 3:
            x[i, keep // 2] = 0
    return x


def brute_matrix(q, d, normalize=False) -> torch.Tensor:
    return torch.tensor([[reference_maxsim(a, b, normalize) for b in d] for a in q], dtype=torch.float64)


# ---- MaxSim --------------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 50, 2**25])
def test_maxsim_equals_the_written_out_definition(normalize, chunk):
    g = torch.Generator().manual_seed(0)
    q, d = tokens(g, 5, 4), tokens(g, 7, 6)
    d[3] = 0  # a document with no present token scores 0
    q[4] = 0  # so does a query with none
    ref = brute_matrix(q, d, normalize)
    torch.testing.assert_close(maxsim(q, d, normalize=normalize, chunk=chunk), ref, atol=1e-12, rtol=0)
    assert ref[:, 3].abs().max() == 0 and ref[4].abs().max() == 0
    pairs = maxsim_pairs(q, d[:5], normalize=normalize, chunk=chunk)
    torch.testing.assert_close(pairs, ref[:, :5].diagonal(), atol=1e-12, rtol=0)


def test_absent_document_tokens_are_never_chosen():
    """A query token whose every real dot product is negative scores that negative maximum,
    not the 0 of a padding vector (colpali-engine's einsum + amax would give 0)."""
    q = torch.zeros(1, 2, DIM, dtype=torch.float64)
    q[0, 0, 0] = 1.0
    d = torch.zeros(1, 3, DIM, dtype=torch.float64)
    d[0, 0, 0] = -1.0
    d[0, 1, 1] = -1.0
    d[0, 1] = F.normalize(torch.tensor([-1.0, -2, 0, 0, 0, 0], dtype=torch.float64), dim=0)
    expect = max(-1.0, -1 / math.sqrt(5))
    assert float(maxsim(q, d)) == pytest.approx(expect, abs=1e-12)
    assert float(maxsim_pairs(q, d)) == pytest.approx(expect, abs=1e-12)
    padded_amax = torch.einsum("qid,cjd->qcij", q, d).amax(-1).sum(-1)  # zeros taking part in the max
    assert float(padded_amax) == 0.0


def test_maxsim_equals_sentence_transformers_maxsim_with_masks():
    from sentence_transformers.util.similarity import maxsim as st_maxsim

    g = torch.Generator().manual_seed(1)
    q, d = tokens(g, 6, 5, holes=False, dtype=torch.float32), tokens(g, 9, 8, holes=False, dtype=torch.float32)
    for normalize in (False, True):
        ref = st_maxsim(q, d, a_mask=present_tokens(q), b_mask=present_tokens(d), length_normalize=normalize)
        torch.testing.assert_close(maxsim(q, d, normalize=normalize, chunk=100), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("normalize", [False, True])
def test_chunked_gradients_equal_the_unchunked_product(normalize):
    g = torch.Generator().manual_seed(2)
    q0, d0 = tokens(g, 4, 5), tokens(g, 6, 7)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64)
    grads = []
    for chunk in (1, 13, 2**25):
        q, d = q0.clone().requires_grad_(), d0.clone().requires_grad_()
        (maxsim(q, d, normalize=normalize, chunk=chunk) * w).sum().backward()
        grads.append((q.grad, d.grad))
    # the unchunked reference, written out: one einsum, absent document tokens at -inf
    q, d = q0.clone().requires_grad_(), d0.clone().requires_grad_()
    sim = torch.einsum("qid,cjd->qcij", q, d).masked_fill(~present_tokens(d0)[None, :, None, :], float("-inf"))
    ref = (sim.amax(-1) * present_tokens(q0)[:, None, :]).sum(-1)  # absent query tokens: no score, no gradient
    if normalize:
        ref = ref / present_tokens(q0).sum(-1, keepdim=True)
    (ref * w).sum().backward()
    for gq, gd in grads:
        torch.testing.assert_close(gq, q.grad, atol=1e-12, rtol=0)
        torch.testing.assert_close(gd, d.grad, atol=1e-12, rtol=0)
    assert q.grad.abs().max() > 0.1


def _saved_numels(fn) -> list[int]:
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_the_product_is_not_saved_for_backward():
    """Under autograd only views of the inputs, small masks and the argmax indices [b, Lq, c]
    are saved; never a tensor of the [b, c, Lq, Ld] product's size (nor one chunk's)."""
    g = torch.Generator().manual_seed(3)
    b, lq, c, ld = 4, 6, 16, 20
    q = tokens(g, b, lq, dtype=torch.float32).requires_grad_()
    d = tokens(g, c, ld, dtype=torch.float32).requires_grad_()
    product = b * c * lq * ld
    chunk = b * lq * ld * 8  # eight documents per step
    saved = _saved_numels(lambda: maxsim(q, d, chunk=chunk).sum())
    inputs = max(q.numel(), d.numel())
    assert max(saved) <= inputs < chunk  # views of the inputs are the biggest saved tensors
    indices = [n for n in saved if n == b * lq * 8]
    assert len(indices) == c // 8  # one [b, Lq, 8] index tensor per step
    assert sum(saved) < product / 2  # (views of the inputs counted once per step)
    # the naive form saves the whole product (a check that the measurement can fail)
    naive = _saved_numels(lambda: torch.einsum("qid,cjd->qcij", q, d).amax(-1).sum())
    assert max(naive) >= product


def test_trim_tokens_drops_only_columns_absent_in_every_row():
    g = torch.Generator().manual_seed(4)
    x = tokens(g, 3, 9, lengths=[2, 5, 3])
    t = trim_tokens(x)
    assert t.shape == (3, 5, DIM) and torch.equal(t, x[:, :5])
    assert trim_tokens(torch.zeros(2, 4, DIM)).shape == (2, 1, DIM)
    d = tokens(g, 4, 9)
    torch.testing.assert_close(maxsim(t, d), maxsim(x, d), atol=1e-12, rtol=0)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match=r"\[n, L, D\]"):
        maxsim(torch.zeros(2, 3), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="chunk"):
        maxsim(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), chunk=0)
    with pytest.raises(ValueError, match="chunk"):
        MaxSim(chunk=True)


# ---- InfoNCE over MaxSim: a per-anchor loop ----------------------------------------------------

def group_batch(gen, neg_counts, lq=4, ld=7):
    """Rows a0, p0, n0_*, a1, ... ([N, ld, DIM]; anchors use only their first lq positions) and labels."""
    rows, labels = [], []
    for c in neg_counts:
        rows.append(tokens(gen, 1, ld, lengths=[int(torch.randint(1, lq + 1, (1,), generator=gen))]))
        rows.append(tokens(gen, 1 + c, ld))
        labels += [1.0] + [0.0] * c
    return torch.cat(rows), torch.tensor(labels, dtype=torch.float64)


def loop_infonce(emb, labels, *, temperature, use_batch=True, hard_negatives=None, mask_fake_negative=False,
                 fake_neg_margin=0.1, include_qq=False, include_dd=False, normalize=False):
    """ms-swift's InfoNCE (DESIGN.md) with s = MaxSim, one anchor at a time."""
    def s(a, b):
        return reference_maxsim(a, b, normalize)

    groups, i, li = [], 0, 0
    while i < emb.shape[0]:
        negs = []
        j, li = i + 2, li + 1
        while li < len(labels) and labels[li] == 0.0:
            negs.append(emb[j])
            j, li = j + 1, li + 1
        if hard_negatives is not None:
            assert len(negs) >= hard_negatives  # the tests keep the selection deterministic
            negs = negs[:hard_negatives]
        groups.append((emb[i], emb[i + 1], negs))
        i = j
    docs = [d for _, p, ns in groups for d in [p, *ns]]
    pos_col = []
    col = 0
    for _, _, ns in groups:
        pos_col.append(col)
        col += 1 + len(ns)
    total = 0.0
    for gi, (a, p, ns) in enumerate(groups):
        if not use_batch:
            logits = [s(a, p)] + [s(a, n) for n in ns]
            target = 0
        else:
            sp = s(a, p)
            qd = [s(a, d) for d in docs]
            if mask_fake_negative:
                qd = [v if (k == pos_col[gi] or v <= sp + fake_neg_margin) else -math.inf for k, v in enumerate(qd)]
            logits, target = list(qd), pos_col[gi]
            if include_qq:
                qq = [s(a, other) for k, (other, _, _) in enumerate(groups) if k != gi]
                if mask_fake_negative:
                    qq = [v if v <= sp + fake_neg_margin else -math.inf for v in qq]
                logits += qq
            if include_dd:
                logits += [s(p, d) for k, d in enumerate(docs) if k != pos_col[gi]]
        z = [v / temperature for v in logits]
        top = max(z)
        total += -(z[target] - top - math.log(sum(math.exp(v - top) for v in z)))
    return total / len(groups)


SETTINGS = [
    {},
    {"include_qq": True},
    {"include_dd": True},
    {"include_qq": True, "include_dd": True, "mask_fake_negative": True, "fake_neg_margin": 0.05},
    {"mask_fake_negative": True, "fake_neg_margin": 0.0},
    {"use_batch": False},
    {"hard_negatives": 1},
    {"hard_negatives": 2, "use_batch": False},
]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_infonce_over_maxsim_equals_the_per_anchor_loop(settings, normalize):
    g = torch.Generator().manual_seed(5)
    counts = [2, 3, 2, 4] if settings.get("hard_negatives") else [2, 0, 1, 3, 1]
    emb, labels = group_batch(g, counts)
    temperature = 0.05 if normalize else 0.7
    loss_fn = InfoNCELoss(temperature=temperature, similarity=MaxSim(normalize=normalize, chunk=37), **settings)
    got = loss_fn({"last_hidden_state": emb}, labels)
    ref = loop_infonce(emb, labels, temperature=temperature, normalize=normalize, **settings)
    assert float(got) == pytest.approx(ref, abs=1e-9)
    # the same through the registered name, and through split_parts / forward_from_parts
    named = build_loss("late_interaction_infonce", temperature=temperature, normalize_scores=normalize, **settings)
    assert float(named({"last_hidden_state": emb}, labels)) == pytest.approx(ref, abs=1e-9)
    assert float(loss_fn.forward_from_parts(loss_fn.split_parts({"last_hidden_state": emb}, labels))) == \
        pytest.approx(ref, abs=1e-9)


def test_forward_from_parts_query_rows_and_different_lengths():
    """Parts whose positives and negatives have different lengths (as gathered from processes)
    and a slice of query rows: the mean of the loop's per-anchor losses of those rows."""
    g = torch.Generator().manual_seed(6)
    emb, labels = group_batch(g, [1, 2, 1])
    loss_fn = InfoNCELoss(temperature=0.5, similarity=MaxSim(), include_qq=True)
    parts = loss_fn.split_parts({"last_hidden_state": emb}, labels)
    padded = type(parts)(F.pad(parts.anchors, (0, 0, 0, 3)), parts.positives, F.pad(parts.negatives, (0, 0, 0, 2)),
                         parts.neg_group)
    whole = loss_fn.forward_from_parts(parts)
    torch.testing.assert_close(loss_fn.forward_from_parts(padded), whole)
    rows = [loss_fn.forward_from_parts(padded, query_rows=slice(i, i + 1)) for i in range(3)]
    torch.testing.assert_close(torch.stack(rows).mean(), whole)
    with pytest.raises(ValueError, match="token vectors"):
        loss_fn.forward_from_parts(type(parts)(parts.anchors[:, 0], parts.positives, parts.negatives, parts.neg_group))


def test_dense_path_is_unchanged_and_refuses_token_vectors():
    g = torch.Generator().manual_seed(7)
    emb = F.normalize(torch.randn(5, 8, generator=g, dtype=torch.float64), dim=-1)
    labels = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    loss_fn = InfoNCELoss()
    assert loss_fn.similarity is DOT and loss_fn.config.temperature == 0.1
    a, p, n, p1 = emb[0], emb[1], emb[2], emb[4]
    z0 = torch.stack([a @ p, a @ n, a @ p1]) / 0.1
    z1 = torch.stack([emb[3] @ p, emb[3] @ n, emb[3] @ p1]) / 0.1
    ref = (-(z0[0] - torch.logsumexp(z0, 0)) - (z1[2] - torch.logsumexp(z1, 0))) / 2
    torch.testing.assert_close(loss_fn({"last_hidden_state": emb}, labels), ref)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        loss_fn({"last_hidden_state": emb[:, None]}, labels)
    with pytest.raises(ValueError, match=r"\[N, L, D\]"):
        InfoNCELoss(similarity=MaxSim())({"last_hidden_state": emb}, labels)


def test_temperature_defaults_and_the_variable_wins(monkeypatch):
    monkeypatch.delenv("INFONCE_TEMPERATURE", raising=False)
    assert build_loss("infonce").config.temperature == 0.1
    assert build_loss("infonce", similarity=MaxSim()).config.temperature == 1.0
    assert build_loss("infonce", similarity=MaxSim(normalize=True)).config.temperature == 0.02
    assert build_loss("late_interaction_infonce").config.temperature == 1.0
    assert build_loss("late_interaction_infonce", normalize_scores=True).config.temperature == 0.02
    assert InfoNCELoss(similarity=MaxSim()).config.temperature == 1.0
    assert LateInteractionInfoNCELoss(normalize_scores=True).config.temperature == 0.02
    assert build_loss("late_interaction_infonce", temperature=0.3).config.temperature == 0.3
    monkeypatch.setenv("INFONCE_TEMPERATURE", "0.25")
    monkeypatch.setenv("INFONCE_INCLUDE_QQ", "true")
    for loss in (build_loss("infonce", similarity=MaxSim(normalize=True)),
                 build_loss("late_interaction_infonce", normalize_scores=True)):
        assert loss.config.temperature == 0.25 and loss.config.include_qq
    with pytest.raises(ValueError, match="similarity"):
        build_loss("infonce", similarity="maxsim")


# ---- sentence-transformers' MultiVectorMultipleNegativesRankingLoss ------------------------------

class _Table(nn.Module):
    """A stand-in MultiVectorEncoder: ``input_ids[:, 0]`` names a row of precomputed token vectors."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, features, task=None):
        rows = self.table[features["input_ids"][:, 0]][:, : features["input_ids"].shape[1]]
        return {"token_embeddings": rows, "attention_mask": features["attention_mask"]}


def _features(emb, idx):
    mask = present_tokens(emb[idx]).long()
    return {"input_ids": idx[:, None].expand(-1, emb.shape[1]).contiguous(), "attention_mask": mask}


@pytest.mark.parametrize("n_neg", [0, 2])
@pytest.mark.parametrize("cached", [False, True])
def test_equals_sentence_transformers_mnrl(n_neg, cached):
    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
        MultiVectorMultipleNegativesRankingLoss,
    )

    g = torch.Generator().manual_seed(8)
    emb, labels = group_batch(g, [n_neg] * 4)
    emb = emb.float()
    temperature = 0.5
    table = emb.clone().requires_grad_()
    b = 4
    anchor = torch.arange(b) * (2 + n_neg)
    columns = [_features(emb, anchor)] + [_features(emb, anchor + 1 + k) for k in range(1 + n_neg)]
    if cached:
        st_loss = CachedMultiVectorMultipleNegativesRankingLoss(_Table(table), scale=1 / temperature,
                                                                mini_batch_size=3)
    else:
        st_loss = MultiVectorMultipleNegativesRankingLoss(_Table(table), scale=1 / temperature)
    ref = st_loss(columns, None)
    if not cached:
        ref.backward()
    mine_emb = emb.clone().requires_grad_()
    got = InfoNCELoss(temperature=temperature, similarity=MaxSim())({"last_hidden_state": mine_emb}, labels)
    assert float(got.detach()) == pytest.approx(float(ref.detach()), abs=1e-6)
    if not cached:  # the cached loss backpropagates into the model by itself, outside this call
        got.backward()
        torch.testing.assert_close(mine_emb.grad, table.grad, atol=1e-6, rtol=1e-5)
