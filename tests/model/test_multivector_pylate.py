"""PyLate 1.6 (``pylate.models.ColBERT``) loads the PyLate-flavoured folder mmembed writes and
gives the same token vectors as mmembed's ``LateInteractionModel``.

PyLate pins other versions of sentence-transformers and transformers, so its vectors were
recorded once in its own venv (tests/fixtures/pylate/make_fixtures.py, how to run it at its top)
into tests/fixtures/pylate/vectors.npz: for all-MiniLM-L6-v2 and a fixed-seed projection, the
vectors of a few queries (``[MASK]`` expansion to the query length, attended or not) and
documents (punctuation skiplist). Here the projection is rebuilt from the seed (its digest must
equal the recorded one) and mmembed's vectors are compared to PyLate's. sentence-transformers
6.2 also loads that PyLate folder (its legacy path) with the same vectors."""

import json
import os

import numpy as np
import pytest
import torch
from fixtures.pylate.make_fixtures import projection

from mmembed.model.late_interaction import (
    PUNCTUATION_SKIPLIST,
    LateInteractionModel,
    skiplist_token_ids,
    token_vectors,
    tokenize_queries,
)
from mmembed.model.multivector_io import projection_from_weight, weight_digest, write_multivector_folder

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "pylate", "vectors.npz")


@pytest.fixture(scope="module")
def recorded():
    arrays = dict(np.load(FIXTURE))
    return json.loads(str(arrays.pop("meta"))), arrays


@pytest.fixture(scope="module")
def model_and_tokenizer(minilm_path, recorded):
    from transformers import AutoTokenizer

    from mmembed.model.embedding import load_backbone

    meta, _ = recorded
    weight = projection(meta["seed"], dim=meta["dim"])
    assert weight_digest(weight) == meta["digest"]  # the projection PyLate encoded with
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = LateInteractionModel(load_backbone(minilm_path), meta["dim"], projection=projection_from_weight(weight),
                                 skiplist_ids=skiplist_token_ids(tokenizer, PUNCTUATION_SKIPLIST)).eval()
    return model, tokenizer


def _ours(model, tokenizer, meta, settings):
    queries = tokenize_queries(tokenizer, meta["queries"], settings["query_expansion"],
                               query_length=settings["query_length"])
    docs = tokenizer(meta["documents"], return_tensors="pt", padding=True, truncation=True,
                     max_length=settings["document_length"])
    with torch.no_grad():
        q = token_vectors(model(**queries)["last_hidden_state"])
        d = token_vectors(model(**docs, apply_skiplist=torch.ones(len(meta["documents"]), dtype=torch.bool))
                          ["last_hidden_state"])
    return q, d


@pytest.mark.parametrize("name", ["expand", "expand_attend"])
def test_same_vectors_as_pylate(recorded, model_and_tokenizer, name):
    meta, arrays = recorded
    model, tokenizer = model_and_tokenizer
    settings = meta["settings"][name]
    q, d = _ours(model, tokenizer, meta, settings)
    for side, ours in (("q", q), ("d", d)):
        for i, vectors in enumerate(ours):
            theirs = torch.from_numpy(arrays[f"{name}/{side}{i}"])
            assert vectors.shape == theirs.shape, (name, side, i)
            torch.testing.assert_close(vectors, theirs, atol=1e-5, rtol=0)
    assert all(len(v) == settings["query_length"] for v in q)  # expansion: every position scored
    assert len(d[0]) < len(tokenizer(meta["documents"][0])["input_ids"])  # punctuation dropped


def test_sentence_transformers_loads_the_pylate_folder(tmp_path, recorded, model_and_tokenizer, minilm_path):
    from sentence_transformers import MultiVectorEncoder

    meta, arrays = recorded
    model, tokenizer = model_and_tokenizer
    settings = meta["settings"]["expand"]
    folder = write_multivector_folder(str(tmp_path / "pylate"), minilm_path, model.projection, flavor="pylate",
                                      **settings)
    st = MultiVectorEncoder(folder, device="cpu")
    for side, texts, encode in (("q", meta["queries"], st.encode_query), ("d", meta["documents"], st.encode_document)):
        for i, vectors in enumerate(encode(texts)):
            torch.testing.assert_close(vectors, torch.from_numpy(arrays[f"expand/{side}{i}"]), atol=1e-5, rtol=0)
