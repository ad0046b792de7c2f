"""Saved forms of a late-interaction model (mmembed.model.multivector_io), checked against the
libraries that load them: sentence-transformers 6.2's ``MultiVectorEncoder`` loads the folder as
written (no conversion) and gives the same token vectors as mmembed's ``LateInteractionModel``
(same kept tokens: the document skiplist, the [MASK] query expansion); transformers'
``ColQwen2ForRetrieval`` loads the ColQwen2 folder and gives the same ``embeddings`` on the same
token inputs; the checkpoint's projection and settings round-trip."""

import json
import os

import pytest
import torch

from mmembed.model.late_interaction import (
    LateInteractionModel,
    skiplist_token_ids,
    token_vectors,
    tokenize_queries,
)
from mmembed.model.multivector_io import (
    LATE_INTERACTION_KEY,
    PROJECTION_FILE,
    late_interaction_config,
    load_projection,
    projection_from_weight,
    read_late_interaction_config,
    save_projection,
    weight_digest,
    write_colqwen2_folder,
    write_multivector_folder,
)

QUERIES = ["what is a flute?", "who wrote the odyssey, and when"]
DOCUMENTS = ["A flute is a woodwind instrument; it has no reed.",
             "Homer (8th century BC?) wrote the Odyssey: an epic poem!",
             "short"]
EXPANSION = {"strategy": "fixed", "attend": False, "length": 16}


@pytest.fixture(scope="module")
def minilm_late(minilm_no_dropout):
    from transformers import AutoTokenizer

    from mmembed.model.embedding import load_backbone

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm_no_dropout)
    model = LateInteractionModel(load_backbone(minilm_no_dropout), 64, skiplist_ids=skiplist_token_ids(tokenizer),
                                 length_chunks=1).eval()
    return model, tokenizer, minilm_no_dropout


def _encode_documents(model, tokenizer, texts, prefix, length):
    enc = tokenizer([prefix + t for t in texts], return_tensors="pt", padding=True, truncation=True, max_length=length)
    with torch.no_grad():
        out = model(**enc, apply_skiplist=torch.ones(len(texts), dtype=torch.bool))["last_hidden_state"]
    return token_vectors(out), enc


@pytest.mark.parametrize("expansion", [EXPANSION, {**EXPANSION, "attend": True}, None],
                         ids=["expand", "expand_attend", "no_expansion"])
def test_sentence_transformers_loads_the_folder_with_the_same_vectors(tmp_path, minilm_late, expansion):
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    model, tokenizer, folder = minilm_late
    out = write_multivector_folder(str(tmp_path / "mv"), model, tokenizer=tokenizer, query_prefix="query: ",
                                   document_prefix="passage: ", query_length=24 if expansion is None else None,
                                   document_length=20, query_expansion=expansion)
    st = MultiVectorEncoder(out, device="cpu")
    # loaded as written: the four modules, not a conversion (which would add a random projection)
    assert [type(m) for m in st] == [Transformer, Dense, MultiVectorMask, Normalize]
    assert torch.equal(st[1].linear.weight, model.projection.weight)
    assert st.similarity_fn_name == "maxsim"

    queries = tokenize_queries(tokenizer, QUERIES, expansion, prefix="query: ", query_length=24)
    with torch.no_grad():
        ours_q = token_vectors(model(**queries)["last_hidden_state"])
    theirs_q = st.encode_query(QUERIES)
    for a, b in zip(ours_q, theirs_q):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if expansion is not None:  # every query is the expansion length, [MASK] positions included
        assert all(len(q) == expansion["length"] for q in theirs_q)

    ours_d, enc = _encode_documents(model, tokenizer, DOCUMENTS, "passage: ", 20)
    theirs_d = st.encode_document(DOCUMENTS)
    for a, b in zip(ours_d, theirs_d):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the skiplist did drop punctuation from the documents (and a truncated document is cut at 20)
    assert len(ours_d[0]) < int(enc["attention_mask"][0].sum())


def test_query_expansion_tokens_match_sentence_transformers(tmp_path, minilm_late):
    """expand_query (through tokenize_queries) gives the ids, attention mask and scored positions
    of sentence-transformers' own query preprocessing, for both strategies and both padding
    sides."""
    from sentence_transformers.base.modules import Transformer

    _, tokenizer, folder = minilm_late
    texts = [*QUERIES, "a much longer query that goes on and on well past the expansion length of sixteen tokens"]
    for expansion in (EXPANSION, {**EXPANSION, "attend": True}, {"strategy": "min", "attend": False, "length": 12}):
        module = Transformer(folder, query_expansion=expansion, query_length=64)
        theirs = module.preprocess(texts, task="query")
        ours = tokenize_queries(tokenizer, texts, expansion, query_length=64)
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["attention_mask"].bool(), theirs["attention_mask"].bool())
        assert torch.equal(ours["token_mask"], theirs["attention_mask"].bool() | theirs["query_expansion_positions"])
        assert (ours["input_ids"] == tokenizer.mask_token_id).any()


def test_projection_and_settings_round_trip(tmp_path, minilm_late):
    model, _, _ = minilm_late
    path = save_projection(str(tmp_path), model)
    assert os.path.basename(path) == PROJECTION_FILE
    weight = load_projection(str(tmp_path))
    assert torch.equal(weight, model.projection.weight.detach())
    assert weight_digest(projection_from_weight(weight).weight) == weight_digest(model.projection.weight)

    config = late_interaction_config(64, query_expansion={"strategy": "fixed", "length": 32}, document_length=180,
                                     normalize_scores=True)
    saved = json.loads(json.dumps({LATE_INTERACTION_KEY: config}))  # as it comes back from mmembed.json
    assert read_late_interaction_config(saved) == config
    assert config["query_expansion"] == {"strategy": "fixed", "attend": False, "token": None, "length": 32}
    with pytest.raises(ValueError, match="dim"):
        read_late_interaction_config({LATE_INTERACTION_KEY: {**config, "dim": 0}})
    with pytest.raises(ValueError, match="strategy"):
        late_interaction_config(64, query_expansion={"strategy": "pad", "length": 32})


# --- ColQwen2ForRetrieval --------------------------------------------------------------------

def _image(seed: int, size: int = 56):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def test_colqwen2_folder_gives_the_same_embeddings(tmp_path, tiny_model):
    from transformers import AutoProcessor, ColQwen2ForRetrieval, ColQwen2Processor

    from mmembed.model.embedding import load_backbone

    folder = tiny_model("qwen2_vl")
    torch.manual_seed(0)
    model = LateInteractionModel(load_backbone(folder), 32, tower="vision").eval()
    out = write_colqwen2_folder(str(tmp_path / "colqwen2"), model, AutoProcessor.from_pretrained(folder))
    col = ColQwen2ForRetrieval.from_pretrained(out, dtype=torch.float32).eval()
    processor = ColQwen2Processor.from_pretrained(out)
    assert col.config.embedding_dim == 32
    assert torch.equal(col.embedding_proj_layer.weight, model.projection.weight)

    # queries: ColQwen2's own rendering ("Query: " + text + 10 pad tokens + "\n"), the same ids fed to both
    q = processor.process_queries(["a red square", "where is the cat?"])
    with torch.no_grad():
        theirs = col(input_ids=q["input_ids"], attention_mask=q["attention_mask"]).embeddings
        ours = model(input_ids=q["input_ids"], attention_mask=q["attention_mask"])["last_hidden_state"]
    assert (q["input_ids"] == processor.tokenizer.pad_token_id).sum(1).min() >= 10  # the augmentation tokens
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert torch.equal(ours.ne(0).any(-1), q["attention_mask"].bool())  # padding exactly zero in both

    # image documents: the same pixels and ids; ColQwen2 given the M-RoPE positions the backbone uses
    d = processor.process_images([_image(0), _image(1, 84)])
    grid = d["image_grid_thw"]
    flat = d["pixel_values"][torch.arange(d["pixel_values"].shape[1]) < (grid[:, 1] * grid[:, 2]).unsqueeze(1)]
    mm_types = (d["input_ids"] == col.config.vlm_config.image_token_id).int()
    base = model._base()
    positions, _ = base.get_rope_index(d["input_ids"], mm_token_type_ids=mm_types, image_grid_thw=grid,
                                       attention_mask=d["attention_mask"])
    with torch.no_grad():
        theirs = col(input_ids=d["input_ids"], attention_mask=d["attention_mask"], pixel_values=d["pixel_values"],
                     image_grid_thw=grid, position_ids=positions).embeddings
        ours = model(input_ids=d["input_ids"], attention_mask=d["attention_mask"], pixel_values=flat,
                     image_grid_thw=grid, mm_token_type_ids=mm_types)["last_hidden_state"]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert torch.equal(ours.ne(0).any(-1), d["attention_mask"].bool())
