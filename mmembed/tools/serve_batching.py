"""What ``mmembed serve``'s endpoints share: the refused-request error (OpenAI's error shape)
and the dynamic batcher (a queue drained by one worker thread that owns the model)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..data.sample import DataError

log = logging.getLogger("mmembed.serve")


class RequestError(Exception):
    """A request the server refuses: becomes ``{"error": {...}}`` with ``status``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """One request waiting in the queue."""

    items: list[Any]
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)


@dataclass
class Stats:
    requests: int = 0
    batches: int = 0  # model calls
    largest_batch: int = 0  # inputs in the largest one


class Batcher:
    """Runs queued jobs on one worker thread, several requests per model call.

    A subclass says what a call is: ``_check(items) -> tokens per item`` (a ``RequestError``
    fails that job only) and ``_encode(items) -> array`` (one row per item). ``check`` runs
    per job on the worker, so a bad input fails its own request only; the good jobs of the
    batch share one ``_encode``."""

    def __init__(self, max_batch_size: int, max_wait_ms: float, batching: bool):
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.batching = batching
        self.stats = Stats()
        self._queue: asyncio.Queue[Job] | None = None
        self._task: asyncio.Task | None = None
        # one thread owns the model and the tokenizer (fast tokenizers are not thread-safe)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mmembed-encode")

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def submit(self, items: list[Any]) -> tuple[Any, list[int]]:
        """``_encode``'s rows for ``items`` and each item's token count."""
        job = Job(items, asyncio.get_running_loop().create_future())
        await self._queue.put(job)
        return await job.future

    async def _collect(self) -> list[Job]:
        jobs = [await self._queue.get()]
        size = len(jobs[0].items)
        if not self.batching:
            return jobs
        deadline = asyncio.get_running_loop().time() + self.max_wait
        while size < self.max_batch_size:
            try:
                job = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self._queue.get(), left)
                except asyncio.TimeoutError:
                    break
            jobs.append(job)
            size += len(job.items)
        return jobs

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._collect()
            try:
                results = await loop.run_in_executor(self._worker, self._run, jobs)
            except Exception as e:  # noqa: BLE001 - the worker itself failed: every job learns why
                results = [e] * len(jobs)
            for job, result in zip(jobs, results):
                if job.future.done():  # the client went away
                    continue
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result((result, job.tokens))

    def _run(self, jobs: list[Job]) -> list[Any]:
        """On the worker: check each job, run the good ones together, scatter."""
        results: list[Any] = [None] * len(jobs)
        good = []
        for j, job in enumerate(jobs):
            try:
                job.tokens = self._check(job.items)
                good.append(j)
            except RequestError as e:
                results[j] = e
        if good:
            items = [it for j in good for it in jobs[j].items]
            try:
                out = self._encode(items)
            except Exception:  # noqa: BLE001 - find the job at fault: each alone
                for j in good:
                    try:
                        results[j] = self._encode(jobs[j].items)
                    except Exception as e:  # noqa: BLE001
                        results[j] = as_request_error(e)
            else:
                start = 0
                for j in good:
                    n = len(jobs[j].items)
                    results[j] = out[start : start + n]
                    start += n
        return results

    def _count(self, items: list[Any]) -> None:
        self.stats.batches += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(items))

    def _check(self, items: list[Any]) -> list[int]:
        raise NotImplementedError

    def _encode(self, items: list[Any]) -> Any:
        raise NotImplementedError


def as_request_error(e: Exception) -> RequestError:
    if isinstance(e, RequestError):
        return e
    if isinstance(e, (DataError, ValueError, OSError)):
        return RequestError(str(e), code="invalid_input")
    log.exception("the model call failed")
    return RequestError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")


def batching_app(batcher: Batcher, title: str, health: dict[str, Any]):
    """The FastAPI application both servers start from: ``batcher`` started and stopped with the
    app (``app.state.batcher``), a :class:`RequestError` answered as its JSON body and status,
    and ``GET /health``: ``{"status": "ok", **health}`` with the batcher's counts."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.batcher = batcher

    @app.exception_handler(RequestError)
    async def _refused(request: Request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def _health():
        s = batcher.stats
        return {"status": "ok", **health, "requests": s.requests, "batches": s.batches,
                "largest_batch": s.largest_batch}

    return app
