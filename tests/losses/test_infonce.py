"""InfoNCE: the batched loss against the per-group loop in reference_losses.py.

Batches are spelled in ms-swift's layout: rows ``a0, p0, n0_*, a1, p1, n1_*, ...`` and one
label per non-anchor row (1.0 positive, 0.0 negative). Each case compares the loss and
its gradient with respect to the embeddings.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from reference_losses import parse_groups, reference_infonce

from mmembed.losses import (
    LOSSES,
    GroupParts,
    InfoNCEConfig,
    InfoNCELoss,
    build_loss,
    select_hard_negatives,
    split_groups,
)

TOL = dict(atol=1e-9, rtol=1e-9)  # float64 throughout unless a test says otherwise


def layout(neg_counts: list[int]) -> torch.Tensor:
    """Labels for groups with these numbers of negatives: [1, 0 * k0, 1, 0 * k1, ...]."""
    return torch.tensor([x for k in neg_counts for x in [1.0] + [0.0] * k])


def batch(neg_counts: list[int], dim: int = 16, seed: int = 0, dtype=torch.float64):
    """Random L2-normalized embeddings (a leaf needing grad) and labels for ``neg_counts``."""
    gen = torch.Generator().manual_seed(seed)
    n_rows = sum(2 + k for k in neg_counts)
    emb = F.normalize(torch.randn(n_rows, dim, generator=gen, dtype=torch.float64), dim=-1)
    return emb.to(dtype).requires_grad_(True), layout(neg_counts)


def value_and_grad(fn, emb: torch.Tensor):
    x = emb.detach().clone().requires_grad_(True)
    loss = fn(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def compare(options: dict, neg_counts: list[int], picks=None, seed: int = 0, generator=None):
    """mmembed's loss and the reference agree in value and gradient; returns the value."""
    emb, labels = batch(neg_counts, seed=seed)
    loss_fn = InfoNCELoss(**options, generator=generator)
    ref_options = {k: v for k, v in options.items() if k != "hard_negatives"}
    got, got_grad = value_and_grad(lambda x: loss_fn({"last_hidden_state": x}, labels), emb)
    want, want_grad = value_and_grad(lambda x: reference_infonce(x, labels, picks=picks, **ref_options), emb)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    if got.item() > 0:  # a loss of exactly 0 (one candidate per row) has no gradient
        assert got_grad.abs().sum() > 0
    return got.item()


COUNTS = {
    "equal": [2, 2, 2, 2],
    "unequal": [3, 0, 1, 5, 2],
    "zero_negatives_first": [0, 2, 4],
    "all_zero": [0, 0, 0],
    "one_group": [3],
}

CONFIGS = {
    "in_group": dict(use_batch=False),
    "in_group_t0.05": dict(use_batch=False, temperature=0.05),
    "batch": dict(use_batch=True),
    "batch_t1": dict(use_batch=True, temperature=1.0),
    "qq": dict(include_qq=True),
    "dd": dict(include_dd=True),
    "qq_dd": dict(include_qq=True, include_dd=True),
    "mask": dict(mask_fake_negative=True, fake_neg_margin=0.05),
    "mask_qq_dd": dict(
        mask_fake_negative=True, fake_neg_margin=0.0, include_qq=True, include_dd=True, temperature=0.02
    ),
    "in_group_ignores_mask_qq_dd": dict(use_batch=False, mask_fake_negative=True, include_qq=True, include_dd=True),
}


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("options", list(CONFIGS.values()), ids=list(CONFIGS))
def test_matches_reference(options, counts):
    compare(options, counts)


def test_in_group_ignores_mask_qq_dd():
    plain = compare(dict(use_batch=False), [3, 0, 2])
    extras = compare(dict(use_batch=False, mask_fake_negative=True, fake_neg_margin=-1.0, include_qq=True), [3, 0, 2])
    assert plain == extras


def test_every_option_changes_the_value():
    """Sanity: the comparisons above could fail, since each option moves the loss."""
    emb, labels = batch([3, 1, 1, 2], seed=3)
    out = {"last_hidden_state": emb}
    variants = [
        dict(),
        dict(use_batch=False),
        dict(temperature=0.5),
        dict(include_qq=True),
        dict(include_dd=True),
        dict(mask_fake_negative=True, fake_neg_margin=-0.2),
        dict(hard_negatives=1),
    ]
    values = [InfoNCELoss(**v)(out, labels).item() for v in variants]
    for (i, a), (j, b) in itertools.combinations(enumerate(values), 2):
        assert not math.isclose(a, b, rel_tol=1e-6), (variants[i], variants[j])


def test_reference_against_closed_form():
    """The reference itself, on one group with one negative: -log softmax at the positive."""
    emb, labels = batch([1])
    a, p, n = emb.detach()
    t = 0.1
    want = -math.log(math.exp(a @ p / t) / (math.exp(a @ p / t) + math.exp(a @ n / t)))
    got = reference_infonce(emb.detach(), labels, temperature=t, use_batch=False)
    assert math.isclose(got.item(), want, rel_tol=1e-12)
    assert parse_groups(7, [1.0, 0.0, 0.0, 1.0, 0.0]) == [(0, 1, [2, 3]), (4, 5, [6])]


def test_float32_close_to_float64_reference():
    emb, labels = batch([2, 0, 4, 1], dim=64, seed=5)
    options = dict(include_qq=True, include_dd=True, temperature=0.05)
    got, got_grad = value_and_grad(lambda x: InfoNCELoss(**options)({"last_hidden_state": x.float()}, labels), emb)
    want, want_grad = value_and_grad(lambda x: reference_infonce(x, labels, **options), emb)
    assert abs(got.item() - want.item()) < 1e-5
    assert (got_grad - want_grad).abs().max() < 1e-5


# ---- fake-negative mask ---------------------------------------------------------------


def masking_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two groups where a negative and another anchor score far above the positive.

    Group 0: a0 = e0, p0 at cos 0.6, n0_0 at cos ~0.995 (a fake negative), n0_1 unrelated.
    Group 1: a1 at cos ~0.98 with a0 (a fake query-query pair), p1, n1_0.
    """
    e = torch.eye(8, dtype=torch.float64)
    rows = [
        e[0],  # a0
        0.6 * e[0] + 0.8 * e[1],  # p0
        e[0] + 0.1 * e[2],  # n0_0: nearly a0
        e[3],  # n0_1
        e[0] + 0.2 * e[4],  # a1: nearly a0
        e[4] + 0.5 * e[0],  # p1
        e[5],  # n1_0
    ]
    emb = F.normalize(torch.stack(rows), dim=-1).requires_grad_(True)
    return emb, layout([2, 1])


@pytest.mark.parametrize("include_qq", [False, True])
@pytest.mark.parametrize("include_dd", [False, True])
def test_mask_triggers_and_matches_reference(include_qq, include_dd):
    emb, labels = masking_batch()
    opts = dict(include_qq=include_qq, include_dd=include_dd, fake_neg_margin=0.1)
    masked_fn = InfoNCELoss(mask_fake_negative=True, **opts)
    masked, masked_grad = value_and_grad(lambda x: masked_fn({"last_hidden_state": x}, labels), emb)
    want, want_grad = value_and_grad(lambda x: reference_infonce(x, labels, mask_fake_negative=True, **opts), emb)
    torch.testing.assert_close(masked, want, **TOL)
    torch.testing.assert_close(masked_grad, want_grad, **TOL)

    plain = InfoNCELoss(**opts)({"last_hidden_state": emb}, labels)
    assert masked.item() < plain.item() - 0.1  # the fake negative was dropped
    # the masked fake negative n0_0 (row 2) gets no gradient from anchor 0's row anymore
    unmasked_grad = value_and_grad(lambda x: InfoNCELoss(**opts)({"last_hidden_state": x}, labels), emb)[1]
    assert masked_grad[2].abs().max() < unmasked_grad[2].abs().max()


def test_mask_qq_block_is_masked():
    """s(a0, a1) = 0.98 beats both anchors' positives (0.60, 0.61) by more than the margin.

    So with the mask the query-query block adds nothing (both entries are dropped), while
    without the mask it raises the loss.
    """
    emb, labels = masking_batch()
    out = {"last_hidden_state": emb}
    with_qq = InfoNCELoss(mask_fake_negative=True, include_qq=True)(out, labels)
    without_qq = InfoNCELoss(mask_fake_negative=True, include_qq=False)(out, labels)
    qq_left_in = reference_infonce(emb, labels, include_qq=True, mask_fake_negative=True, fake_neg_margin=0.5)
    qq_dropped = reference_infonce(emb, labels, include_qq=False, mask_fake_negative=True, fake_neg_margin=0.5)
    assert with_qq.item() == pytest.approx(without_qq.item(), rel=1e-12)
    assert qq_left_in.item() > qq_dropped.item() + 0.1  # the case is not vacuous


def test_mask_never_drops_own_positive():
    """With a negative margin every candidate passes the threshold, even the positive."""
    for counts in ([2, 1, 3], [0, 2]):
        value = compare(dict(mask_fake_negative=True, fake_neg_margin=-5.0, include_qq=True), counts)
        # only the positive is left in each row: log softmax of a single logit is 0
        assert value == pytest.approx(0.0, abs=1e-12)


def test_large_margin_equals_unmasked():
    emb, labels = masking_batch()
    out = {"last_hidden_state": emb}
    a = InfoNCELoss(mask_fake_negative=True, fake_neg_margin=100.0, include_qq=True)(out, labels)
    b = InfoNCELoss(include_qq=True)(out, labels)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


# ---- hard negatives -------------------------------------------------------------------


def test_select_hard_negatives_truncates_and_pads_with_own_negatives():
    counts = torch.tensor([5, 1, 3, 2])
    picks = select_hard_negatives(counts, 3, torch.Generator().manual_seed(0))
    assert picks.shape == (4, 3)
    assert picks[0].tolist() == [0, 1, 2]  # first H kept
    assert picks[2].tolist() == [0, 1, 2]
    assert picks[1].tolist() == [0, 0, 0]  # the only negative, repeated
    assert picks[3, :2].tolist() == [0, 1]
    # the draws only ever index the group's own negatives, never the positive
    many = select_hard_negatives(torch.tensor([1, 2, 3, 7]), 64, torch.Generator().manual_seed(1))
    for g, c in enumerate([1, 2, 3, 7]):
        assert set(many[g].tolist()) == set(range(c))


def test_select_hard_negatives_is_reproducible():
    counts = torch.tensor([1, 2, 3])
    a = select_hard_negatives(counts, 6, torch.Generator().manual_seed(7))
    b = select_hard_negatives(counts, 6, torch.Generator().manual_seed(7))
    c = select_hard_negatives(counts, 6, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("use_batch", [True, False])
@pytest.mark.parametrize("hard", [1, 2, 4, 7])
def test_hard_negatives_match_reference_with_same_picks(use_batch, hard):
    counts = [3, 1, 5, 2]
    picks = select_hard_negatives(torch.tensor(counts), hard, torch.Generator().manual_seed(11))
    assert all(0 <= i < counts[g] for g in range(len(counts)) for i in picks[g].tolist())
    options = dict(use_batch=use_batch, hard_negatives=hard, include_qq=use_batch, include_dd=use_batch)
    value = compare(options, counts, picks=picks.tolist(), generator=torch.Generator().manual_seed(11))
    # sanity: using every negative instead gives another value
    emb, labels = batch(counts)
    every = reference_infonce(emb, labels, use_batch=use_batch, include_qq=use_batch, include_dd=use_batch)
    assert not math.isclose(value, every.item(), rel_tol=1e-9)


def test_hard_negatives_padding_never_samples_the_positive():
    """One negative padded to 5 has a single correct outcome: 5 copies of that negative.

    ms-swift's padding draws from the positive and the negatives, which would put s(a, p)
    into the logits more than once; over many seeds the value must stay the closed form.
    """
    emb, labels = batch([1])
    a, p, n = emb.detach()
    t = 0.1
    want = -torch.log_softmax(torch.stack([a @ p] + [a @ n] * 5) / t, 0)[0]
    positive_drawn = -torch.log_softmax(torch.stack([a @ p, a @ p] + [a @ n] * 4) / t, 0)[0]
    assert not math.isclose(want.item(), positive_drawn.item(), rel_tol=1e-6)
    for seed in range(20):
        loss_fn = InfoNCELoss(hard_negatives=5, use_batch=False, generator=torch.Generator().manual_seed(seed))
        assert loss_fn({"last_hidden_state": emb}, labels).item() == pytest.approx(want.item(), rel=1e-12)


def test_hard_negatives_with_a_zero_negative_group_is_an_error():
    emb, labels = batch([2, 0, 1])
    with pytest.raises(ValueError, match="group 1 has no negatives"):
        InfoNCELoss(hard_negatives=2)({"last_hidden_state": emb}, labels)
    with pytest.raises(ValueError, match="group 1 has no negatives"):
        select_hard_negatives(torch.tensor([2, 0, 1]), 2)


# ---- layout ---------------------------------------------------------------------------


def test_split_groups_layout():
    # a0 p0 n0_0 n0_1 | a1 p1 | a2 p2 n2_0
    labels = torch.tensor([1.0, 0, 0, 1, 1, 0])
    anchor_idx, pos_idx, neg_idx, neg_group = split_groups(labels, 9)
    assert anchor_idx.tolist() == [0, 4, 6]
    assert pos_idx.tolist() == [1, 5, 7]
    assert neg_idx.tolist() == [2, 3, 8]
    assert neg_group.tolist() == [0, 0, 2]


@pytest.mark.parametrize(
    "labels, n_rows, message",
    [
        ([1.0, 0, 0, 1], 5, "must have 6 rows"),  # labels length != N - B
        ([1.0, 0, 0, 1], 7, "must have 6 rows"),
        ([0.0, 1, 0], 4, "group 0 has no positive"),
        ([0.0, 0.0], 2, "no 1.0 entry"),
        ([], 0, "empty"),
        ([1.0, 0.5, 1], 5, r"labels\[1\] = 0.5"),
    ],
)
def test_malformed_labels(labels, n_rows, message):
    with pytest.raises(ValueError, match=message):
        split_groups(torch.tensor(labels), n_rows)
    emb = torch.randn(n_rows, 4)
    with pytest.raises(ValueError, match=message):
        InfoNCELoss()({"last_hidden_state": emb}, torch.tensor(labels))


def test_two_dimensional_labels_rejected():
    with pytest.raises(ValueError, match="1-D"):
        split_groups(torch.tensor([[1.0, 0.0]]), 3)


def test_forward_from_parts_query_rows_split_the_mean():
    """The cross-device seam: per-slice losses, weighted by slice size, add up to the whole."""
    counts = [2, 0, 3, 1, 2]
    emb, labels = batch(counts, seed=9)
    anchor_idx, pos_idx, neg_idx, neg_group = split_groups(labels, emb.shape[0])
    parts = GroupParts(emb[anchor_idx], emb[pos_idx], emb[neg_idx], neg_group)
    for options in (dict(include_qq=True, include_dd=True, mask_fake_negative=True), dict(use_batch=False)):
        loss_fn = InfoNCELoss(**options)
        whole = loss_fn.forward_from_parts(parts)
        first = loss_fn.forward_from_parts(parts, query_rows=slice(0, 2))
        rest = loss_fn.forward_from_parts(parts, query_rows=slice(2, 5))
        torch.testing.assert_close(whole, (2 * first + 3 * rest) / 5, **TOL)
        torch.testing.assert_close(whole, loss_fn({"last_hidden_state": emb}, labels), **TOL)
    with pytest.raises(ValueError, match="query_rows"):
        loss_fn.forward_from_parts(parts, query_rows=slice(3, 3))
    with pytest.raises(ValueError, match="neg_group"):
        loss_fn.forward_from_parts(replace(parts, neg_group=neg_group + 10))


def test_forward_from_parts_accepts_unsorted_negatives():
    counts = [2, 1, 3]
    emb, labels = batch(counts, seed=4)
    anchor_idx, pos_idx, neg_idx, neg_group = split_groups(labels, emb.shape[0])
    perm = torch.tensor([5, 0, 3, 1, 4, 2])
    for use_batch in (True, False):
        loss_fn = InfoNCELoss(use_batch=use_batch)
        a = loss_fn.forward_from_parts(GroupParts(emb[anchor_idx], emb[pos_idx], emb[neg_idx], neg_group))
        b = loss_fn.forward_from_parts(GroupParts(emb[anchor_idx], emb[pos_idx], emb[neg_idx][perm], neg_group[perm]))
        torch.testing.assert_close(a, b, **TOL)


# ---- configuration from the environment -----------------------------------------------

ALL_VARS = [
    "INFONCE_TEMPERATURE",
    "INFONCE_USE_BATCH",
    "INFONCE_HARD_NEGATIVES",
    "INFONCE_MASK_FAKE_NEGATIVE",
    "INFONCE_FAKE_NEG_MARGIN",
    "INFONCE_INCLUDE_QQ",
    "INFONCE_INCLUDE_DD",
]


@pytest.fixture
def clean_env(monkeypatch):
    for var in ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_defaults_without_environment(clean_env):
    assert InfoNCEConfig.from_env() == InfoNCEConfig()
    assert InfoNCEConfig() == InfoNCEConfig(
        temperature=0.1,
        use_batch=True,
        hard_negatives=None,
        mask_fake_negative=False,
        fake_neg_margin=0.1,
        include_qq=False,
        include_dd=False,
    )
    assert build_loss("infonce").config == InfoNCEConfig()


def test_environment_is_read_by_build_loss(clean_env):
    clean_env.setenv("INFONCE_TEMPERATURE", "0.05")
    clean_env.setenv("INFONCE_USE_BATCH", "FALSE")
    clean_env.setenv("INFONCE_HARD_NEGATIVES", "3")
    clean_env.setenv("INFONCE_MASK_FAKE_NEGATIVE", "True")
    clean_env.setenv("INFONCE_FAKE_NEG_MARGIN", "0.2")
    clean_env.setenv("INFONCE_INCLUDE_QQ", "1")
    clean_env.setenv("INFONCE_INCLUDE_DD", "tRuE")
    assert build_loss("infonce").config == InfoNCEConfig(
        temperature=0.05,
        use_batch=False,
        hard_negatives=3,
        mask_fake_negative=True,
        fake_neg_margin=0.2,
        include_qq=True,
        include_dd=True,
    )
    # constructing the class directly takes only its arguments, not the environment
    assert InfoNCELoss().config == InfoNCEConfig()


@pytest.mark.parametrize(
    "raw, value",
    [("true", True), ("TRUE", True), ("1", True), ("False", False), ("0", False), (" false ", False)],
)
def test_booleans_any_case(raw, value):
    assert InfoNCEConfig.from_env({"INFONCE_INCLUDE_QQ": raw}).include_qq is value


@pytest.mark.parametrize(
    "var, raw",
    [
        ("INFONCE_USE_BATCH", "yes"),
        ("INFONCE_INCLUDE_DD", "2"),
        ("INFONCE_MASK_FAKE_NEGATIVE", "t"),
        ("INFONCE_TEMPERATURE", "warm"),
        ("INFONCE_TEMPERATURE", "0"),
        ("INFONCE_TEMPERATURE", "-0.1"),
        ("INFONCE_HARD_NEGATIVES", "0"),
        ("INFONCE_HARD_NEGATIVES", "2.5"),
        ("INFONCE_FAKE_NEG_MARGIN", "nan"),
    ],
)
def test_invalid_environment_values(var, raw):
    with pytest.raises(ValueError) as info:
        InfoNCEConfig.from_env({var: raw})
    assert var in str(info.value) and repr(raw) in str(info.value)


def test_empty_variable_counts_as_unset():
    assert InfoNCEConfig.from_env({"INFONCE_HARD_NEGATIVES": "", "INFONCE_TEMPERATURE": " "}) == InfoNCEConfig()


def test_explicit_options_override_environment(clean_env):
    clean_env.setenv("INFONCE_TEMPERATURE", "0.5")
    clean_env.setenv("INFONCE_INCLUDE_QQ", "true")
    clean_env.setenv("INFONCE_USE_BATCH", "not-a-bool")  # overridden, so never parsed
    loss = build_loss("infonce", temperature=0.2, use_batch=False)
    assert loss.config.temperature == 0.2
    assert loss.config.use_batch is False
    assert loss.config.include_qq is True  # still from the environment


def test_invalid_options():
    with pytest.raises(ValueError, match="temperature"):
        InfoNCELoss(temperature=0.0)
    with pytest.raises(ValueError, match="hard_negatives"):
        InfoNCELoss(hard_negatives=0)
    with pytest.raises(ValueError, match="takes no option .temprature."):
        build_loss("infonce", temprature=0.1)
    with pytest.raises(ValueError, match="unknown loss"):
        build_loss("triplet")


def test_registry_names():
    assert set(LOSSES) == {"infonce", "cosine_similarity", "contrastive", "online_contrastive",  # ms-swift's
                           "gist", "distill_cosine", "distill_mse", "distill_marginal", "distill_kl", "matryoshka",
                           # late interaction (MaxSim over token vectors)
                           "late_interaction_infonce", "colbert_pairwise_ce", "colbert_negative_ce",
                           "colbert_pairwise_negative_ce"}
    assert LOSSES["infonce"] is InfoNCELoss
