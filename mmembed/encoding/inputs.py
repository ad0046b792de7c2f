"""Items -> model inputs: the one place where rendered text meets the tokenizer or processor.

``InputBuilder`` is shared by training (the collator), evaluation, ``--truncation_strategy
delete`` (``lengths``) and the ``Embedder``, so every path renders and encodes an item the
same way.

- Text models get the tokenizer's output (``input_ids``, ``attention_mask``, ...).
- Multimodal models (a template with media placeholders and a processor) get the
  processor's output: each ``<image>``/``<video>``/``<audio>`` tag is rendered as the
  template's placeholder, the media are loaded (``mmembed.encoding.media``, with the
  builder's :class:`~mmembed.encoding.media.MediaSettings`: the pixel and frame budgets of
  ``MAX_PIXELS``, ``FPS``, ... and the download settings), and the processor expands each placeholder
  to one token per visual patch group or audio frame and returns ``pixel_values``,
  ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ``input_features``, ...
  The media of a batch are passed in the order their tags appear, row by row, which is
  the order the processor assigns them to placeholders.

Builders never change the tokenizer they are given: the collator's builder, the Embedder's
and those of the evaluation tasks share one tokenizer (or processor) object, and each pads
and truncates on its own sides, set for the length of one call (``sides``).

A media file that cannot be read is a ``DataError`` naming the data file, line and field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..data.sample import DataError, Item, Origin
from .buckets import bucket_width, pad_to_width
from .measure import TextCounter
from .media_measure import MediaCounter, Undecided
from .templates import Template

if TYPE_CHECKING:  # the media loader is imported at the first row with media (qwen-vl-utils: about a second)
    from .media import MediaSettings

# [N, 3] images, videos, audios per row of a media batch: which pixel / feature rows belong
# to which input row (select_rows). The model wrapper drops it before the backbone.
MEDIA_COUNTS = "media_counts"
# per-medium tensors of a processor's output, by medium: (patch rows, per-medium rows)
MEDIA_TENSORS = (
    ("pixel_values", ("image_grid_thw",)),
    ("pixel_values_videos", ("video_grid_thw", "second_per_grid_ts")),
    (None, ("input_features", "feature_attention_mask")),
)
MEDIA_KEYS = frozenset(k for patch, per in MEDIA_TENSORS for k in (patch, *per) if k)


def tokenizer_of(processing: Any) -> Any:
    """The tokenizer inside a processor, or the tokenizer itself."""
    return getattr(processing, "tokenizer", None) or processing


def is_multimodal_processor(processing: Any) -> bool:
    return any(hasattr(processing, a) for a in ("image_processor", "video_processor", "feature_extractor"))


@contextmanager
def sides(tokenizer: Any, padding_side: str, truncation_side: str) -> Iterator[None]:
    """Inside the block ``tokenizer`` pads and truncates on these sides; after it (error or
    not) its own sides are back. A processor reads the sides of the tokenizer it holds."""
    saved = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = padding_side, truncation_side
    try:
        yield
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = saved


class InputBuilder:
    """Render and encode items for one model.

    Args:
        template: how an item becomes text (and its media placeholders).
        processing: the tokenizer, or for a multimodal template the model's processor.
        max_length: the longest input in tokens (``None``: no limit).
        truncation_side: ``right`` or ``left``; used only when ``truncate`` is true.
        truncate: cut rows longer than ``max_length`` (``--truncation_strategy left|right``).
            A row with media is never cut (that would cut its media tokens): it is an
            error naming the row. Without ``truncate`` rows are encoded whole.
        bucket: pad text batches to a bucketed width (:mod:`mmembed.encoding.buckets`), never
            past ``max_length`` unless a row is longer.
        media: how media are loaded: pixel and frame budgets, downloads (the command's
            settings, parsed once where it started). None: the environment's, parsed at the
            first row with media and kept. Stored on the builder, the settings travel with it
            to data-loader workers.
        check_media: how :meth:`lengths` counts media tokens: ``full`` decodes every medium
            and runs the processor; ``header`` reads the files' headers and applies the
            processor's rules (:mod:`mmembed.encoding.measure`: the same counts, a medium the
            header cannot decide decoded as with ``full``).
    """

    def __init__(self, template: Template, processing: Any, max_length: int | None = None,
                 truncation_side: str = "right", truncate: bool = True, bucket: bool = False,
                 media: MediaSettings | None = None, check_media: str = "full"):
        self.template = template
        self.tokenizer = tokenizer_of(processing)
        self.processor = processing if template.media and is_multimodal_processor(processing) else None
        if template.media and self.processor is None:
            raise ValueError(f"template '{template.name}' takes media; it needs the model's processor, not a tokenizer")
        self.max_length = max_length
        self.truncate = truncate and max_length is not None
        self.padding_side = template.padding_side
        self.truncation_side = "left" if truncation_side == "left" else "right"
        self.bucket = bucket
        self.media = self._with_template_defaults(media)
        if check_media not in ("header", "full"):
            raise ValueError(f"check_media must be 'header' or 'full', got {check_media!r}")
        self.check_media = check_media

    def __getstate__(self) -> dict[str, Any]:
        # the length counters' caches (text_lengths, media_counter) stay in the process that filled them
        return {k: v for k, v in self.__dict__.items() if k not in ("_text_counter", "_media_counter")}

    def text_lengths(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each rendered text (special tokens as the template adds them, no
        truncation), many per call of the fast tokenizer's backend; the counts of texts
        already seen are kept (:class:`~mmembed.encoding.measure.TextCounter`)."""
        return self.text_counter()(texts)

    def text_counter(self) -> TextCounter:
        """The counter :meth:`text_lengths` counts with, made at the first call and kept."""
        counter = self.__dict__.get("_text_counter")
        if counter is None or counter.tokenizer is not self.tokenizer:
            counter = self._text_counter = TextCounter(self.tokenizer, self.template.add_special_tokens)
        return counter

    def media_counter(self) -> MediaCounter:
        """This builder's media tokens from the files' headers
        (:class:`~mmembed.encoding.media_measure.MediaCounter`), made at the first call and kept."""
        counter = self.__dict__.get("_media_counter")
        if counter is None or counter.processor is not self.processor:
            counter = self._media_counter = MediaCounter(self.processor, self.tokenizer, self.media_settings(),
                                                         self.patch_size, self.sampling_rate)
        return counter

    @property
    def multimodal(self) -> bool:
        return self.processor is not None

    def media_settings(self) -> MediaSettings:
        """The settings this builder loads media with: those it was given, else the
        environment's, parsed now and kept (every later batch uses the same)."""
        if self.media is None:
            from .media import MediaSettings

            self.media = self._with_template_defaults(MediaSettings.from_env())
        return self.media

    def _with_template_defaults(self, media: MediaSettings | None) -> MediaSettings | None:
        """``media`` with the template's ``media_defaults`` (the family's own loader sets them, as
        ms-swift's) where the environment set nothing."""
        if media is None or not self.template.media_defaults:
            return media
        return dataclasses.replace(media, budget=media.budget.with_defaults(self.template.media_defaults))

    # ---- encoding -------------------------------------------------------------------
    def __call__(self, items: Sequence[Item], origins: Sequence[Origin] | None = None) -> dict[str, torch.Tensor]:
        texts = [self.template.render(it) for it in items]
        if not self.multimodal or not any(it.has_media for it in items):
            return dict(self._tokenize(texts, truncate=self.truncate))
        media = self._load_media(items, origins)
        out = self._process(texts, media, truncate=False)
        if self.truncate:
            lengths = out["attention_mask"].sum(1).tolist()
            over = [i for i, n in enumerate(lengths) if n > self.max_length]
            for i in over:
                if items[i].has_media:
                    where = origins[i] if origins else ("<input>", 0, "")
                    raise DataError(where[0], where[1], where[2] or None,
                                    f"{lengths[i]} tokens with its media, over --max_length {self.max_length}; "
                                    "a row with media is not truncated (that would cut its media tokens): "
                                    "raise --max_length, lower MAX_PIXELS, or use --truncation_strategy delete")
            if over:  # only text-only rows are too long: cut those, the media rows are under the limit
                out = self._process(texts, media, truncate=True)
        out = self._widened(out)
        out[MEDIA_COUNTS] = torch.tensor([[len(it.images), len(it.videos), len(it.audios)] for it in items])
        return out

    def lengths(self, items: Sequence[Item], origins: Sequence[Origin] | None = None) -> list[int]:
        """Tokens per item as the model would see them (media expanded), untruncated. Media
        are counted as ``check_media`` says (the counts agree); text in one tokenizer call.
        A medium that cannot be read is a ``DataError`` naming file, line and field."""
        if self.check_media == "header":
            return self._header_lengths(items, origins)
        out: list[int] = [0] * len(items)
        text_rows = [i for i, it in enumerate(items) if not (self.multimodal and it.has_media)]
        if text_rows:
            for i, n in zip(text_rows, self.text_lengths([self.template.render(items[i]) for i in text_rows])):
                out[i] = n
        for i, it in enumerate(items):
            if self.multimodal and it.has_media:  # one at a time: the media of one row in memory
                out[i] = self.full_length(it, origins[i] if origins else None)
        return out

    def _header_lengths(self, items: Sequence[Item], origins: Sequence[Origin] | None = None) -> list[int]:
        """:meth:`lengths` from the media files' headers (:mod:`mmembed.encoding.measure`): the
        same numbers as ``check_media="full"``; an item whose headers cannot decide
        (:class:`~mmembed.encoding.media_measure.Undecided`) is counted by decoding. Raises the
        ``DataError`` of the first bad item."""
        texts = [self.template.render(it) for it in items]
        extra = [0] * len(items)
        decode: list[int] = []
        if self.multimodal:
            media = self.media_counter()
            for i, it in enumerate(items):
                if not it.has_media:
                    continue
                base = origins[i] if origins else ("<input>", 0, "")
                self.check_kinds(it, base)
                try:
                    texts[i], extra[i] = media.expand(it, texts[i], base)
                except Undecided:
                    decode.append(i)
        if decode:  # these items the old way, one at a time (the media of one item in memory)
            slow = set(decode)
            counted = self.text_lengths([t for i, t in enumerate(texts) if i not in slow])
            out, k = [], 0
            for i in range(len(items)):
                if i in slow:
                    out.append(self.full_length(items[i], origins[i] if origins else None))
                else:
                    out.append(counted[k] + extra[i])
                    k += 1
            return out
        return [n + e for n, e in zip(self.text_lengths(texts), extra)]

    def full_length(self, item: Item, origin: Origin | None = None) -> int:
        """The tokens of one item counted by loading its media and running the processor."""
        if not (self.multimodal and item.has_media):
            return len(self.tokenizer(self.template.render(item), add_special_tokens=self.template.add_special_tokens)
                       ["input_ids"])
        enc = self._process([self.template.render(item)], self._load_media([item], [origin] if origin else None),
                            truncate=False)
        return int(enc["attention_mask"].sum())

    def encode_pairs(self, firsts: Sequence[str], seconds: Sequence[str]) -> dict[str, torch.Tensor]:
        """Text pairs in the tokenizer's own pair encoding, ``tokenizer(firsts, seconds)``
        (``[CLS] a [SEP] b [SEP]`` for BERT, with the token type ids the tokenizer gives):
        padded, bucketed and truncated as single texts are; a pair over ``max_length`` loses
        tokens from its longer text first (the tokenizer's ``longest_first``, as
        sentence-transformers' CrossEncoder truncates)."""
        if self.multimodal:
            raise ValueError(f"template '{self.template.name}': text pairs are encoded by a tokenizer, not a processor")
        return dict(self._tokenize(list(firsts), truncate=self.truncate, pairs=list(seconds)))

    def _tokenize(self, texts: list[str], truncate: bool, pairs: list[str] | None = None):
        with sides(self.tokenizer, self.padding_side, self.truncation_side):
            enc = self.tokenizer(
                texts,
                *(() if pairs is None else (pairs,)),
                padding=True,
                truncation=truncate,
                max_length=self.max_length if truncate else None,
                add_special_tokens=self.template.add_special_tokens,
                return_tensors="pt",
            )
        return self._widened(dict(enc))

    def _widened(self, enc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With ``bucket``: ``enc`` padded to its bucketed width (never past ``max_length``
        unless a row is longer); a processor's media tensors are left as they are."""
        if not self.bucket:
            return enc
        width = enc["input_ids"].shape[1]
        target = min(bucket_width(width), max(width, self.max_length or width))
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return pad_to_width(enc, target, pad_id, self.padding_side, exclude=MEDIA_KEYS)

    def _process(self, texts: list[str], media: dict[str, Any], truncate: bool) -> dict[str, torch.Tensor]:
        kwargs = dict(media)
        if truncate:
            kwargs.update(truncation=True, max_length=self.max_length)
        with sides(self.tokenizer, self.padding_side, self.truncation_side):  # the processor pads with its tokenizer
            enc = self.processor(text=texts, padding=True, return_tensors="pt",
                                 add_special_tokens=self.template.add_special_tokens, **kwargs)
        return {k: v for k, v in enc.items() if torch.is_tensor(v)}

    def _load_media(self, items: Sequence[Item], origins: Sequence[Origin] | None) -> dict[str, Any]:
        """The batch's media in tag order, as processor keyword arguments."""
        from . import media as M

        settings = self.media_settings()
        budget, downloads = settings.budget, settings.downloads
        patch = self.patch_size
        images, videos, audios = [], [], []
        for i, it in enumerate(items):
            base = origins[i] if origins else ("<input>", 0, "")
            self.check_kinds(it, base)
            for j, ref in enumerate(it.images):
                images.append(M.load_image(ref, budget, where=_where(base, "images", j), patch_size=patch,
                                           downloads=downloads))
            for j, ref in enumerate(it.videos):
                videos.append(M.load_video(ref, budget, where=_where(base, "videos", j), patch_size=patch,
                                           downloads=downloads))
            for j, ref in enumerate(it.audios):
                audios.append(M.load_audio(ref, self.sampling_rate, where=_where(base, "audios", j),
                                           downloads=downloads))
        # the media arrive sized and sampled by the budget (as qwen-vl-utils does it for
        # ms-swift): the processor must not resize or resample them again
        kwargs: dict[str, Any] = {}
        if images:
            kwargs.update(images=images, do_resize=False)
        if videos:
            kwargs.update(videos=[v.frames for v in videos], video_metadata=[v.metadata for v in videos],
                          do_sample_frames=False, do_resize=False)
        if audios:
            kwargs.update(audio=audios, sampling_rate=self.sampling_rate)
        return kwargs

    def check_kinds(self, item: Item, base: Origin) -> None:
        """A medium the template has no placeholder for is an error naming the row."""
        for kind in ("image", "video", "audio"):
            refs = item.media(kind)
            if refs and kind not in self.template.media:
                raise DataError(base[0], base[1], base[2] or None,
                                f"template '{self.template.name}' takes no {kind} inputs, but the row has {len(refs)}")

    @property
    def patch_size(self) -> int:
        """The vision processor's patch size (14 when it names none)."""
        for name in ("image_processor", "video_processor"):
            size = getattr(getattr(self.processor, name, None), "patch_size", None)
            if size:
                return int(size)
        return 14

    @property
    def sampling_rate(self) -> int:
        fe = getattr(self.processor, "feature_extractor", None)
        return int(getattr(fe, "sampling_rate", 16000))


def _where(base: Origin, kind: str, index: int) -> Origin:
    part = f"{base[2]} " if base[2] else ""
    return (base[0], base[1], f"{part}{kind}[{index}]")


def select_rows(batch: dict[str, Any], rows: torch.Tensor | Sequence[int]) -> dict[str, Any]:
    """The batch restricted to ``rows`` (in that order), with each row's images, videos and
    audio: per-row tensors are indexed; pixel rows follow their images' grids. ``labels``
    is left out (losses take it whole)."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    n = batch["input_ids"].shape[0]
    counts = batch.get(MEDIA_COUNTS)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "labels" or key in MEDIA_KEYS:
            continue
        out[key] = value[rows.to(value.device)] if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == n else value
    if counts is None:
        return out
    for kind, (patch_key, per_keys) in enumerate(MEDIA_TENSORS):
        c = counts[:, kind].cpu()
        if int(c.sum()) == 0:
            continue
        start = torch.cumsum(c, 0) - c
        media = torch.cat([torch.arange(int(start[r]), int(start[r] + c[r])) for r in rows.tolist()])
        if len(media) == 0:  # none of these rows has this medium: leave its keys out, as the processor does
            continue
        for key in per_keys:
            if key in batch:
                out[key] = batch[key][media.to(batch[key].device)]
        if patch_key and patch_key in batch:
            grid = batch[per_keys[0]]
            patches = grid.prod(-1).cpu()
            pstart = torch.cumsum(patches, 0) - patches
            idx = torch.cat([torch.arange(int(pstart[m]), int(pstart[m] + patches[m])) for m in media.tolist()])
            out[patch_key] = batch[patch_key][idx.to(batch[patch_key].device)]
    return out


def split_rows(batch: dict[str, Any], rows_per_chunk: int) -> list[dict[str, Any]]:
    """Consecutive chunks of ``rows_per_chunk`` rows, each with its own media (the gradient
    cache's ``split_fn`` for text and media batches)."""
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    n = batch["input_ids"].shape[0]
    return [select_rows(batch, range(i, min(i + rows_per_chunk, n))) for i in range(0, n, rows_per_chunk)]
