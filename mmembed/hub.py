"""Models by hub id, resolved to local folders as ms-swift resolves them.

``--model ORG/NAME`` names a repository of ModelScope by default (ms-swift's default; the
optional ``modelscope`` package downloads it) and of Hugging Face with ``--use_hf true`` or
``USE_HF=1`` (``huggingface_hub.snapshot_download``). :func:`resolve_model` turns a flag's
value into a local folder once, where a command starts, so everything after it (the checks,
the loaders, the saved configuration) sees a folder:

- a local folder wins over an id of the same spelling (``~`` expanded; ms-swift's
  ``ORG/NAME:SUB`` is also looked for as the folder ``ORG/NAME/SUB``);
- ``ORG/NAME`` (or ``NAME``) that is no folder is downloaded into the client's own cache
  (``HF_HOME`` / ``HF_HUB_CACHE``, ``MODELSCOPE_CACHE``) and its snapshot folder returned;
  ``ORG/NAME:SUB`` downloads the repository's ``SUB/`` only and returns that folder;
- files of other formats (``*.onnx``, ``*.gguf``, ``*.h5``, ``*.pt``, ...) are skipped as
  ms-swift skips them (:data:`IGNORE_PATTERNS`);
- the offline switches (``HF_HUB_OFFLINE=1``, ``MMEMBED_OFFLINE=1``) read the caches only,
  for either hub (ModelScope has no switch of its own).

The clients do the downloading: their progress bars, their retries (huggingface_hub resumes a
file whose connection broke with a ranged request, and keeps the files already complete when
a run is stopped), their tokens (``HF_TOKEN`` or ``hf auth login``'s; ``MODELSCOPE_API_TOKEN``;
``--hub_token`` before either) and their endpoints (``HF_ENDPOINT``, ``MODELSCOPE_ENDPOINT``).
What a hub refuses (no such repository, a gated one, no network, offline with nothing cached)
is a :class:`~mmembed.errors.UsageError` of one line naming the flag, the id and what to do.

Several processes of one node download once: see
:func:`mmembed.training.hub_models.resolve_model_flags`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .environment import Environment
from .environment import read as read_environment
from .errors import UsageError, one_line, parse_bool

__all__ = ["IGNORE_PATTERNS", "HubOptions", "add_hub_flags", "is_hub_id", "local_folder", "modelscope_endpoint",
           "modelscope_not_found", "offline_switched", "resolve_model"]

#: the files of a model repository that are not downloaded (ms-swift's ``safe_snapshot_download``
#: list): archives, other formats' weights, ONNX exports
IGNORE_PATTERNS = ("*.zip", "*.gguf", "*.pth", "*.pt", "consolidated*", "onnx/*", "*.safetensors.md", "*.msgpack",
                   "*.onnx", "*.ot", "*.h5")

# ORG/NAME (or a bare NAME, as Hugging Face's oldest ids), optionally :SUBFOLDER (ms-swift's)
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)(?::(?P<sub>[\w.-]+(?:/[\w.-]+)*))?$")

INSTALL_MODELSCOPE = ("pip install 'mmembed[modelscope]' (or pip install modelscope), or pass --use_hf true (or "
                      "USE_HF=1) to download it from Hugging Face")


@dataclass(frozen=True)
class HubOptions:
    """Where and how hub ids are downloaded: ``use_hf`` (Hugging Face, else ModelScope),
    ``revision`` (``--model_revision``: a branch, tag or commit; None: the default branch),
    ``token`` (``--hub_token``; None: the client's own), ``offline`` (the caches only)."""

    use_hf: bool = False
    revision: str | None = None
    token: str | None = None
    offline: bool = False

    @property
    def hub(self) -> str:
        return "Hugging Face" if self.use_hf else "ModelScope"

    @classmethod
    def from_flags(cls, use_hf: bool | None = None, revision: str | None = None, token: str | None = None,
                   environment: Environment | None = None) -> HubOptions:
        """The options of a command: ``--use_hf true`` or ``USE_HF=1`` (either, as in ms-swift),
        ``--model_revision``, ``--hub_token`` and the offline switches of ``environment``
        (None: read now). A malformed variable is a UsageError naming it."""
        env = read_environment(environment)
        return cls(bool(use_hf) or env.hub.use_hf, revision or None, token or None, offline_switched(env))

    def for_flag(self, flag: str) -> HubOptions:
        """``--model_revision`` is ``--model``'s: the other model flags take the default branch."""
        return self if flag == "--model" else HubOptions(self.use_hf, None, self.token, self.offline)


def offline_switched(env: Environment) -> bool:
    """Whether ``env``'s offline switches (``HF_HUB_OFFLINE``, ``MMEMBED_OFFLINE``) forbid
    downloads, for either hub; a malformed switch is a UsageError naming it."""
    try:
        return bool(env.downloads.offline_switches())
    except ValueError as e:
        raise UsageError(str(e)) from None


def add_hub_flags(parser) -> None:
    """``--use_hf``, ``--model_revision`` and ``--hub_token`` (ms-swift's names) on a command's
    ``argparse`` parser: how its model flags that name hub ids are downloaded."""
    parser.add_argument("--use_hf", type=lambda v: parse_bool("--use_hf", v), nargs="?", const=True, default=False,
                        help="hub ids are Hugging Face's (as USE_HF=1); default: ModelScope's, as in ms-swift")
    parser.add_argument("--model_revision", default=None, help="--model's branch, tag or commit on the hub")
    parser.add_argument("--hub_token", default=None,
                        help="the hub's token (default: the client's own: HF_TOKEN or hf auth login's; "
                             "MODELSCOPE_API_TOKEN)")


def local_folder(spec: str) -> str | None:
    """The local folder ``spec`` names, None when there is none: the path itself (``~``
    expanded), or for ``ORG/NAME:SUB`` the folder ``ORG/NAME/SUB`` (ms-swift's rule)."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return path
    if ":" in spec:
        path = os.path.expanduser(spec.replace(":", "/", 1))
        if os.path.isdir(path):
            return path
    return None


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` is spelled as a hub id (``ORG/NAME``, ``NAME``, with an optional
    ``:SUBFOLDER``), i.e. not as a path (absolute, ``./``, ``~``, more than one ``/``)."""
    return bool(_ID.match(spec)) and not spec.startswith(".")


def resolve_model(spec: str, flag: str = "--model", options: HubOptions | None = None, *,
                  cached_only: bool = False) -> str:
    """The local folder of ``spec``, the value of ``flag``: :func:`local_folder` when there
    is one, else the snapshot of hub id ``spec`` downloaded by ``options``' hub (None:
    :meth:`HubOptions.from_flags` of the environment). ``cached_only``: from the cache,
    with no request (a process whose node's first process downloaded it).

    Raises:
        UsageError: ``spec`` is neither a folder nor a hub id, or the hub could not give it
            (one line naming ``flag``, ``spec`` and what to do)."""
    folder = local_folder(spec)
    if folder is not None:
        return folder
    if os.path.exists(os.path.expanduser(spec)):
        raise UsageError(f"{flag} {spec!r} is a file; pass a model folder or a hub id (ORG/NAME)")
    if not is_hub_id(spec):
        raise UsageError(f"{flag} {spec!r} is not a local folder (no such folder), nor a hub id (ORG/NAME)")
    options = options or HubOptions.from_flags()
    match = _ID.match(spec)
    repo_id, sub = match.group("repo"), match.group("sub")
    fetch = _from_hugging_face if options.use_hf else _from_modelscope
    root = fetch(repo_id, sub, f"{flag} {spec!r}", options, cached_only or options.offline)
    path = os.path.join(root, sub) if sub else root
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {spec!r}: {options.hub}'s {repo_id} has no folder {sub!r}")
    return path


def _from_hugging_face(repo_id: str, sub: str | None, named: str, options: HubOptions, cached_only: bool) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = "main" if options.revision in (None, "master") else options.revision  # ms-swift's mapping
    where = f"Hugging Face ({constants.ENDPOINT})"
    login = "log in (hf auth login, HF_TOKEN or --hub_token)"
    try:
        return snapshot_download(repo_id, revision=revision, token=options.token, ignore_patterns=list(IGNORE_PATTERNS),
                                 allow_patterns=[f"{sub}/*"] if sub else None, local_files_only=cached_only)
    except GatedRepoError:
        raise UsageError(f"{named} is a gated model of {where}: accept its conditions on its page, then {login}") \
            from None
    except RevisionNotFoundError:
        raise UsageError(f"{named}: --model_revision {revision} is not a branch, tag or commit of {repo_id} on "
                         f"{where}") from None
    except RepositoryNotFoundError:
        raise UsageError(f"{named} is no local folder and no model of {where}: check the id (without --use_hf / "
                         f"USE_HF, ids are ModelScope's); if it is private, {login}") from None
    except LocalEntryNotFoundError as e:
        cache = constants.HF_HUB_CACHE
        if cached_only or constants.HF_HUB_OFFLINE:
            raise UsageError(f"{named} is not in the Hugging Face cache ({cache}) and the offline switches "
                             "(HF_HUB_OFFLINE / MMEMBED_OFFLINE) allow no download: download it once online, or pass "
                             "its folder") from None
        cause = one_line(e.__cause__ or e).split(" An error happened")[0][:200]
        raise UsageError(f"{named}: {where} could not be reached ({cause}) and it is not in the cache ({cache}): check "
                         "the network (HF_ENDPOINT for a mirror), or pass the model's folder") from None
    except HfHubHTTPError as e:
        raise UsageError(f"{named}: {where} answered {one_line(e)[:300]}") from None


def _from_modelscope(repo_id: str, sub: str | None, named: str, options: HubOptions, cached_only: bool) -> str:
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise UsageError(f"{named} is no local folder; downloading it from ModelScope (ms-swift's default hub) needs "
                         f"the modelscope package: {INSTALL_MODELSCOPE}") from None
    revision = "master" if options.revision in (None, "main") else options.revision  # ms-swift's mapping
    try:
        folder = snapshot_download(repo_id, revision=revision, token=options.token,
                                   ignore_patterns=list(IGNORE_PATTERNS),
                                   allow_patterns=[f"{sub}/*"] if sub else None, local_files_only=cached_only)
    except Exception as e:  # noqa: BLE001 (modelscope's errors have no common base: reported in one line)
        what = one_line(e)[:300]
        if cached_only:
            raise UsageError(f"{named} is not in the ModelScope cache (MODELSCOPE_CACHE) and the offline switches "
                             f"(HF_HUB_OFFLINE / MMEMBED_OFFLINE) allow no download ({what}): download it once "
                             "online, or pass its folder") from None
        where = f"ModelScope ({modelscope_endpoint()})"
        if modelscope_not_found(e):
            raise UsageError(f"{named} is no local folder and no model of {where}: check the id (with --use_hf true / "
                             "USE_HF=1, ids are Hugging Face's); if it is private, pass --hub_token or set "
                             "MODELSCOPE_API_TOKEN") from None
        raise UsageError(f"{named} is no local folder, and {where} could not give it ({type(e).__name__}: {what}): "
                         "check the id and the network (MODELSCOPE_ENDPOINT for a mirror), or pass --use_hf true for "
                         "Hugging Face's") from None
    if not sub and not (os.path.isdir(folder) and os.listdir(folder)):
        # the hub answers a revision it does not have with an empty file list, and the client returns an empty folder
        raise UsageError(f"{named}: ModelScope ({modelscope_endpoint()}) has no files of {repo_id} to download at "
                         f"revision {revision} (a revision the model does not have lists none: --model_revision takes "
                         "a branch, tag or commit; ModelScope's default branch is master)")
    return folder


def modelscope_endpoint() -> str:
    """The address modelscope's client asks: ``MODELSCOPE_ENDPOINT`` (or ``MODELSCOPE_DOMAIN``),
    else its default, as its configuration read them."""
    try:
        from modelscope_hub.config import get_default_config
    except ImportError:  # a modelscope older than 1.38 (the extra asks for 1.40)
        return "MODELSCOPE_ENDPOINT, else https://modelscope.cn"
    return get_default_config().endpoint


def modelscope_not_found(error: BaseException | None) -> bool:
    """Whether modelscope's error is the hub's 404: no such model, or a private one the token
    does not open (the hub answers both alike). modelscope_hub raises ``NotExistError``, which
    modelscope's ``snapshot_download`` raises again as a ``requests`` ``HTTPError`` from it."""
    while error is not None:
        if type(error).__name__ == "NotExistError" or getattr(getattr(error, "response", None), "status_code", None) == 404:
            return True
        error = error.__cause__
    return False
