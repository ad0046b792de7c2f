"""EmbeddingTrainer (mmembed/training/trainer.py) on the real all-MiniLM-L6-v2, piece by piece:
its loss call against InfoNCE written out one anchor at a time, the eval embedding loop
(evaluation.embed_eval_set, which the evaluation and the charts share) against embedding
the whole eval set in one call, and the training datasets given to its constructor reaching
the sampler."""

import numpy as np
import pytest
import torch
from reference_losses import reference_infonce
from transformers import TrainingArguments

from mmembed.data.sample import Item, Sample
from mmembed.encoding.collator import EmbeddingCollator
from mmembed.encoding.layout import Layout
from mmembed.encoding.templates import get_template
from mmembed.losses import build_loss
from mmembed.model.embedding import EmbeddingModel, load_backbone
from mmembed.training.evaluation import embed_eval_set
from mmembed.training.trainer import EmbeddingTrainer


class Rows(list):
    """Samples with the dataset index of each (what EmbeddingDataset.dataset_ids gives)."""

    dataset_ids = None


def rows(n: int) -> Rows:
    out = Rows(Sample(Item(f"query {i} about topic {i % 3}"), [Item(f"document {i} on topic {i % 3}")],
                      [Item(f"unrelated text {i}")] * (i % 3), dataset_id=i % 2) for i in range(n))
    out.dataset_ids = np.array([s.dataset_id for s in out])
    return out


@pytest.fixture(scope="module")
def parts(minilm_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = EmbeddingModel(load_backbone(minilm_path), "mean").eval()
    collator = EmbeddingCollator(get_template("bert"), tokenizer, Layout.GROUP, 64, with_dataset_ids=True)
    return model, collator, tokenizer


def trainer(parts, tmp_path, **kw) -> EmbeddingTrainer:
    model, collator, tokenizer = parts
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, dataloader_pin_memory=False)
    return EmbeddingTrainer(model=model, args=args, data_collator=collator, processing_class=tokenizer,
                            loss=build_loss("infonce", temperature=0.05), **kw)


def test_the_loss_call_is_infonce_of_the_models_embeddings(parts, tmp_path):
    t = trainer(parts, tmp_path)
    batch = parts[1](rows(4))
    with torch.no_grad():
        got = t.compute_loss(t.model, dict(batch))
        emb = parts[0](**{k: v for k, v in batch.items() if k not in ("labels", "dataset_ids")})["last_hidden_state"]
    want = reference_infonce(emb, batch["labels"].tolist(), temperature=0.05)
    assert torch.allclose(got, want, atol=1e-6)


def test_the_eval_loop_embeds_every_row_once_as_one_call_does(parts, tmp_path):
    t = trainer(parts, tmp_path)
    data = rows(5)  # batches of 2 samples, the last one alone
    emb, lab = embed_eval_set(t, data)
    batch = parts[1](data)
    with torch.no_grad():
        want = parts[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        token_type_ids=batch["token_type_ids"])["last_hidden_state"]
    assert emb.shape == tuple(want.shape) and emb.dtype == np.float32
    np.testing.assert_allclose(emb, want.numpy(), atol=1e-5)
    assert lab.tolist() == batch["labels"].tolist()
    seen = []
    embed_eval_set(t, data, lambda b, out: seen.append((b.dataset_ids.tolist(), out["last_hidden_state"].shape[0])))
    # each batch handed over unpacked, with its dataset indices and its rows' embeddings
    assert seen == [([0, 1], 2 + 3), ([0, 1], 4 + 2), ([0], 3)]  # 0, 1, 2, 0, 1 negatives


def test_the_training_datasets_given_to_the_constructor_reach_the_sampler(parts, tmp_path):
    import types

    infos = [types.SimpleNamespace(name="first", weight=1.0), types.SimpleNamespace(name="second", weight=3.0)]
    t = trainer(parts, tmp_path, train_datasets=infos, train_dataset=rows(8))
    t.args.multi_dataset_sampler = "round_robin"
    sampler = t._get_train_sampler()
    assert t.training_sampler is sampler
    state = sampler.state(0)
    assert [(d["name"], d["weight"], d["rows"]) for d in state["datasets"]] == [("first", 1.0, 4), ("second", 3.0, 4)]
