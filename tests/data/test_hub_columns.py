"""Hub rows -> mmembed's row forms (mmembed/data/hub_columns.py): ms-swift's registered
embedding and reranker datasets mapped as ms-swift maps them, sentence-transformers' column
order, ms-swift's lookup of a dataset id and its column renames.

The rows use each hub dataset's real column names, from where they are read:
sentence-transformers/stsb (``sentence1``, ``sentence2``, ``score``) and the mteb reranking sets
(``query``, ``positive``, ``negative``) from ms-swift's own ``StsbPreprocessor`` and
``MTEBRerankPreprocessor`` (swift/dataset/dataset/llm.py); HuggingFaceM4/TextCaps (``image``,
``image_id``, ``reference_strs``, ...) from ms-swift's ``TextCaps*Preprocessor``s (mllm.py,
``columns={'reference_strs': 'response'}``, ``image`` -> ``images``) and HuggingFaceM4's own
evaluation code (m4: ``image_column_name = "image"``, ``text_column_name = "reference_strs"``);
sentence-transformers' label columns from its data collator (``DEFAULT_LABEL_COLUMNS``).
"""

import numpy as np
import pytest

from mmembed.data.hub_columns import (
    SWIFT_DATASETS,
    MtebRerank,
    StsbPairs,
    TextCapsEmb,
    TextCapsRerank,
    positional_columns,
    swift_dataset,
    swift_renames,
)


def test_stsb_pairs_as_ms_swift_maps_them():
    row = {"sentence1": "A plane is taking off.", "sentence2": "An air plane is taking off.", "score": 1.0}
    assert StsbPairs()(row) == {"messages": [{"role": "user", "content": "A plane is taking off."}],
                                "positive_messages": [[{"role": "user", "content": "An air plane is taking off."}]],
                                "label": 1.0}
    low = dict(row, score=0.5)
    assert StsbPairs(threshold=0.75)(low) is None  # stsb:positive keeps pairs scored >= 0.75
    assert StsbPairs(threshold=0.75)(dict(row, score=0.75))["label"] == 0.75
    assert StsbPairs()(low)["label"] == 0.5


def test_mteb_reranking_rows_take_every_positive_and_negative():
    row = {"query": "graph neural networks", "positive": ["GNN survey", "Message passing"], "negative": ["Protein folding"]}
    out = MtebRerank()(row)
    assert out["messages"] == [{"role": "user", "content": "graph neural networks"}]
    assert out["positive_messages"] == [[{"role": "assistant", "content": "GNN survey"}],
                                        [{"role": "assistant", "content": "Message passing"}]]
    assert out["negative_messages"] == [[{"role": "assistant", "content": "Protein folding"}]]
    single = MtebRerank()({"query": "q", "positive": "p", "negative": "n"})  # one text, not a list
    assert single["positive_messages"] == [[{"role": "assistant", "content": "p"}]]


def test_textcaps_emb_is_the_image_against_its_first_caption(tmp_path):
    image = tmp_path / "a.jpg"
    image.write_bytes(b"x")
    row = {"images": str(image), "image_id": "011e7e629fb9ae7b", "response": ["a sign reads STOP", "a red sign"]}
    assert TextCapsEmb()(row) == {"messages": [{"role": "user", "content": "<image>"}],
                                  "positive_messages": [[{"role": "user", "content": "a sign reads STOP"}]],
                                  "images": [str(image)]}


def test_textcaps_rerank_draws_negatives_as_ms_swift_does(tmp_path):
    """ms-swift's TextCapsReRankPreprocessor: one RandomState(42); per row whose image file is
    there, a permutation of the split's captions, the first ones not among the row's own."""
    image = str(tmp_path / "a.jpg")
    open(image, "wb").close()
    split = [["c0", "c1"], ["c2"], ["c3", "c4", "c0"], ["c5"], ["c6", "c7"]]
    rows = [{"images": image, "response": caps} for caps in split]
    rows[3]["images"] = str(tmp_path / "absent.jpg")  # ms-swift drops it before drawing: no draw
    mapper = TextCapsRerank(negatives=3)
    mapper.prepare(lambda column: {"response": split}[column])
    got = [mapper(r) for r in rows]

    pool = [c for caps in split for c in caps]
    rs = np.random.RandomState(42)
    for row, out in zip(rows, got):
        want = []
        if row["images"] == image:
            for i in rs.permutation(len(pool)):
                if pool[i] not in row["response"]:
                    want.append(pool[i])
                if len(want) >= 3:
                    break
        assert [g[0]["content"] for g in out["negative_messages"]] == want
        assert out["positive_messages"] == [[{"role": "user", "content": row["response"][0]}]]
    assert all(len(g["negative_messages"]) == 3 for i, g in enumerate(got) if i != 3)
    assert got[3]["negative_messages"] == []


@pytest.mark.parametrize("columns, text, expected", [
    (["sentence_A", "sentence_B", "score"], {"sentence_A", "sentence_B"},
     {"sentence_A": "query", "sentence_B": "response", "score": "label"}),
    (["premise", "hypothesis", "label"], {"premise", "hypothesis"},
     {"premise": "query", "hypothesis": "response", "label": "label"}),
    (["text", "pos", "neg1", "neg2"], {"text", "pos", "neg1", "neg2"},
     {"text": "query", "pos": "response", "neg1": "negative_1", "neg2": "negative_2"}),
    (["hypothesis", "entailment", "contradiction"], {"hypothesis", "entailment", "contradiction"},
     {"hypothesis": "query", "entailment": "response", "contradiction": "negative_1"}),
])
def test_sentence_transformers_column_order(columns, text, expected):
    assert positional_columns(columns, text) == expected


@pytest.mark.parametrize("columns, text", [
    (["anchor", "positive", "negative"], {"anchor", "positive", "negative"}),  # read by name
    (["sentence1", "sentence2", "score"], {"sentence1", "sentence2"}),
    (["messages", "positive_messages"], set()),
    (["query", "pos"], {"query", "pos"}),  # the reader names the missing response
    (["text", "relatedness_score"], {"text"}),  # a number that is no label column: neither reading
    (["only"], {"only"}),
])
def test_columns_read_by_name_or_not_at_all(columns, text):
    assert positional_columns(columns, text) is None


def test_dataset_ids_resolve_as_ms_swift_resolves_them():
    textcaps = next(d for d in SWIFT_DATASETS if d.ms_id == "swift/TextCaps")
    assert swift_dataset("ms", "swift/TextCaps") == (textcaps, True)
    assert swift_dataset("hf", "HuggingFaceM4/TextCaps") == (textcaps, True)
    assert swift_dataset("hf", "swift/TextCaps") == (textcaps, False)  # by its name, as ms-swift matches
    assert swift_dataset("hf", "mteb/scidocs-reranking")[0].ms_id == "MTEB/scidocs-reranking"
    assert swift_dataset("ms", "someone/stsb") == (SWIFT_DATASETS[0], False)
    assert swift_dataset("hf", "org/tiny-data") == (None, False)


def test_registered_subsets_take_the_datasets_splits_and_mapping():
    scidocs = swift_dataset("ms", "MTEB/scidocs-reranking")[0]
    default = scidocs.subset("default")
    assert default.splits == ("validation", "test") and isinstance(default.mapper(7), MtebRerank)
    other = scidocs.subset("other")  # not registered: the hub's subset of that name, the dataset's mapping
    assert (other.hub_subset, other.splits) == ("other", ("validation", "test"))
    textcaps = swift_dataset("ms", "swift/TextCaps")[0]
    emb = textcaps.subset("emb")
    assert (emb.hub_subset, emb.splits, emb.columns) == ("default", ("train", "validation"),
                                                         {"reference_strs": "response"})
    assert textcaps.subset("default").refused and swift_dataset("ms", "sentence-transformers/stsb")[0].subset("reg").refused
    assert textcaps.subset("rerank").mapper(5).negatives == 5


def test_swift_renames_ignore_case_and_skip_a_shared_target():
    columns = ["Image", "image_id", "Reference_Strs"]
    assert swift_renames(columns, {"reference_strs": "response"}) == {"Reference_Strs": "response", "Image": "images"}
    assert swift_renames(["image", "images"], {}) == {}  # both would be images: neither renamed
    assert swift_renames(["audio", "q"], {"q": "query"}) == {"q": "query", "audio": "audios"}
