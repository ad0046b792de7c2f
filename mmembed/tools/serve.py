"""``mmembed serve``: an OpenAI-compatible embeddings server with dynamic batching.

    mmembed serve --model output/checkpoint-60 --port 8000 [--allowed_media_dir /data/images]

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.embeddings.create(model="checkpoint-60", input=["A man plays a flute."]).data[0].embedding

Endpoints: ``POST /v1/embeddings`` (OpenAI's request and response), ``GET /v1/models`` and
``GET /health``; a reranker folder is served at ``POST /v1/rerank`` instead
(:mod:`mmembed.tools.serve_rerank`). An input is a string, or for a multimodal model an object
``{"text": "...", "image": REF}`` (also ``images``/``video``/``videos``/``audio``/``audios``,
and ``system``); the text may hold ``<image>`` tags where the media go, else the media come
first. ``REF`` is a ``data:`` URI, or a path inside ``--allowed_media_dir`` (relative paths
resolve against it). The server fetches no URLs.

``input_type`` (``"query"`` or ``"document"``; the OpenAI client sends it as
``extra_body={"input_type": "query"}``) embeds the request's inputs as that side, with the
instruction the model was trained with for it (``Embedder.encode(..., input_type=...)``, what
sentence-transformers' ``encode_query`` / ``encode_document`` give on an export); without it
the inputs are embedded as they are.

Dynamic batching: requests wait in a queue; one worker thread takes the first, gathers more
for up to ``--max_wait_ms`` or until ``--max_batch_size`` inputs, checks each request alone
(token counts, media readable), embeds the good ones with one :meth:`Embedder.encode` call
and hands each request its rows. A bad request fails alone, with OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` and a 4xx status; the others in its
batch are served.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here
from transformers.hf_argparser import string_to_bool  # true/false as mmembed sft's flags take them

from ..data.paths import SCHEME_RE
from ..data.sample import MEDIA_KINDS, DataError, Item, json_type
from ..encoding.templates import SIDES
from ..errors import ArgumentParser, UsageError
from ..hub import add_hub_flags
from ..model.embedder import Embedder, as_item
from ..task import canonical_task
from .serve_batching import Batcher, RequestError, as_request_error, batching_app
from .serve_config import ServeConfig

log = logging.getLogger("mmembed.serve")

_PLURAL = {kind: kind + "s" for kind in MEDIA_KINDS}


# ---- requests -> items -------------------------------------------------------------------
def _media_ref(ref: Any, allowed_dir: str | None, param: str) -> str:
    """A media reference the server may read: a ``data:`` URI unchanged, or the real path of
    a file inside ``allowed_dir``. Checked before anything opens the file, so a refused path
    reveals nothing about what exists outside the folder."""
    if not isinstance(ref, str) or not ref:
        raise RequestError(f"a media reference must be a non-empty string, got {json_type(ref)}", param)
    scheme = SCHEME_RE.match(ref)
    scheme = scheme.group(1).lower() if scheme and len(scheme.group(1)) > 1 else None  # "C:" is a drive
    if scheme == "data":
        return ref
    if scheme in ("http", "https"):
        raise RequestError("the server fetches no URLs; send the media as a data: URI or a path in the allowed folder",
                           param, "url_not_allowed")
    if scheme == "file":
        from urllib.parse import unquote, urlparse

        ref = unquote(urlparse(ref).path)
    elif scheme is not None:
        raise RequestError(f"unsupported media reference scheme {scheme!r}; use a data: URI or a path", param)
    if allowed_dir is None:
        raise RequestError("media paths are refused: the server was started without --allowed_media_dir; "
                           "send a data: URI", param, "media_path_not_allowed", status=403, kind="permission_error")
    root = os.path.realpath(allowed_dir)
    path = os.path.realpath(os.path.join(root, os.path.expanduser(ref)))
    if os.path.commonpath([root, path]) != root:
        raise RequestError(f"media path {ref!r} is outside the allowed folder", param, "media_path_not_allowed",
                           status=403, kind="permission_error")
    return path


def request_row(raw: Any, index: int, allowed_dir: str | None, media_kinds: Sequence[str]) -> str | dict[str, Any]:
    """One entry of ``input``: a string, or an object with ``text`` and media references,
    turned into what :func:`~mmembed.model.embedder.as_item` reads (media paths checked).
    ``media_kinds``: the kinds the model takes."""
    param = f"input[{index}]"
    if isinstance(raw, str):
        return raw
    if isinstance(raw, (int, float)) or (isinstance(raw, list) and all(isinstance(t, int) for t in raw)):
        raise RequestError("token-id input is not accepted; send text", param, "unsupported_input")
    if not isinstance(raw, dict):
        raise RequestError(f"an input is a string or an object, got {json_type(raw)}", param)
    unknown = set(raw) - {"text", "system", *MEDIA_KINDS, *_PLURAL.values()}
    if unknown:
        raise RequestError(f"unknown field(s) {sorted(unknown)}; an input object takes text, system, "
                           "image(s), video(s), audio(s)", param)
    text = raw.get("text", "")
    if not isinstance(text, str):
        raise RequestError(f"'text' must be a string, got {json_type(text)}", f"{param}.text")
    row: dict[str, Any] = {}
    tags = ""
    for kind in MEDIA_KINDS:
        refs = raw.get(_PLURAL[kind], [])
        refs = [refs] if isinstance(refs, str) else refs
        if not isinstance(refs, list):
            raise RequestError(f"'{_PLURAL[kind]}' must be a list of references", f"{param}.{_PLURAL[kind]}")
        if kind in raw:
            refs = [raw[kind], *refs]
        if refs and kind not in media_kinds:
            taken = f"takes only {', '.join(sorted(media_kinds))}" if media_kinds else "is a text model"
            raise RequestError(f"this model {taken}; the input has {kind} references", f"{param}.{kind}",
                               "unsupported_input")
        if refs:
            row[_PLURAL[kind]] = [_media_ref(r, allowed_dir, f"{param}.{kind}") for r in refs]
            tags += f"<{kind}>" * len(refs)
    if not row and not text:
        raise RequestError("the input is empty", param)
    # text with its own tags places the media; otherwise they come before the text
    row["query"] = text if any(f"<{k}>" in text for k in MEDIA_KINDS) else tags + text
    if raw.get("system") is not None:
        row["system"] = raw["system"]
    return row


def parse_request(body: Any, config: ServeConfig, model_name: str,
                  media_kinds: Sequence[str] = ()) -> tuple[list[Item], str, int | None]:
    """The checked request: its items, ``encoding_format`` and ``dimensions``."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {json_type(body)}")
    if body.get("model") != model_name:
        raise RequestError(f"the model {body.get('model')!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found", status=404)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError(f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise RequestError(f"dimensions must be a positive integer, got {dims!r}", "dimensions")
    raw = body.get("input")
    if raw is None:
        raise RequestError("'input' is required", "input")
    if isinstance(raw, str) or isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise RequestError(f"'input' must be a string or an array, got {json_type(raw)}", "input")
    if not raw:
        raise RequestError("'input' is empty", "input")
    if all(isinstance(t, int) for t in raw):  # one token-id array
        raise RequestError("token-id input is not accepted; send text", "input", "unsupported_input")
    if len(raw) > config.max_inputs:
        raise RequestError(f"{len(raw)} inputs in one request; at most {config.max_inputs}", "input",
                           "too_many_inputs")
    items = []
    for i, entry in enumerate(raw):
        row = request_row(entry, i, config.allowed_media_dir, media_kinds)
        if isinstance(row, str) and not row:
            raise RequestError("the input is an empty string", f"input[{i}]")
        try:
            items.append(as_item(row, source="input", line=i, base_dir=config.allowed_media_dir))
        except DataError as e:
            raise RequestError(str(e), f"input[{i}]", "invalid_input") from None
    return items, fmt, dims


def request_input_type(body: dict[str, Any]) -> str | None:
    """The request's ``input_type``: ``query``, ``document`` or ``None`` (absent)."""
    value = body.get("input_type")
    if value is not None and value not in SIDES:
        raise RequestError(f"input_type must be one of {', '.join(map(repr, SIDES))}, got {value!r}", "input_type")
    return value


# ---- batching ----------------------------------------------------------------------------
class BatchingEmbedder(Batcher):
    """Embeds queued jobs on one worker thread, several requests per ``encode`` call
    (:class:`~mmembed.tools.serve_batching.Batcher`): a job's items are checked alone (token
    counts, media readable), the good jobs of a batch share one :meth:`Embedder.encode`."""

    def __init__(self, embedder: Embedder, max_batch_size: int, max_wait_ms: float, batching: bool,
                 encode_batch_size: int):
        super().__init__(max_batch_size, max_wait_ms, batching)
        self.embedder = embedder
        self.encode_batch_size = encode_batch_size

    async def embed(self, items: list[Item]) -> tuple[np.ndarray, list[int]]:
        """``[len(items), D]`` embeddings and each input's token count."""
        return await self.submit(items)

    def _encode(self, items: list[Item]) -> np.ndarray:
        emb = self.embedder.encode(items, batch_size=self.encode_batch_size)
        self._count(items)
        return emb

    def _check(self, items: list[Item]) -> list[int]:
        """Tokens per input as the model sees them (media expanded); an input over the
        model's limit, or with media that cannot be read, is a ``RequestError``."""
        builder = self.embedder.builder
        try:
            lengths = builder.lengths(items, [("input", i, "") for i in range(len(items))])
        except Exception as e:  # noqa: BLE001 - unreadable media and the like
            raise as_request_error(e) from None
        limit = self.embedder.max_length
        for i, n in enumerate(lengths):
            if limit and n > limit:
                raise RequestError(f"input[{i}] has {n} tokens; this model's maximum is {limit}", f"input[{i}]",
                                   "context_length_exceeded")
        return lengths


# ---- the app -----------------------------------------------------------------------------
def encode_vector(vector: np.ndarray, fmt: str) -> list[float] | str:
    """One embedding as OpenAI returns it: floats, or the base64 of its little-endian float32 bytes."""
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


def shorten(emb: np.ndarray, dims: int | None) -> np.ndarray:
    """``dimensions``: the first ``dims`` components, L2-normalized again (Matryoshka style)."""
    if dims is None:
        return emb
    if dims > emb.shape[1]:
        raise RequestError(f"dimensions {dims} is more than the model's {emb.shape[1]}", "dimensions")
    cut = emb[:, :dims]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def create_app(embedder: Embedder, config: ServeConfig):
    """The FastAPI application serving ``embedder`` as ``config`` says."""
    from fastapi.responses import JSONResponse

    model_name = config.name()
    batcher = BatchingEmbedder(embedder, config.max_batch_size, config.max_wait_ms, config.batching,
                               config.encode_batch_size)
    app = batching_app(batcher, "mmembed", {"model": model_name})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "mmembed"}]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any undecodable body
            raise RequestError("the request body is not valid JSON") from None
        items, fmt, dims = parse_request(body, config, model_name, sorted(embedder.template.media))
        input_type = request_input_type(body)
        items = [embedder.as_input(it, input_type) for it in items]  # the side's instruction, if any
        batcher.stats.requests += 1
        emb, tokens = await batcher.embed(items)
        emb = shorten(emb, dims)
        total = int(sum(tokens))
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, fmt)} for i, v in enumerate(emb)],
            "model": model_name,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        })

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def rerank_refused():
        raise RequestError(f"{model_name!r} is an embedding model: it does not rerank; serve a reranker (a folder "
                           "trained with --task_type reranker or generative_reranker) for /v1/rerank", None,
                           "unsupported_endpoint")

    return app


def serve(config: ServeConfig, embedder: Embedder | None = None) -> None:
    """Load the model (unless given) and serve until interrupted: a reranker
    (the folder's task, :func:`~mmembed.task.task_of_folder`) at ``/v1/rerank``, else an embedding
    model at ``/v1/embeddings``."""
    import uvicorn

    from ..task import get_task, task_of_folder
    from .serve_rerank import create_rerank_app

    task = task_of_folder(config.model, config.task_type) if embedder is None else get_task("embedding")
    t0 = time.perf_counter()
    if task.scores_pairs:
        model = task.load_scorer(config.model, device=config.device, torch_dtype=config.torch_dtype)
        app, path = create_rerank_app(model, config), "rerank"
    else:
        if embedder is None:
            embedder = Embedder.from_pretrained(config.model, device=config.device, torch_dtype=config.torch_dtype)
        app, path = create_app(embedder, config), "embeddings"
    log.info("loaded %s in %.1f s", config.model, time.perf_counter() - t0)
    log.info("serving %r on http://%s:%d/v1/%s", config.name(), config.host, config.port, path)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")


def parse_serve_args(argv: Sequence[str]) -> ServeConfig:
    p = ArgumentParser(prog="mmembed serve", allow_abbrev=False,
                       description="OpenAI-compatible POST /v1/embeddings (a reranker: POST /v1/rerank) with dynamic "
                                   "batching.")
    p.add_argument("--model", required=True, help="checkpoint, exported folder or base model folder, or hub id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served_model_name", default=None,
                   help="the name requests must give (default: the folder name, or the hub id)")
    p.add_argument("--allowed_media_dir", default=None,
                   help="media paths must lie in this folder (relative ones resolve against it); without it, only "
                        "data: URIs are accepted")
    p.add_argument("--max_batch_size", type=int, default=64, help="inputs embedded together at most")
    p.add_argument("--max_wait_ms", type=float, default=2.0, help="how long a batch waits for more requests")
    p.add_argument("--batching", type=string_to_bool, default=True, help="false: one encode call per request")
    p.add_argument("--max_inputs", type=int, default=2048, help="inputs per request at most")
    p.add_argument("--batch_size", dest="encode_batch_size", type=int, default=32, help="Embedder.encode's batch size")
    p.add_argument("--device", default=None)
    p.add_argument("--torch_dtype", default=None)
    p.add_argument("--task_type", default=None,
                   help="what the model is, a --task_type (default: its mmembed.json, else a "
                        "*ForSequenceClassification is a reranker): a reranker answers POST /v1/rerank")
    add_hub_flags(p)
    a = p.parse_args(list(argv))
    config = ServeConfig(**vars(a))
    if config.task_type is not None:
        try:
            config.task_type = canonical_task(config.task_type)
        except UsageError as e:
            p.error(str(e))
    for name in ("max_batch_size", "max_inputs", "encode_batch_size"):
        if getattr(config, name) < 1:
            p.error(f"--{name} must be an integer >= 1, got {getattr(config, name)}")
    if not config.max_wait_ms >= 0 or config.max_wait_ms == float("inf"):
        p.error(f"--max_wait_ms must be a finite number >= 0, got {config.max_wait_ms}")
    if not 0 <= config.port <= 65535:
        p.error(f"--port must be an integer from 0 to 65535, got {config.port}")
    if config.allowed_media_dir is not None and not os.path.isdir(config.allowed_media_dir):
        p.error(f"--allowed_media_dir {config.allowed_media_dir!r} is not a folder")
    return config
