"""Remote media: an ``http(s)://`` URL is downloaded once into an on-disk cache and read from
there by every later step, epoch, data-loader worker, process and run.

The cache
---------
One file per URL, named by the SHA-256 of the URL (plus the URL's file extension, so decoders
that look at it see ``.mp4`` or ``.wav``), in ``$MMEMBED_MEDIA_CACHE``, by default
``$XDG_CACHE_HOME/mmembed/media`` (``~/.cache/mmembed/media``). It lives outside any
``--output_dir`` so that ``mmembed embed``, ``eval`` and later runs (into other folders, or
offline) find what an earlier run fetched, as the Hugging Face hub cache does for models. A
download is written under a temporary name in the same folder and renamed when complete, so
a killed or failed download never leaves a part under the final name; processes that want
the same URL at once take a lock on it, and the second finds the first one's file. Files are
never changed once written; delete the folder (or files in it) to fetch again.

Settings (parsed once)
----------------------
:class:`DownloadSettings` holds what a download reads from the environment, parsed once by
:meth:`DownloadSettings.from_env` where a command starts (``mmembed sft`` and ``mmembed embed``
build it with their ``--offline`` flag; the media loader and the data-loader workers are
handed it); a call given none parses the environment at that call:

* ``MMEMBED_HTTP_TIMEOUT`` (seconds, default 30): the longest wait for the server, to connect
  and for each piece of the answer; a server silent for longer fails the download.
* ``MMEMBED_MEDIA_MAX_BYTES`` (default 536870912, 512 MiB): a larger ``Content-Length`` is
  refused before anything is read, and a body that grows past it is cut off.
* Offline: ``MMEMBED_OFFLINE=1`` (or ``--offline true`` of ``mmembed sft`` and ``mmembed
  embed``) or ``HF_HUB_OFFLINE=1`` refuses every URL not already in the cache; a cached URL
  is read from the cache as usual. ``data:`` URIs are not network: always read.
* ``MMEMBED_MEDIA_CACHE``: the cache folder (above).

Every failure raises ``ValueError`` with the reason; the media loader adds the data file,
line, field and URL (:class:`~mmembed.data.paths.MediaFileError`). Each download is logged at
INFO (URL, bytes, seconds); :func:`prefetch` fetches the URLs of a whole data set up front and
logs one summary line.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

try:
    import fcntl
except ImportError:  # Windows: no lock between processes (a race costs a second download, never a broken file)
    fcntl = None

from ..data.sample import Origin, Sample
from ..environment import DownloadVariables, EnvironmentLike, media_cache_folder, read

__all__ = [
    "HTTP_TIMEOUT", "MAX_BYTES", "DownloadSettings", "Tally", "cache_dir", "cache_path", "fetch", "is_url", "prefetch",
    "redact", "sample_urls", "tally",
]  # fmt: skip

logger = logging.getLogger(__name__)

CACHE_ENV = "MMEMBED_MEDIA_CACHE"
TIMEOUT_ENV = "MMEMBED_HTTP_TIMEOUT"
MAX_BYTES_ENV = "MMEMBED_MEDIA_MAX_BYTES"
OFFLINE_ENV = "MMEMBED_OFFLINE"

#: Default seconds to wait for a server (to connect, and for each read) before a download fails.
HTTP_TIMEOUT = 30.0
#: Default largest download, in bytes (512 MiB: a long video, far above any image or clip).
MAX_BYTES = 512 * 2**20

_CHUNK = 1 << 16
_PREFETCH_THREADS = 8
_URL_RE = re.compile(r"(?i)^https?://")
_SUFFIX_RE = re.compile(r"\.[A-Za-z0-9]{1,8}$")


def is_url(ref: object) -> bool:
    return isinstance(ref, str) and bool(_URL_RE.match(ref.strip()))


def redact(url: str) -> str:
    """``url`` as logs and messages show it: a ``user:password@`` and the query string and
    fragment (where signed URLs carry their tokens) replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url.strip())
        host = parts.netloc.rpartition("@")[2]
    except ValueError:  # not parseable (a bad port, brackets): show the scheme and a mark only
        return url.split("://", 1)[0] + "://***"
    netloc = f"***@{host}" if "@" in parts.netloc else host
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "",
                       "***" if parts.fragment else ""))


# ----------------------------------------------------------------------------- settings


def cache_dir(environ: EnvironmentLike = None) -> str:
    """The folder of cached downloads (``MMEMBED_MEDIA_CACHE``, else ``~/.cache/mmembed/media``)
    as ``environ`` (default ``os.environ``) names it."""
    return media_cache_folder(read(environ).variables)


@dataclass(frozen=True)
class DownloadSettings:
    """How URLs are fetched: the variables of the module docstring, parsed once.

    Attributes:
        timeout: seconds to wait for the server (``MMEMBED_HTTP_TIMEOUT``).
        max_bytes: the largest download (``MMEMBED_MEDIA_MAX_BYTES``).
        offline: the switches that forbid downloads as messages name them (``"MMEMBED_OFFLINE=1"``,
            ``"MMEMBED_OFFLINE=1 and HF_HUB_OFFLINE=1"``); empty: online.
        cache: the folder of cached downloads (``MMEMBED_MEDIA_CACHE``).
    """

    timeout: float = HTTP_TIMEOUT
    max_bytes: int = MAX_BYTES
    offline: str = ""
    cache: str = field(default_factory=lambda: media_cache_folder({}))

    @classmethod
    def from_env(cls, environ: EnvironmentLike = None, *, offline: bool = False) -> DownloadSettings:
        """The settings ``environ`` (default ``os.environ``; a mapping or an
        :class:`~mmembed.environment.Environment`) asks for; ``offline`` (a command's
        ``--offline true``) switches downloads off as ``MMEMBED_OFFLINE=1`` does. A malformed
        variable is a ValueError naming it and its value (a switch too, which would otherwise be
        taken as off)."""
        return cls.from_variables(read(environ).downloads, offline=offline)

    @classmethod
    def from_variables(cls, downloads: DownloadVariables, *, offline: bool = False) -> DownloadSettings:
        """The settings of the parsed download variables (unset ones: the defaults above)."""
        return cls(HTTP_TIMEOUT if downloads.timeout is None else downloads.timeout,
                   MAX_BYTES if downloads.max_bytes is None else downloads.max_bytes,
                   downloads.offline_switches(offline), downloads.cache)


def redact_text(text: str, url: str) -> str:
    """``text`` (an error's message about ``url``) with ``url``'s password, user and query
    string replaced by ``***`` wherever they appear (an HTTP library may quote them)."""
    from urllib.parse import urlsplit

    text = text.replace(url.strip(), redact(url))
    try:
        parts = urlsplit(url.strip())
        secrets_ = [parts.netloc.rpartition("@")[0] if "@" in parts.netloc else "", parts.query, parts.fragment]
        secrets_ += [parts.password or "", parts.username or ""]
    except ValueError:
        return text
    for secret in sorted(filter(None, secrets_), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def cache_path(url: str, folder: str | None = None) -> str:
    """Where ``url``'s bytes are (or will be) cached: the SHA-256 of the URL, plus its extension."""
    url = url.strip()
    name = hashlib.sha256(url.encode("utf-8")).hexdigest()
    suffix = _SUFFIX_RE.search(urlparse(url).path)
    return os.path.join(folder or cache_dir(), name + (suffix.group(0).lower() if suffix else ""))


# ----------------------------------------------------------------------------- counts


@dataclass
class Tally:
    """What this process did with URLs: downloads (bytes, seconds) and URLs found cached."""

    downloaded: int = 0
    bytes: int = 0
    seconds: float = 0.0
    cached: int = 0

    def __sub__(self, other: Tally) -> Tally:
        return Tally(self.downloaded - other.downloaded, self.bytes - other.bytes, self.seconds - other.seconds,
                     self.cached - other.cached)

    def __bool__(self) -> bool:
        return bool(self.downloaded or self.cached)

    def summary(self, cache: str | None = None) -> str:
        """One line of the counts; ``cache``: the cache folder they name (default: the environment's)."""
        return (f"remote media: {self.downloaded} URL(s) downloaded ({self.bytes:,} bytes in {self.seconds:.2f} s), "
                f"{self.cached} found in the cache {cache or cache_dir()}")


_tally = Tally()
_seen: set[str] = set()  # cached URLs already counted by this process
_tally_lock = threading.Lock()


def tally() -> Tally:
    """A copy of this process's counts (subtract an earlier copy for the counts in between)."""
    with _tally_lock:
        return Tally(**vars(_tally))


def _count_cached(path: str) -> None:
    with _tally_lock:
        if path not in _seen:
            _seen.add(path)
            _tally.cached += 1


# ----------------------------------------------------------------------------- fetching


def fetch(url: str, settings: DownloadSettings | None = None) -> str:
    """The path of ``url``'s bytes in the cache, downloaded first when not there yet.

    ``settings``: the timeout, size limit, offline switch and cache folder (None: the
    environment's, parsed at this call). Raises ``ValueError`` with the reason (offline,
    timeout, size limit, HTTP status, ...).
    """
    return _fetch(url, DownloadSettings.from_env() if settings is None else settings)[0]


def _fetch(url: str, settings: DownloadSettings) -> tuple[str, bool]:
    """``(path, whether this call downloaded it)``."""
    url = url.strip()
    folder = settings.cache
    path = cache_path(url, folder)
    if os.path.isfile(path):
        _count_cached(path)
        return path, False
    if settings.offline:
        raise ValueError(f"offline ({settings.offline}) and the URL is not in the media cache {folder}; "
                         "fetch it once online (any mmembed command that reads it caches it), or unset the switch")
    try:
        os.makedirs(os.path.join(folder, ".locks"), exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the media cache {folder} ({e.strerror or e}); set {CACHE_ENV} to a "
                         "writable folder") from None
    with _locked(os.path.join(folder, ".locks", os.path.basename(path))):
        if os.path.isfile(path):  # another process (or thread) fetched it while this one waited
            _count_cached(path)
            return path, False
        _download(url, path, settings)
    with _tally_lock:
        _seen.add(path)
    return path, True


@contextlib.contextmanager
def _locked(lock_path: str) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _download(url: str, path: str, settings: DownloadSettings) -> None:
    """Stream ``url`` into a temporary file beside ``path``, then rename it to ``path``."""
    folder = os.path.dirname(path)
    # a name of this download alone, created with the permissions a plain open() gives (not mkstemp's 0600),
    # so a shared cache stays readable
    tmp = os.path.join(folder, f".{os.path.basename(path)}-{os.getpid()}-{secrets.token_hex(4)}.part")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise _write_error(folder, e) from None
    start = time.monotonic()
    try:
        with os.fdopen(fd, "wb") as out:
            size = _stream(url, out, settings.timeout, settings.max_bytes, folder)
            try:
                out.flush()
                os.fsync(out.fileno())
            except OSError as e:
                raise _write_error(folder, e) from None
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    seconds = time.monotonic() - start
    with _tally_lock:
        _tally.downloaded += 1
        _tally.bytes += size
        _tally.seconds += seconds
    logger.info("downloaded %s: %s bytes in %.2f s -> %s", redact(url), f"{size:,}", seconds, path)


def _write_error(folder: str, e: OSError) -> ValueError:
    return ValueError(f"cannot write to the media cache {folder} ({e.strerror or e}); nothing was kept")


def _stream(url: str, out, timeout: float, limit: int, folder: str) -> int:
    """Copy the body of ``url`` into ``out``; returns its size. Errors become ``ValueError``."""
    slow = (f"no answer from the server within {timeout:g} s ({TIMEOUT_ENV}, default {HTTP_TIMEOUT:g}); "
            "the download was abandoned")
    request = urllib.request.Request(url, headers={"User-Agent": "mmembed"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            announced = response.headers.get("Content-Length")
            announced = int(announced) if announced and announced.strip().isdigit() else None
            if announced is not None and announced > limit:
                raise ValueError(f"the server announces {announced:,} bytes, over the limit of {limit:,} bytes "
                                 f"({MAX_BYTES_ENV}); nothing was downloaded")
            size = 0
            while chunk := response.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise ValueError(f"the download passed the limit of {limit:,} bytes ({MAX_BYTES_ENV}) and was "
                                     "stopped; nothing was kept")
                try:
                    out.write(chunk)
                except OSError as e:
                    raise _write_error(folder, e) from None
            if announced is not None and size < announced:
                raise ValueError(f"the connection closed after {size:,} of {announced:,} bytes; nothing was kept")
            return size
    except urllib.error.HTTPError as e:
        raise ValueError(f"HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise ValueError(slow) from None
        raise ValueError(f"cannot fetch URL ({e.reason})") from None
    except TimeoutError:
        raise ValueError(slow) from None
    except (OSError, http.client.HTTPException) as e:
        raise ValueError(f"cannot fetch URL ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------- whole data sets


def sample_urls(sample: Sample) -> Iterator[tuple[str, Origin]]:
    """The URLs a sample's members refer to, each with the (file, line, field) naming it."""
    members = [("query", sample.anchor)]
    members += [("response" if k == 0 else f"response[{k}]", it) for k, it in enumerate(sample.positives)]
    members += [(f"rejected_response[{k}]", it) for k, it in enumerate(sample.negatives)]
    for name, item in members:
        for kind in ("images", "videos", "audios"):
            for j, ref in enumerate(getattr(item, kind)):
                for r in ref if isinstance(ref, (list, tuple)) else [ref]:  # a video may be a list of frames
                    if is_url(r):
                        yield r.strip(), (sample.source, sample.line, f"{name} {kind}[{j}]")


def prefetch(refs: Iterable[tuple[str, Origin]], threads: int = _PREFETCH_THREADS,
             failed: dict[str, str] | None = None, settings: DownloadSettings | None = None) -> Tally:
    """Fetch every URL of ``refs`` (``(url, where)`` pairs) into the cache before it is needed,
    a few at a time, with ``settings`` (None: the environment's), and log one summary line. The first URL (in ``refs``' order) that fails
    raises :class:`~mmembed.data.paths.MediaFileError` naming its file, line, field and the URL;
    given ``failed`` (a dict), every URL that fails is put there instead (URL -> reason, redacted).
    Returns the counts of this call."""
    from ..data.paths import MediaFileError

    settings = DownloadSettings.from_env() if settings is None else settings
    first: dict[str, Origin] = {}
    for url, where in refs:
        first.setdefault(url.strip(), where)
    if not first:
        return Tally()
    before = tally()
    downloaded = 0
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(first)))) as pool:
        futures = [(url, where, pool.submit(_fetch, url, settings)) for url, where in first.items()]
        for url, where, future in futures:
            try:
                downloaded += future.result()[1]
            except ValueError as e:
                if failed is not None:  # --strict false: the caller skips the rows naming it
                    failed[url] = redact_text(str(e), url)
                    continue
                pool.shutdown(wait=True, cancel_futures=True)
                source, line, fieldname = where
                raise MediaFileError(source, line, fieldname, redact_text(f"cannot download ({e}): {redact(url)!r}", url)) from None
    moved = tally() - before
    done = Tally(downloaded, moved.bytes, moved.seconds, len(first) - downloaded - len(failed or ()))
    logger.info("%s (%d distinct URL(s) in the data)", done.summary(settings.cache), len(first))
    return done
