"""The data contract (DESIGN.md, "Contract 1: data rows") as tests of the row reader.

Rows are written to real files in the layouts users copy from ms-swift's docs; media are
small PNG files made with PIL, a small MPEG-4 video and a WAV file.
"""

from __future__ import annotations

import base64
import csv
import json
import os

import pytest
from conftest import write_jsonl, write_video, write_wav
from PIL import Image

from mmembed.data import DataError, Item, Sample, iter_raw_rows, load_samples, parse_row, read_file


@pytest.fixture
def media(tmp_path):
    """dog.png, cat.png, bird.png in tmp_path, sub/fish.png, clip.mp4, speech.wav, broken.png."""
    for name, color in [("dog", "red"), ("cat", "blue"), ("bird", "green")]:
        Image.new("RGB", (8, 8), color).save(tmp_path / f"{name}.png")
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (8, 8), "white").save(tmp_path / "sub" / "fish.png")
    write_video(tmp_path / "clip.mp4")  # real files: the reader opens each media file's header
    write_wav(tmp_path / "speech.wav")
    (tmp_path / "broken.png").write_text("this is not an image")
    return tmp_path


def read_one(tmp_path, row, name="data.jsonl"):
    samples = read_file(write_jsonl(tmp_path / name, [row]))
    assert len(samples) == 1
    return samples[0]


def p(tmp_path, name):
    return os.path.join(str(tmp_path), name)


# ----------------------------------------------------------------------------- query form


def test_gme_docs_row(media):
    s = read_one(
        media, {"query": "<image>", "response": "A dog on grass", "images": ["dog.png"], "rejected_response": ["A cat"]}
    )
    assert s.anchor == Item(text="<image>", images=[p(media, "dog.png")])
    assert s.positives == [Item(text="A dog on grass")]
    assert s.negatives == [Item(text="A cat")]
    assert s.label is None
    assert s.source.endswith("data.jsonl") and s.line == 1


@pytest.mark.parametrize(
    "rejected, expected",
    [
        (None, []),
        ([], []),
        ("one negative", ["one negative"]),
        (["n1"], ["n1"]),
        (["n1", "n2", "n3"], ["n1", "n2", "n3"]),
    ],
)
def test_query_form_any_number_of_negatives(tmp_path, rejected, expected):
    row = {"query": "what is a dog", "response": "a dog is an animal"}
    if rejected is not None:
        row["rejected_response"] = rejected
    s = read_one(tmp_path, row)
    assert [n.text for n in s.negatives] == expected


def test_query_form_binds_images_query_then_response_then_each_negative(media):
    row = {
        "query": "compare <image> and <image>",
        "response": "<image> is a dog",
        "rejected_response": ["plain text", "<image> a bird"],
        "images": ["cat.png", "dog.png", "dog.png", "bird.png"],
        "label": 1,
    }
    s = read_one(media, row)
    assert s.anchor.images == [p(media, "cat.png"), p(media, "dog.png")]
    assert s.positives[0].images == [p(media, "dog.png")]
    assert s.negatives[0].images == [] and s.negatives[1].images == [p(media, "bird.png")]
    assert s.label == 1.0 and isinstance(s.label, float)


def test_query_form_images_as_single_string_and_videos_audios(media):
    row = {
        "query": "<image><video>",
        "response": "<audio> a sound",
        "images": "dog.png",
        "videos": ["clip.mp4"],
        "audios": "speech.wav",
        "label": 0.7,
    }
    s = read_one(media, row)
    assert s.anchor.images == [p(media, "dog.png")] and s.anchor.videos == [p(media, "clip.mp4")]
    assert s.positives[0].audios == [p(media, "speech.wav")]
    assert s.label == pytest.approx(0.7)


def test_query_form_system_applies_to_every_member(tmp_path):
    s = read_one(tmp_path, {"system": "Represent the text.", "query": "q", "response": "r", "rejected_response": ["n"]})
    assert {s.anchor.system, s.positives[0].system, s.negatives[0].system} == {"Represent the text."}


@pytest.mark.parametrize(
    "row",
    [
        {"anchor": "q", "positive": "r", "negative": "n", "score": 0.5},
        {"sentence1": "q", "sentence2": "r", "negatives": ["n"], "score": 0.5},
        {"query": "q", "response": "r", "negative_2": "n2", "negative_1": "n", "label": 0.5},
    ],
)
def test_column_aliases(tmp_path, row):
    s = read_one(tmp_path, row)
    assert s.anchor.text == "q" and s.positives[0].text == "r"
    assert s.negatives[0].text == "n" and s.label == 0.5
    if "negative_2" in row:
        assert [n.text for n in s.negatives] == ["n", "n2"]


def test_alias_given_twice_is_an_error(tmp_path):
    with pytest.raises(DataError, match="both 'query' and 'anchor'") as e:
        read_one(tmp_path, {"query": "q", "anchor": "q2", "response": "r"})
    assert e.value.field == "query"


# ----------------------------------------------------------------------------- messages form


def test_messages_form_docs_infonce_row(media):
    row = {
        "messages": [{"role": "user", "content": "<image>sentence1"}],
        "images": ["dog.png"],
        "positive_messages": [[{"role": "user", "content": "<image>sentence2"}]],
        "positive_images": [["cat.png"]],
        "negative_messages": [
            [{"role": "user", "content": "<image><image>sentence3"}],
            [{"role": "user", "content": "<image>sentence4"}],
            [{"role": "user", "content": "no image here"}],
        ],
        "negative_images": [["bird.png", "dog.png"], ["cat.png"], []],
    }
    s = read_one(media, row)
    assert s.anchor == Item(text="<image>sentence1", images=[p(media, "dog.png")])
    assert s.positives == [Item(text="<image>sentence2", images=[p(media, "cat.png")])]
    assert [n.images for n in s.negatives] == [
        [p(media, "bird.png"), p(media, "dog.png")],
        [p(media, "cat.png")],
        [],
    ]


def test_messages_form_system_and_joined_contents(tmp_path):
    row = {
        "messages": [
            {"role": "system", "content": "Instruction"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "second"},
            {"role": "user", "content": "third"},
        ],
        "positive_messages": [[{"role": "system", "content": "Doc"}, {"role": "user", "content": "Positive"}]],
        "negative_messages": [[{"role": "user", "content": "Negative"}]],
        "label": 0.8,
    }
    s = read_one(tmp_path, row)
    assert s.anchor == Item(text="first\nsecond\nthird", system="Instruction")
    assert s.positives == [Item(text="Positive", system="Doc")]
    assert s.negatives == [Item(text="Negative")]
    assert s.label == 0.8


def test_messages_form_pair_row_without_negatives(media):
    row = {
        "messages": [{"role": "user", "content": "sentence1"}],
        "positive_messages": [[{"role": "user", "content": "<image>sentence2"}]],
        "positive_images": [["/" + os.path.relpath(p(media, "dog.png"), "/")]],
        "label": 0,
    }
    s = read_one(media, row)
    assert s.negatives == [] and s.label == 0.0
    assert s.positives[0].images == [p(media, "dog.png")]


def test_messages_form_videos_bind_per_group(media):
    row = {
        "messages": [{"role": "user", "content": "<video>"}],
        "videos": ["clip.mp4"],
        "positive_messages": [[{"role": "user", "content": "<audio>"}]],
        "positive_audios": [["speech.wav"]],
    }
    s = read_one(media, row)
    assert s.anchor.videos == [p(media, "clip.mp4")] and s.positives[0].audios == [p(media, "speech.wav")]


def test_content_parts_bind_in_place(media):
    """Parts with a path carry it; literal tags and path-less parts take the group's list in order."""
    row = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<image> then "},
                    {"type": "image", "image": "dog.png"},
                    {"type": "image"},
                    {"type": "image_url", "image_url": {"url": "sub/fish.png"}},
                    {"type": "text", "text": " end"},
                ],
            }
        ],
        "images": ["cat.png", "bird.png"],
        "positive_messages": [
            [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "a clip"}]}]
        ],
    }
    s = read_one(media, row)
    assert s.anchor.text == "<image> then <image><image><image> end"
    assert s.anchor.images == [p(media, "cat.png"), p(media, "dog.png"), p(media, "bird.png"), p(media, "sub/fish.png")]
    assert s.positives[0] == Item(text="<video>a clip", videos=[p(media, "clip.mp4")])


def test_legacy_messages_form_assistant_is_positive(media):
    """ms-swift 3.x standard format: [system, user, assistant] + rejected_response."""
    row = {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "<image>query"},
            {"role": "assistant", "content": "<image>positive"},
        ],
        "rejected_response": ["<image>negative"],
        "images": ["dog.png", "cat.png", "bird.png"],
    }
    s = read_one(media, row)
    assert s.anchor == Item(text="<image>query", system="sys", images=[p(media, "dog.png")])
    assert s.positives == [Item(text="<image>positive", system="sys", images=[p(media, "cat.png")])]
    assert s.negatives == [Item(text="<image>negative", system="sys", images=[p(media, "bird.png")])]


# ----------------------------------------------------------------------------- media paths


def test_relative_paths_resolve_against_the_data_files_folder(media, monkeypatch, tmp_path_factory):
    data_dir = media / "sub"
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # holds no fish.png
    path = write_jsonl(data_dir / "rows.jsonl", [{"query": "<image>", "response": "fish", "images": ["fish.png"]}])
    [s] = read_file(path)
    assert s.anchor.images == [p(media, "sub/fish.png")]
    rows = list(iter_raw_rows(path))
    s2 = parse_row(rows[0][1], "rows.jsonl", 1, str(data_dir))
    assert s2.anchor.images == [p(media, "sub/fish.png")]


def test_relative_paths_resolve_against_the_working_directory_as_ms_swift_does(media, monkeypatch, tmp_path_factory):
    """ms-swift datasets name images relative to where training starts: data/x.jsonl with
    "images/a.png" while the images live in ./images, not data/images."""
    monkeypatch.chdir(media)
    data_dir = tmp_path_factory.mktemp("data")
    path = write_jsonl(data_dir / "rows.jsonl", [
        {"query": "<image>", "response": "fish", "images": ["sub/fish.png"]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "dog.png"}]}],
         "positive_messages": [[{"role": "user", "content": "a dog"}]]},
    ])
    s1, s2 = read_file(path)
    assert s1.anchor.images == [p(media, "sub/fish.png")]
    assert s2.anchor.images == [p(media, "dog.png")]
    # the training loader (Arrow cache) too, and the cache is keyed on the working directory
    from mmembed.data import load_samples
    from mmembed.data.sample import Sample

    cache = str(tmp_path_factory.mktemp("cache"))
    ds = load_samples([path], cache_dir=cache).dataset
    assert Sample.from_json(ds[0]["sample"]).anchor.images == [p(media, "sub/fish.png")]
    monkeypatch.chdir(data_dir)  # sub/fish.png is found nowhere now: not a stale cache hit
    with pytest.raises(DataError, match="not found"):
        load_samples([path], cache_dir=cache)


def test_a_relative_path_found_in_both_places_is_an_error_naming_both(media, monkeypatch, tmp_path_factory):
    here = tmp_path_factory.mktemp("here")
    Image.new("RGB", (8, 8), "black").save(here / "dog.png")  # a different dog.png than the data folder's
    monkeypatch.chdir(here)
    path = write_jsonl(media / "rows.jsonl", [{"query": "a", "response": "<image>", "images": ["dog.png"]}])
    with pytest.raises(DataError) as e:
        read_file(path)
    msg = str(e.value)
    assert "rows.jsonl:1" in msg and "images[0]" in msg and "ambiguous" in msg
    assert str(here / "dog.png") in msg and p(media, "dog.png") in msg
    # the same file reached both ways (working directory = the data folder) is no conflict
    monkeypatch.chdir(media)
    assert read_file(path)[0].positives[0].images == [p(media, "dog.png")]


def test_a_relative_path_resolves_against_root_image_dir_as_in_ms_swift(media, monkeypatch, tmp_path_factory):
    """ms-swift's _check_path: a relative path that is not under the working directory is
    looked up under $ROOT_IMAGE_DIR. mmembed does the same (in read_file, the Arrow loader,
    whose cache is keyed on it, and the stream), and two different files reached from
    different places stay an error naming both."""
    from mmembed.data import load_samples
    from mmembed.data.sample import Sample
    from mmembed.data.streaming import stream_samples

    here = tmp_path_factory.mktemp("here")
    data_dir = tmp_path_factory.mktemp("data")
    monkeypatch.chdir(here)
    path = write_jsonl(data_dir / "rows.jsonl", [{"query": "<image>", "response": "fish", "images": ["sub/fish.png"]}])
    monkeypatch.delenv("ROOT_IMAGE_DIR", raising=False)
    with pytest.raises(DataError, match="not found"):
        read_file(path)
    cache = str(tmp_path_factory.mktemp("cache"))
    with pytest.raises(DataError, match="not found"):
        load_samples([path], cache_dir=cache)
    monkeypatch.setenv("ROOT_IMAGE_DIR", str(media))
    assert read_file(path)[0].anchor.images == [p(media, "sub/fish.png")]
    ds = load_samples([path], cache_dir=cache).dataset  # not the cached error of the run without it
    assert Sample.from_json(ds[0]["sample"]).anchor.images == [p(media, "sub/fish.png")]
    stream = stream_samples([str(path)], strict=True, seed=42, shuffle=False, buffer_size=10)
    assert next(iter(stream)).anchor.images == [p(media, "sub/fish.png")]
    # the working directory holds another sub/fish.png: ambiguous, both named
    (here / "sub").mkdir()
    Image.new("RGB", (8, 8), "black").save(here / "sub" / "fish.png")
    with pytest.raises(DataError) as e:
        read_file(path)
    msg = str(e.value)
    assert "ambiguous" in msg and str(here / "sub" / "fish.png") in msg and p(media, "sub/fish.png") in msg
    assert "ROOT_IMAGE_DIR" in msg
    # the same file reached through ROOT_IMAGE_DIR and the working directory is no conflict
    monkeypatch.chdir(media)
    assert read_file(path)[0].anchor.images == [p(media, "sub/fish.png")]


def test_a_relative_path_found_nowhere_names_file_line_field_and_both_tried_paths(media, monkeypatch, tmp_path_factory):
    here = tmp_path_factory.mktemp("here")
    monkeypatch.chdir(here)
    path = write_jsonl(media / "rows.jsonl", [{"query": "q", "response": "r"},
                                              {"query": "<image>", "response": "r", "images": ["gone/x.png"]}])
    with pytest.raises(DataError) as e:
        read_file(path)
    msg = str(e.value)
    assert "rows.jsonl:2" in msg and "images[0]" in msg and "not found" in msg
    assert str(here / "gone" / "x.png") in msg and str(media / "gone" / "x.png") in msg


def test_file_uri_http_url_and_data_uri(media):
    png = base64.b64encode((media / "dog.png").read_bytes()).decode()
    row = {
        "query": "<image><image><image>",
        "response": "r",
        "images": ["file://" + p(media, "cat.png"), "https://example.com/a.png", f"data:image/png;base64,{png}"],
    }
    s = read_one(media, row)
    assert s.anchor.images == [p(media, "cat.png"), "https://example.com/a.png", f"data:image/png;base64,{png}"]


def test_image_struct_with_bytes_becomes_data_uri(tmp_path):
    raw = {"query": "<image>", "response": "r", "images": [{"bytes": b"\x89PNG\r\n", "path": None}]}
    s = parse_row(raw, "x.parquet", 1, str(tmp_path))
    assert s.anchor.images[0].startswith("data:image/png;base64,")


# ----------------------------------------------------------------------------- file formats


def test_jsonl_line_numbers_skip_blank_lines(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"query": "a", "response": "b"}, "", "   ", {"query": "c", "response": "d"}]
    )
    assert [line for line, _ in iter_raw_rows(path)] == [1, 4]
    assert [s.line for s in read_file(path)] == [1, 4]


def test_json_array_reports_each_elements_line(tmp_path):
    path = tmp_path / "d.json"
    rows = [{"query": "a", "response": "b"}, {"query": "c", "response": "d", "rejected_response": ["e"]}]
    path.write_text(json.dumps(rows, indent=2))
    lines = [line for line, _ in iter_raw_rows(str(path))]
    text = path.read_text().splitlines()
    assert [text[i - 1].strip() for i in lines] == ["{", "{"]
    assert lines[0] == 2 and lines[1] > lines[0]
    assert [s.anchor.text for s in read_file(str(path))] == ["a", "c"]


def test_json_file_with_jsonl_content_and_pretty_object(tmp_path):
    path = write_jsonl(tmp_path / "d.json", [{"query": "a", "response": "b"}, {"query": "c", "response": "d"}])
    assert [line for line, _ in iter_raw_rows(path)] == [1, 2]
    pretty = tmp_path / "one.json"
    pretty.write_text("\n" + json.dumps({"query": "a", "response": "b"}, indent=2))
    assert [line for line, _ in iter_raw_rows(str(pretty))] == [2]


def test_csv_with_list_cells_and_numeric_label(media):
    path = media / "d.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["query", "response", "rejected_response", "images", "label"])
        w.writerow(["<image>", "a dog", json.dumps(["a cat", "a bird"]), json.dumps(["dog.png"]), "1"])
        w.writerow(["multi\nline query", "r", "just one negative", "", "0.25"])
        w.writerow(["q", "r", "", "", ""])
    samples = read_file(str(path))
    assert samples[0].anchor.images == [p(media, "dog.png")]
    assert [n.text for n in samples[0].negatives] == ["a cat", "a bird"] and samples[0].label == 1.0
    assert samples[1].anchor.text == "multi\nline query" and [n.text for n in samples[1].negatives] == [
        "just one negative"
    ]
    assert samples[1].label == 0.25 and samples[2].label is None and samples[2].negatives == []
    assert [s.line for s in samples] == [2, 3, 5]


def test_tsv(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text("anchor\tpositive\tscore\nq\tr\t0.5\n")
    [s] = read_file(str(path))
    assert (s.anchor.text, s.positives[0].text, s.label, s.line) == ("q", "r", 0.5, 2)


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"query": ["a", "b"], "response": ["c", "d"], "rejected_response": [["x"], []]})
    pq.write_table(table, tmp_path / "d.parquet")
    samples = read_file(str(tmp_path / "d.parquet"))
    assert [(s.anchor.text, len(s.negatives), s.line) for s in samples] == [("a", 1, 1), ("b", 0, 2)]


def test_samples_round_trip_through_json(media):
    s = read_one(
        media, {"query": "<image>", "response": "r", "images": ["dog.png"], "rejected_response": ["n"], "label": 1}
    )
    assert Sample.from_json(s.to_json()) == s


# ----------------------------------------------------------------------------- broken rows

# (content of the file as lines, file name, line of the error, field, words in the message)
BROKEN = {
    "bad json": (
        ['{"query": "a", "response": "b"}', "", '{"query": "a", "response": }'],
        "d.jsonl",
        3,
        None,
        "invalid JSON",
    ),
    "not an object": (['{"query": "a", "response": "b"}', '["a", "b"]'], "d.jsonl", 2, None, "not a JSON object"),
    "missing query": ([{"response": "b"}], "d.jsonl", 1, "query", "missing"),
    "missing response": ([{"query": "a", "rejected_response": ["n"]}], "d.jsonl", 1, "response", "missing"),
    "missing positive_messages": (
        [{"messages": [{"role": "user", "content": "a"}]}],
        "d.jsonl",
        1,
        "positive_messages",
        "missing",
    ),
    "rejected_response is a number": (
        [{"query": "a", "response": "b", "rejected_response": 3}],
        "d.jsonl",
        1,
        "rejected_response",
        "list of strings",
    ),
    "negative not a string": (
        [{"query": "a", "response": "b", "rejected_response": ["ok", 5]}],
        "d.jsonl",
        1,
        "rejected_response[1]",
        "string",
    ),
    "label not a number": ([{"query": "a", "response": "b", "label": "high"}], "d.jsonl", 1, "label", "number"),
    "query not a string": ([{"query": ["a"], "response": "b"}], "d.jsonl", 1, "query", "string"),
    "content not str/list": (
        [{"messages": [{"role": "user", "content": 5}], "positive_messages": [[{"role": "user", "content": "b"}]]}],
        "d.jsonl",
        1,
        "messages[0].content",
        "string or a list",
    ),
    "images not a list": (
        [{"query": "<image>", "response": "b", "images": 5}],
        "d.jsonl",
        1,
        "images",
        "list of paths",
    ),
    "query form: more tags than paths": (
        [{"query": "<image>", "response": "<image>", "images": ["dog.png"]}],
        "d.jsonl",
        1,
        "images",
        "2 <image> tag(s)",
    ),
    "query form: paths without tags": (
        [{"query": "a", "response": "b", "videos": ["clip.mp4"]}],
        "d.jsonl",
        1,
        "videos",
        "0 <video> tag(s)",
    ),
    "messages form: negative tags vs paths": (
        [
            {
                "messages": [{"role": "user", "content": "a"}],
                "positive_messages": [[{"role": "user", "content": "b"}]],
                "negative_messages": [
                    [{"role": "user", "content": "c"}],
                    [{"role": "user", "content": "<image><image>"}],
                ],
                "negative_images": [[], ["dog.png"]],
            }
        ],
        "d.jsonl",
        1,
        "negative_images[1]",
        "2 <image> tag(s)",
    ),
    "messages form: anchor tags vs paths": (
        [
            {
                "messages": [{"role": "user", "content": "<image>"}],
                "positive_messages": [[{"role": "user", "content": "b"}]],
            }
        ],
        "d.jsonl",
        1,
        "images",
        "1 <image> tag(s)",
    ),
    "messages form: outer lengths differ": (
        [
            {
                "messages": [{"role": "user", "content": "a"}],
                "positive_messages": [[{"role": "user", "content": "<image>"}]],
                "positive_images": [["dog.png"], ["cat.png"]],
            }
        ],
        "d.jsonl",
        1,
        "positive_images",
        "2 entries",
    ),
    "positive_messages without the outer list": (
        [{"messages": [{"role": "user", "content": "a"}], "positive_messages": [{"role": "user", "content": "b"}]}],
        "d.jsonl",
        1,
        "positive_messages",
        "one more []",
    ),
    "two positives": (
        [
            {
                "messages": [{"role": "user", "content": "a"}],
                "positive_messages": [[{"role": "user", "content": "b"}], [{"role": "user", "content": "c"}]],
            }
        ],
        "d.jsonl",
        1,
        "positive_messages",
        "exactly one",
    ),
    "missing media file": (
        [{"query": "<image>", "response": "b", "images": ["nowhere.png"]}],
        "d.jsonl",
        1,
        "images[0]",
        "not found",
    ),
    "missing media file in a content part": (
        [
            {
                "messages": [{"role": "user", "content": [{"type": "image", "image": "nowhere.png"}]}],
                "positive_messages": [[{"role": "user", "content": "b"}]],
            }
        ],
        "d.jsonl",
        1,
        "messages[0].content[0]",
        "not found",
    ),
    "unreadable image": (
        [{"query": "<image>", "response": "b", "images": ["broken.png"]}],
        "d.jsonl",
        1,
        "images[0]",
        "unreadable image",
    ),
    "unsupported URI scheme": (
        [{"query": "<image>", "response": "b", "images": ["s3://bucket/a.png"]}],
        "d.jsonl",
        1,
        "images[0]",
        "scheme",
    ),
    "empty text, no media": ([{"query": "a", "response": "  "}], "d.jsonl", 1, "response", "empty text"),
    "empty negative": (
        [{"query": "a", "response": "b", "rejected_response": ["x", ""]}],
        "d.jsonl",
        1,
        "rejected_response[1]",
        "empty text",
    ),
    "empty messages group": (
        [{"messages": [{"role": "user", "content": ""}], "positive_messages": [[{"role": "user", "content": "b"}]]}],
        "d.jsonl",
        1,
        "messages",
        "empty text",
    ),
    "unknown role": (
        [{"messages": [{"role": "tool", "content": "a"}], "positive_messages": [[{"role": "user", "content": "b"}]]}],
        "d.jsonl",
        1,
        "messages[0].role",
        "unknown role",
    ),
    "unknown role in a negative": (
        [
            {
                "messages": [{"role": "user", "content": "a"}],
                "positive_messages": [[{"role": "user", "content": "b"}]],
                "negative_messages": [[{"role": "narrator", "content": "c"}]],
            }
        ],
        "d.jsonl",
        1,
        "negative_messages[0][0].role",
        "unknown role",
    ),
    "unknown content part": (
        [
            {
                "messages": [{"role": "user", "content": [{"type": "pdf", "pdf": "a.pdf"}]}],
                "positive_messages": [[{"role": "user", "content": "b"}]],
            }
        ],
        "d.jsonl",
        1,
        "messages[0].content[0].type",
        "unknown content part",
    ),
    "mixed forms": (
        [{"query": "a", "response": "b", "positive_messages": [[{"role": "user", "content": "b"}]]}],
        "d.jsonl",
        1,
        "positive_messages",
        "messages form",
    ),
    "json array: bad element": (
        ['[{"query": "a", "response": "b"},', "", '{"query": oops}]'],
        "d.json",
        3,
        None,
        "invalid JSON",
    ),
    "json array: non-object element": (
        ["[", '{"query": "a", "response": "b"},', "42", "]"],
        "d.json",
        3,
        None,
        "not a JSON object",
    ),
    "csv: bad label": (["query,response,label", "a,b,0.5", "c,d,very", "e,f,1"], "d.csv", 3, "label", "number"),
    "csv: broken list cell": (["query,response,images", 'a,b,"[""x.png"""'], "d.csv", 2, "images", "not valid JSON"),
    "csv: too many cells": (["query,response", "a,b,c"], "d.csv", 2, None, "3 cells"),
}


@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_broken_rows_name_file_line_and_field(media, case):
    lines, name, line, fieldname, words = BROKEN[case]
    path = media / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(DataError) as e:
        read_file(str(path))
    err = e.value
    message = str(err)
    assert name in message and f":{line}" in message, message
    assert err.line == line and err.source.endswith(name)
    assert err.field == fieldname, message
    if fieldname:
        assert f"'{fieldname}'" in message
    assert words in message, message
    # the parse of training (a .jsonl file's plain rows read by Arrow's parser): the same error
    with pytest.raises(DataError) as loaded:
        load_samples([str(path)], cache_dir=str(media / "cache"))
    assert str(loaded.value) == message and type(loaded.value) is type(err)


def test_verify_images_can_be_turned_off(media):
    path = write_jsonl(media / "d.jsonl", [{"query": "<image>", "response": "b", "images": ["broken.png"]}])
    [s] = read_file(path, verify_images=False)
    assert s.anchor.images == [p(media, "broken.png")]


def test_iter_raw_rows_stops_with_data_error_at_bad_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"a": 1}, "{nope", {"b": 2}])
    rows = iter_raw_rows(path)
    assert next(rows) == (1, {"a": 1})
    with pytest.raises(DataError, match=r"d\.jsonl:2: invalid JSON"):
        next(rows)


def test_unsupported_extension(tmp_path):
    (tmp_path / "d.txt").write_text("hello\n")
    with pytest.raises(DataError, match="unsupported file type"):
        list(iter_raw_rows(str(tmp_path / "d.txt")))
