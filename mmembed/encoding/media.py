"""Load the media an :class:`~mmembed.data.sample.Item` refers to, as ms-swift does for
Qwen-VL and Qwen-Audio models.

* :func:`load_image` -> an RGB ``PIL.Image`` resized by qwen-vl-utils' ``fetch_image``;
* :func:`load_video` -> a :class:`Video`: sampled frames (``uint8 [T, C, H, W]``) plus the
  sampling information the Qwen2.5-VL / Qwen3-VL processors need;
* :func:`load_audio` -> a mono ``float32`` waveform at the requested rate.

A reference is what the reader leaves in an ``Item``: an absolute path, a ``file://`` URI,
a ``data:...;base64,`` URI or an ``http(s)://`` URL (downloaded once into the media cache, with
a timeout and a size limit, and read from there; see :mod:`mmembed.encoding.remote`). Anything that
cannot be loaded raises :class:`~mmembed.data.paths.MediaFileError` naming the file, line
and field (``where=(source, line, field)``; default ``("<input>", 0, None)``) and the
reference; nothing is skipped silently.

Budgets (the environment variables of ms-swift / qwen-vl-utils)
---------------------------------------------------------------
:meth:`MediaBudget.from_env` reads ``MAX_PIXELS``, ``MIN_PIXELS`` (images),
``VIDEO_MAX_PIXELS``, ``VIDEO_MIN_PIXELS``, ``VIDEO_TOTAL_PIXELS`` (per video frame / whole
video), ``FPS``, ``FPS_MIN_FRAMES``, ``FPS_MAX_FRAMES`` (frame sampling) and
``FORCE_QWENVL_VIDEO_READER``. :class:`MediaSettings` holds the budget with the download
settings (:class:`~mmembed.encoding.remote.DownloadSettings`): a command parses it once
where it starts (:meth:`MediaSettings.from_env`, with its ``--max_pixels`` / ``--offline``
flags) and hands it to the :class:`~mmembed.encoding.inputs.InputBuilder`, which passes it
to every load here (and, pickled with the builder, to data-loader workers). The functions
below, called without one, parse the environment at that call.
qwen-vl-utils 0.0.14 itself reads none of them: its limits are module constants counted in
tokens (``IMAGE_MAX_TOKEN_NUM`` etc.; one token = ``factor**2`` pixels, ``factor =
patch_size * 2``). ms-swift converts a pixel variable to tokens (``MAX_PIXELS // factor**2``)
and patches the constants; mmembed computes the same numbers and passes them to each call,
so the process-wide constants are never changed. Unset variables keep qwen-vl-utils'
defaults:

=====================  ==============================  ===========================
variable               default (factor 28, Qwen2-VL)   rule
=====================  ==============================  ===========================
``MIN_PIXELS``         3136                            4 tokens
``MAX_PIXELS``         12845056                        16384 tokens
``VIDEO_MIN_PIXELS``   100352                          128 tokens per frame
``VIDEO_MAX_PIXELS``   602112                          768 tokens per frame
``VIDEO_TOTAL_PIXELS`` 90316800                        MODEL_SEQ_LEN (128000) * 0.9 tokens
``FPS``                2.0
``FPS_MIN_FRAMES``     4
``FPS_MAX_FRAMES``     768
=====================  ==============================  ===========================

A video frame is never made smaller than ``1.05 * VIDEO_MIN_PIXELS`` allows, so a small
``VIDEO_MAX_PIXELS`` needs a small ``VIDEO_MIN_PIXELS`` too (the same holds for images:
``MAX_PIXELS`` below ``MIN_PIXELS`` is an error).

Video readers
-------------
qwen-vl-utils reads with torchcodec, decord or torchvision; torchvision's reader is broken
with torchvision >= 0.28 and qwen-vl-utils falls back to it on any error. mmembed reads with
decord when it is installed, else with PyAV (``FORCE_QWENVL_VIDEO_READER=decord|pyav``
picks one), and applies qwen-vl-utils' own frame sampling (``smart_nframes`` and evenly
spaced indices) and resizing (``smart_resize`` and bicubic antialiased resize), so both
readers give the frames ``fetch_video`` gives.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import importlib.util
import io
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlparse
from urllib.request import url2pathname

import numpy as np
import torch
from PIL import Image
from qwen_vl_utils import vision_process as qvu

from ..data.paths import SCHEME_RE, MediaFileError
from ..data.sample import Origin
from ..environment import EnvironmentLike, MediaVariables, read
from . import remote
from .remote import HTTP_TIMEOUT, DownloadSettings

__all__ = ["HTTP_TIMEOUT", "MediaBudget", "MediaSettings", "Video", "load_audio", "load_image", "load_video",
           "video_reader"]

#: Frames per second qwen-vl-utils assumes for a video given as a list of frames.
FRAME_LIST_FPS = 2.0

VIDEO_READERS = ("decord", "pyav")

_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")

# ----------------------------------------------------------------------------- budget


@dataclass(frozen=True)
class MediaBudget:
    """Pixel and frame limits for one load; ``None`` means qwen-vl-utils' default.

    Pixel limits are per image or per video frame (``video_total_pixels``: the whole video).
    They are rounded down to whole tokens of the model's patch size as ms-swift does with
    qwen-vl-utils 0.0.14 (``MAX_PIXELS // factor**2`` tokens), see the module docstring.
    """

    max_pixels: int | None = None
    min_pixels: int | None = None
    video_max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_total_pixels: int | None = None
    fps: float = qvu.FPS
    fps_min_frames: int = qvu.FPS_MIN_FRAMES
    fps_max_frames: int = qvu.FPS_MAX_FRAMES
    video_reader: str | None = None  # "decord" | "pyav" | None (decord when installed)
    # the image token cap when max_pixels is None (a template's default; None: qwen-vl-utils')
    image_max_tokens: int | None = None
    # the variables the environment set (from_variables); None: every field as constructed
    given: frozenset | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.video_reader is not None and self.video_reader not in VIDEO_READERS:
            raise ValueError(
                f"unknown video reader {self.video_reader!r} (FORCE_QWENVL_VIDEO_READER); "
                f"expected one of {', '.join(VIDEO_READERS)}"
            )
        if not self.fps > 0:
            raise ValueError(f"FPS must be a number > 0, got {self.fps}")
        if self.fps_max_frames < qvu.FRAME_FACTOR:
            raise ValueError(f"FPS_MAX_FRAMES must be at least {qvu.FRAME_FACTOR}, got {self.fps_max_frames}")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"MIN_PIXELS={self.min_pixels} is above MAX_PIXELS={self.max_pixels}; "
                             "set MIN_PIXELS below MAX_PIXELS")

    @classmethod
    def from_env(cls, environ: EnvironmentLike = None) -> MediaBudget:
        """The budget the environment asks for now (``os.environ`` unless ``environ``: a
        mapping or an :class:`~mmembed.environment.Environment`)."""
        return cls.from_variables(read(environ).media)

    @classmethod
    def from_variables(cls, media: MediaVariables) -> MediaBudget:
        """The budget of the parsed media variables (unset ones: qwen-vl-utils' defaults)."""
        return cls(
            max_pixels=media.max_pixels,
            min_pixels=media.min_pixels,
            video_max_pixels=media.video_max_pixels,
            video_min_pixels=media.video_min_pixels,
            video_total_pixels=media.video_total_pixels,
            fps=qvu.FPS if media.fps is None else media.fps,
            fps_min_frames=qvu.FPS_MIN_FRAMES if media.fps_min_frames is None else media.fps_min_frames,
            fps_max_frames=qvu.FPS_MAX_FRAMES if media.fps_max_frames is None else media.fps_max_frames,
            video_reader=media.video_reader,
            given=frozenset(name for name in ("max_pixels", "fps", "fps_max_frames")
                            if getattr(media, name) is not None),
        )

    def with_defaults(self, defaults: dict[str, Any]) -> MediaBudget:
        """This budget with a template's ``media_defaults`` (``image_max_tokens``, ``fps``,
        ``fps_max_frames``) where the environment set nothing (a budget built directly, not
        from the environment, is kept as it is)."""
        if not defaults or self.given is None:
            return self
        changes: dict[str, Any] = {}
        if "image_max_tokens" in defaults and "max_pixels" not in self.given:
            changes["image_max_tokens"] = int(defaults["image_max_tokens"])
        for name in ("fps", "fps_max_frames"):
            if name in defaults and name not in self.given:
                changes[name] = defaults[name]
        return dataclasses.replace(self, **changes) if changes else self

    def image_tokens(self, factor: int) -> tuple[int, int]:
        """``(min, max)`` tokens of ``factor**2`` pixels for one image."""
        lo = qvu.IMAGE_MIN_TOKEN_NUM if self.min_pixels is None else self.min_pixels // factor**2
        if self.max_pixels is None:
            hi = qvu.IMAGE_MAX_TOKEN_NUM if self.image_max_tokens is None else self.image_max_tokens
        else:
            hi = self.max_pixels // factor**2
        if hi < max(lo, 1):
            raise ValueError(
                f"MAX_PIXELS={self.max_pixels} allows {hi} token(s) of {factor}x{factor} pixels, fewer than "
                f"MIN_PIXELS={self.min_pixels if self.min_pixels is not None else lo * factor**2} ({lo} tokens); "
                "set MIN_PIXELS below MAX_PIXELS"
            )
        return lo, hi

    def video_frame_pixels(self, factor: int, nframes: int) -> tuple[int, float]:
        """``(min_pixels, max_pixels)`` for each of ``nframes`` frames, as ``fetch_video``."""
        lo = (qvu.VIDEO_MIN_TOKEN_NUM if self.video_min_pixels is None else self.video_min_pixels // factor**2)
        hi = (qvu.VIDEO_MAX_TOKEN_NUM if self.video_max_pixels is None else self.video_max_pixels // factor**2)
        min_pixels = lo * factor**2
        if self.video_max_pixels is not None and self.video_min_pixels is None and hi * factor**2 < min_pixels:
            warnings.warn(
                f"VIDEO_MAX_PIXELS={self.video_max_pixels} is below the default VIDEO_MIN_PIXELS ({min_pixels}): "
                f"video frames keep at least {int(min_pixels * 1.05)} pixels, as in qwen-vl-utils; "
                "set VIDEO_MIN_PIXELS too",
                stacklevel=3,
            )
        total = self.video_total_pixels
        if total is None:
            total = qvu.MODEL_SEQ_LEN * factor * factor * 0.9
        max_pixels = max(min(hi * factor**2, total / nframes * qvu.FRAME_FACTOR), int(min_pixels * 1.05))
        return min_pixels, max_pixels


@dataclass(frozen=True)
class MediaSettings:
    """Everything the media loader takes from the environment, parsed once: the pixel and
    frame ``budget`` and how URLs are fetched (``downloads``: timeout, size limit, offline
    switch, cache folder). Built where a command starts and passed down, so the loader never
    reads the environment batch by batch."""

    budget: MediaBudget = field(default_factory=MediaBudget)
    downloads: DownloadSettings = field(default_factory=DownloadSettings)

    @classmethod
    def from_env(cls, environ: EnvironmentLike = None, *, max_pixels: int | None = None,
                 offline: bool = False) -> MediaSettings:
        """The settings of ms-swift's media variables and mmembed's download variables in
        ``environ`` (default ``os.environ``; a mapping or an
        :class:`~mmembed.environment.Environment`). A command's flags take their variable's place:
        ``max_pixels`` (``--max_pixels``) that of ``MAX_PIXELS``, ``offline`` (``--offline
        true``) that of ``MMEMBED_OFFLINE=1``. A malformed variable is a ValueError naming it."""
        env = read(environ)
        if max_pixels is not None:
            env = env.with_values(MAX_PIXELS=str(max_pixels))
        return cls(MediaBudget.from_env(env), DownloadSettings.from_env(env, offline=offline))


# ----------------------------------------------------------------------------- references


def _error(where: Origin | None, ref: Any, message: str) -> MediaFileError:
    source, line, fieldname = tuple(where) if where else ("<input>", 0, None)
    return MediaFileError(source, line, fieldname, f"{message}: {_show(ref)}")


def _show(ref: Any) -> str:
    """The reference for an error message (data: URIs shortened, URLs redacted)."""
    if isinstance(ref, str) and ref[:5].lower() == "data:" and len(ref) > 80:
        return repr(f"{ref[:60]}...") + f" ({len(ref)} characters)"
    if remote.is_url(ref):  # no password or signed query string in a message
        return repr(remote.redact(ref))
    return repr(ref)


def _local_path(ref: str) -> str | None:
    """The file path ``ref`` names, or None for a data: / http(s) reference."""
    m = SCHEME_RE.match(ref)
    if not m:
        return os.path.expanduser(ref)
    scheme = m.group(1).lower()
    if scheme == "file":
        parsed = urlparse(ref)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI with a remote host ({parsed.netloc!r}) is not supported")
        return url2pathname(unquote(parsed.path))
    if scheme in ("http", "https", "data"):
        return None
    raise ValueError(f"unsupported URI scheme {scheme!r}; use a local path, file://, http(s):// or data:")


def _decode_data_uri(ref: str) -> bytes:
    """The bytes of a data: URI (raises ValueError with the reason)."""
    header, sep, payload = ref[5:].partition(",")
    if not sep:
        raise ValueError("malformed data: URI (no ',')")
    if header.lower().endswith(";base64"):
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"invalid base64 in data: URI ({e})") from None
    return unquote_to_bytes(payload)


def _open(ref: str, where: Origin | None, kind: str, downloads: DownloadSettings | None) -> str | io.BytesIO:
    """A local path (checked to exist; for a URL, its file in the media cache, downloaded
    first if needed with ``downloads``) or the decoded bytes of a data: URI."""
    if not isinstance(ref, str) or not ref.strip():
        raise _error(where, ref, f"a {kind} reference must be a non-empty path or URL string")
    try:
        path = _local_path(ref.strip())
        if path is None:
            if ref.strip()[:5].lower() == "data:":
                return io.BytesIO(_decode_data_uri(ref.strip()))
            return remote.fetch(ref, downloads)
    except ValueError as e:
        reason = remote.redact_text(str(e), ref) if remote.is_url(ref) else str(e)
        raise _error(where, ref, f"cannot read {kind} ({reason})") from None
    if not os.path.exists(path):
        raise _error(where, ref, f"{kind} file not found")
    if os.path.isdir(path) and kind != "video":
        raise _error(where, ref, f"{kind} path is a folder, not a file")
    return path


# ----------------------------------------------------------------------------- images


def load_image(
    ref: str, budget: MediaBudget | None = None, where: Origin | None = None, *, patch_size: int = 14,
    downloads: DownloadSettings | None = None,
) -> Image.Image:
    """Open an image and resize it as qwen-vl-utils' ``fetch_image`` does.

    ``ref``: absolute path, ``file://`` URI, ``data:`` URI or ``http(s)://`` URL (fetched with
    ``downloads``). ``budget`` / ``downloads``: None parses the environment at this call.
    ``patch_size``: the vision encoder's patch (14 for Qwen2/2.5-VL and GME, 16 for Qwen3-VL:
    ``processor.image_processor.patch_size``); sides become multiples of ``2 * patch_size``
    and the pixel count lies within the budget (``smart_resize``).

    Returns an RGB image (transparent pixels composited on white, as qwen-vl-utils does), ready
    for the Qwen-VL image processor with ``do_resize=False``. Raises :class:`MediaFileError`.
    """
    budget = MediaBudget.from_env() if budget is None else budget
    return _load_image(ref, budget.image_tokens(patch_size * qvu.SPATIAL_MERGE_SIZE), where, patch_size, downloads)


def _load_image(ref: str, tokens: tuple[int, int], where: Origin | None, patch_size: int,
                downloads: DownloadSettings | None) -> Image.Image:
    source = _open(ref, where, "image", downloads)
    try:
        with Image.open(source) as im:
            im.load()  # decode now: a truncated or corrupt file fails here, not later
        factor = patch_size * qvu.SPATIAL_MERGE_SIZE
        ele = {"image": im, "min_pixels": tokens[0] * factor**2, "max_pixels": tokens[1] * factor**2}
        return qvu.fetch_image(ele, image_patch_size=patch_size)
    except Exception as e:  # PIL raises many kinds (OSError, SyntaxError, ValueError, ...)
        raise _error(where, ref, f"cannot read image ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------- videos


@dataclass
class Video:
    """Sampled video frames and how they were sampled.

    ``frames``: ``uint8 [T, C, H, W]`` RGB, ``T`` even, ``H`` and ``W`` multiples of
    ``2 * patch_size``: ready for a Qwen-VL video processor with ``do_resize=False``.
    ``fps``: frames per second of the sampled frames (qwen-vl-utils' ``sample_fps``, a plain
    float: ``process_vision_info(return_video_kwargs=True)`` gives it as a one-element list).
    ``metadata``: ``{"fps": source fps, "frames_indices": [...], "total_num_frames": int,
    "video_backend": str}``, which transformers' ``VideoMetadata`` takes; Qwen3-VL needs it
    (frame timestamps), and Qwen2.5-VL derives ``second_per_grid_ts`` from it.

    Processor calls (transformers 5), frames already sampled and resized::

        processor(text=..., videos=[v.frames], video_metadata=[v.metadata],
                  do_sample_frames=False, do_resize=False, return_tensors="pt")
    """

    frames: torch.Tensor
    fps: float
    metadata: dict = field(default_factory=dict)


def video_reader(budget: MediaBudget | None = None) -> str:
    """The reader :func:`load_video` uses: the budget's choice, else decord when installed,
    else PyAV."""
    budget = MediaBudget.from_env() if budget is None else budget
    if budget.video_reader is not None:
        return budget.video_reader
    return "decord" if importlib.util.find_spec("decord") is not None else "pyav"


def load_video(
    ref: str | Sequence[str],
    budget: MediaBudget | None = None,
    where: Origin | None = None,
    *,
    patch_size: int = 14,
    downloads: DownloadSettings | None = None,
) -> Video:
    """Read, sample and resize a video as qwen-vl-utils' ``fetch_video`` does.

    ``ref``: a video file (path, ``file://``, ``data:`` or ``http(s)://``), a folder of frame
    images (sorted by name) or a list of frame image references. Frames are sampled at
    ``budget.fps`` (at least ``fps_min_frames``, at most ``fps_max_frames``, an even count,
    evenly spaced) and resized to the per-frame budget; a frame list is taken whole (padded
    to an even count by repeating the last frame) at ``FRAME_LIST_FPS``. URLs are fetched with
    ``downloads``; ``budget`` / ``downloads``: None parses the environment at this call.
    Raises :class:`MediaFileError`.
    """
    budget = MediaBudget.from_env() if budget is None else budget
    factor = patch_size * qvu.SPATIAL_MERGE_SIZE
    if isinstance(ref, str):
        source = _open(ref, where, "video", downloads)
        if isinstance(source, str) and os.path.isdir(source):
            names = sorted(n for n in os.listdir(source) if n.lower().endswith(_IMAGE_EXTENSIONS))
            if not names:
                raise _error(where, ref, "video folder holds no frame images")
            frames, metadata, sample_fps = _frame_list([os.path.join(source, n) for n in names], budget, where, factor,
                                                       downloads)
        else:
            reader = video_reader(budget)
            frames, metadata, sample_fps = _read_video(source, reader, budget, ref, where)
    elif isinstance(ref, Sequence) and ref:
        frames, metadata, sample_fps = _frame_list(list(ref), budget, where, factor, downloads)
    else:
        raise _error(where, ref, "a video must be a path/URL or a non-empty list of frame images")

    nframes, _, height, width = frames.shape
    min_pixels, max_pixels = budget.video_frame_pixels(factor, nframes)
    try:
        h, w = qvu.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as e:  # aspect ratio beyond qwen-vl-utils' MAX_RATIO
        raise _error(where, ref, f"cannot use video ({e})") from None
    # On uint8 input torchvision rounds and clamps, so this equals fetch_video's output
    # (float) followed by ms-swift's .to(torch.uint8).
    frames = _resize(frames, h, w)
    return Video(frames=frames, fps=float(sample_fps), metadata=metadata)


def _resize(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    return F.resize(frames, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True)


def _sampling(budget: MediaBudget, total: int, video_fps: float, ref: Any, where: Origin | None) -> list[int]:
    """qwen-vl-utils' frame indices for a video of ``total`` frames at ``video_fps``."""
    if total < qvu.FRAME_FACTOR:
        raise _error(where, ref, f"video has {total} frame(s); at least {qvu.FRAME_FACTOR} are needed")
    if not video_fps > 0:
        raise _error(where, ref, "video has no usable frame rate")
    ele = {"fps": budget.fps, "min_frames": budget.fps_min_frames, "max_frames": budget.fps_max_frames}
    nframes = qvu.smart_nframes(ele, total_frames=total, video_fps=video_fps)
    return torch.linspace(0, total - 1, nframes).round().long().tolist()


def _read_video(source, reader: str, budget: MediaBudget, ref: Any, where: Origin | None):
    try:
        if reader == "decord":
            return _read_decord(source, budget, ref, where)
        return _read_pyav(source, budget, ref, where)
    except MediaFileError:
        raise
    except Exception as e:  # decord and PyAV raise their own error types
        raise _error(where, ref, f"cannot read video with {reader} ({type(e).__name__}: {e})") from None


def _read_decord(source, budget: MediaBudget, ref: Any, where: Origin | None):
    import decord

    vr = decord.VideoReader(source)
    total, video_fps = len(vr), float(vr.get_avg_fps())
    idx = _sampling(budget, total, video_fps, ref, where)
    frames = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(0, 3, 1, 2)
    meta = {"fps": video_fps, "frames_indices": idx, "total_num_frames": total, "video_backend": "decord"}
    return frames, meta, len(idx) / total * video_fps


def _read_pyav(source, budget: MediaBudget, ref: Any, where: Origin | None):
    import av

    def container():
        if isinstance(source, io.BytesIO):
            source.seek(0)
        return av.open(source)

    with container() as c:
        if not c.streams.video:
            raise _error(where, ref, "no video stream in the file")
        stream = c.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        video_fps = float(rate) if rate else 0.0
        total = stream.frames
    if total <= 0:  # the container does not say: count by decoding
        with container() as c:
            total = sum(1 for _ in c.decode(video=0))
    idx = _sampling(budget, total, video_fps, ref, where)
    wanted = set(idx)
    decoded: dict[int, np.ndarray] = {}
    with container() as c:
        for i, frame in enumerate(c.decode(video=0)):
            if i in wanted:
                decoded[i] = frame.to_ndarray(format="rgb24")
            if i >= idx[-1]:
                break
    if len(decoded) < len(wanted):
        raise _error(where, ref, f"video ended after {len(decoded)} of the sampled frames (header says {total})")
    frames = torch.from_numpy(np.stack([decoded[i] for i in idx])).permute(0, 3, 1, 2)
    meta = {"fps": video_fps, "frames_indices": idx, "total_num_frames": total, "video_backend": "pyav"}
    return frames, meta, len(idx) / total * video_fps


def _frame_list(refs: list, budget: MediaBudget, where: Origin | None, factor: int,
                downloads: DownloadSettings | None):
    """fetch_video's list branch: every frame through fetch_image, padded to an even count."""
    # qwen-vl-utils passes the video factor (2 * patch) to fetch_image as its *patch* size,
    # so frames are first resized to multiples of 4 * patch within the image budget counted
    # in those larger tokens; then the video budget applies. Kept as is so frames match.
    tokens = budget.image_tokens(factor)
    images = [_load_image(r, tokens, where, factor, downloads) for r in refs]
    sizes = {im.size for im in images}
    if len(sizes) > 1:
        raise _error(where, refs, f"video frames differ in size after resizing: {sorted(sizes)}")
    nframes = math.ceil(len(images) / qvu.FRAME_FACTOR) * qvu.FRAME_FACTOR
    images += [images[-1]] * (nframes - len(images))
    frames = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1) for im in images])
    meta = {
        "fps": FRAME_LIST_FPS,
        "frames_indices": list(range(nframes)),
        "total_num_frames": nframes,
        "video_backend": "frames",
    }
    return frames, meta, FRAME_LIST_FPS


# ----------------------------------------------------------------------------- audio


def load_audio(ref: str, sampling_rate: int, where: Origin | None = None, *,
               downloads: DownloadSettings | None = None) -> np.ndarray:
    """A mono ``float32`` waveform in [-1, 1] at ``sampling_rate`` Hz, as ``librosa.load(ref,
    sr=sampling_rate)`` gives it (ms-swift's loader): soundfile decodes (WAV, FLAC, OGG,
    MP3, ...; other containers such as M4A through PyAV), channels are averaged, and soxr
    resamples at librosa's default quality (``soxr_hq``) to ``ceil(n * sampling_rate / rate)``
    samples. URLs are fetched with ``downloads`` (None: the environment's, parsed at this call).
    Raises :class:`MediaFileError`.
    """
    if not (isinstance(sampling_rate, (int, float)) and sampling_rate > 0):
        raise ValueError(f"sampling_rate must be a positive number, got {sampling_rate!r}")
    source = _open(ref, where, "audio", downloads)
    try:
        y, rate = _decode_soundfile(source)
    except Exception as e_sf:  # libsndfile does not know the format: try FFmpeg
        try:
            y, rate = _decode_pyav(source)
        except Exception as e_av:
            raise _error(
                where, ref, f"cannot read audio (soundfile: {_reason(e_sf)}; PyAV: {_reason(e_av)})"
            ) from None
    if y.size == 0:
        raise _error(where, ref, "audio has no samples")
    if not np.isfinite(y).all():
        raise _error(where, ref, "audio holds NaN or infinite samples")
    if rate != sampling_rate:
        import soxr

        n = math.ceil(y.shape[0] * sampling_rate / rate)
        y = soxr.resample(y, rate, sampling_rate, quality="soxr_hq")
        y = y[:n] if y.shape[0] >= n else np.pad(y, (0, n - y.shape[0]))
    return np.ascontiguousarray(y, dtype=np.float32)


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".strip()


def _decode_soundfile(source) -> tuple[np.ndarray, int]:
    import soundfile as sf

    if isinstance(source, io.BytesIO):
        source.seek(0)
    data, rate = sf.read(source, dtype="float32", always_2d=True)
    return (data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]), int(rate)


def _decode_pyav(source) -> tuple[np.ndarray, int]:
    import av

    if isinstance(source, io.BytesIO):
        source.seek(0)
    with av.open(source) as c:
        if not c.streams.audio:
            raise ValueError("no audio stream")
        stream = c.streams.audio[0]
        rate = stream.rate
        # planar float keeps channels apart so they can be averaged like librosa's to_mono
        resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
        chunks = []
        for frame in c.decode(stream):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray())
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray())
    if not chunks:
        return np.zeros(0, np.float32), int(rate)
    data = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    return data.mean(axis=0, dtype=np.float32), int(rate)
