"""Token counts without decoding media: what the length check measures by default.

:meth:`InputBuilder.lengths <mmembed.encoding.inputs.InputBuilder.lengths>` with
``check_media="header"`` gives, for each item, the number of tokens the model will see (the
rendered text with each media placeholder expanded by the processor), exactly as it counts
them with ``check_media="full"`` (decoding every medium and running the processor), but from
the media files' headers (:class:`~mmembed.encoding.media_measure.MediaCounter`):

* an image: its size from PIL's header (``Image.open``, no pixels decoded; PNG, JPEG, WebP,
  GIF, BMP, TIFF, MPO), resized as :func:`~mmembed.encoding.media.load_image` resizes it
  (qwen-vl-utils' ``smart_resize`` with the builder's ``MAX_PIXELS`` / ``MIN_PIXELS``
  budget in tokens of ``2 * patch_size``), then the processor's grid (``[1, h / patch,
  w / patch]``: the processor gets the image sized, ``do_resize=False``);
* a video file: frame count and frame rate from the reader :func:`~mmembed.encoding.media.load_video`
  uses (decord's index, or PyAV's container header), frame size from PyAV's header; then
  qwen-vl-utils' frame sampling (``smart_nframes``: ``FPS``, ``FPS_MIN_FRAMES``,
  ``FPS_MAX_FRAMES``, an even count) and per-frame budget (``VIDEO_MAX_PIXELS``,
  ``VIDEO_MIN_PIXELS``, ``VIDEO_TOTAL_PIXELS``), and the grid ``[ceil(T / temporal patch),
  h / patch, w / patch]``;
* an audio file (WAV, FLAC, AIFF): its sample count and rate from libsndfile's header,
  resampled to the feature extractor's rate as :func:`~mmembed.encoding.media.load_audio`
  does, then Whisper's frame mask and Qwen2-Audio's two stride-2 reductions.

The placeholder text is the processor's own (its ``replace_image_token`` /
``replace_video_token`` / ``replace_audio_token`` on the grid: Qwen3-VL's frame timestamps
included); a run of pad tokens (an added token, so the tokenizer splits around it) counts
one token each without being tokenized. Supported processors: Qwen2-VL (GME), Qwen2.5-VL,
Qwen3-VL, Qwen2-Audio. Anything else the header cannot decide (another processor, a video
given as frame images, a container that does not say its frame count, an audio format
whose header is not exact) is measured the old way, that item alone.

A file that is missing or whose header does not open is a
:class:`~mmembed.data.paths.MediaFileError` naming file, line and field, as with a full
decode; pixels that do not decode are found when their batch is built.

Text is counted in one call of the fast tokenizer's backend per batch (no offsets, no
Python lists of ids), with the lengths of texts already seen kept (up to
:data:`TEXT_CACHE_SIZE`): hard negatives recur across rows.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

from .layout import Layout
from .templates import MEDIA_TAGS, Template

#: ``--check_media``: ``header`` counts media tokens from the files' headers; ``full``
#: decodes every medium and runs the processor (every pixel checked before training).
CHECK_MEDIA = ("header", "full")

#: Texts whose token count is kept per builder (then the cache starts again).
TEXT_CACHE_SIZE = 1 << 16


# ----------------------------------------------------------------------------- text


class TextCounter:
    """Token counts of rendered texts, many per call of the fast tokenizer's backend."""

    def __init__(self, tokenizer: Any, add_special_tokens: bool):
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.backend = backend if backend is not None and hasattr(backend, "encode_batch") else None
        self.cache: dict[str, int] = {}
        self.hits: set[str] = set()  # the cached texts asked for again since the cache last started

    def __call__(self, texts: Sequence[str]) -> list[int]:
        cache = self.cache
        counts = list(map(cache.get, texts))
        self.hits.update(itertools.compress(texts, counts))  # (a count of 0 is not worth keeping)
        missing = [i for i, n in enumerate(counts) if n is None]
        if not missing:
            return counts
        todo = list(dict.fromkeys(texts[i] for i in missing))
        new = dict(zip(todo, self._count(todo)))
        for i in missing:
            counts[i] = new[texts[i]]
        if len(cache) + len(new) > TEXT_CACHE_SIZE:
            # full: start again with the texts asked for again since the last start (hard negatives
            # recur across rows, a query seldom), at most half the cache
            kept = list(self.hits)[:TEXT_CACHE_SIZE // 2]
            self.cache = cache = {t: cache[t] for t in kept}
            self.hits = set()
        cache.update(new)
        return counts

    @functools.cached_property
    def ascii_bound(self) -> tuple[int, int] | None:
        """``(per_char, extra)``: an ASCII text of ``c`` characters is never more than
        ``per_char * c + extra`` tokens to this tokenizer (:func:`ascii_token_bound`); None
        when its pipeline holds a step that bound does not cover."""
        return ascii_token_bound(self.backend, self.add_special_tokens) if self.backend is not None else None

    def _count(self, texts: list[str]) -> list[int]:
        if self.backend is None:  # a slow tokenizer: its own call
            ids = self.tokenizer(texts, add_special_tokens=self.add_special_tokens, return_attention_mask=False,
                                 return_token_type_ids=False)["input_ids"]
            return [len(x) for x in ids]
        backend = self.backend
        # what the tokenizer's own call does when it neither truncates nor pads
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [len(e) for e in encode(texts, add_special_tokens=self.add_special_tokens)]


#: normalizers that never lengthen an ASCII text (nor make it other than ASCII)
_ASCII_NORMALIZERS = frozenset({"BertNormalizer", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents",
                                "ByteLevel"})
#: pre-tokenizers that only split a text (ByteLevel and Metaspace are read below)
_SPLITTERS = frozenset({"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits", "Split",
                        "CharDelimiterSplit", "UnicodeScripts"})
#: models whose every token stands for at least one character of its word (WordPiece: a
#: piece or [UNK] for the word; BPE and Unigram: a merge of characters, or one token per
#: byte of an unknown character with byte fallback; WordLevel: the word)
_MODELS = frozenset({"WordPiece", "BPE", "Unigram", "WordLevel"})


def ascii_token_bound(backend: Any, add_special_tokens: bool) -> tuple[int, int] | None:
    """``(per_char, extra)`` such that the fast tokenizer ``backend`` (no truncation, no
    padding) never gives an ASCII text of ``c`` characters more than ``per_char * c + extra``
    tokens, or None when its pipeline holds a step not known to keep to that.

    The reasoning, step by step: the added tokens found in the text are one token each, for one
    or more characters; the normalizer keeps an ASCII text's length (case folding, Unicode
    forms, accents, BERT's cleaning: none lengthens ASCII) or prepends ``k`` characters to each
    piece between added tokens (``Prepend``; ``Replace`` of a string by one no longer); the
    pre-tokenizer splits, or adds a prefix space to each piece (``ByteLevel`` with
    ``add_prefix_space``, ``Metaspace`` with a prepend scheme); each token of the model stands
    for at least one character of its piece (a byte-level step makes each byte a character:
    ASCII stays one byte a character, so a step that brings in other characters is not
    covered); the post-processor adds its special tokens. With ``p`` characters prefixed per
    piece and at most ``c + 1`` pieces: ``(1 + p) * c + p + specials``."""
    def state(component: Any) -> dict | None:  # a pipeline step's settings (its tokenizer.json entry)
        return None if component is None else json.loads(component.__getstate__())

    try:
        normalizer_spec, pre_tokenizer_spec = state(backend.normalizer), state(backend.pre_tokenizer)
    except Exception:  # a step that does not serialize: no bound
        return None
    prefix, brings_non_ascii, byte_level = 0, False, False

    def normalizer(n: dict | None) -> bool:
        nonlocal prefix, brings_non_ascii, byte_level
        if n is None:
            return True
        kind = n.get("type")
        if kind == "Sequence":
            return all(normalizer(x) for x in n.get("normalizers", []))
        if kind in _ASCII_NORMALIZERS:
            byte_level |= kind == "ByteLevel"
            return True
        if kind == "Prepend" and isinstance(n.get("prepend"), str):
            prefix += len(n["prepend"])
            brings_non_ascii |= not n["prepend"].isascii()
            return True
        if kind == "Replace":
            pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
            if isinstance(pattern, str) and isinstance(content, str) and 0 < len(content) <= len(pattern):
                brings_non_ascii |= not content.isascii()
                return True
        return False

    def pre_tokenizer(p: dict | None) -> bool:
        nonlocal prefix, brings_non_ascii, byte_level
        if p is None:
            return True
        kind = p.get("type")
        if kind == "Sequence":
            return all(pre_tokenizer(x) for x in p.get("pretokenizers", []))
        if kind in _SPLITTERS:
            return True
        if kind == "ByteLevel":
            byte_level = True
            prefix += 1 if p.get("add_prefix_space", True) else 0
            return True
        if kind == "Metaspace":
            replacement = p.get("replacement", "\u2581")
            if not isinstance(replacement, str) or len(replacement) != 1:
                return False
            brings_non_ascii |= not replacement.isascii()
            prefix += 0 if p.get("prepend_scheme", "always") == "never" and not p.get("add_prefix_space") else 1
            return True
        return False

    model = type(backend.model).__name__
    if not (normalizer(normalizer_spec) and pre_tokenizer(pre_tokenizer_spec) and model in _MODELS):
        return None
    if model == "BPE":
        byte_level |= bool(getattr(backend.model, "byte_fallback", True))
    elif model == "Unigram":  # (its settings hold the vocabulary: read as text, not parsed)
        byte_level |= '"byte_fallback":false' not in backend.model.__getstate__().decode("utf-8", "replace")
    if brings_non_ascii and byte_level:  # a character of several bytes, each a token
        return None
    specials = 0
    if add_special_tokens and backend.post_processor is not None:
        specials = backend.post_processor.num_special_tokens_to_add(False)
    return 1 + prefix, prefix + specials


# ----------------------------------------------------------------------------- lengths


def _arrow_sample_schema():
    import pyarrow as pa

    item = pa.struct([("text", pa.string()), ("system", pa.string()), *((kind + "s", pa.list_(pa.string()))
                                                                         for kind in ("image", "video", "audio"))])
    return pa.schema([("anchor", item), ("positives", pa.list_(item)), ("negatives", pa.list_(item)),
                      ("label", pa.float64())])


def json_text_lengths(template: Template, counter: TextCounter, rows: Sequence[str], layout: Layout,
                      within: int | None = None) -> list[int] | None:
    """The length check's number for each row (the longest of its encoded inputs, as
    :func:`~mmembed.encoding.collator.token_lengths` gives it) when every row is text only:
    ``rows`` are the Arrow cache's Sample JSON texts, read by Arrow's JSON parser (the fields
    the count needs, without a Python object per row) and rendered as
    :meth:`Template.render <mmembed.encoding.templates.Template.render>` renders them, each side
    with its instruction. None when a row needs the general path: media, a media tag in a text,
    no positive, a pair without its label, or anything the parser does not read as expected
    (the general path then gives the numbers, or the row's error).

    ``within`` (the length check's ``--max_length``): a row whose inputs are all ASCII and
    provably no longer than ``within`` tokens (:attr:`TextCounter.ascii_bound`: at most so many
    tokens per character) is not tokenized; its number is that bound, no more than ``within``
    (the check keeps the row either way). The other rows get their exact numbers.

    ``template`` and ``counter`` are a builder's (``builder.template``,
    ``builder.text_counter()``: its kept counts are used and added to)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as paj

    if not rows:
        return []
    group = layout is Layout.GROUP
    try:
        table = paj.read_json(
            pa.BufferReader("\n".join(rows).encode("utf-8")),
            read_options=paj.ReadOptions(use_threads=False, block_size=1 << 24),
            parse_options=paj.ParseOptions(explicit_schema=_arrow_sample_schema(), unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowException, UnicodeEncodeError):
        return None
    if table.num_rows != len(rows):
        return None
    anchor = table.column("anchor").combine_chunks()
    sides = {"positives": table.column("positives").combine_chunks()}
    if group:
        sides["negatives"] = table.column("negatives").combine_chunks()
    if anchor.null_count or any(lists.null_count for lists in sides.values()):
        return None
    if not group and table.column("label").null_count:
        return None
    if (sides["positives"].value_lengths().to_numpy(zero_copy_only=False) < 1).any():
        return None
    members = [anchor, *(lists.flatten() for lists in sides.values())]
    for member in members:
        for kind in ("images", "videos", "audios"):
            if pc.sum(pc.list_value_length(member.field(kind))).as_py():
                return None
        if member.field("text").null_count:
            return None
    # a row's inputs: its anchor (a query), its first positive and its negatives (documents)
    inputs = [anchor, pc.list_element(sides["positives"], 0)]
    if group:
        inputs.append(sides["negatives"].flatten())
    texts = pa.concat_arrays([pc.struct_field(member, "text") for member in inputs])
    if pc.any(pc.match_substring_regex(texts, "|".join(re.escape(tag) for tag in MEDIA_TAGS.values()))).as_py():
        return None
    n = len(rows)
    # each input's system: its own, else its side's instruction (None: none)
    side = pa.concat_arrays([pa.array([template.side_system("query")] * n, pa.string()),
                             pa.array([template.side_system("document")] * (len(texts) - n), pa.string())])
    systems = pc.coalesce(pa.concat_arrays([pc.struct_field(member, "system") for member in inputs]), side)
    rendered = rendered_texts(template, texts, systems)
    # the row each input belongs to
    owner = np.arange(2 * n) % n
    if group:
        owner = np.concatenate([owner, pc.list_parent_indices(sides["negatives"]).to_numpy()])
    measured = np.ones(n, dtype=bool)  # the rows tokenized (the others are short by the bound)
    out = np.zeros(n, dtype=np.int64)
    bound = counter.ascii_bound if within is not None else None
    if bound is not None:
        per_char, extra = bound
        bounds = per_char * pc.binary_length(rendered).to_numpy(zero_copy_only=False).astype(np.int64) + extra
        bounds[~pc.string_is_ascii(rendered).to_numpy(zero_copy_only=False)] = within + 1  # (not bounded)
        np.maximum.at(out, owner, bounds)
        measured = out > within
        if not measured.any():
            return out.tolist()
        rendered = rendered.filter(pa.array(measured[owner]))
        owner = owner[measured[owner]]
    # each distinct text counted once (hard negatives recur across rows)
    distinct = rendered.dictionary_encode()
    counted = np.asarray(counter(distinct.dictionary.to_pylist()), dtype=np.int64)
    exact = np.zeros(n, dtype=np.int64)
    np.maximum.at(exact, owner, counted[distinct.indices.to_numpy()])  # each row's longest input
    out[measured] = exact[measured]
    return out.tolist()


def rendered_texts(template, contents, systems):
    """:meth:`Template.format_text <mmembed.encoding.templates.Template.format_text>` of each
    content and system (Arrow strings; a system null or empty: none), as Arrow strings."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def one_by_one():  # a format with more than {content} and {system} fields
        return pa.array([template.format_text(c, s) for c, s in zip(contents.to_pylist(), systems.to_pylist())],
                        pa.string())

    plain = _formatted(template.format, contents, systems.fill_null(""))
    if plain is None:
        return one_by_one()
    has_system = pc.not_equal(systems, "").fill_null(False)
    if template.format_with_system is None or not pc.any(has_system).as_py():
        return plain
    with_system = _formatted(template.format_with_system, contents, systems.fill_null(""))
    return one_by_one() if with_system is None else pc.if_else(has_system, with_system, plain)


def _formatted(fmt: str, contents, systems):
    """``fmt.format(content=..., system=...)`` of each content and system (Arrow strings), or
    None for a format other than literal text and ``{content}`` / ``{system}`` fields."""
    import string

    import pyarrow.compute as pc

    pieces = []
    for literal, name, spec, conversion in string.Formatter().parse(fmt):
        if literal:
            pieces.append(literal)
        if name is None:
            continue
        if name not in ("content", "system") or spec or conversion:
            return None
        pieces.append(contents if name == "content" else systems)
    if not any(not isinstance(p, str) for p in pieces):
        return None
    return pc.binary_join_element_wise(*pieces, "")

