"""GradCache against the plain, uncached step on the real all-MiniLM-L6-v2.

The reference is written out here, independently of ``mmembed.training.gradcache``: embed the batch
with graph (the whole batch at once, or the same row chunks one after another so that
dropout draws from the RNG in the same order), concatenate, compute the loss, call
``loss.backward()``. The cached step must give the same loss and the same gradient for
every trainable parameter, with dropout active (``model.train()``), which only holds
because each chunk's second forward replays its RNG state: a run without the replay is
shown to fail.

Layouts are ms-swift's: InfoNCE rows ``a0, p0, n0_*, a1, p1, n1_*, ...`` with labels
``[N - B]`` (1.0 for a positive, 0.0 for a negative); pair losses rows ``s1_0, s2_0, s1_1,
s2_1, ...`` with one label per pair.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import pytest
import torch
from conftest import DATA

import mmembed.training.gradcache as gradcache
from mmembed.losses import build_loss
from mmembed.model.embedding import EmbeddingModel, load_backbone
from mmembed.training.gradcache import GradCache, RandContext, split_batch

ATOL = 1e-5
RTOL = 1e-5  # |cached - plain| <= ATOL + RTOL * |plain|: relative where gradients are large

with open(os.path.join(DATA, "stsb_train_pairs.jsonl"), encoding="utf-8") as f:
    _ALL = sorted((json.loads(line) for line in f), key=lambda r: len(r["query"]))
# 16 pairs from the shortest sentence to the longest, in a mixed order so that each chunk
# holds rows of very different lengths (the test batches: 6 to 28 tokens a row)
PAIRS = [_ALL[i * (len(_ALL) - 1) // 15] for i in (7, 0, 12, 3, 15, 9, 1, 5, 13, 2, 10, 6, 14, 4, 11, 8)]


# ---- data ---------------------------------------------------------------------------


def infonce_texts(neg_counts: list[int]) -> tuple[list[str], torch.Tensor]:
    """Group ``g`` is ``a_g, p_g`` then ``neg_counts[g]`` negatives.

    The trained MiniLM would find the true paraphrase with a loss near zero and gradients
    near 1e-5, too small to test at 1e-5. So the labelled positive is another pair's
    sentence and the anchor's paraphrase is its first negative: a large loss, large
    gradients.
    """
    texts, labels = [], []
    for g, k in enumerate(neg_counts):
        texts += [PAIRS[g]["query"], PAIRS[g + 8]["response"]]
        texts += ([PAIRS[g]["response"]] + [PAIRS[15 - g - j]["response"] for j in range(k - 1)])[:k]
        labels += [1.0] + [0.0] * k
    return texts, torch.tensor(labels)


def pair_texts(labels: list[float]) -> tuple[list[str], torch.Tensor]:
    """Rows alternate sentence1, sentence2; one label per pair."""
    texts = []
    for i in range(len(labels)):
        texts += [PAIRS[i]["query"], PAIRS[i]["response"]]
    return texts, torch.tensor(labels)


GROUP_NEGS = [0, 1, 3]  # unequal negatives per group: 2 + 3 + 5 = 10 rows
LOSS_CASES = {
    "infonce": ("infonce", dict(temperature=0.05), "group"),
    "infonce_qq_dd": ("infonce", dict(temperature=0.05, include_qq=True, include_dd=True), "group"),
    "infonce_mask_fake": ("infonce", dict(temperature=0.05, mask_fake_negative=True, include_qq=True), "group"),
    "cosine_similarity": ("cosine_similarity", {}, "pair_scores"),
    "contrastive": ("contrastive", {}, "pair_binary"),
}


def case_batch(tokenizer, layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if layout == "group":
        texts, labels = infonce_texts(GROUP_NEGS)
    elif layout == "pair_scores":
        texts, labels = pair_texts([0.9, 0.2, 0.55, 0.7])
    else:
        texts, labels = pair_texts([1.0, 0.0, 1.0, 0.0])
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids"}
    return batch, labels


# ---- models -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


def make_model(path: str, tuner: str = "full", device: str = "cpu") -> EmbeddingModel:
    backbone = load_backbone(path)
    if tuner == "lora":
        from peft import LoraConfig, get_peft_model

        backbone = get_peft_model(
            backbone, LoraConfig(task_type="FEATURE_EXTRACTION", r=4, target_modules=["query", "value"])
        )
        # PEFT starts lora_B at zero, which makes every lora_A gradient zero; give B values
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in backbone.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model = EmbeddingModel(backbone, "mean", length_chunks=1).to(device)
    model.train()  # dropout active
    return model


def trainable_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def assert_grads_close(cached: dict, plain: dict) -> None:
    assert cached.keys() == plain.keys()
    assert any(float(g.abs().max()) > 1e-4 for g in plain.values()), "the reference gradients are trivial"
    for name, want in plain.items():
        # torch.testing.assert_close's rule, written out: it is slow on the 30522 x 384
        # embedding gradient
        excess = (cached[name] - want).abs() - (ATOL + RTOL * want.abs())
        worst = float(excess.max())
        assert worst <= 0, f"{name}: |cached - plain| exceeds {ATOL} + {RTOL} * |plain| by {worst:.3g}"


# ---- the reference: plain forward and backward -----------------------------------------


def plain_step(model, loss_fn, batch, labels, bounds: list[int] | None = None) -> torch.Tensor:
    """Embed rows ``bounds[i]:bounds[i + 1]`` one chunk after another, with graph (the whole
    batch in one call when ``bounds`` is None), then one ``loss.backward()``."""
    n = batch["input_ids"].shape[0]
    bounds = bounds or [0, n]
    parts = [model(**{k: v[a:b] for k, v in batch.items()})["last_hidden_state"] for a, b in zip(bounds, bounds[1:])]
    loss = loss_fn({"last_hidden_state": torch.cat(parts)}, labels)
    loss.backward()
    return loss.detach()


def chunk_bounds(n: int, size: int) -> list[int]:
    return list(range(0, n, size)) + [n]


def compare(model, loss_fn, batch, labels, mini_batch_size: int, seed: int = 0):
    """(cached loss, cached grads, plain loss, plain grads), each step from the same seed."""
    n = batch["input_ids"].shape[0]
    torch.manual_seed(seed)
    plain_loss = plain_step(model, loss_fn, batch, labels, chunk_bounds(n, mini_batch_size))
    plain = trainable_grads(model)
    torch.manual_seed(seed)
    cached_loss = GradCache(model, loss_fn, mini_batch_size).step(batch, labels)
    cached = trainable_grads(model)
    return cached_loss, cached, plain_loss, plain


# ---- equality with the plain step --------------------------------------------------------


@pytest.mark.parametrize("tuner", ["full", "lora"])
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_cached_step_equals_plain_step_with_dropout(minilm_path, tokenizer, case, tuner):
    name, options, layout = LOSS_CASES[case]
    model = make_model(minilm_path, tuner)
    batch, labels = case_batch(tokenizer, layout)
    cached_loss, cached, plain_loss, plain = compare(model, build_loss(name, **options), batch, labels, 3)
    torch.testing.assert_close(cached_loss, plain_loss, atol=ATOL, rtol=RTOL)
    assert_grads_close(cached, plain)
    if tuner == "lora":
        assert cached.keys() and all("lora_" in n for n in cached)


def test_without_rng_replay_the_gradients_differ(minilm_path, tokenizer, monkeypatch):
    """The check above can fail: if the second forward draws fresh dropout masks, the
    gradients no longer match the plain step (the loss, from the first pass, still does)."""

    class NoReplay:
        def __init__(self, devices=()):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(gradcache, "RandContext", NoReplay)
    model = make_model(minilm_path)
    batch, labels = case_batch(tokenizer, "group")
    cached_loss, cached, plain_loss, plain = compare(model, build_loss("infonce", temperature=0.05), batch, labels, 3)
    torch.testing.assert_close(cached_loss, plain_loss, atol=ATOL, rtol=RTOL)
    worst = max(float((cached[n] - plain[n]).abs().max()) for n in plain)
    assert worst > 100 * ATOL, worst
    with pytest.raises(AssertionError):
        assert_grads_close(cached, plain)


@pytest.mark.parametrize("mini_batch_size", [1, 4, 64])
def test_chunk_sizes_from_one_row_to_more_than_the_batch(minilm_path, tokenizer, mini_batch_size):
    """mini_batch_size >= N is one chunk, so the reference is the plain whole-batch step;
    1 embeds row by row."""
    model = make_model(minilm_path)
    batch, labels = case_batch(tokenizer, "group")
    cached_loss, cached, plain_loss, plain = compare(model, build_loss("infonce", temperature=0.05), batch, labels,
                                                     mini_batch_size)
    torch.testing.assert_close(cached_loss, plain_loss, atol=ATOL, rtol=RTOL)
    assert_grads_close(cached, plain)
    if mini_batch_size >= 10:  # one chunk (N = 10): also the plain whole-batch call
        torch.manual_seed(0)
        whole_loss = plain_step(model, build_loss("infonce", temperature=0.05), batch, labels)
        torch.testing.assert_close(cached_loss, whole_loss, atol=ATOL, rtol=RTOL)
        assert_grads_close(cached, trainable_grads(model))


def test_without_dropout_chunks_equal_one_whole_batch_call(minilm_path, tokenizer):
    """Rows do not interact in the encoder: chunking alone changes nothing."""
    model = make_model(minilm_path).eval()
    batch, labels = case_batch(tokenizer, "group")
    loss_fn = build_loss("infonce", temperature=0.05)
    plain_loss = plain_step(model, loss_fn, batch, labels)
    plain = trainable_grads(model)
    cached_loss = GradCache(model, loss_fn, 3).step(batch, labels)
    torch.testing.assert_close(cached_loss, plain_loss, atol=ATOL, rtol=RTOL)
    assert_grads_close(trainable_grads(model), plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cached_step_equals_plain_step_on_cuda(minilm_path, tokenizer):
    model = make_model(minilm_path, device="cuda")
    batch, labels = case_batch(tokenizer, "group")
    batch = {k: v.cuda() for k, v in batch.items()}
    cached_loss, cached, plain_loss, plain = compare(model, build_loss("infonce", temperature=0.05), batch,
                                                     labels.cuda(), 3)
    torch.testing.assert_close(cached_loss, plain_loss, atol=ATOL, rtol=RTOL)
    assert_grads_close(cached, plain)


# ---- the hooks and the two halves ---------------------------------------------------------


def test_backward_fn_and_no_sync_call_order(minilm_path, tokenizer):
    """K chunks: K calls of backward_fn in batch order, is_last only on the last; no_sync
    holds around the forward and backward of every chunk but the last."""
    model = make_model(minilm_path)
    batch, labels = case_batch(tokenizer, "group")  # 10 rows -> chunks of 4, 4, 2
    loss_fn = build_loss("infonce", temperature=0.05)
    events: list[tuple] = []
    state = {"no_sync": False}

    @contextmanager
    def no_sync():
        state["no_sync"] = True
        events.append(("enter_no_sync",))
        yield
        state["no_sync"] = False
        events.append(("exit_no_sync",))

    def record_forward(module, args, kwargs):
        events.append(("forward", kwargs["input_ids"].shape[0], torch.is_grad_enabled(), state["no_sync"]))

    def backward_fn(tensor, grad, is_last):
        assert tensor.shape == grad.shape and tensor.requires_grad and not grad.requires_grad
        events.append(("backward", tensor.shape[0], is_last, state["no_sync"]))
        tensor.backward(grad)

    handle = model.register_forward_pre_hook(record_forward, with_kwargs=True)
    torch.manual_seed(0)
    loss = GradCache(model, loss_fn, 4).step(batch, labels, backward_fn=backward_fn, no_sync=no_sync)
    handle.remove()
    cached = trainable_grads(model)

    assert events == [
        ("forward", 4, False, False), ("forward", 4, False, False), ("forward", 2, False, False),  # no graph
        ("enter_no_sync",), ("forward", 4, True, True), ("backward", 4, False, True), ("exit_no_sync",),
        ("enter_no_sync",), ("forward", 4, True, True), ("backward", 4, False, True), ("exit_no_sync",),
        ("forward", 2, True, False), ("backward", 2, True, False),
    ]
    torch.manual_seed(0)
    plain_loss = plain_step(model, loss_fn, batch, labels, [0, 4, 8, 10])
    torch.testing.assert_close(loss, plain_loss, atol=ATOL, rtol=RTOL)
    assert_grads_close(cached, trainable_grads(model))


def test_extra_passes_for_a_process_with_fewer_chunks(minilm_path, tokenizer):
    """num_chunks_fn asks for 5 passes where the batch has 3 chunks (4, 4, 2 rows): the last
    chunk runs twice more, without graph after the real chunks and with graph before them,
    with a zero gradient; the last backward_fn is still the last real chunk's, and loss and
    gradients (dropout on) are those of the plain step."""
    model = make_model(minilm_path)
    batch, labels = case_batch(tokenizer, "group")
    loss_fn = build_loss("infonce", temperature=0.05)
    events: list[tuple] = []

    def record_forward(module, args, kwargs):
        events.append(("forward", kwargs["input_ids"].shape[0], torch.is_grad_enabled()))

    def backward_fn(tensor, grad, is_last):
        events.append(("backward", tensor.shape[0], is_last, bool(grad.abs().sum() > 0)))
        tensor.backward(grad)

    asked = []

    def num_chunks_fn(k):
        asked.append((k, len(events)))  # before any forward: the count is agreed on first
        return 5

    handle = model.register_forward_pre_hook(record_forward, with_kwargs=True)
    torch.manual_seed(0)
    loss = GradCache(model, loss_fn, 4).step(batch, labels, backward_fn=backward_fn, num_chunks_fn=num_chunks_fn)
    handle.remove()
    cached = trainable_grads(model)

    assert asked == [(3, 0)]
    assert events == [
        ("forward", 4, False), ("forward", 4, False), ("forward", 2, False), ("forward", 2, False), ("forward", 2, False),
        ("forward", 2, True), ("backward", 2, False, False), ("forward", 2, True), ("backward", 2, False, False),
        ("forward", 4, True), ("backward", 4, False, True), ("forward", 4, True), ("backward", 4, False, True),
        ("forward", 2, True), ("backward", 2, True, True),
    ]
    torch.manual_seed(0)
    plain_loss = plain_step(model, loss_fn, batch, labels, [0, 4, 8, 10])
    torch.testing.assert_close(loss, plain_loss, atol=ATOL, rtol=RTOL)
    assert_grads_close(cached, trainable_grads(model))
    with pytest.raises(ValueError, match="num_chunks_fn"):
        GradCache(model, loss_fn, 4).step(batch, labels, num_chunks_fn=lambda k: k - 1)


def test_the_two_halves_with_a_scaled_loss_backward(minilm_path, tokenizer):
    """embed_without_graph, then the caller's loss and backward, then backward_chunks: the
    seam for a cross-device gather. A scaled loss backward scales every gradient."""
    model = make_model(minilm_path)
    batch, labels = case_batch(tokenizer, "pair_scores")
    loss_fn = build_loss("cosine_similarity")
    cache = GradCache(model, loss_fn, 3)

    torch.manual_seed(0)
    chunks = cache.split(batch)
    reps, states = cache.embed_without_graph(chunks)
    assert reps.shape == (8, 384) and reps.is_leaf and reps.requires_grad and len(states) == 3
    loss_fn({"last_hidden_state": reps}, labels).backward()
    cache.backward_chunks(chunks, states, reps.grad)
    halves = trainable_grads(model)

    torch.manual_seed(0)
    loss = cache.step(batch, labels, loss_backward_fn=lambda loss: (loss * 3.0).backward())
    assert not loss.requires_grad
    scaled = trainable_grads(model)
    torch.manual_seed(0)
    plain_loss = plain_step(model, loss_fn, batch, labels, [0, 3, 6, 8])
    plain = trainable_grads(model)
    torch.testing.assert_close(loss, plain_loss, atol=ATOL, rtol=RTOL)
    assert_grads_close(halves, plain)
    assert_grads_close(scaled, {n: 3.0 * g for n, g in plain.items()})


def test_split_fn_is_used(minilm_path, tokenizer):
    """A caller's split_fn decides the chunks (here uneven: 1, 6, 3 rows)."""
    model = make_model(minilm_path)
    batch, labels = case_batch(tokenizer, "group")
    calls = []

    def split_fn(b, size):
        calls.append(size)
        return [{k: v[a:z] for k, v in b.items() if k != "labels"} for a, z in [(0, 1), (1, 7), (7, 10)]]

    loss_fn = build_loss("infonce", temperature=0.05)
    torch.manual_seed(0)
    loss = GradCache(model, loss_fn, 5, split_fn=split_fn).step({**batch, "labels": labels}, labels)
    cached = trainable_grads(model)
    assert calls == [5]
    torch.manual_seed(0)
    plain_loss = plain_step(model, loss_fn, batch, labels, [0, 1, 7, 10])
    torch.testing.assert_close(loss, plain_loss, atol=ATOL, rtol=RTOL)
    assert_grads_close(cached, trainable_grads(model))


def test_a_zero_or_missing_gradient_still_runs_every_chunk(minilm_path, tokenizer):
    """Every chunk is re-embedded and backpropagated even when d loss / d reps is zero, or
    None (a loss that ignored the embeddings), so every process would join the sync."""
    model = make_model(minilm_path)
    batch, labels = case_batch(tokenizer, "group")
    cache = GradCache(model, lambda out, lab: 0.0 * out["last_hidden_state"].sum() + 2.0, 4)
    calls = []

    def backward_fn(tensor, grad, is_last):
        calls.append((tensor.shape[0], is_last, float(grad.abs().sum())))

    assert float(cache.step(batch, labels, backward_fn=backward_fn)) == 2.0
    chunks = cache.split(batch)
    reps, states = cache.embed_without_graph(chunks)
    cache.backward_chunks(chunks, states, None, backward_fn)
    assert calls == [(4, False, 0.0), (4, False, 0.0), (2, True, 0.0)] * 2


# ---- pieces -------------------------------------------------------------------------------


def test_rand_context_replays_and_then_restores():
    ctx = RandContext()
    first = torch.rand(5)
    after_first = torch.get_rng_state()
    with ctx:
        assert torch.equal(torch.rand(5), first)
    assert torch.equal(torch.get_rng_state(), after_first)  # the replay consumed nothing
    with ctx:  # replays again
        assert torch.equal(torch.rand(5), first)


def test_split_batch_slices_rows_and_leaves_labels_out():
    batch = {
        "input_ids": torch.arange(14).reshape(7, 2),
        "attention_mask": torch.ones(7, 2, dtype=torch.long),
        "token_type_ids": torch.zeros(7, 2, dtype=torch.long),
        "labels": torch.ones(4),
        "flag": None,
    }
    chunks = split_batch(batch, 3)
    assert [c["input_ids"].shape[0] for c in chunks] == [3, 3, 1]
    assert all(set(c) == {"input_ids", "attention_mask", "token_type_ids", "flag"} for c in chunks)
    assert torch.equal(torch.cat([c["input_ids"] for c in chunks]), batch["input_ids"])
    assert [len(c["input_ids"]) for c in split_batch(batch, 7)] == [7]
    assert [len(c["input_ids"]) for c in split_batch(batch, 100)] == [7]
    assert [len(c["input_ids"]) for c in split_batch(batch, 1)] == [1] * 7


def test_split_batch_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="pixel_values.*split_fn"):
        split_batch({"input_ids": torch.zeros(4, 3), "pixel_values": torch.zeros(9, 5)}, 2)
    with pytest.raises(ValueError, match="input_ids"):
        split_batch({"inputs_embeds": torch.zeros(4, 3, 2)}, 2)
    with pytest.raises(ValueError, match="input_ids"):
        split_batch({"input_ids": torch.zeros(0, 3)}, 2)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_mini_batch_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=f"mini_batch_size must be an integer >= 1, got {bad!r}"):
        GradCache(lambda **kw: {}, lambda out, lab: out, bad)
    with pytest.raises(ValueError, match="mini_batch_size"):
        split_batch({"input_ids": torch.zeros(4, 3)}, bad)
