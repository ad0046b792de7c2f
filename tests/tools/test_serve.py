"""``mmembed serve`` over loopback with the real ``openai`` client: the vectors equal
``Embedder.encode``'s, concurrent requests are batched, and a bad request gets OpenAI's
error shape with a 4xx status while the server keeps serving."""

import asyncio
import base64
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest
import uvicorn
from conftest import DATA, REPO, free_port

from mmembed.model.embedder import Embedder, as_item

try:  # the HTTP client the openai package is built on: httpx2 in openai 3.x, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
from mmembed.tools.serve import ServeConfig, create_app

MM = os.path.join(DATA, "mm")
TEXTS = ["A man is playing a flute.", "Someone plays music.", "A cat sleeps on the sofa.", "Two dogs run.", "x"]


class ThreadServer:
    """uvicorn serving ``app`` on a free loopback port in a daemon thread."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kw)


@pytest.fixture(scope="module")
def minilm_embedder(minilm_path):
    return Embedder.from_pretrained(minilm_path, device="cpu")


@pytest.fixture(scope="module")
def text_server(minilm_embedder, minilm_path):
    config = ServeConfig(model=minilm_path, served_model_name="minilm", max_inputs=8, max_wait_ms=5)
    with ThreadServer(create_app(minilm_embedder, config)) as server:
        yield server


def test_vectors_equal_embedder_encode_in_both_encodings(text_server, minilm_embedder):
    client = _client(text_server.url)
    want = minilm_embedder.encode(TEXTS)
    got = client.embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, atol=1e-5)
    assert got.model == "minilm"
    # usage: the tokens the model sees ([CLS] text [SEP]), counted by the tokenizer itself
    tokens = sum(len(minilm_embedder.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    # base64: OpenAI's little-endian float32 bytes; the client hands back the raw string
    raw = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(vec, want[0], atol=1e-5)
    # dimensions: the first k components, normalized again
    short = client.embeddings.create(model="minilm", input=TEXTS[0], dimensions=64).data[0].embedding
    np.testing.assert_allclose(short, want[0, :64] / np.linalg.norm(want[0, :64]), atol=1e-5)


def test_health_and_models(text_server):
    health = httpx.get(text_server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "minilm"
    assert [m.id for m in _client(text_server.url).models.list().data] == ["minilm"]


def test_64_concurrent_clients_are_served_and_batched(text_server, minilm_embedder):
    texts = [f"sentence number {i} about {'music' if i % 2 else 'animals'}" for i in range(64)]
    want = minilm_embedder.encode(texts)
    before = httpx.get(text_server.url + "/health").json()

    async def main():
        client = openai.AsyncOpenAI(base_url=text_server.url + "/v1", api_key="unused", max_retries=0)
        start = asyncio.Event()

        async def one(i):
            await start.wait()
            return await client.embeddings.create(model="minilm", input=texts[i])

        tasks = [asyncio.create_task(one(i)) for i in range(64)]
        start.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    got = np.array([r.data[0].embedding for r in results])
    np.testing.assert_allclose(got, want, atol=1e-5)
    after = httpx.get(text_server.url + "/health").json()
    assert after["requests"] - before["requests"] == 64
    # concurrent requests share encode calls: fewer calls than requests, some with several inputs
    assert after["batches"] - before["batches"] < 64
    assert after["largest_batch"] > 1


BAD_TEXT_REQUESTS = {
    "wrong model name": ({"model": "gpt-4", "input": "hi"}, 404, "model"),
    "empty input list": ({"model": "minilm", "input": []}, 400, "input"),
    "empty string": ({"model": "minilm", "input": ""}, 400, "input[0]"),
    "too many inputs": ({"model": "minilm", "input": ["a"] * 9}, 400, "input"),
    "too long input": ({"model": "minilm", "input": ["ok", "word " * 600]}, 400, "input[1]"),
    "token ids": ({"model": "minilm", "input": [1, 2, 3]}, 400, "input"),
    "bad encoding_format": ({"model": "minilm", "input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    "too many dimensions": ({"model": "minilm", "input": "a", "dimensions": 4096}, 400, "dimensions"),
    "media for a text model": ({"model": "minilm", "input": [{"text": "a", "image": "x.png"}]}, 400, "input[0].image"),
    "input not a list": ({"model": "minilm", "input": 5}, 400, "input"),
}


@pytest.mark.parametrize("name", list(BAD_TEXT_REQUESTS))
def test_bad_text_request_gets_openai_error_and_server_keeps_serving(text_server, minilm_embedder, name):
    body, status, param = BAD_TEXT_REQUESTS[name]
    r = httpx.post(text_server.url + "/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    # the openai client raises its own typed error from the same response
    with pytest.raises(openai.APIStatusError) as info:
        _client(text_server.url).embeddings.create(**body)
    assert info.value.status_code == status
    ok = _client(text_server.url).embeddings.create(model="minilm", input="still serving")
    np.testing.assert_allclose(ok.data[0].embedding, minilm_embedder.encode(["still serving"])[0], atol=1e-5)


def test_bad_request_in_a_batch_fails_alone(text_server, minilm_embedder):
    """A too-long input queued together with good ones: only its request fails."""
    good = [f"good request {i}" for i in range(8)]

    async def main():
        client = openai.AsyncOpenAI(base_url=text_server.url + "/v1", api_key="unused", max_retries=0)
        calls = [client.embeddings.create(model="minilm", input=t) for t in good]
        calls.insert(3, client.embeddings.create(model="minilm", input="word " * 600))
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[3], openai.BadRequestError)
    assert results[3].body["code"] == "context_length_exceeded"
    got = np.array([r.data[0].embedding for i, r in enumerate(results) if i != 3])
    np.testing.assert_allclose(got, minilm_embedder.encode(good), atol=1e-5)


def test_not_json_body(text_server):
    r = httpx.post(text_server.url + "/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


# ---- multimodal: tiny Qwen2-VL -------------------------------------------------------------
@pytest.fixture(scope="module")
def vl(tiny_model, tmp_path_factory):
    """A tiny Qwen2-VL served with an allowed folder holding one good and one broken image."""
    allowed = tmp_path_factory.mktemp("allowed")
    shutil.copy(os.path.join(MM, "red_circle.png"), allowed / "red_circle.png")
    (allowed / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really an image" * 10)
    os.symlink(os.path.join(MM, "blue_square.png"), allowed / "link_out.png")  # points outside
    path = tiny_model("qwen2_vl")
    embedder = Embedder.from_pretrained(path, device="cpu")
    config = ServeConfig(model=path, allowed_media_dir=str(allowed))
    with ThreadServer(create_app(embedder, config)) as server:
        yield server, embedder, str(allowed), config.name()


def _data_uri(path: str) -> str:
    with open(path, "rb") as f:
        return "data:image/png;base64," + base64.b64encode(f.read()).decode()


def test_image_as_data_uri_and_allowed_path_equals_encode(vl):
    server, embedder, allowed, name = vl
    image = os.path.join(allowed, "red_circle.png")
    want = embedder.encode([{"query": "<image>", "images": [image]},
                            {"query": "<image>a red circle", "images": [image]}, "a red circle"])
    inputs = [{"image": _data_uri(image)}, {"image": "red_circle.png"}, {"image": image},
              {"text": "a red circle", "image": "red_circle.png"},
              {"text": "<image>a red circle", "images": ["file://" + image]}, "a red circle"]
    got = _client(server.url).embeddings.create(model=name, input=inputs)
    vec = np.array([d.embedding for d in got.data])
    np.testing.assert_allclose(vec[:3], np.repeat(want[:1], 3, axis=0), atol=1e-5)
    np.testing.assert_allclose(vec[3:5], np.repeat(want[1:2], 2, axis=0), atol=1e-5)
    np.testing.assert_allclose(vec[5], want[2], atol=1e-5)
    # usage counts the tokens the model sees, each image's expanded pad tokens included
    rows = [{"query": "<image>", "images": [image]}, {"query": "<image>a red circle", "images": [image]}, "a red circle"]
    items = [as_item(r) for r in rows]
    n_image, n_both, n_text = embedder.builder.lengths(items)
    one_pad = len(embedder.tokenizer(embedder.template.render(items[0]), add_special_tokens=False)["input_ids"])
    assert n_image > one_pad  # the image's placeholder counts as the pad tokens it expands to
    assert got.usage.prompt_tokens == 3 * n_image + 2 * n_both + n_text


def test_bad_media_requests_get_4xx_and_server_keeps_serving(vl):
    server, embedder, allowed, name = vl
    outside = os.path.join(MM, "blue_square.png")  # exists, but not in the allowed folder
    bad = {
        "path outside the folder": ({"image": outside}, 403, "media_path_not_allowed"),
        "relative path escaping": ({"image": "../" + os.path.basename(allowed) + "/../x.png"}, 403,
                                   "media_path_not_allowed"),
        "symbolic link leading outside": ({"image": "link_out.png"}, 403, "media_path_not_allowed"),
        "unreadable image file": ({"image": "broken.png"}, 400, "invalid_input"),
        "unreadable data uri": ({"image": "data:image/png;base64," + base64.b64encode(b"garbage").decode()}, 400,
                                "invalid_input"),
        "missing file": ({"image": "nope.png"}, 400, "invalid_input"),
        "url": ({"image": "http://example.com/a.png"}, 400, "url_not_allowed"),
        "audio for a vision model": ({"audio": "x.wav"}, 400, "unsupported_input"),
        "tags and media disagree": ({"text": "<image><image>", "image": "red_circle.png"}, 400, "invalid_input"),
    }
    good = embedder.encode([{"query": "<image>", "images": [os.path.join(allowed, "red_circle.png")]}])[0]
    for what, (entry, status, code) in bad.items():
        r = httpx.post(server.url + "/v1/embeddings", json={"model": name, "input": [entry]}, timeout=60)
        assert r.status_code == status, (what, r.text)
        assert r.json()["error"]["code"] == code, (what, r.json())
        ok = _client(server.url).embeddings.create(model=name, input=[{"image": "red_circle.png"}])
        np.testing.assert_allclose(ok.data[0].embedding, good, atol=1e-5, err_msg=what)


def test_media_paths_refused_without_allowed_folder(vl):
    _, embedder, allowed, _ = vl
    config = ServeConfig(model="m")
    with ThreadServer(create_app(embedder, config)) as server:
        r = httpx.post(server.url + "/v1/embeddings",
                       json={"model": "m", "input": [{"image": os.path.join(allowed, "red_circle.png")}]})
        assert r.status_code == 403 and "--allowed_media_dir" in r.json()["error"]["message"]
        data = _data_uri(os.path.join(allowed, "red_circle.png"))
        assert len(_client(server.url).embeddings.create(model="m", input=[{"image": data}]).data) == 1


def _file_uri(path: str, mime: str) -> str:
    with open(path, "rb") as f:
        return f"data:{mime};base64," + base64.b64encode(f.read()).decode()


@pytest.mark.parametrize("kind,model,source,mime", [
    ("video", "qwen2_vl", "clip.mp4", "video/mp4"),
    ("audio", "qwen2_audio", "tone.wav", "audio/wav"),
], ids=["video", "audio"])  # .ci/floor deselects "audio"
def test_a_clip_as_data_uri_and_allowed_path_equals_encode(tiny_model, tmp_path, kind, model, source, mime):
    """A video (tiny Qwen2-VL) and an audio clip (tiny Qwen2-Audio), each as a data: URI and
    as a path in the allowed folder, alone and with text: the vectors Embedder.encode gives
    the same rows read from files."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    media = str(allowed / source)
    shutil.copy(os.path.join(MM, source), media)
    path = tiny_model(model)
    embedder = Embedder.from_pretrained(path, device="cpu")
    plural = kind + "s"
    want = embedder.encode([{"query": f"<{kind}>", plural: [media]},
                            {"query": f"<{kind}>what is this", plural: [media]}, "what is this"])
    inputs = [{kind: _file_uri(media, mime)}, {kind: source}, {plural: [media]},
              {"text": "what is this", kind: _file_uri(media, mime)}, {"text": f"<{kind}>what is this", plural: [source]},
              "what is this"]
    config = ServeConfig(model=path, allowed_media_dir=str(allowed))
    with ThreadServer(create_app(embedder, config)) as server:
        got = _client(server.url).embeddings.create(model=config.name(), input=inputs)
        vec = np.array([d.embedding for d in got.data])
        np.testing.assert_allclose(vec[:3], np.repeat(want[:1], 3, axis=0), atol=1e-5)
        np.testing.assert_allclose(vec[3:5], np.repeat(want[1:2], 2, axis=0), atol=1e-5)
        np.testing.assert_allclose(vec[5], want[2], atol=1e-5)
        assert not np.allclose(want[0], want[2], atol=1e-3)  # the medium counts: not the text's vector
        n_media, n_both, n_text = embedder.builder.lengths([as_item(r) for r in (
            {"query": f"<{kind}>", plural: [media]}, {"query": f"<{kind}>what is this", plural: [media]}, "what is this")])
        assert got.usage.prompt_tokens == 3 * n_media + 2 * n_both + n_text
        # a broken file of the kind is the request's error; the server keeps serving
        (allowed / ("broken" + os.path.splitext(source)[1])).write_bytes(b"not a media file" * 20)
        r = httpx.post(server.url + "/v1/embeddings", timeout=60,
                       json={"model": config.name(), "input": [{kind: "broken" + os.path.splitext(source)[1]}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input", r.text
        ok = _client(server.url).embeddings.create(model=config.name(), input=[{kind: source}])
        np.testing.assert_allclose(ok.data[0].embedding, want[0], atol=1e-5)


# ---- the command line --------------------------------------------------------------------
def test_mmembed_serve_command(minilm_path, minilm_embedder):
    """``mmembed serve`` as a user starts it: default model name (the folder's), /health, one request."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mmembed.tools.cli", "serve", "--model", minilm_path,
                             "--port", str(port)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "mmembed serve did not come up"
            time.sleep(0.2)
        name = os.path.basename(os.path.normpath(minilm_path))
        got = _client(url).embeddings.create(model=name, input=TEXTS[:2])
        np.testing.assert_allclose([d.embedding for d in got.data], minilm_embedder.encode(TEXTS[:2]), atol=1e-5)
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_flags_are_checked(tmp_path):
    from mmembed.errors import UsageError
    from mmembed.tools.serve import parse_serve_args

    with pytest.raises(UsageError, match="--allowed_media_dir"):
        parse_serve_args(["--model", "m", "--allowed_media_dir", str(tmp_path / "missing")])
    with pytest.raises(UsageError, match="--max_batch_size must be an integer >= 1, got 0"):
        parse_serve_args(["--model", "m", "--max_batch_size", "0"])
    config = parse_serve_args(["--model", "/x/ckpt/", "--batching", "false", "--port", "9"])
    assert (config.name(), config.batching, config.port) == ("ckpt", False, 9)
