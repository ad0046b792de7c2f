"""Token counts from media headers (mmembed.encoding.measure) against the processor's own count.

The reference is the old measuring, ``InputBuilder.lengths`` with ``check_media="full"``:
each medium decoded and resized by the loader, then the real Qwen2-VL / Qwen2.5-VL /
Qwen3-VL / Qwen2-Audio processor run on it, its ``attention_mask`` summed. The header
count must equal it for many sizes, budgets, frame rates and durations, without decoding
anything (the loader is replaced by one that fails while the header count runs). Text
lengths are compared with the tokenizer called on one text at a time.
"""

from __future__ import annotations

import json
import logging
import os
import random

import av
import numpy as np
import pytest
import soundfile as sf
from conftest import write_jsonl
from PIL import Image

from mmembed.data import load_samples
from mmembed.data.sample import DataError, Item
from mmembed.encoding import measure
from mmembed.encoding.inputs import InputBuilder
from mmembed.encoding.layout import Layout
from mmembed.encoding.media import MediaBudget, MediaSettings
from mmembed.encoding.templates import get_template
from mmembed.training.length_check import drop_overlong, length_check_fingerprint

TEMPLATES = {"qwen2_vl": "qwen2_gme", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl_emb"}

BUDGETS = {
    "default": MediaBudget(),
    "small": MediaBudget(max_pixels=112 * 112, min_pixels=28 * 28),
    "band": MediaBudget(max_pixels=60_000, min_pixels=40_000),
    "large_min": MediaBudget(min_pixels=300 * 300, max_pixels=400 * 400),
}

VIDEO_BUDGETS = {
    "default": MediaBudget(),
    "few": MediaBudget(fps=1.0, fps_min_frames=2, fps_max_frames=4, video_max_pixels=64 * 64 * 4,
                       video_min_pixels=28 * 28),
    "many": MediaBudget(fps=8.0, fps_max_frames=40, video_max_pixels=200 * 200, video_min_pixels=56 * 56,
                        video_total_pixels=600_000),
}

# (height, width): tiny, patch-aligned and not, extreme aspect ratios (200 is the limit), large
IMAGE_SIZES = [
    (1, 1), (2, 3), (27, 29), (28, 28), (32, 32), (55, 57), (100, 100), (112, 113), (113, 112), (480, 640),
    (640, 480), (1, 200), (200, 1), (10, 2000), (2000, 10), (7, 999), (333, 17), (1200, 1600), (2500, 3000),
]


@pytest.fixture(scope="module")
def processors(tiny_model):
    from transformers import AutoProcessor

    return {kind: AutoProcessor.from_pretrained(tiny_model(kind)) for kind in (*TEMPLATES, "qwen2_audio")}


def builder(processors, kind, budget=None, check_media="header", max_length=None, template=None):
    template = get_template(template or TEMPLATES.get(kind, kind))
    return InputBuilder(template, processors[kind], max_length, truncate=False,
                        media=MediaSettings(budget or MediaBudget()), check_media=check_media)


def header_only(monkeypatch):
    """The loader and the processor fail from here on: what is counted, is counted from headers."""
    def fail(*a, **k):
        raise AssertionError("media decoded while counting from headers")

    monkeypatch.setattr(InputBuilder, "_load_media", fail)
    monkeypatch.setattr(InputBuilder, "_process", fail)


def full_counts(b: InputBuilder, items, origins=None):
    return [b.full_length(it, origins[i] if origins else None) for i, it in enumerate(items)]


def noise(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    paths = []
    for k, (h, w) in enumerate(IMAGE_SIZES):
        p = str(d / f"{k}_{h}x{w}.png")
        (noise(h, w, k) if h * w < 400_000 else Image.new("RGB", (w, h), (k, 90, 200))).save(p)
        paths.append(p)
    return paths


def image_item(paths, text="a photo <image> of"):
    return Item(text=" ".join(["<image>"] * len(paths)) if text is None else text, images=list(paths))


@pytest.mark.parametrize("kind", list(TEMPLATES))
def test_image_counts_equal_the_processors(processors, images, kind, monkeypatch):
    """Every size under every budget: the header count is the processor's count, or both refuse
    the image (an aspect ratio over qwen-vl-utils' 200)."""
    for name, budget in BUDGETS.items():
        b = builder(processors, kind, budget)
        items = [image_item([p]) for p in images]
        # a row with two images and text between them
        items.append(Item(text="first <image> then <image> end", images=[images[4], images[9]]))
        expected = []
        for it in items:
            if name == "default" and any("2500x3000" in p or "1200x1600" in p for p in it.images):
                expected.append(None)  # millions of pixels through a tiny processor: counted below
                continue
            try:
                expected.append(b.full_length(it, ("d.jsonl", 1, "query")))
            except DataError as e:
                expected.append(e)
        with monkeypatch.context() as m:
            header_only(m)
            for it, want in zip(items, expected):
                if isinstance(want, DataError) and "aspect ratio" in str(want):
                    with pytest.raises(DataError, match="aspect ratio") as got:
                        b.lengths([it], [("d.jsonl", 1, "query")])
                    assert str(got.value) == str(want)
                    continue
                if isinstance(want, DataError):  # the budget leaves a side of 0 pixels: decoded, the loader's error
                    m.undo()
                    with pytest.raises(DataError, match="height and width must be > 0"):
                        b.lengths([it], [("d.jsonl", 1, "query")])
                    header_only(m)
                    continue
                got = b.lengths([it], [("d.jsonl", 1, "query")])[0]
                if want is not None:
                    assert got == want, (kind, name, it.images)
    # the two large ones under the default budget: the pad token once, plus the processor's
    # grid (qwen-vl-utils' smart_resize with the default 4..16384 tokens) less that one pad
    from qwen_vl_utils import smart_resize

    b = builder(processors, kind)
    factor = processors[kind].image_processor.patch_size * 2
    with_pad = b.lengths([Item(text="a photo <image> of")])[0]
    for p in images[-2:]:
        h, w = (int(x) for x in os.path.basename(p).split("_")[1][:-4].split("x"))
        rh, rw = smart_resize(h, w, factor=factor, min_pixels=4 * factor**2, max_pixels=16384 * factor**2)
        with monkeypatch.context() as m:
            header_only(m)
            assert b.lengths([image_item([p])])[0] == with_pad + (rh // factor) * (rw // factor) - 1


@pytest.mark.parametrize("kind", list(TEMPLATES))
def test_image_formats_and_orientation(processors, tmp_path, kind, monkeypatch):
    """JPEG (with an EXIF rotation: neither path turns the image), WebP, GIF, BMP, RGBA PNG,
    a data: URI: header counts equal the processor's."""
    im = noise(90, 250, 3)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees": qwen-vl-utils does not apply it, nor does mmembed
    refs = []
    for ext, kw in ((".jpg", {"exif": exif}), (".webp", {}), (".gif", {}), (".bmp", {}), (".tiff", {})):
        p = str(tmp_path / f"im{ext}")
        im.save(p, **kw)
        refs.append(p)
    rgba = str(tmp_path / "rgba.png")
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (61, 47, 4), dtype=np.uint8), "RGBA").save(rgba)
    refs.append(rgba)
    import base64

    with open(refs[0], "rb") as f:
        refs.append("data:image/jpeg;base64," + base64.b64encode(f.read()).decode())
    b = builder(processors, kind, BUDGETS["small"])
    items = [image_item([r]) for r in refs]
    want = full_counts(b, items)
    with monkeypatch.context() as m:
        header_only(m)
        assert b.lengths(items) == want


def write_video(path, frames, height, width, rate, codec="mpeg4"):
    with av.open(str(path), mode="w") as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        rng = np.random.default_rng(frames)
        for _ in range(frames):
            img = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return str(path)


# (frames, height, width, fps)
VIDEOS = [(4, 32, 32, 4), (9, 48, 80, 8), (30, 48, 64, 30), (45, 96, 160, 24), (7, 32, 64, 1), (60, 40, 40, 25)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return [write_video(d / f"v{k}.mp4", *spec) for k, spec in enumerate(VIDEOS)]


@pytest.mark.parametrize("reader", ["decord", "pyav"])
@pytest.mark.parametrize("kind", list(TEMPLATES))
def test_video_counts_equal_the_processors(processors, videos, kind, reader, monkeypatch):
    """Videos of several sizes, rates and lengths under several sampling budgets, with either
    reader: Qwen3-VL's per-frame timestamps included."""
    import dataclasses

    for name, budget in VIDEO_BUDGETS.items():
        b = builder(processors, kind, dataclasses.replace(budget, video_reader=reader))
        items = [Item(text="clip <video> here", videos=[v]) for v in videos]
        items.append(Item(text="<image> and <video>", images=[videos[0].replace(".mp4", ".png")], videos=[videos[1]]))
        noise(40, 70).save(items[-1].images[0])
        want = full_counts(b, items)
        with monkeypatch.context() as m:
            header_only(m)
            assert b.lengths(items) == want, (name, reader)


def test_audio_counts_equal_the_processors(processors, tmp_path, monkeypatch):
    """WAV and FLAC of several lengths (shorter and longer than the feature extractor's chunk)
    and rates (resampled to the extractor's): Qwen2-Audio's count."""
    fe = processors["qwen2_audio"].feature_extractor
    chunk = fe.n_samples / fe.sampling_rate
    refs = []
    for k, (seconds, rate, ext) in enumerate([(0.1, 16000, "wav"), (1.0, 8000, "flac"), (chunk, 16000, "wav"),
                                              (chunk + 0.7, 44100, "wav"), (0.0137, 22050, "flac"),
                                              (2.3333, 11025, "wav")]):
        t = np.arange(int(seconds * rate)) / rate
        p = str(tmp_path / f"a{k}.{ext}")
        sf.write(p, (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate)
        refs.append(p)
    b = builder(processors, "qwen2_audio")
    items = [Item(text="sound: <audio>", audios=[r]) for r in refs]
    want = full_counts(b, items)
    with monkeypatch.context() as m:
        header_only(m)
        assert b.lengths(items) == want
    assert len(set(want)) >= 4  # the lengths differ: the count follows the duration


def test_undecided_media_are_decoded_that_item_alone(processors, tmp_path, monkeypatch):
    """An image format whose header is not trusted (ICO) and a video given as frame images are
    measured the old way, each alone; the other items of the batch from headers."""
    ico = str(tmp_path / "icon.ico")
    noise(48, 48).save(ico, sizes=[(48, 48), (16, 16)])
    frames = tmp_path / "frames"
    frames.mkdir()
    for k in range(3):
        noise(40, 60, k).save(frames / f"{k:03}.png")
    png = str(tmp_path / "a.png")
    noise(50, 90).save(png)
    b = builder(processors, "qwen2_vl", BUDGETS["small"])
    items = [image_item([png]), image_item([ico]), Item(text="frames <video>", videos=[str(frames)]),
             Item(text="plain text")]
    want = full_counts(b, items)
    decoded = []
    real = InputBuilder.full_length

    def spy(self, item, origin=None):
        decoded.append(item)
        return real(self, item, origin)

    monkeypatch.setattr(InputBuilder, "full_length", spy)
    assert b.lengths(items) == want
    assert decoded == [items[1], items[2]]


def test_a_processor_without_a_known_rule_is_measured_the_old_way(processors, tmp_path, monkeypatch):
    """A processor class the header count does not know: every media item decoded."""
    from transformers import Qwen2VLProcessor

    class OtherProcessor(Qwen2VLProcessor):
        pass

    proc = processors["qwen2_vl"]
    other = OtherProcessor(image_processor=proc.image_processor, tokenizer=proc.tokenizer,
                           video_processor=proc.video_processor)
    png = str(tmp_path / "a.png")
    noise(70, 30).save(png)
    b = InputBuilder(get_template("qwen2_gme"), other, None, truncate=False, check_media="header")
    calls = []
    real = InputBuilder.full_length
    monkeypatch.setattr(InputBuilder, "full_length", lambda self, it, o=None: calls.append(it) or real(self, it, o))
    item = image_item([png])
    assert b.lengths([item, Item(text="x")]) == [real(b, item), real(b, Item(text="x"))]
    assert calls == [item]


# ----------------------------------------------------------------------------- text


def test_text_lengths_equal_one_call_per_text(minilm_path, processors, monkeypatch):
    """A batch counted in one backend call (with repeats, served from the cache) equals the
    tokenizer called on each text alone, for WordPiece (MiniLM, special tokens added) and
    Qwen's byte-level BPE (none added), even after a call that truncated and padded."""
    from transformers import AutoTokenizer

    rng = random.Random(0)
    words = ["cat", "naïve", "日本語", "emoji 🙂", "  spaces  ", "A.B-C", "\t", "<|im_end|>", "long" * 40, ""]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 30))) for _ in range(300)]
    texts += texts[:50]
    for tok, template in ((AutoTokenizer.from_pretrained(minilm_path), "bert"),
                          (processors["qwen3_vl"].tokenizer, "qwen3_emb")):
        tok(["a b c", "d"], truncation=True, max_length=2, padding="max_length")  # leaves the backend truncating
        b = InputBuilder(get_template(template), tok, 8, truncate=False, check_media="header")
        items = [Item(text=t) for t in texts]
        want = [len(tok(b.template.render(it), add_special_tokens=b.template.add_special_tokens)["input_ids"])
                for it in items]
        assert b.lengths(items) == want
        assert b.lengths(items[::-1]) == want[::-1]
        assert max(want) > 8  # untruncated
    # a cache that fills up starts again, and a batch is counted whole across that
    monkeypatch.setattr(measure, "TEXT_CACHE_SIZE", 60)
    b = InputBuilder(get_template("bert"), AutoTokenizer.from_pretrained(minilm_path), None, truncate=False,
                     check_media="header")
    items = [Item(text=t) for t in texts]
    want = [len(b.tokenizer(t)["input_ids"]) for t in texts]
    for start in range(0, len(items), 40):
        assert b.lengths(items[start:start + 80]) == want[start:start + 80]
    assert len(b._text_counter.cache) <= 60 // 2 + 80  # (of some 300 distinct texts; the ones asked for again kept)


def test_text_rows_read_by_arrow_count_as_each_text_alone(minilm_path, processors, tmp_path):
    """The length check's text-only path (the cache's Sample JSON read by Arrow's parser, no
    Sample objects) gives each row's longest input as the tokenizer gives it text by text:
    rows' own systems, side instructions, templates with and without a system format, group
    and pair layouts, any number of negatives. A batch it cannot take (media, a media tag, no
    positive, a pair without its label) is None: the general path counts it or names its error."""
    import dataclasses

    from transformers import AutoTokenizer

    from mmembed.data.sample import Sample

    rng = random.Random(1)
    words = ["cat", "naïve", "日本語", "emoji 🙂", "A.B-C", "\t", "<|im_end|>", "long" * 30, "\"quoted\"", "{x}"]

    def text():
        return " ".join(rng.choice(words) for _ in range(rng.randint(0, 25)))

    def item():
        return Item(text=text(), system=rng.choice([None, None, "", "Answer: {content}", text()]))

    rows = [Sample(anchor=item(), positives=[item() for _ in range(rng.randint(1, 3))],
                   negatives=[item() for _ in range(rng.randint(0, 4))], label=rng.choice([0.0, 2.5, 5.0]),
                   source="rows.jsonl", line=k + 1) for k in range(200)]
    def alone(tok, template, it, side):
        return len(tok(template.render(it, side), add_special_tokens=template.add_special_tokens)["input_ids"])

    for processing, name in ((AutoTokenizer.from_pretrained(minilm_path), "bert"),
                             (processors["qwen3_vl"].tokenizer, "qwen3_emb"), (processors["qwen2_vl"], "qwen2_gme")):
        tok = getattr(processing, "tokenizer", processing)
        for query, document in ((None, None), ("Find the passage for: ", None), ("Q", "D")):
            template = dataclasses.replace(get_template(name), query_system=query, document_system=document)
            b = InputBuilder(template, processing, None, truncate=False, check_media="header")
            for layout in (Layout.GROUP, Layout.PAIR):
                want = [max([alone(tok, template, r.anchor, "query"), alone(tok, template, r.positives[0], "document"),
                             *(alone(tok, template, n, "document") for n in (r.negatives if layout is Layout.GROUP else []))])
                        for r in rows]
                assert measure.json_text_lengths(b.template, b.text_counter(), [r.to_json() for r in rows], layout) == want, (name, query, layout)
    b = InputBuilder(get_template("qwen2_gme"), processors["qwen2_vl"], None, truncate=False, check_media="header")
    plain = [r.to_json() for r in rows[:3]]
    media = dataclasses.replace(rows[3], anchor=Item(text="<image> a", images=[str(tmp_path / "a.png")]))
    tag = dataclasses.replace(rows[3], anchor=Item(text="see <video>"))
    no_positive = dataclasses.replace(rows[3], positives=[])
    no_label = dataclasses.replace(rows[3], label=None)
    assert measure.json_text_lengths(b.template, b.text_counter(), plain, Layout.PAIR) is not None
    for odd, layout in ((media, Layout.GROUP), (tag, Layout.GROUP), (no_positive, Layout.GROUP), (no_label, Layout.PAIR)):
        assert measure.json_text_lengths(b.template, b.text_counter(), [*plain, odd.to_json()], layout) is None
    assert measure.json_text_lengths(b.template, b.text_counter(), [*plain, no_label.to_json()], Layout.GROUP) is not None


# ----------------------------------------------------------------------------- the length check


def media_rows(tmp_path, n_images=3):
    paths = []
    for k in range(n_images):
        p = str(tmp_path / f"img{k}.png")
        noise(60 + 40 * k, 80).save(p)
        paths.append(p)
    rows = [{"query": f"q{k} <image>", "images": [p], "response": f"doc {k}"} for k, p in enumerate(paths)]
    rows.append({"query": "text only", "response": "doc"})
    return write_jsonl(tmp_path / "train.jsonl", rows), paths


def test_missing_or_unreadable_image_is_named_before_training(processors, tmp_path, caplog):
    """A file gone since the rows were read, or whose header does not open: an error naming
    file, line and field; with strict false the row is skipped and listed."""
    data, paths = media_rows(tmp_path)
    ds = load_samples([data]).dataset
    os.remove(paths[1])
    with open(paths[2], "wb") as f:
        f.write(b"not an image at all")
    b = builder(processors, "qwen2_vl", BUDGETS["small"], max_length=4096)
    with pytest.raises(DataError) as e:
        drop_overlong(ds, b, Layout.GROUP, 4096, 1, "train")
    assert f"{data}:2 field 'query images[0]'" in str(e.value) and "image file not found" in str(e.value)
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        kept = drop_overlong(ds, b, Layout.GROUP, 4096, 1, "train", strict=False)
    assert len(kept) == 2
    assert f"{data}:2 field 'query images[0]'" in caplog.text and f"{data}:3 field 'query images[0]'" in caplog.text
    assert "cannot read image (UnidentifiedImageError" in caplog.text


def test_image_over_max_length_deleted_or_refused(processors, tmp_path, monkeypatch):
    """An image row over --max_length: deleted with delete, a data error naming it with left/right."""
    data, paths = media_rows(tmp_path)
    ds = load_samples([data]).dataset
    b = builder(processors, "qwen2_vl", BUDGETS["default"], max_length=60)
    lengths = [b.full_length(Item(text=f"q{k} <image>", images=[p])) for k, p in enumerate(paths)]
    limit = sorted(lengths)[1]  # the first two fit, the third does not
    header_only(monkeypatch)
    kept = drop_overlong(ds, b, Layout.GROUP, limit, 1, "train")
    assert [json.loads(s)["line"] for s in kept["sample"]] == [1, 2, 4]
    with pytest.raises(DataError, match=rf"{data}:3: {lengths[2]} tokens with its media, over --max_length {limit}"):
        drop_overlong(ds, b, Layout.GROUP, limit, 1, "train", truncate=True)


def test_corrupt_pixels_pass_header_but_not_full(processors, tmp_path):
    """--check_media full decodes: a JPEG cut short opens (header) but does not decode. The
    header count lets it through (its batch names it); full refuses it before training. The
    two modes are cached apart."""
    data, paths = media_rows(tmp_path)
    jpg = paths[0].replace(".png", ".jpg")
    noise(300, 400).save(jpg, quality=95)
    with open(jpg, "rb") as f:
        head = f.read()
    with open(jpg, "wb") as f:
        f.write(head[: len(head) // 3])
    with open(data) as f:
        rows = [json.loads(line) for line in f]
    rows[0]["images"] = [jpg]
    write_jsonl(data, rows)
    ds = load_samples([data]).dataset
    header = builder(processors, "qwen2_vl", BUDGETS["small"], max_length=4096)
    full = builder(processors, "qwen2_vl", BUDGETS["small"], max_length=4096, check_media="full")
    assert len(drop_overlong(ds, header, Layout.GROUP, 4096, 1, "train")) == 4
    with pytest.raises(DataError, match=rf"{data}:1 field 'query images\[0\]': cannot read image"):
        drop_overlong(ds, full, Layout.GROUP, 4096, 1, "train")
    assert length_check_fingerprint(ds, header, Layout.GROUP, True) != length_check_fingerprint(ds, full, Layout.GROUP, True)


def test_check_media_flag(tmp_path, minilm_path):
    from mmembed.training.arguments import SftArguments, UsageError, parse_sft_args

    assert SftArguments(model="m", dataset=["d"], output_dir=str(tmp_path)).check_media == "header"
    common = ["--model", minilm_path, "--dataset", "d.jsonl", "--output_dir", str(tmp_path)]
    assert parse_sft_args([*common, "--check_media", "full"]).check_media == "full"
    with pytest.raises((UsageError, SystemExit)):
        parse_sft_args([*common, "--check_media", "pixels"])
    with pytest.raises(ValueError, match="check_media"):
        InputBuilder(get_template("bert"), object(), check_media="pixels")
    assert measure.CHECK_MEDIA == ("header", "full")
