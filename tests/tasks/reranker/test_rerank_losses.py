"""mmembed.tasks.reranker.losses against ms-swift's reranker losses written out as plain per-group loops."""

import pytest
import torch
import torch.nn.functional as F

from mmembed.environment import read
from mmembed.errors import UsageError
from mmembed.losses import LOSSES, build_loss
from mmembed.tasks.reranker.losses import (
    RERANK_LOSSES,
    ListwiseRerankLoss,
    PointwiseRerankLoss,
    RerankLoss,
    build_rerank_loss,
    rerank_task_of,
)

# ----------------------------------------------------------------------------- references


def pointwise_reference(scores, labels):
    """ms-swift's pointwise loss: BCEWithLogitsLoss() (the mean) over every pair."""
    return torch.nn.BCEWithLogitsLoss()(scores, labels.to(scores.dtype))


def listwise_reference(scores, labels, temperature=1.0, min_group_size=2):
    """ms-swift's listwise loss as it is written: one group per positive, from it to the next
    positive; skip small groups and groups not starting with a positive; CrossEntropyLoss on the
    group's scores / temperature with class 0; the mean over the groups kept; 0 when none."""
    labels = labels.float()
    positives = [i for i in range(len(labels)) if labels[i] == 1]
    total, groups = 0.0, 0
    for k, start in enumerate(positives):
        end = positives[k + 1] if k + 1 < len(positives) else len(labels)
        group, group_labels = scores[start:end], labels[start:end]
        if len(group) < min_group_size or group_labels[0] != 1:
            continue
        total = total + torch.nn.CrossEntropyLoss()((group / temperature)[None], torch.tensor([0]))
        groups += 1
    return total / groups if groups else torch.tensor(0.0)


def random_batch(gen, sizes, lead=0, scale=3.0):
    """Labels for groups of ``sizes`` (a positive then size-1 negatives), after ``lead`` stray
    negatives; random float64 scores (standard deviation ``scale``)."""
    labels = [0.0] * lead
    for size in sizes:
        labels += [1.0] + [0.0] * (size - 1)
    labels = torch.tensor(labels)
    return torch.randn(len(labels), generator=gen, dtype=torch.float64) * scale, labels


def value_and_grad(fn, scores, labels, dtype=torch.float32):
    x = scores.detach().to(dtype).requires_grad_()
    loss = fn(x, labels)
    (grad,) = torch.autograd.grad(loss, x) if loss.requires_grad and loss.grad_fn is not None else (torch.zeros_like(x),)
    return loss.detach().double(), grad.double()


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("seed", range(6))
def test_pointwise_equals_ms_swift(seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 9, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
    scores, labels = random_batch(gen, sizes, lead=seed % 3)
    loss, grad = value_and_grad(PointwiseRerankLoss(), scores, labels, torch.float64)
    ref, ref_grad = value_and_grad(pointwise_reference, scores, labels, torch.float64)
    assert torch.allclose(loss, ref, atol=1e-6, rtol=0) and torch.allclose(grad, ref_grad, atol=1e-6, rtol=0)
    loss32, grad32 = value_and_grad(PointwiseRerankLoss(), scores, labels)  # float32 math
    assert torch.allclose(loss32, ref, atol=1e-6, rtol=0) and torch.allclose(grad32, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", range(12))
def test_listwise_equals_ms_swift_per_group_loop(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    n_groups = int(torch.randint(1, 8, (1,), generator=gen))
    sizes = torch.randint(1, 10, (n_groups,), generator=gen).tolist()  # size 1 groups too: skipped at min 2
    scores, labels = random_batch(gen, sizes, lead=seed % 3, scale=2.0)  # pairs before the first positive: no group
    temperature = [1.0, 0.5, 0.7, 2.0][seed % 4]
    min_size = [2, 1, 3, 5][seed % 4]
    check_listwise(scores, labels, temperature, min_size, sizes, tol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_listwise_at_a_small_temperature(seed):
    """Logits up to ~200: float32 keeps them to ~1e-5, so both float32 computations agree to that."""
    gen = torch.Generator().manual_seed(200 + seed)
    sizes = torch.randint(1, 10, (6,), generator=gen).tolist()
    scores, labels = random_batch(gen, sizes, scale=3.0)
    check_listwise(scores, labels, 0.05, 2, sizes, tol=1e-5)


def check_listwise(scores, labels, temperature, min_size, sizes, tol):
    loss_fn = ListwiseRerankLoss(temperature=temperature, min_group_size=min_size)

    def ref_fn(s, y):
        return listwise_reference(s, y, temperature, min_size)

    # ms-swift's loop on float32 scores (its math for float32 scores), and the exact value in float64
    ref, ref_grad = value_and_grad(ref_fn, scores, labels, torch.float32)
    exact, exact_grad = value_and_grad(ref_fn, scores.float(), labels, torch.float64)
    for dtype in (torch.float32, torch.float64):  # float64 scores: float32 math as well, the same result
        loss, grad = value_and_grad(loss_fn, scores, labels, dtype)
        assert torch.allclose(loss, ref, atol=tol, rtol=tol), (sizes, loss, ref)
        assert torch.allclose(grad, ref_grad, atol=tol, rtol=tol), (sizes, grad, ref_grad)
        assert torch.allclose(loss, exact, atol=tol, rtol=tol) and torch.allclose(grad, exact_grad, atol=tol, rtol=tol)


def test_float32_math_whatever_the_score_dtype():
    gen = torch.Generator().manual_seed(7)
    scores, labels = random_batch(gen, [4, 3, 8, 2])
    for loss_fn, ref_fn in ((PointwiseRerankLoss(), pointwise_reference), (ListwiseRerankLoss(), listwise_reference)):
        half = scores.to(torch.bfloat16).requires_grad_()
        loss = loss_fn(half, labels)
        assert loss.dtype == torch.float32 and loss.dim() == 0
        loss.backward()
        assert half.grad.dtype == torch.bfloat16
        ref = ref_fn(half.detach().double(), labels)  # the same bf16 scores, in float64
        assert abs(float(loss.detach()) - float(ref)) < 1e-6


def test_column_scores_as_ms_swift_gives_them():
    gen = torch.Generator().manual_seed(3)
    scores, labels = random_batch(gen, [3, 4])
    for loss_fn in (PointwiseRerankLoss(), ListwiseRerankLoss()):
        assert torch.equal(loss_fn(scores[:, None], labels), loss_fn(scores, labels))
    with pytest.raises(ValueError, match="differ in length"):
        ListwiseRerankLoss()(scores, labels[:-1])
    with pytest.raises(ValueError, match=r"\[N\] or \[N, 1\]"):
        PointwiseRerankLoss()(scores.reshape(7, 1, 1), labels)


@pytest.mark.parametrize("labels", [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0], [1.0, 1.0]],
                         ids=["no_positive", "every_group_too_small", "singletons"])
def test_listwise_without_a_group_is_zero_with_a_gradient(labels):
    labels = torch.tensor(labels)
    scores = torch.randn(len(labels), requires_grad=True)
    loss = ListwiseRerankLoss(min_group_size=4 if len(labels) == 4 else 2)(scores, labels)
    assert float(loss.detach()) == 0.0 and loss.requires_grad and loss.dtype == torch.float32
    assert float(listwise_reference(scores.detach(), labels, min_group_size=4 if len(labels) == 4 else 2)) == 0.0
    loss.backward()
    assert torch.equal(scores.grad, torch.zeros_like(scores))
    # a score that is not finite still gets a zero gradient (an empty sum, not scores * 0)
    bad = torch.tensor([float("nan"), 1.0, 2.0], requires_grad=True)
    ListwiseRerankLoss()(bad, torch.zeros(3)).backward()
    assert torch.equal(bad.grad, torch.zeros(3))
    # no grad asked (evaluation): still a scalar 0 that backward accepts
    assert ListwiseRerankLoss()(torch.randn(3), torch.zeros(3)).requires_grad


def test_no_python_loop_over_groups_one_cross_entropy(monkeypatch):
    calls = []
    real = torch.nn.functional.cross_entropy
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    gen = torch.Generator().manual_seed(5)
    scores, labels = random_batch(gen, [3, 1, 5, 2, 4])
    ListwiseRerankLoss()(scores, labels)
    assert calls == [torch.Size([4, 5])]  # the four groups kept, padded to the longest


def test_declarations():
    assert RERANK_LOSSES == ("pointwise_reranker", "listwise_reranker", "generative_reranker",
                             "listwise_generative_reranker")
    for name, cls, listwise in (("pointwise_reranker", PointwiseRerankLoss, False),
                                ("listwise_reranker", ListwiseRerankLoss, True),
                                ("generative_reranker", PointwiseRerankLoss, False),
                                ("listwise_generative_reranker", ListwiseRerankLoss, True)):
        loss = build_rerank_loss(name, {})
        assert type(loss) is cls and isinstance(loss, RerankLoss) and loss.listwise is listwise
        assert loss.name == ("listwise_reranker" if listwise else "pointwise_reranker")
    assert rerank_task_of("generative_reranker") == rerank_task_of("listwise_generative_reranker") == \
        "generative_reranker"
    assert rerank_task_of("listwise_reranker") is None and rerank_task_of("pointwise_reranker") is None
    assert rerank_task_of("infonce") is None
    assert not set(RERANK_LOSSES) & set(LOSSES)  # the embedding losses' registry holds none of them
    with pytest.raises(ValueError, match=r"reranker loss \(--task_type reranker\), built by its task.s package \(mmembed.tasks.reranker\)"):
        build_loss("listwise_reranker")


# ----------------------------------------------------------------------------- settings


def test_settings_from_values_and_environment(monkeypatch):
    loss = build_rerank_loss("listwise_reranker", {"LISTWISE_RERANKER_TEMPERATURE": "0.05",
                                                   "LISTWISE_RERANKER_MIN_GROUP_SIZE": "3"})
    assert (loss.temperature, loss.min_group_size) == (0.05, 3)
    loss = build_rerank_loss("listwise_generative_reranker", {"LISTWISE_RERANKER_TEMPERATURE": " "})  # blank: unset
    assert (loss.temperature, loss.min_group_size) == (1.0, 2)
    monkeypatch.setenv("LISTWISE_RERANKER_TEMPERATURE", "0.5")
    monkeypatch.setenv("LISTWISE_RERANKER_MIN_GROUP_SIZE", "4")
    loss = build_rerank_loss("listwise_reranker")  # None: the process environment, through mmembed.environment
    assert (loss.temperature, loss.min_group_size) == (0.5, 4)
    assert build_rerank_loss("listwise_reranker", read()).temperature == 0.5  # an Environment
    assert build_rerank_loss("listwise_reranker", {}).temperature == 1.0  # the values given, not the process's
    assert read().reranker.values == {"LISTWISE_RERANKER_TEMPERATURE": "0.5", "LISTWISE_RERANKER_MIN_GROUP_SIZE": "4"}


@pytest.mark.parametrize("name,value", [
    ("LISTWISE_RERANKER_TEMPERATURE", "warm"), ("LISTWISE_RERANKER_TEMPERATURE", "0"),
    ("LISTWISE_RERANKER_TEMPERATURE", "-1"), ("LISTWISE_RERANKER_TEMPERATURE", "inf"),
    ("LISTWISE_RERANKER_TEMPERATURE", "nan"), ("LISTWISE_RERANKER_TEMPERATURE", "1e-40"),
    ("LISTWISE_RERANKER_MIN_GROUP_SIZE", "two"), ("LISTWISE_RERANKER_MIN_GROUP_SIZE", "2.5"),
    ("LISTWISE_RERANKER_MIN_GROUP_SIZE", "0"),
])
def test_a_bad_variable_is_a_usage_error_naming_it(name, value, monkeypatch):
    with pytest.raises(UsageError, match=f"{name}={value!r}"):
        build_rerank_loss("listwise_reranker", {name: value})
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=name):
        build_rerank_loss("listwise_generative_reranker")
    assert isinstance(build_rerank_loss("pointwise_reranker"), PointwiseRerankLoss)  # reads none of them


def test_unknown_loss_and_bad_arguments():
    with pytest.raises(UsageError, match="--loss_type 'listwise'.*pointwise_reranker"):
        build_rerank_loss("listwise", {})
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="temperature"):
            ListwiseRerankLoss(temperature=bad)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="min_group_size"):
            ListwiseRerankLoss(min_group_size=bad)
    assert "temperature=0.1, min_group_size=3" in repr(ListwiseRerankLoss(0.1, 3))


def test_pointwise_takes_soft_labels_and_an_empty_batch():
    scores, labels = torch.randn(5, dtype=torch.float64), torch.rand(5)
    assert abs(float(PointwiseRerankLoss()(scores, labels)) - float(F.binary_cross_entropy_with_logits(
        scores, labels.double()))) < 1e-6
    empty = torch.zeros(0, requires_grad=True)
    loss = PointwiseRerankLoss()(empty, torch.zeros(0))
    assert float(loss.detach()) == 0.0 and loss.requires_grad
