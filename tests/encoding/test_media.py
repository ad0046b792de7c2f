"""Media loading (mmembed.encoding.media) against independent references.

The references are written out here: qwen-vl-utils' ``smart_resize`` applied by hand to the
sizes a test chose, frame counts and indices from qwen-vl-utils' sampling rule spelled in
numpy, PIL's own resize, an FFT of the resampled audio; and, as ms-swift runs it,
``qwen_vl_utils.fetch_image`` / ``fetch_video`` with their module constants patched the way
ms-swift patches them from the environment. Every medium is written by the test itself
(PIL, PyAV, soundfile); URLs are served by a loopback ``http.server``.
"""

from __future__ import annotations

import base64
import functools
import http.server
import math
import os
import platform
import sys
import threading

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import REPO
from PIL import Image
from qwen_vl_utils import smart_resize
from qwen_vl_utils import vision_process as qvu

from mmembed.data import read_file
from mmembed.data.paths import MediaFileError
from mmembed.encoding.media import MediaBudget, MediaSettings, Video, load_audio, load_image, load_video, video_reader
from mmembed.encoding.remote import DownloadSettings

MM = os.path.join(REPO, "examples", "data", "mm")
WHERE = ("train.jsonl", 7, "images[0]")
BUDGET_VARS = (
    "MAX_PIXELS", "MIN_PIXELS", "VIDEO_MAX_PIXELS", "VIDEO_MIN_PIXELS", "VIDEO_TOTAL_PIXELS",
    "FPS", "FPS_MIN_FRAMES", "FPS_MAX_FRAMES", "FORCE_QWENVL_VIDEO_READER",
)  # fmt: skip

# decord is a dependency on x86_64 only (pyproject); elsewhere PyAV is the only reader.
needs_decord = pytest.mark.skipif(platform.machine() != "x86_64", reason="decord ships for x86_64 only")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Tests start with qwen-vl-utils' defaults, whatever the caller's shell exports."""
    for key in BUDGET_VARS:
        monkeypatch.delenv(key, raising=False)


def noise(h, w, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


def save(im, path):
    im.save(path)
    return str(path)


def expect_error(exc_info, where, ref, *words):
    """The message names file:line, the field, the reference and the reason."""
    msg = str(exc_info.value)
    source, line, fieldname = where
    assert f"{source}:{line}" in msg
    assert f"field '{fieldname}'" in msg
    assert ref in msg
    for w in words:
        assert w in msg, (w, msg)


def qwen_budget(monkeypatch, **tokens):
    """Patch qwen-vl-utils' module constants as ms-swift does from the environment."""
    for name, value in tokens.items():
        monkeypatch.setattr(qvu, name, value)


# ----------------------------------------------------------------------------- budget


def test_budget_defaults_are_qwen_vl_utils_defaults():
    b = MediaBudget.from_env()
    assert (b.fps, b.fps_min_frames, b.fps_max_frames) == (2.0, 4, 768)
    assert b.image_tokens(28) == (4, 16384)  # 3136 .. 12845056 pixels for Qwen2-VL
    assert b.image_tokens(32) == (4, 16384)
    # per frame: 128 .. 768 tokens, unless the whole-video cap (MODEL_SEQ_LEN * 0.9 tokens)
    # divided over the frames is smaller
    assert b.video_frame_pixels(28, 4) == (128 * 784, 768 * 784)
    n = 600
    assert b.video_frame_pixels(28, n) == (128 * 784, max(128000 * 784 * 0.9 / n * 2, int(128 * 784 * 1.05)))
    assert b.video_frame_pixels(28, n)[1] < 768 * 784


def test_budget_from_env_reads_each_variable(monkeypatch):
    env = {
        "MAX_PIXELS": "1003520", "MIN_PIXELS": "3136", "VIDEO_MAX_PIXELS": "50176", "VIDEO_MIN_PIXELS": "3136",
        "VIDEO_TOTAL_PIXELS": "200000", "FPS": "1.5", "FPS_MIN_FRAMES": "2", "FPS_MAX_FRAMES": "12",
        "FORCE_QWENVL_VIDEO_READER": "PyAV",
    }  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    b = MediaBudget.from_env()
    assert b == MediaBudget(1003520, 3136, 50176, 3136, 200000, 1.5, 2, 12, "pyav")
    assert b.image_tokens(28) == (4, 1280)
    # 50176 px = 64 tokens per frame; 200000 px over 10 frames = 40000 px < 64 tokens, but
    # never below 1.05 * the minimum (qwen-vl-utils' rule)
    assert b.video_frame_pixels(28, 10) == (3136, 40000.0)
    assert b.video_frame_pixels(28, 1000) == (3136, int(3136 * 1.05))


def test_budget_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("MAX_PIXELS", "lots")
    with pytest.raises(ValueError, match="MAX_PIXELS"):
        MediaBudget.from_env()
    monkeypatch.setenv("MAX_PIXELS", "3000")  # below the default minimum of 4 tokens (3136 px)
    with pytest.raises(ValueError, match="MIN_PIXELS"):
        load_image(os.path.join(MM, "red_circle.png"))
    monkeypatch.delenv("MAX_PIXELS")
    monkeypatch.setenv("FORCE_QWENVL_VIDEO_READER", "opencv")
    with pytest.raises(ValueError, match="opencv"):
        MediaBudget.from_env()


def test_media_settings_are_the_budget_and_the_download_variables_parsed_once(monkeypatch, tmp_path):
    """MediaSettings.from_env reads ms-swift's media variables and mmembed's download
    variables in one place; the object then is what every load uses, whatever the
    environment says later."""
    env = {"MAX_PIXELS": "50176", "FPS": "1.5", "MMEMBED_HTTP_TIMEOUT": "2.5", "MMEMBED_MEDIA_MAX_BYTES": "1000",
           "MMEMBED_OFFLINE": "yes", "HF_HUB_OFFLINE": "0", "MMEMBED_MEDIA_CACHE": str(tmp_path / "cache")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = MediaSettings.from_env()
    assert settings == MediaSettings(MediaBudget(max_pixels=50176, fps=1.5),
                                     DownloadSettings(2.5, 1000, "MMEMBED_OFFLINE=yes", str(tmp_path / "cache")))
    assert MediaSettings.from_env(dict(env, HF_HUB_OFFLINE="1")).downloads.offline == \
        "MMEMBED_OFFLINE=yes and HF_HUB_OFFLINE=1"
    monkeypatch.setenv("MAX_PIXELS", "784")
    assert settings.budget.max_pixels == 50176  # parsed: the variable is not read again
    defaults = MediaSettings.from_env({})
    assert defaults == MediaSettings() and defaults.downloads.offline == ""
    assert defaults.downloads.cache.endswith(os.path.join(".cache", "mmembed", "media"))


def test_a_commands_flags_take_their_variables_place(monkeypatch):
    """--max_pixels stands for MAX_PIXELS (a malformed MAX_PIXELS is then not read), --offline
    true for MMEMBED_OFFLINE=1 (named so in messages); a malformed switch is still refused."""
    assert MediaSettings.from_env({"MAX_PIXELS": "9999"}, max_pixels=50176).budget.max_pixels == 50176
    assert MediaSettings.from_env({"MAX_PIXELS": "lots"}, max_pixels=50176).budget.max_pixels == 50176
    assert MediaSettings.from_env({}, offline=True).downloads.offline == "MMEMBED_OFFLINE=1"
    assert MediaSettings.from_env({"MMEMBED_OFFLINE": "yes", "HF_HUB_OFFLINE": "on"}, offline=True).downloads.offline \
        == "MMEMBED_OFFLINE=1 and HF_HUB_OFFLINE=on"
    for bad in ({"MAX_PIXELS": "lots"}, {"MMEMBED_OFFLINE": "maybe"}, {"MMEMBED_HTTP_TIMEOUT": "0"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MediaSettings.from_env(bad, offline=True)


# ----------------------------------------------------------------------------- images


def test_image_already_on_the_grid_loads_unchanged(tmp_path):
    im = noise(56, 84)
    out = load_image(save(im, tmp_path / "a.png"))
    assert out.mode == "RGB" and out.size == (84, 56)
    assert np.array_equal(np.asarray(out), np.asarray(im))


@pytest.mark.parametrize("patch_size", [14, 16])
def test_image_resized_by_smart_resize(tmp_path, patch_size):
    im = noise(75, 100, seed=1)
    factor = 2 * patch_size
    h, w = smart_resize(75, 100, factor=factor, min_pixels=4 * factor**2, max_pixels=16384 * factor**2)
    out = load_image(save(im, tmp_path / "b.png"), patch_size=patch_size)
    assert out.size == (w, h) and h % factor == 0 and w % factor == 0
    assert np.array_equal(np.asarray(out), np.asarray(im.resize((w, h), Image.Resampling.BICUBIC)))


def test_transparent_pixels_become_white(tmp_path):
    a = np.zeros((56, 56, 4), np.uint8)
    a[:, :28] = (10, 20, 30, 255)  # left half opaque, right half fully transparent black
    out = np.asarray(load_image(save(Image.fromarray(a, "RGBA"), tmp_path / "t.png")))
    assert (out[:, :28] == (10, 20, 30)).all() and (out[:, 28:] == 255).all()


def test_max_and_min_pixels_from_env_at_call_time(tmp_path, monkeypatch):
    path = save(noise(300, 200, seed=2), tmp_path / "c.png")
    assert load_image(path).size == (196, 308)  # default budget: only snapped to the grid

    monkeypatch.setenv("MAX_PIXELS", str(20 * 784))
    monkeypatch.setenv("MIN_PIXELS", str(4 * 784))
    h, w = smart_resize(300, 200, factor=28, min_pixels=4 * 784, max_pixels=20 * 784)
    assert load_image(path).size == (w, h) and h * w <= 20 * 784

    small = save(noise(30, 40, seed=3), tmp_path / "d.png")
    monkeypatch.setenv("MAX_PIXELS", str(1000 * 784))
    monkeypatch.setenv("MIN_PIXELS", str(64 * 784))
    h, w = smart_resize(30, 40, factor=28, min_pixels=64 * 784, max_pixels=1000 * 784)
    assert load_image(small).size == (w, h) and h * w >= 64 * 784


def test_pixel_budget_counts_whole_tokens_like_ms_swift(tmp_path, monkeypatch):
    """ms-swift with qwen-vl-utils 0.0.14 turns MAX_PIXELS into MAX_PIXELS // factor**2
    tokens and patches IMAGE_MAX_TOKEN_NUM; the same image must come out of both."""
    path = save(noise(100, 254, seed=4), tmp_path / "e.png")
    monkeypatch.setenv("MAX_PIXELS", "20000")  # 25.5 tokens of 28x28 -> 25 tokens = 19600 px
    monkeypatch.setenv("MIN_PIXELS", "3136")
    floored = smart_resize(100, 254, factor=28, min_pixels=3136, max_pixels=19600)
    assert floored != smart_resize(100, 254, factor=28, min_pixels=3136, max_pixels=20000)
    out = load_image(path)
    assert out.size == floored[::-1]

    qwen_budget(monkeypatch, IMAGE_MAX_TOKEN_NUM=20000 // 784, IMAGE_MIN_TOKEN_NUM=3136 // 784)
    assert np.array_equal(np.asarray(out), np.asarray(qvu.fetch_image({"image": path})))


def test_image_budget_argument_overrides_env(tmp_path, monkeypatch):
    path = save(noise(300, 200, seed=2), tmp_path / "c.png")
    monkeypatch.setenv("MAX_PIXELS", str(20 * 784))
    assert load_image(path, MediaBudget()).size == (196, 308)


@pytest.fixture
def http_root(tmp_path, monkeypatch):
    """An http.server on 127.0.0.1 serving tmp_path/www; yields its base URL. URLs are fetched
    online (the suite runs with HF_HUB_OFFLINE=1) into a media cache of the test's own
    (tests/encoding/test_remote_media.py tests the cache itself)."""
    root = tmp_path / "www"
    root.mkdir()
    monkeypatch.setenv("MMEMBED_MEDIA_CACHE", str(tmp_path / "media-cache"))
    for name in ("HF_HUB_OFFLINE", "MMEMBED_OFFLINE"):
        monkeypatch.delenv(name, raising=False)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_same_image_from_path_file_uri_data_uri_and_http(http_root):
    root, base = http_root
    path = save(noise(90, 120, seed=5), root / "pic.png")
    data = base64.b64encode(open(path, "rb").read()).decode("ascii")
    want = np.asarray(load_image(path))
    for ref in ("file://" + path, f"data:image/png;base64,{data}", f"{base}/pic.png"):
        assert np.array_equal(np.asarray(load_image(ref)), want), ref


def test_http_404_is_a_media_error(http_root):
    _, base = http_root
    url = f"{base}/missing.png"
    with pytest.raises(MediaFileError) as e:
        load_image(url, where=WHERE)
    expect_error(e, WHERE, url, "404")


def test_missing_file_is_a_media_error(tmp_path):
    path = str(tmp_path / "nope.png")
    with pytest.raises(MediaFileError) as e:
        load_image(path, where=WHERE)
    expect_error(e, WHERE, path, "not found")


def test_truncated_png_is_a_media_error(tmp_path):
    path = save(noise(64, 64, seed=6), tmp_path / "whole.png")
    data = open(path, "rb").read()
    cut = tmp_path / "cut.png"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaFileError) as e:
        load_image(str(cut), where=WHERE)
    expect_error(e, WHERE, str(cut), "cannot read image")


def test_other_bad_image_references(tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    cases = [
        (str(text), "cannot read image"),
        ("s3://bucket/key.png", "unsupported URI scheme"),
        ("data:image/png;base64,@@@@", "base64"),
        (str(tmp_path), "folder"),
    ]
    for ref, words in cases:
        with pytest.raises(MediaFileError) as e:
            load_image(ref, where=WHERE)
        expect_error(e, WHERE, ref, words)


def test_error_without_where_names_the_input():
    with pytest.raises(MediaFileError, match=r"^<input>:0: .*nope\.png"):
        load_image("/nonexistent/nope.png")


# ----------------------------------------------------------------------------- videos

FRAMES, RATE, H, W = 30, 10, 64, 96


def write_video(path, frames=FRAMES, rate=RATE, codec="mpeg4"):
    """Frame i is uniform grey level 8*i, so a sampled frame tells which index it was."""
    with av.open(str(path), mode="w") as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        s.options = {"qscale": "1"} if codec == "mpeg4" else {}
        for i in range(frames):
            a = np.full((H, W, 3), 8 * i, np.uint8)
            for packet in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return str(path)


def expected_indices(fps, min_frames, max_frames, total=FRAMES, rate=RATE):
    """qwen-vl-utils' smart_nframes and evenly spaced indices, written out."""
    n = total / rate * fps
    n = min(max(n, math.ceil(min_frames / 2) * 2), math.floor(min(max_frames, total) / 2) * 2, total)
    n = math.floor(n / 2) * 2
    return np.round(np.linspace(0, total - 1, n)).astype(int).tolist()


def sampled_indices(video: Video):
    """Which source frame each output frame shows (from its grey level)."""
    return [round(float(f.float().mean()) / 8) for f in video.frames]


SMALL_FRAMES = {"VIDEO_MIN_PIXELS": str(4 * 784), "VIDEO_MAX_PIXELS": str(8 * 784)}


@pytest.fixture
def clip(tmp_path):
    return write_video(tmp_path / "clip.mp4")


def _load_with(reader, path, monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if reader == "pyav":  # as on a machine without decord: find_spec("decord") is None
        monkeypatch.setitem(sys.modules, "decord", None)
    assert video_reader() == reader
    return load_video(path)


READERS = [pytest.param("decord", marks=needs_decord), "pyav"]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(
    "env, rule",
    [
        ({}, (2.0, 4, 768)),  # 3 s at FPS 2 -> 6 frames
        ({"FPS_MAX_FRAMES": "4"}, (2.0, 4, 4)),
        ({"FPS": "5"}, (5.0, 4, 768)),  # 15 -> 14 (even)
        ({"FPS": "0.5", "FPS_MIN_FRAMES": "6"}, (0.5, 6, 768)),  # 1.5 -> at least 6
    ],
)
def test_video_frames_follow_qwen_sampling_rule(clip, monkeypatch, reader, env, rule):
    v = _load_with(reader, clip, monkeypatch, **SMALL_FRAMES, **env)
    want = expected_indices(*rule)
    h, w = smart_resize(H, W, factor=28, min_pixels=4 * 784, max_pixels=8 * 784)
    assert v.frames.dtype == torch.uint8 and tuple(v.frames.shape) == (len(want), 3, h, w)
    assert v.metadata["frames_indices"] == want and sampled_indices(v) == want
    assert v.metadata["total_num_frames"] == FRAMES and v.metadata["fps"] == pytest.approx(RATE)
    assert v.metadata["video_backend"] == reader
    assert v.fps == pytest.approx(len(want) / FRAMES * RATE)


@needs_decord
def test_decord_and_pyav_give_the_same_frames(clip, monkeypatch):
    a = _load_with("decord", clip, monkeypatch, **SMALL_FRAMES)
    b = _load_with("pyav", clip, monkeypatch)
    assert a.frames.shape == b.frames.shape and a.fps == b.fps
    assert a.metadata["frames_indices"] == b.metadata["frames_indices"]
    assert (a.frames.float() - b.frames.float()).abs().mean() < 1.0


def test_force_reader_from_env(clip, monkeypatch):
    monkeypatch.setenv("FORCE_QWENVL_VIDEO_READER", "pyav")
    assert video_reader() == "pyav"
    assert load_video(clip).metadata["video_backend"] == "pyav"


@needs_decord
def test_decord_is_picked_when_installed():
    assert video_reader(MediaBudget()) == "decord"


@needs_decord
@pytest.mark.parametrize("patch_size", [14, 16])
def test_video_equals_fetch_video_with_default_budget(clip, patch_size):
    """Default budget: frames (upscaled to >= 128 tokens) equal fetch_video's, cast to uint8
    as ms-swift does; the fps and metadata are the ones process_vision_info passes on."""
    v = load_video(clip, patch_size=patch_size)
    (ref, meta), fps = qvu.fetch_video(
        {"video": clip}, image_patch_size=patch_size, return_video_sample_fps=True, return_video_metadata=True
    )
    assert torch.equal(v.frames, ref.to(torch.uint8))
    assert v.fps == fps and v.metadata == meta
    factor = 2 * patch_size
    assert v.frames.shape[2] * v.frames.shape[3] >= 128 * factor**2


@needs_decord
def test_video_env_budget_equals_ms_swift_patched_qwen_vl_utils(clip, monkeypatch):
    env = {"VIDEO_MAX_PIXELS": "50176", "VIDEO_MIN_PIXELS": "3136", "FPS": "4", "FPS_MAX_FRAMES": "8"}
    for k, val in env.items():
        monkeypatch.setenv(k, val)
    v = load_video(clip)
    qwen_budget(monkeypatch, VIDEO_MAX_TOKEN_NUM=50176 // 784, VIDEO_MIN_TOKEN_NUM=3136 // 784, FPS=4.0, FPS_MAX_FRAMES=8)
    ref, fps = qvu.fetch_video({"video": clip}, return_video_sample_fps=True)
    assert v.frames.shape[0] == 8 and torch.equal(v.frames, ref.to(torch.uint8)) and v.fps == fps


def test_small_video_max_pixels_alone_is_held_up_by_the_minimum(clip, monkeypatch):
    """DESIGN.md: with a small max also set the min. Without it qwen-vl-utils keeps frames at
    >= 1.05 * VIDEO_MIN_PIXELS (default 128 tokens), whatever VIDEO_MAX_PIXELS says."""
    monkeypatch.setenv("VIDEO_MAX_PIXELS", str(8 * 784))
    with pytest.warns(UserWarning, match="set VIDEO_MIN_PIXELS too"):
        v = load_video(clip)
    h, w = smart_resize(H, W, factor=28, min_pixels=128 * 784, max_pixels=int(128 * 784 * 1.05))
    assert tuple(v.frames.shape[2:]) == (h, w) and h * w >= 128 * 784


def test_video_total_pixels_caps_the_frames(clip, monkeypatch):
    monkeypatch.setenv("VIDEO_MIN_PIXELS", str(4 * 784))
    monkeypatch.setenv("VIDEO_TOTAL_PIXELS", str(6 * 784 * 3))  # 6 frames, 2 per temporal patch -> 6*784 each
    v = load_video(clip)
    h, w = smart_resize(H, W, factor=28, min_pixels=4 * 784, max_pixels=6 * 784 * 3 / 6 * 2)
    assert tuple(v.frames.shape) == (6, 3, h, w)


def test_video_as_frame_list_and_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("VIDEO_MIN_PIXELS", str(4 * 784))
    monkeypatch.setenv("VIDEO_MAX_PIXELS", str(8 * 784))
    folder = tmp_path / "frames"
    folder.mkdir()
    paths = [save(Image.new("RGB", (W, H), (40 * i, 0, 0)), folder / f"f{i:02d}.png") for i in range(3)]
    v = load_video(paths)
    h, w = smart_resize(H, W, factor=28, min_pixels=4 * 784, max_pixels=8 * 784)
    assert tuple(v.frames.shape) == (4, 3, h, w)  # padded to an even count with the last frame
    assert [int(f[0].float().mean().round()) for f in v.frames] == [0, 40, 80, 80]
    assert v.fps == 2.0 and v.metadata["frames_indices"] == [0, 1, 2, 3]
    assert torch.equal(load_video(str(folder)).frames, v.frames)
    qwen_budget(monkeypatch, VIDEO_MAX_TOKEN_NUM=8, VIDEO_MIN_TOKEN_NUM=4)
    ref, fps = qvu.fetch_video({"video": paths}, return_video_sample_fps=True)
    assert torch.equal(v.frames, ref.to(torch.uint8)) and fps == v.fps


@pytest.mark.parametrize("reader", READERS)
def test_bad_videos_are_media_errors(tmp_path, monkeypatch, reader):
    where = ("train.jsonl", 12, "videos[0]")
    fake = tmp_path / "fake.mp4"
    fake.write_text("this is not a video")
    one = write_video(tmp_path / "one.mp4", frames=1)
    budget = MediaBudget(video_reader=reader)
    for ref, words in [(str(fake), "cannot read video"), (one, "at least 2"), (str(tmp_path / "gone.mp4"), "not found")]:
        with pytest.raises(MediaFileError) as e:
            load_video(ref, budget, where)
        expect_error(e, where, ref, words)


def test_video_from_data_uri_and_http(clip, http_root, monkeypatch):
    root, base = http_root
    monkeypatch.setenv("VIDEO_MIN_PIXELS", str(4 * 784))
    monkeypatch.setenv("VIDEO_MAX_PIXELS", str(8 * 784))
    want = load_video(clip)
    data = open(clip, "rb").read()
    (root / "v.mp4").write_bytes(data)
    for ref in (f"data:video/mp4;base64,{base64.b64encode(data).decode()}", f"{base}/v.mp4"):
        got = load_video(ref)
        assert torch.equal(got.frames, want.frames) and got.metadata == want.metadata


# ----------------------------------------------------------------------------- audio


def fft_peak_hz(y, rate):
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return np.fft.rfftfreq(len(y), 1 / rate)[int(np.argmax(spectrum))]


def test_audio_44k_stereo_resampled_to_16k(tmp_path):
    rate, seconds, hz = 44100, 1.5, 1000.0
    t = np.arange(int(rate * seconds)) / rate
    tone = np.sin(2 * np.pi * hz * t)
    path = str(tmp_path / "tone.wav")
    sf.write(path, np.stack([0.6 * tone, 0.2 * tone], axis=1), rate, subtype="FLOAT")
    y = load_audio(path, 16000)
    assert y.dtype == np.float32 and y.ndim == 1
    assert len(y) == math.ceil(len(t) * 16000 / rate) == 24000
    assert abs(fft_peak_hz(y, 16000) - hz) <= 16000 / len(y)
    middle = y[2000:-2000]  # channel mean: 0.4 * sine, edges left out of the filter transient
    assert np.sqrt(np.mean(middle**2)) == pytest.approx(0.4 / np.sqrt(2), rel=0.01)


def test_audio_at_target_rate_is_the_samples_themselves(tmp_path):
    y0 = (0.3 * np.sin(np.arange(8000) / 5)).astype(np.float32)
    path = str(tmp_path / "a.flac")
    sf.write(path, y0, 16000, subtype="PCM_24")
    want, _ = sf.read(path, dtype="float32")
    assert np.array_equal(load_audio(path, 16000), want)
    data = base64.b64encode(open(path, "rb").read()).decode()
    assert np.array_equal(load_audio(f"data:audio/flac;base64,{data}", 16000), want)


def test_audio_other_containers_through_pyav(tmp_path):
    """An AAC track in an .m4a: libsndfile cannot read it, FFmpeg (PyAV) can."""
    rate, hz = 48000, 440.0
    path = str(tmp_path / "a.m4a")
    with av.open(path, mode="w") as c:
        s = c.add_stream("aac", rate=rate, layout="mono")
        t = np.arange(rate) / rate
        samples = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)[None]
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in s.encode(frame):
            c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    with pytest.raises(sf.LibsndfileError):
        sf.read(path)
    y = load_audio(path, 16000)
    assert abs(len(y) - 16000) <= 16000 * 0.1  # AAC adds priming/padding samples
    assert abs(fft_peak_hz(y, 16000) - hz) <= 2 * 16000 / len(y)


def test_bad_audio_is_a_media_error(tmp_path):
    where = ("train.jsonl", 3, "audios[0]")
    fake = tmp_path / "speech.wav"
    fake.write_text("not a sound")
    with pytest.raises(MediaFileError) as e:
        load_audio(str(fake), 16000, where)
    expect_error(e, where, str(fake), "cannot read audio", "soundfile", "PyAV")
    gone = str(tmp_path / "gone.wav")
    with pytest.raises(MediaFileError) as e:
        load_audio(gone, 16000, where)
    expect_error(e, where, gone, "not found")


# ----------------------------------------------------------------------------- example data


def test_example_files_read_and_their_media_load():
    """examples/data/mm: both row forms parse, and every medium they name loads."""
    seen = set()
    for name, rows in [("gme_train.jsonl", 16), ("qwen3_vl_train.jsonl", 16), ("audio_train.jsonl", 4)]:
        samples = read_file(os.path.join(MM, name))
        assert len(samples) == rows
        for s in samples:
            for item in [s.anchor, *s.positives, *s.negatives]:
                seen.update((kind, ref) for kind in ("image", "video", "audio") for ref in item.media(kind))
    kinds = {k for k, _ in seen}
    assert kinds == {"image", "video", "audio"}
    budget = MediaBudget(video_min_pixels=4 * 784, video_max_pixels=16 * 784)
    for kind, ref in sorted(seen):
        if kind == "image":
            assert load_image(ref, budget).size == (56, 56)
        elif kind == "video":
            v = load_video(ref, budget)
            assert v.frames.shape[0] == 4 and v.metadata["total_num_frames"] == 16
        else:
            assert load_audio(ref, 16000).shape == (16000,)
    assert sum(os.path.getsize(os.path.join(MM, n)) for n in os.listdir(MM)) < 1_000_000
