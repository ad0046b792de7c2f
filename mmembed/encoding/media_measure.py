"""Media token counts from the files' headers, for :meth:`InputBuilder.lengths
<mmembed.encoding.inputs.InputBuilder.lengths>` with ``check_media="header"`` (see
:mod:`mmembed.encoding.measure`'s docstring): :class:`MediaCounter` expands each image,
video and audio placeholder of an item to the tokens the processor would give it, from the
file's header (size, frame count, sample rate) kept per unchanged file, without decoding
it; :class:`Undecided` when a header cannot decide, and that item is measured by decoding."""

from __future__ import annotations

import math
import os
import re
import stat
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ..data.sample import Item, Origin

if TYPE_CHECKING:  # the media loader is imported at the first medium (qwen-vl-utils: about a second)
    from .media import MediaSettings

#: The processors whose placeholder rule the header counts follow.
VISION_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor"})
AUDIO_PROCESSORS = frozenset({"Qwen2AudioProcessor"})
_IMAGE_PROCESSORS = frozenset({"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"})
_VIDEO_PROCESSORS = frozenset({"Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor"})

#: Image formats whose header size is the decoded size.
HEADER_IMAGE_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "MPO"})
#: Audio formats whose header frame count is the decoded count.
HEADER_AUDIO_FORMATS = frozenset({"WAV", "WAVEX", "FLAC", "AIFF", "W64", "RF64"})

_HEADER_CACHE_SIZE = 1 << 16


class Undecided(Exception):
    """The header cannot give this item's count: measure it by decoding."""


def _source(ref: Any, where: Origin | None, kind: str, downloads) -> tuple[Any, tuple | None]:
    """What to open for ``ref`` (as the media loader opens it) and a cache key for a local
    file (path, modification time, size), or None."""
    from . import media as M

    if isinstance(ref, str) and ref.strip():
        try:
            path = M._local_path(ref.strip())
        except ValueError:
            path = None  # the loader's own message
        if path is not None:
            try:
                st = os.stat(path)
            except OSError:
                raise M._error(where, ref, f"{kind} file not found") from None
            if stat.S_ISDIR(st.st_mode):
                if kind != "video":
                    raise M._error(where, ref, f"{kind} path is a folder, not a file")
                raise Undecided  # a folder of frames
            return path, (path, st.st_mtime_ns, st.st_size)
    return M._open(ref, where, kind, downloads), None


class _Headers:
    """Header facts per file, kept while the file is unchanged."""

    def __init__(self):
        self.images: dict[tuple, tuple[str, int, int]] = {}
        self.videos: dict[tuple, tuple[int, float, int, int]] = {}
        self.audios: dict[tuple, tuple[str, int, int]] = {}

    @staticmethod
    def _keep(cache: dict, key, value):
        if key is not None:
            if len(cache) >= _HEADER_CACHE_SIZE:
                cache.clear()
            cache[key] = value
        return value

    def image(self, ref: Any, where: Origin | None, downloads) -> tuple[int, int]:
        """``(width, height)`` of the image as loaded (before the budget's resize)."""
        from PIL import Image

        from . import media as M

        source, key = _source(ref, where, "image", downloads)
        got = self.images.get(key) if key is not None else None
        if got is None:
            try:
                with Image.open(source) as im:
                    got = self._keep(self.images, key, (im.format, *im.size))
            except Exception as e:  # PIL raises many kinds; the loader words it the same way
                raise M._error(where, ref, f"cannot read image ({type(e).__name__}: {e})") from None
        fmt, width, height = got
        if fmt not in HEADER_IMAGE_FORMATS:
            raise Undecided
        return width, height

    def video(self, ref: Any, reader: str, where: Origin | None, downloads) -> tuple[int, float, int, int]:
        """``(frames, fps, height, width)`` as the loader's ``reader`` sees the file."""
        from . import media as M

        if not isinstance(ref, str):
            raise Undecided  # a list of frame images
        source, key = _source(ref, where, "video", downloads)
        key = key and (*key, reader)
        got = self.videos.get(key) if key is not None else None
        if got is None:
            try:
                got = self._keep(self.videos, key, _video_header(source, reader))
            except Undecided:
                raise
            except M.MediaFileError:
                raise
            except Exception as e:  # decord and PyAV raise their own error types
                raise M._error(where, ref, f"cannot read video with {reader} ({type(e).__name__}: {e})") from None
        if got is None:
            raise M._error(where, ref, "no video stream in the file")
        return got

    def audio(self, ref: Any, where: Origin | None, downloads) -> tuple[int, int]:
        """``(samples, rate)`` of the audio file."""
        import soundfile

        source, key = _source(ref, where, "audio", downloads)
        got = self.audios.get(key) if key is not None else None
        if got is None:
            try:
                if hasattr(source, "seek"):
                    source.seek(0)
                info = soundfile.info(source)
            except Exception:  # not a format libsndfile knows: the loader decodes it with PyAV
                raise Undecided from None
            got = self._keep(self.audios, key, (info.format, int(info.frames), int(info.samplerate)))
        fmt, frames, rate = got
        if fmt not in HEADER_AUDIO_FORMATS or rate <= 0:
            raise Undecided
        return frames, rate


def _video_header(source, reader: str):
    """``(frames, fps, height, width)``, or None without a video stream."""
    import av

    if hasattr(source, "seek"):
        source.seek(0)
    with av.open(source) as c:
        if not c.streams.video:
            return None
        stream = c.streams.video[0]
        height, width = stream.codec_context.height, stream.codec_context.width
        rate = stream.average_rate or stream.guessed_rate
        total, fps = stream.frames, (float(rate) if rate else 0.0)
    if not (height > 0 and width > 0):
        raise Undecided
    if reader == "decord":
        import decord

        if hasattr(source, "seek"):
            source.seek(0)
        vr = decord.VideoReader(source)
        total, fps = len(vr), float(vr.get_avg_fps())
    elif total <= 0:  # the container does not say: the loader counts by decoding
        raise Undecided
    return total, fps, height, width


# ----------------------------------------------------------------------------- placeholders


class MediaCounter:
    """One builder's media tokens from headers: per item, the text to tokenize (its pad
    runs collapsed to one pad) and the tokens that collapsing removed.

    Args:
        processor: the builder's processor; tokenizer: its tokenizer.
        settings: the :class:`~mmembed.encoding.media.MediaSettings` the builder loads media
            with (budgets, downloads).
        patch_size: the vision processor's patch size; sampling_rate: the rate audio is
            loaded at (the builder's ``patch_size`` / ``sampling_rate``).
    """

    def __init__(self, processor: Any, tokenizer: Any, settings: MediaSettings, patch_size: int, sampling_rate: int):
        from . import media as M

        self.processor = processor
        name = type(processor).__name__
        self.budget, self.downloads = settings.budget, settings.downloads
        self.patch = patch_size
        self.sampling_rate = sampling_rate
        self.factor = self.patch * M.qvu.SPATIAL_MERGE_SIZE
        self.kinds: set[str] = set()
        added = tokenizer_added(tokenizer)
        self.pads: dict[str, str] = {}
        if name in VISION_PROCESSORS:
            ip = getattr(processor, "image_processor", None)
            if (type(ip).__name__ in _IMAGE_PROCESSORS and getattr(ip, "patch_size", None) == self.patch
                    and getattr(ip, "merge_size", None) and processor.image_token in added):
                self.kinds.add("image")
                self.pads["image"] = processor.image_token
            vp = getattr(processor, "video_processor", None)
            if (type(vp).__name__ in _VIDEO_PROCESSORS and getattr(vp, "patch_size", None) == self.patch
                    and getattr(vp, "merge_size", None) and getattr(vp, "temporal_patch_size", None)
                    and processor.video_token in added):
                self.kinds.add("video")
                self.pads["video"] = processor.video_token
        if name in AUDIO_PROCESSORS:
            fe = getattr(processor, "feature_extractor", None)
            if (type(fe).__name__ == "WhisperFeatureExtractor" and getattr(processor, "audio_token", None) in added
                    and all(getattr(fe, a, None) for a in ("n_samples", "hop_length", "sampling_rate"))):
                self.kinds.add("audio")
                self.pads["audio"] = processor.audio_token
        self.runs = {kind: re.compile(f"(?:{re.escape(pad)})+") for kind, pad in self.pads.items()}
        self.headers = _Headers()
        self.placeholders: dict[tuple, tuple[str, int]] = {}
        self.reader = M.video_reader(self.budget) if "video" in self.kinds else None

    def expand(self, item: Item, text: str, base: Origin) -> tuple[str, int]:
        """``(text to tokenize, tokens to add)`` for ``item`` rendered as ``text``; raises
        :class:`Undecided` or the media's ``MediaFileError``."""
        extra = 0
        for kind in ("image", "video", "audio"):
            refs = item.media(kind)
            if not refs:
                continue
            if kind not in self.kinds:
                raise Undecided
            pad = self.pads[kind]
            if text.count(pad) != len(refs):  # a literal pad in the text: the processor decides
                raise Undecided
            parts = text.split(pad)
            out = [parts[0]]
            for j, ref in enumerate(refs):
                where = _where(base, kind + "s", j)
                short, n = getattr(self, "_" + kind)(ref, where)
                out += [short, parts[j + 1]]
                extra += n
            text = "".join(out)
        return text, extra

    def _placeholder(self, key: tuple, kind: str, make) -> tuple[str, int]:
        """The processor's placeholder for one medium with pad runs collapsed, and how many
        pad tokens collapsing removed (kept per ``key``)."""
        got = self.placeholders.get(key)
        if got is None:
            full = make()
            pad = self.pads[kind]
            short = self.runs[kind].sub(lambda m: pad, full)
            got = (short, full.count(pad) - short.count(pad))
            if len(self.placeholders) >= _HEADER_CACHE_SIZE:
                self.placeholders.clear()
            self.placeholders[key] = got
        return got

    def _image(self, ref: Any, where: Origin) -> tuple[str, int]:
        import torch

        from . import media as M

        width, height = self.headers.image(ref, where, self.downloads)
        lo, hi = self.budget.image_tokens(self.factor)
        f = self.factor
        try:
            h, w = M.qvu.smart_resize(height, width, factor=f, min_pixels=lo * f * f, max_pixels=hi * f * f)
        except ValueError as e:  # aspect ratio beyond MAX_RATIO: the loader's error
            raise M._error(where, ref, f"cannot read image ({type(e).__name__}: {e})") from None
        if not (h > 0 and w > 0):  # the budget leaves no pixels: the loader's error, by decoding
            raise Undecided
        ip = self.processor.image_processor
        grid = (1, h // ip.patch_size, w // ip.patch_size)
        if h % ip.patch_size or w % ip.patch_size or grid[1] % ip.merge_size or grid[2] % ip.merge_size:
            raise Undecided
        return self._placeholder(("image", grid), "image", lambda: self.processor.replace_image_token(
            {"image_grid_thw": torch.tensor([grid])}, image_idx=0))

    def _video(self, ref: Any, where: Origin) -> tuple[str, int]:
        import torch

        from . import media as M

        total, fps, height, width = self.headers.video(ref, self.reader, where, self.downloads)
        idx = M._sampling(self.budget, total, fps, ref, where)
        lo, hi = self.budget.video_frame_pixels(self.factor, len(idx))
        try:
            h, w = M.qvu.smart_resize(height, width, factor=self.factor, min_pixels=lo, max_pixels=hi)
        except ValueError as e:  # aspect ratio beyond MAX_RATIO: the loader's error
            raise M._error(where, ref, f"cannot use video ({e})") from None
        if not (h > 0 and w > 0):
            raise Undecided
        vp = self.processor.video_processor
        tp = vp.temporal_patch_size
        grid = (math.ceil(len(idx) / tp), h // vp.patch_size, w // vp.patch_size)
        if h % vp.patch_size or w % vp.patch_size or grid[1] % vp.merge_size or grid[2] % vp.merge_size:
            raise Undecided
        timed = type(self.processor).__name__ == "Qwen3VLProcessor"  # timestamps in the placeholder text
        key = ("video", grid, fps, tuple(idx)) if timed else ("video", grid)
        return self._placeholder(key, "video", lambda: self.processor.replace_video_token(
            {"video_grid_thw": torch.tensor([grid]),
             "video_metadata": [SimpleNamespace(fps=fps, frames_indices=list(idx))]}, video_idx=0))

    def _audio(self, ref: Any, where: Origin) -> tuple[str, int]:
        from . import media as M

        frames, rate = self.headers.audio(ref, where, self.downloads)
        if frames <= 0:
            raise M._error(where, ref, "audio has no samples")
        fe = self.processor.feature_extractor
        sr = self.sampling_rate
        if sr != fe.sampling_rate:
            raise Undecided
        n = frames if rate == sr else math.ceil(frames * sr / rate)  # load_audio's resampled length
        tokens = qwen2_audio_tokens(n, fe.n_samples, fe.hop_length)
        return self._placeholder(("audio", tokens), "audio", lambda: self.processor.replace_audio_token(
            {"num_audio_tokens": [tokens]}, audio_idx=0))


def qwen2_audio_tokens(samples: int, n_samples: int, hop_length: int) -> int:
    """Audio tokens of a waveform of ``samples`` samples: Whisper's feature mask (padded or
    cut to ``n_samples``, one frame per ``hop_length`` samples, the last one dropped when
    ``n_samples`` is not a multiple) through Qwen2-Audio's encoder reductions."""
    kept = min(samples, n_samples)
    frames = -(-kept // hop_length)  # mask[::hop] over the padded length
    if n_samples % hop_length and (n_samples - 1) // hop_length * hop_length < kept:
        frames -= 1
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


def tokenizer_added(tokenizer: Any) -> set[str]:
    """The added tokens of ``tokenizer`` (split off before the model's own tokenization)."""
    try:
        return set(tokenizer.get_added_vocab())
    except Exception:  # a tokenizer without added-token bookkeeping: nothing is known to split
        return set()


def _where(base: Origin, kind: str, index: int) -> Origin:
    part = f"{base[2]} " if base[2] else ""
    return (base[0], base[1], f"{part}{kind}[{index}]")
