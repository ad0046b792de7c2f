"""Remote media (mmembed.encoding.remote): an http(s) URL is downloaded once into the on-disk
media cache and read from there by every later load, step, epoch, worker and run; a timeout,
a size limit and an offline switch each fail with the data file, line and URL.

The URLs are served by a real ``http.server`` on the loopback interface that counts the GETs
it answers; some paths misbehave on purpose (answer late, stall mid-body, announce or stream
too many bytes, hang up early).
"""

from __future__ import annotations

import base64
import collections
import http.server
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import DATA, REPO, write_jsonl
from forked_cli import run_cli

from mmembed.data.paths import MediaFileError
from mmembed.data.sample import Item, Sample
from mmembed.encoding import remote
from mmembed.encoding.media import load_audio, load_image, load_video

MM = os.path.join(DATA, "mm")
WHERE = ("train.jsonl", 7, "images[0]")
SERVED = {f"/{name}": open(os.path.join(MM, name), "rb").read()
          for name in ("red_circle.png", "blue_square.png", "green_triangle.png", "tone.wav", "clip.mp4")}
SLOW = 3.0  # seconds a slow path keeps the client waiting (its timeout is far shorter)


class Handler(http.server.BaseHTTPRequestHandler):
    """``/NAME``: the file; ``/slow/NAME``: answers after SLOW s; ``/stall/NAME``: half the body,
    then nothing for SLOW s (``/stall-once/``: only on the first GET); ``/cut/NAME``: half the body,
    then hangs up; ``/huge``: announces a terabyte; ``/endless``: streams without a length."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        gets = self.server.gets
        gets[self.path] += 1
        mode, _, name = self.path.partition("?")[0][1:].rpartition("/")  # a query string is ignored
        body = SERVED.get(f"/{name}")
        try:
            if mode == "slow":
                time.sleep(SLOW)
            if self.path == "/huge":
                self._head(10**12)
                self.wfile.write(b"\0" * 1024)
            elif self.path == "/endless":
                self._head(None)
                for _ in range(256):  # 16 MiB at most
                    self.wfile.write(b"\0" * 65536)
            elif body is None:
                self.send_error(404)
            elif mode in ("stall", "cut") or (mode == "stall-once" and gets[self.path] == 1):
                self._head(len(body))
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                if mode != "cut":
                    time.sleep(SLOW)
                    self.wfile.write(body[len(body) // 2 :])
            else:
                self._head(len(body))
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
            pass

    def _head(self, length):
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()


@pytest.fixture
def server():
    """The loopback server; ``server.url(path)``, ``server.gets`` (a Counter of paths)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.gets = collections.Counter()
    srv.url = lambda path: f"http://127.0.0.1:{srv.server_address[1]}{path}"
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty media cache of the test's own, online (the suite runs with HF_HUB_OFFLINE=1)."""
    folder = tmp_path / "media-cache"
    monkeypatch.setenv("MMEMBED_MEDIA_CACHE", str(folder))
    for name in ("HF_HUB_OFFLINE", "MMEMBED_OFFLINE", "MMEMBED_HTTP_TIMEOUT", "MMEMBED_MEDIA_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)
    return folder


def cached_files(folder) -> list[str]:
    """Every file in the cache except the lock files (partial downloads included)."""
    return sorted(n for n in os.listdir(folder) if n != ".locks") if os.path.isdir(folder) else []


def expect_error(e, where, url, *words):
    text = str(e.value)
    assert text.startswith(f"{where[0]}:{where[1]} field '{where[2]}': "), text
    assert repr(url) in text, text
    for w in words:
        assert w in text, text


# ---------------------------------------------------------------------------- once per URL


def test_training_downloads_each_url_once_and_offline_refuses_a_new_one(tiny_model, server, cache, tmp_path):
    """4 rows naming 2 URLs, 2 steps (2 epochs): one GET per URL, a log line per download and
    a summary; the cached files hold the served bytes. With --offline true a row naming a URL not in the cache is refused
    by file and line, while the cached URL of the row before it passes."""
    red, blue = server.url("/red_circle.png"), server.url("/blue_square.png")
    rows = write_jsonl(tmp_path / "rows.jsonl", [
        {"query": "<image>", "response": "a red circle", "rejected_response": ["<image>"], "images": [red, blue]},
        {"query": "<image>", "response": "a blue square", "images": [blue]},
        {"query": "<image>What shape?", "response": "a circle", "images": [red]},
        {"query": "a blue square", "response": "<image>", "images": [blue]},
    ])
    args = ["sft", "--model", tiny_model("qwen2_vl"), "--dataset", rows, "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "1", "--save_strategy", "no", "--report_to", "none"]
    env = {"MMEMBED_MEDIA_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    r = run_cli(args + ["--max_steps", "2", "--output_dir", str(tmp_path / "out")], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'epoch': '2'" in r.stdout + r.stderr  # the second step is the second epoch
    assert server.gets == {"/red_circle.png": 1, "/blue_square.png": 1}
    for url, path in ((red, "/red_circle.png"), (blue, "/blue_square.png")):
        assert open(remote.cache_path(url, str(cache)), "rb").read() == SERVED[path]
        assert r.stderr.count(f"downloaded {url}: {len(SERVED[path])} bytes in ") == 1, r.stderr[-3000:]
    assert "remote media: 2 URL(s) downloaded" in r.stderr

    green = server.url("/green_triangle.png")
    write_jsonl(rows, [{"query": "<image>", "response": "a red circle", "images": [red]},
                       {"query": "<image>", "response": "a green triangle", "images": [green]}])
    r = run_cli(args + ["--max_steps", "1", "--output_dir", str(tmp_path / "refused"), "--offline", "true"], env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    line = [t for t in r.stderr.splitlines() if t.startswith("mmembed sft: error:")]
    assert line and f"{rows}:2 field 'query images[0]'" in line[0] and repr(green) in line[0], r.stderr[-3000:]
    assert "offline (MMEMBED_OFFLINE=1)" in line[0] and str(cache) in line[0]
    assert server.gets == {"/red_circle.png": 1, "/blue_square.png": 1}


def test_strict_false_skips_and_lists_the_rows_whose_url_cannot_be_fetched(tiny_model, server, cache, tmp_path):
    red, blue, missing = server.url("/red_circle.png"), server.url("/blue_square.png"), server.url("/missing.png")
    rows = write_jsonl(tmp_path / "rows.jsonl", [
        {"query": "<image>", "response": "a red circle", "images": [red]},
        {"query": "<image>", "response": "nothing there", "images": [missing]},
        {"query": "a blue square", "response": "<image>", "images": [blue]},
    ])
    args = ["sft", "--model", tiny_model("qwen2_vl"), "--dataset", rows, "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--save_strategy", "no", "--report_to", "none", "--max_steps", "1"]
    env = {"MMEMBED_MEDIA_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    r = run_cli(args + ["--output_dir", str(tmp_path / "strict")], env=env)
    assert r.returncode == 1 and f"{rows}:2 field 'query images[0]'" in r.stderr, r.stderr[-3000:]
    r = run_cli(args + ["--output_dir", str(tmp_path / "lenient"), "--strict", "false"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train: skipped 1 row(s) whose media cannot be downloaded (--strict false):" in r.stderr, r.stderr[-3000:]
    assert f"  {rows}:2 field 'query images[0]': cannot download (HTTP 404" in r.stderr
    assert "'train_rows': 2" in open(tmp_path / "lenient" / "checkpoint-1" / "mmembed.json").read().replace('"', "'")


def test_data_loader_workers_share_the_cache(server, cache):
    """Two data-loader worker processes loading the same two URLs at once: one GET per URL
    (a lock per URL; the second process finds the first one's file)."""
    import torch

    urls = [server.url("/red_circle.png"), server.url("/blue_square.png")] * 4

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return len(urls)

        def __getitem__(self, i):
            return torch.from_numpy(np.asarray(load_image(urls[i])).copy())

    loader = torch.utils.data.DataLoader(Images(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    images = list(loader)
    assert server.gets == {"/red_circle.png": 1, "/blue_square.png": 1}
    assert all(im.equal(images[i % 2]) for i, im in enumerate(images))


def test_collator_steps_read_each_url_once(tiny_model, server, cache):
    """The training path without the up-front fetch (the collator, batch after batch): each
    URL is fetched at its first use only."""
    from transformers import AutoProcessor

    from mmembed.encoding.collator import EmbeddingCollator
    from mmembed.encoding.layout import Layout
    from mmembed.encoding.templates import get_template

    red, blue = server.url("/red_circle.png"), server.url("/blue_square.png")
    samples = [Sample(Item("<image>", images=[red]), [Item("a red circle")], [Item("<image>", images=[blue])],
                      source="rows.jsonl", line=n) for n in (1, 2)]
    collator = EmbeddingCollator(get_template("qwen2_gme"), AutoProcessor.from_pretrained(tiny_model("qwen2_vl")),
                                 Layout.GROUP)
    batches = [collator(samples[:1]), collator(samples[1:]), collator(samples)]  # three steps
    assert server.gets == {"/red_circle.png": 1, "/blue_square.png": 1}
    assert batches[0]["pixel_values"].equal(batches[1]["pixel_values"])


def test_images_audio_videos_and_frame_lists_are_fetched_once(server, cache):
    png, wav, mp4 = server.url("/red_circle.png"), server.url("/tone.wav"), server.url("/clip.mp4")
    frames = [server.url("/red_circle.png"), server.url("/blue_square.png")]
    for _ in range(3):
        assert np.array_equal(np.asarray(load_image(png)), np.asarray(load_image(os.path.join(MM, "red_circle.png"))))
        np.testing.assert_array_equal(load_audio(wav, 16000), load_audio(os.path.join(MM, "tone.wav"), 16000))
        assert load_video(mp4).frames.equal(load_video(os.path.join(MM, "clip.mp4")).frames)
        local = [os.path.join(MM, n) for n in ("red_circle.png", "blue_square.png")]
        assert load_video(frames).frames.equal(load_video(local).frames)
    assert server.gets == {p: 1 for p in ("/red_circle.png", "/tone.wav", "/clip.mp4", "/blue_square.png")}
    for path in ("/red_circle.png", "/tone.wav", "/clip.mp4", "/blue_square.png"):
        cached = remote.cache_path(server.url(path), str(cache))
        assert cached.endswith(os.path.splitext(path)[1]) and open(cached, "rb").read() == SERVED[path]


def test_prefetch_names_each_url_of_a_sample_and_counts_once(server, cache):
    red, blue = server.url("/red_circle.png"), server.url("/blue_square.png")
    sample = Sample(Item("<image>", images=[red]), [Item("<image><image>", images=["/tmp/x.png", blue])],
                    [Item("<audio>", audios=[red])], source="rows.jsonl", line=4)
    assert list(remote.sample_urls(sample)) == [
        (red, ("rows.jsonl", 4, "query images[0]")),
        (blue, ("rows.jsonl", 4, "response images[1]")),
        (red, ("rows.jsonl", 4, "rejected_response[0] audios[0]")),
    ]
    done = remote.prefetch(remote.sample_urls(sample))
    assert (done.downloaded, done.cached, done.bytes) == (2, 0, len(SERVED["/red_circle.png"]) + len(SERVED["/blue_square.png"]))
    again = remote.prefetch(remote.sample_urls(sample))
    assert (again.downloaded, again.cached, again.bytes) == (0, 2, 0)
    assert server.gets == {"/red_circle.png": 1, "/blue_square.png": 1}
    missing = server.url("/missing.png")
    with pytest.raises(MediaFileError) as e:
        remote.prefetch([(red, ("rows.jsonl", 1, "query images[0]")), (missing, ("rows.jsonl", 9, "response images[0]"))])
    expect_error(e, ("rows.jsonl", 9, "response images[0]"), missing, "HTTP 404")


def test_urls_are_redacted_in_logs_and_errors(server, cache, caplog):
    """A signed URL's query string and a URL's user:password never reach the log or an error
    message: they show as ***."""
    import logging

    signed = server.url("/red_circle.png") + "?X-Amz-Signature=SECRETSIG&token=SECRETTOK"
    with caplog.at_level(logging.INFO, logger="mmembed.encoding.remote"):
        remote.prefetch([(signed, WHERE)])
    assert f"downloaded {server.url('/red_circle.png')}?***: " in caplog.text, caplog.text
    assert "SECRET" not in caplog.text
    bad = server.url("/missing.png").replace("http://", "http://alice:hunter2@") + "?sig=SECRETSIG"
    for call in (lambda: remote.prefetch([(bad, WHERE)]), lambda: load_image(bad, where=WHERE)):
        with pytest.raises(MediaFileError) as e:
            call()
        text = str(e.value)
        assert "hunter2" not in text and "alice" not in text and "SECRETSIG" not in text, text
        assert "http://***@127.0.0.1:" in text and "/missing.png?***" in text, text
    assert remote.redact("https://u:p@h.example/a.png?s=1#f") == "https://***@h.example/a.png?***#***"
    assert remote.redact("https://h.example/a.png") == "https://h.example/a.png"


# ---------------------------------------------------------------------------- limits


def test_a_slow_server_times_out_naming_file_line_and_url(server, cache, monkeypatch):
    monkeypatch.setenv("MMEMBED_HTTP_TIMEOUT", "0.5")
    for path in ("/slow/red_circle.png", "/stall/red_circle.png"):  # no answer; half an answer, then silence
        url = server.url(path)
        start = time.monotonic()
        with pytest.raises(MediaFileError) as e:
            load_image(url, where=WHERE)
        assert time.monotonic() - start < SLOW - 1
        expect_error(e, WHERE, url, "no answer from the server within 0.5 s", "MMEMBED_HTTP_TIMEOUT")
    assert cached_files(cache) == []  # the stalled half was not kept, under any name


def test_the_size_limit_refuses_an_announced_size_and_stops_a_stream(server, cache, monkeypatch):
    url = server.url("/huge")
    with pytest.raises(MediaFileError) as e:
        load_image(url, where=WHERE)
    expect_error(e, WHERE, url, "announces 1,000,000,000,000 bytes", f"limit of {remote.MAX_BYTES:,} bytes",
                 "MMEMBED_MEDIA_MAX_BYTES")
    monkeypatch.setenv("MMEMBED_MEDIA_MAX_BYTES", "100000")
    url = server.url("/endless")
    with pytest.raises(MediaFileError) as e:
        load_video(url, where=WHERE)
    expect_error(e, WHERE, url, "cannot read video", "passed the limit of 100,000 bytes", "MMEMBED_MEDIA_MAX_BYTES")
    url = server.url("/clip.mp4")  # the announced length, over the limit: nothing is read
    monkeypatch.setenv("MMEMBED_MEDIA_MAX_BYTES", str(len(SERVED["/clip.mp4"]) - 1))
    with pytest.raises(MediaFileError) as e:
        load_video(url, where=WHERE)
    expect_error(e, WHERE, url, f"announces {len(SERVED['/clip.mp4']):,} bytes")
    assert cached_files(cache) == []
    monkeypatch.setenv("MMEMBED_MEDIA_MAX_BYTES", str(len(SERVED["/clip.mp4"])))  # exactly the limit is allowed
    load_video(url)
    assert cached_files(cache) == [os.path.basename(remote.cache_path(url))]


def test_a_connection_cut_short_keeps_nothing(server, cache):
    url = server.url("/cut/red_circle.png")
    with pytest.raises(MediaFileError) as e:
        load_image(url, where=WHERE)
    n = len(SERVED["/red_circle.png"])
    expect_error(e, WHERE, url, f"closed after {n // 2:,} of {n:,} bytes")
    assert cached_files(cache) == []


def test_a_killed_download_leaves_nothing_under_the_final_name(server, cache):
    """SIGKILL in the middle of a body: a partial file under its temporary name only; the next
    fetch downloads the whole file."""
    url = server.url("/stall-once/clip.mp4")
    code = f"from mmembed.encoding.remote import fetch; fetch({url!r})"
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not any(n.endswith(".part") for n in cached_files(cache)):
            assert proc.poll() is None and time.monotonic() < deadline, "the download never started"
            time.sleep(0.05)
        time.sleep(0.2)  # the first half arrives
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    final = remote.cache_path(url)
    assert not os.path.exists(final)
    assert [n for n in cached_files(cache) if n.endswith(".part")]  # the killed download's own name
    assert open(remote.fetch(url), "rb").read() == SERVED["/clip.mp4"]
    assert server.gets[url[url.index("/stall-once"):]] == 2


# ---------------------------------------------------------------------------- offline


@pytest.mark.parametrize("switch", ["MMEMBED_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_refuses_an_uncached_url_and_reads_a_cached_one(server, cache, monkeypatch, switch):
    cached, fresh = server.url("/red_circle.png"), server.url("/blue_square.png")
    want = np.asarray(load_image(cached))  # online: fetched into the cache
    monkeypatch.setenv(switch, "1")
    assert np.array_equal(np.asarray(load_image(cached)), want)
    with pytest.raises(MediaFileError) as e:
        load_image(fresh, where=WHERE)
    expect_error(e, WHERE, fresh, f"offline ({switch}=1)", "not in the media cache", str(cache))
    data = "data:image/png;base64," + base64.b64encode(SERVED["/blue_square.png"]).decode()
    assert load_image(data).size == load_image(os.path.join(MM, "blue_square.png")).size  # no network: allowed
    assert server.gets == {"/red_circle.png": 1}


def test_a_fetch_follows_the_settings_it_is_given_not_the_environment(server, cache, monkeypatch, tmp_path):
    """Settings parsed once (a command's, handed to its builders and workers) decide: offline
    ones refuse an uncached URL while the environment is online, online ones fetch while
    the environment says offline, their size limit and cache folder are the ones used."""
    url, other = server.url("/red_circle.png"), server.url("/blue_square.png")
    offline = remote.DownloadSettings(offline="MMEMBED_OFFLINE=1", cache=str(cache))
    with pytest.raises(MediaFileError) as e:
        load_image(url, where=WHERE, downloads=offline)
    expect_error(e, WHERE, url, "offline (MMEMBED_OFFLINE=1)", "not in the media cache", str(cache))
    monkeypatch.setenv("MMEMBED_OFFLINE", "1")
    online = remote.DownloadSettings(cache=str(cache))
    assert open(remote.fetch(url, online), "rb").read() == SERVED["/red_circle.png"]
    assert load_image(url, downloads=offline).size == load_image(os.path.join(MM, "red_circle.png")).size  # cached
    small = remote.DownloadSettings(max_bytes=100, cache=str(cache))
    with pytest.raises(MediaFileError) as e:
        load_image(other, where=WHERE, downloads=small)
    expect_error(e, WHERE, other, "limit of 100 bytes")
    elsewhere = remote.DownloadSettings(cache=str(tmp_path / "other-cache"))
    assert remote.fetch(other, elsewhere) == remote.cache_path(other, str(tmp_path / "other-cache"))
    assert cached_files(tmp_path / "other-cache") == [os.path.basename(remote.cache_path(other))]
    assert server.gets == {"/red_circle.png": 1, "/blue_square.png": 2}  # blue: cut off by the limit, then fetched


def test_embed_caches_and_its_offline_flag(tiny_model, server, cache, tmp_path):
    """mmembed embed fetches a URL once; with --offline true it reads that URL from the cache
    and refuses one not in it, by file and line."""
    url, green = server.url("/red_circle.png"), server.url("/green_triangle.png")
    rows = write_jsonl(tmp_path / "in.jsonl", [{"query": "a red circle"}, {"query": "<image>", "images": [url]}])
    env = {"MMEMBED_MEDIA_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    args = ["embed", "--model", tiny_model("qwen2_vl"), "--input", rows, "--output", str(tmp_path / "e.npy")]
    r = run_cli(args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "remote media: 1 URL(s) downloaded" in r.stderr
    write_jsonl(rows, [{"query": "<image>", "images": [url]}, {"query": "<image>", "images": [green]}])
    r = run_cli(args + ["--offline", "true"], env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"{rows}:2 field 'images[0]'" in r.stderr and repr(green) in r.stderr and "offline" in r.stderr, r.stderr
    assert f"{rows}:1" not in r.stderr  # the cached URL of line 1 was read offline
    assert server.gets == {"/red_circle.png": 1}
