"""Every environment variable mmembed reads, read in one place.

:func:`read` takes a snapshot of the variables below from a mapping (``os.environ`` by
default) into an :class:`Environment`; its sections are frozen dataclasses, each parsed the
first time it is asked for, so a malformed variable is an error when (and only when) the code
that uses it asks: a bad ``FPS`` stops ``mmembed embed``, a bad ``INFONCE_TEMPERATURE`` does
not. A command reads the environment once where it starts (:mod:`mmembed.tools.cli`,
:func:`mmembed.training.sft.run_sft`) and passes the sections down; a library function called
on its own (``MediaSettings.from_env()``, ``InfoNCEConfig.from_env()``, ``load_samples``)
calls :func:`read` itself. No other module of the package reads ``os.environ``
(tests/test_environment.py holds it), and what the package writes there, for its own process
or its children, goes through :func:`export` and :func:`for_children`.

================================  =============  ==========================================================
variable                          section        meaning
================================  =============  ==========================================================
``RANK``, ``LOCAL_RANK``          launch         this process's place (torchrun's); ``LOCAL_RANK`` set: started by a launcher
``WORLD_SIZE``                    launch         processes of the run (default 1): the default gradient accumulation
``LOCAL_WORLD_SIZE``              launch         processes on this node (default 1): the default data-loader workers
``NPROC_PER_NODE``, ``NNODES``    launch         ms-swift's launch habit: more than 1 re-runs ``mmembed sft`` under torchrun
``NODE_RANK``                     launch         this node's rank, ``0 .. NNODES-1`` (default 0)
``MASTER_ADDR``, ``MASTER_PORT``  launch         the rendezvous (default ``127.0.0.1:29500``)
``MMEMBED_WORKER_STDERR``         launch         set by ``NPROC_PER_NODE``'s relaunch: where each process writes its stderr (the user's)
``MAX_PIXELS``, ``MIN_PIXELS``    media          pixels of an image (qwen-vl-utils' budgets; :mod:`mmembed.encoding.media`)
``VIDEO_MAX_PIXELS``              media          pixels of a video frame, at most
``VIDEO_MIN_PIXELS``              media          pixels of a video frame, at least
``VIDEO_TOTAL_PIXELS``            media          pixels of a whole video
``FPS``                           media          frames sampled per second of video
``FPS_MIN_FRAMES``                media          frames of a video, at least
``FPS_MAX_FRAMES``                media          frames of a video, at most
``FORCE_QWENVL_VIDEO_READER``     media          ``decord`` or ``pyav`` (``av``, ``torchvision``: PyAV)
``MMEMBED_HTTP_TIMEOUT``          downloads      seconds to wait for a server (default 30; :mod:`mmembed.encoding.remote`)
``MMEMBED_MEDIA_MAX_BYTES``       downloads      the largest download (default 512 MiB)
``MMEMBED_OFFLINE``               downloads      true: no download, the media cache only
``HF_HUB_OFFLINE``                downloads      true: no download either (the Hugging Face switch)
``MMEMBED_MEDIA_CACHE``           downloads      the media cache folder
``XDG_CACHE_HOME``                downloads      its default's base (``~/.cache``): ``$XDG_CACHE_HOME/mmembed/media`` (and ``.../hub_datasets``)
``ROOT_IMAGE_DIR``                data           ms-swift's third place for relative media paths
``USE_HF``                        hub            true: hub ids (models, datasets) are Hugging Face's (ms-swift's switch, as ``--use_hf true``); else ModelScope's
``MMEMBED_HUB_CACHE``             hub            where a hub dataset's rows are written (default ``$XDG_CACHE_HOME/mmembed/hub_datasets``)
``INFONCE_*``                     infonce        the InfoNCE settings, as text (parsed by :class:`mmembed.losses.InfoNCEConfig`)
``MAX_POSITIVE_SAMPLES``          reranker       positives drawn per reranker row in training (default 1; ms-swift's)
``MAX_NEGATIVE_SAMPLES``          reranker       negatives drawn per drawn positive (default 7; ms-swift's)
``MMEMBED_DEBUG``                 debug          true: an error shows its traceback (``--debug true``)
``MMEMBED_TEST_KILL_AT``          test_hooks     test-only, ``POINT:N``: SIGKILL there (:mod:`mmembed.training.hooks`)
``MMEMBED_TEST_FULL_AT``          test_hooks     test-only, ``POINT:N``: every later write fails as on a full disk
``MMEMBED_TEST_PAUSE_AT``         test_hooks     test-only, ``POINT:N[,POINT:N...]``: pause there
``MMEMBED_TEST_PAUSE_FILE``       test_hooks     test-only: the file a pause creates and waits on
================================  =============  ==========================================================

The reranker variables (section ``reranker``, ms-swift's names, read as text):

========================================  ==========================================================================
variable                                  meaning
========================================  ==========================================================================
``LISTWISE_RERANKER_TEMPERATURE``         the listwise reranker loss's temperature (default 1.0; :mod:`mmembed.tasks.reranker.losses`)
``LISTWISE_RERANKER_MIN_GROUP_SIZE``      groups smaller than this give no listwise loss (default 2)
``GENERATIVE_RERANKER_POSITIVE_TOKEN``    a generative reranker's score is this token's logit ... (default ``yes``; :mod:`mmembed.tasks.reranker.model`)
``GENERATIVE_RERANKER_NEGATIVE_TOKEN``    ... minus this one's (default ``no``)
========================================  ==========================================================================

Numbers are errors naming the variable and its value (``environment variable FPS='x' is not
a number; use a number > 0``); a variable set to an empty string counts as unset.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .errors import UsageError, parse_bool

__all__ = [
    "VARIABLES", "DataPaths", "DownloadVariables", "Environment", "HubVariables", "InfoNCEVariables", "Launch", "MediaVariables",
    "RerankSampling", "RerankerVariables", "TestHooks", "env_number", "export", "for_children", "read",
]  # fmt: skip

#: every variable mmembed reads (``INFONCE_*``: any of that prefix), by section
VARIABLES: dict[str, tuple[str, ...]] = {
    "launch": ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE", "NNODES", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "MMEMBED_WORKER_STDERR"),
    "media": ("MAX_PIXELS", "MIN_PIXELS", "VIDEO_MAX_PIXELS", "VIDEO_MIN_PIXELS", "VIDEO_TOTAL_PIXELS", "FPS",
              "FPS_MIN_FRAMES", "FPS_MAX_FRAMES", "FORCE_QWENVL_VIDEO_READER"),
    "downloads": ("MMEMBED_HTTP_TIMEOUT", "MMEMBED_MEDIA_MAX_BYTES", "MMEMBED_OFFLINE", "HF_HUB_OFFLINE",
                  "MMEMBED_MEDIA_CACHE", "XDG_CACHE_HOME"),
    "data": ("ROOT_IMAGE_DIR",),
    "hub": ("USE_HF", "MMEMBED_HUB_CACHE", "XDG_CACHE_HOME"),
    "infonce": ("INFONCE_TEMPERATURE", "INFONCE_USE_BATCH", "INFONCE_HARD_NEGATIVES", "INFONCE_MASK_FAKE_NEGATIVE",
                "INFONCE_FAKE_NEG_MARGIN", "INFONCE_INCLUDE_QQ", "INFONCE_INCLUDE_DD"),
    "rerank_sampling": ("MAX_POSITIVE_SAMPLES", "MAX_NEGATIVE_SAMPLES"),
    "reranker": ("LISTWISE_RERANKER_TEMPERATURE", "LISTWISE_RERANKER_MIN_GROUP_SIZE",
                 "GENERATIVE_RERANKER_POSITIVE_TOKEN", "GENERATIVE_RERANKER_NEGATIVE_TOKEN"),
    "debug": ("MMEMBED_DEBUG",),
    "test_hooks": ("MMEMBED_TEST_KILL_AT", "MMEMBED_TEST_FULL_AT", "MMEMBED_TEST_PAUSE_AT", "MMEMBED_TEST_PAUSE_FILE",
                   "RANK"),
}
INFONCE_PREFIX = "INFONCE_"
_NAMES = frozenset(name for names in VARIABLES.values() for name in names)

# the download switches' words (MMEMBED_OFFLINE, HF_HUB_OFFLINE)
_SWITCH_TRUE = ("1", "true", "yes", "on")
_SWITCH_FALSE = ("0", "false", "no", "off", "")


def env_number(environ: Mapping[str, str], name: str, kind: type, positive: bool = False) -> Any:
    """The variable ``name`` as a number of ``kind`` (``int`` or ``float``), None when unset or
    blank; a ValueError naming it and its value unless it is a finite number ``>= 0`` (``> 0``
    when ``positive``)."""
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    allowed = "a number > 0" if positive else "a number >= 0"
    try:
        number = kind(float(value)) if kind is int else kind(value)
    except (ValueError, OverflowError):  # int(float("inf")) overflows
        raise ValueError(f"environment variable {name}={value!r} is not a number; use {allowed}") from None
    if number < 0 or (positive and number == 0) or (kind is float and not math.isfinite(number)):
        raise ValueError(f"environment variable {name}={value!r} must be {allowed}")
    return number


# ----------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class Launch:
    """The launch variables as text (None: unset); the properties parse them as their users
    always have."""

    rank: str | None = None
    local_rank: str | None = None
    world_size: str | None = None
    local_world_size: str | None = None
    nproc_per_node: str | None = None
    nnodes: str | None = None
    node_rank: str | None = None
    master_addr: str | None = None
    master_port: str | None = None
    mmembed_worker_stderr: str | None = None  # the user's stderr, for the processes torchrun starts

    @property
    def launched(self) -> bool:
        """Started by a launcher (torchrun sets ``LOCAL_RANK``): not to be relaunched."""
        return self.local_rank is not None

    @property
    def in_process_group(self) -> bool:
        """Any of ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` set: a launcher's process."""
        return any(v is not None for v in (self.rank, self.local_rank, self.world_size))

    @property
    def local_process(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``, else ``RANK``, else 0)."""
        return int(self.local_rank if self.local_rank is not None else self.rank if self.rank is not None else "0")

    @property
    def processes(self) -> int:
        """``WORLD_SIZE`` (default 1)."""
        return int(self.world_size if self.world_size is not None else "1")

    @property
    def local_processes(self) -> int:
        """``LOCAL_WORLD_SIZE`` (default 1; empty: 1)."""
        return int((self.local_world_size if self.local_world_size is not None else "1") or 1)

    @property
    def address(self) -> str:
        """``MASTER_ADDR`` (default ``127.0.0.1``)."""
        return self.master_addr if self.master_addr is not None else "127.0.0.1"

    def integer(self, name: str, default: int, low: int, high: int | None = None) -> int:
        """The launch variable ``name`` (``NPROC_PER_NODE``, ...) as an integer in ``[low,
        high]``, ``default`` when unset or blank, or a UsageError naming it."""
        raw = (getattr(self, name.lower()) or "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
            raise UsageError(f"{name}={raw!r} must be {allowed}")
        return value


@dataclass(frozen=True)
class MediaVariables:
    """ms-swift's / qwen-vl-utils' media variables as numbers (None: unset, the model's
    default applies; :class:`mmembed.encoding.media.MediaBudget` fills the defaults in)."""

    max_pixels: int | None = None
    min_pixels: int | None = None
    video_max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_total_pixels: int | None = None
    fps: float | None = None
    fps_min_frames: int | None = None
    fps_max_frames: int | None = None
    video_reader: str | None = None  # lower case; av / torchvision read as pyav; checked by MediaBudget

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> MediaVariables:
        """A ValueError names a malformed variable and its value."""
        reader = (env.get("FORCE_QWENVL_VIDEO_READER") or "").strip().lower() or None
        if reader in ("av", "torchvision"):  # torchvision's reader is PyAV underneath
            reader = "pyav"
        fps = env_number(env, "FPS", float, positive=True)
        min_frames = env_number(env, "FPS_MIN_FRAMES", int)
        max_frames = env_number(env, "FPS_MAX_FRAMES", int)
        if min_frames is not None and max_frames is not None and min_frames > max_frames:
            raise ValueError(f"FPS_MIN_FRAMES={min_frames} is above FPS_MAX_FRAMES={max_frames}; the minimum must not "
                             "exceed the maximum")
        return cls(
            max_pixels=env_number(env, "MAX_PIXELS", int, positive=True),
            min_pixels=env_number(env, "MIN_PIXELS", int),
            video_max_pixels=env_number(env, "VIDEO_MAX_PIXELS", int, positive=True),
            video_min_pixels=env_number(env, "VIDEO_MIN_PIXELS", int),
            video_total_pixels=env_number(env, "VIDEO_TOTAL_PIXELS", int, positive=True),
            fps=fps, fps_min_frames=min_frames, fps_max_frames=max_frames, video_reader=reader,
        )


def _cache_folder(env: Mapping[str, str], variable: str, name: str) -> str:
    """``variable``'s folder, else ``$XDG_CACHE_HOME/mmembed/NAME`` (``~/.cache/...``), absolute."""
    folder = env.get(variable, "").strip()
    if not folder:
        base = env.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
        folder = os.path.join(base, "mmembed", name)
    return os.path.abspath(os.path.expanduser(folder))


def media_cache_folder(env: Mapping[str, str]) -> str:
    """``MMEMBED_MEDIA_CACHE``, else ``$XDG_CACHE_HOME/mmembed/media`` (``~/.cache/...``), absolute."""
    return _cache_folder(env, "MMEMBED_MEDIA_CACHE", "media")


@dataclass(frozen=True)
class DownloadVariables:
    """The download variables (:mod:`mmembed.encoding.remote`): numbers None when unset, the
    offline switches as their text (checked to be a boolean), the cache folder resolved."""

    timeout: float | None = None
    max_bytes: int | None = None
    offline: str | None = None  # MMEMBED_OFFLINE
    hf_hub_offline: str | None = None  # HF_HUB_OFFLINE
    cache: str = field(default_factory=lambda: media_cache_folder({}))

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> DownloadVariables:
        """A ValueError names a malformed variable and its value (a switch too, which would
        otherwise be taken as off)."""
        timeout = env_number(env, "MMEMBED_HTTP_TIMEOUT", float, positive=True)
        limit = env_number(env, "MMEMBED_MEDIA_MAX_BYTES", int, positive=True)
        switches = []
        for name in ("MMEMBED_OFFLINE", "HF_HUB_OFFLINE"):
            value = env.get(name)
            if value is not None and value.strip().lower() not in _SWITCH_TRUE + _SWITCH_FALSE:
                raise ValueError(f"environment variable {name}={value!r} must be true or false (1/0, yes/no, on/off)")
            switches.append(value)
        return cls(timeout, limit, switches[0], switches[1], media_cache_folder(env))

    def offline_switches(self, offline: bool = False) -> str:
        """The switches that forbid downloads as messages name them (``"MMEMBED_OFFLINE=1 and
        HF_HUB_OFFLINE=1"``), empty when online; ``offline`` (a command's ``--offline true``)
        counts as ``MMEMBED_OFFLINE=1``."""
        switches = {"MMEMBED_OFFLINE": "1" if offline else self.offline, "HF_HUB_OFFLINE": self.hf_hub_offline}
        return " and ".join(f"{name}={value}" for name, value in switches.items()
                            if value is not None and value.strip().lower() in _SWITCH_TRUE)


@dataclass(frozen=True)
class DataPaths:
    """Where relative media paths are looked for besides the working directory and the data
    file's folder: ms-swift's ``ROOT_IMAGE_DIR`` ("" when unset)."""

    root_image_dir: str = ""


@dataclass(frozen=True)
class HubVariables:
    """ms-swift's hub switch and where hub datasets are written as rows (:mod:`mmembed.data.hub`):
    ``USE_HF`` (true: Hugging Face, else ModelScope, as ms-swift reads it) and the folder
    (:func:`hub_cache_folder`)."""

    use_hf: bool = False
    cache: str = field(default_factory=lambda: hub_cache_folder({}))

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> HubVariables:
        """A UsageError names a ``USE_HF`` that is not a boolean."""
        return cls(parse_bool("USE_HF", env.get("USE_HF", "")), hub_cache_folder(env))


def hub_cache_folder(env: Mapping[str, str]) -> str:
    """``MMEMBED_HUB_CACHE``, else ``$XDG_CACHE_HOME/mmembed/hub_datasets`` (``~/.cache/...``), absolute."""
    return _cache_folder(env, "MMEMBED_HUB_CACHE", "hub_datasets")


@dataclass(frozen=True)
class InfoNCEVariables:
    """Every ``INFONCE_*`` variable that is set, as text (known or not: preflight warns about
    the unknown ones). :class:`mmembed.losses.InfoNCEConfig` parses them."""

    values: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> str | None:
        return self.values.get(name)


@dataclass(frozen=True)
class RerankSampling:
    """How many candidates a reranker row gives a training batch (ms-swift's variables and
    defaults; :class:`mmembed.tasks.reranker.inputs.RerankCollator`): ``MAX_POSITIVE_SAMPLES``
    positives drawn per row, ``MAX_NEGATIVE_SAMPLES`` negatives drawn per drawn positive."""

    max_positive: int = 1
    max_negative: int = 7

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> RerankSampling:
        """A ValueError names a malformed variable and its value (a positive count must be > 0)."""
        positive = env_number(env, "MAX_POSITIVE_SAMPLES", int, positive=True)
        negative = env_number(env, "MAX_NEGATIVE_SAMPLES", int)
        for name, value in (("MAX_POSITIVE_SAMPLES", positive), ("MAX_NEGATIVE_SAMPLES", negative)):
            raw = env.get(name)
            if value is not None and float(raw) != value:
                raise ValueError(f"environment variable {name}={raw!r} must be a whole number")
        return cls(1 if positive is None else positive, 7 if negative is None else negative)


@dataclass(frozen=True)
class RerankerVariables:
    """ms-swift's reranker variables that are set, as text: ``LISTWISE_RERANKER_*`` parsed by
    :func:`mmembed.tasks.reranker.losses.build_rerank_loss`, ``GENERATIVE_RERANKER_*_TOKEN`` read by
    :func:`mmembed.tasks.reranker.model.load_reranker`."""

    values: dict[str, str] = field(default_factory=dict)

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.values.get(name, default)


@dataclass(frozen=True)
class TestHooks:
    """The test-only hooks of :mod:`mmembed.training.checkpoints`, as text (None: unset):
    read once when a run starts (:func:`mmembed.training.hooks.arm_test_hooks`)."""

    __test__ = False  # not a pytest class

    kill_at: str | None = None
    full_at: str | None = None
    pause_at: str | None = None
    pause_file: str | None = None
    rank: str | None = None  # under torchrun: one pause file per process

    def __bool__(self) -> bool:
        return bool(self.kill_at or self.full_at or self.pause_at)


# ----------------------------------------------------------------------------- the snapshot


@dataclass(frozen=True)
class Environment:
    """The variables mmembed reads, as they were when :func:`read` took them (``variables``:
    name -> text, only the names of :data:`VARIABLES` and ``INFONCE_*``). Each section is
    parsed on first use and kept."""

    variables: dict[str, str] = field(default_factory=dict)

    def get(self, name: str, default: str | None = None) -> str | None:
        """One variable's text (``default`` when unset)."""
        return self.variables.get(name, default)

    def with_values(self, **values: str) -> Environment:
        """A copy with ``values`` in the place of those variables (a command's flag that takes a
        variable's place: ``--max_pixels`` for ``MAX_PIXELS``)."""
        return Environment({**self.variables, **values})

    @cached_property
    def launch(self) -> Launch:
        return Launch(**{name.lower(): self.variables.get(name) for name in VARIABLES["launch"]})

    @cached_property
    def media(self) -> MediaVariables:
        """Raises ValueError naming a malformed variable."""
        return MediaVariables.parse(self.variables)

    @cached_property
    def downloads(self) -> DownloadVariables:
        """Raises ValueError naming a malformed variable."""
        return DownloadVariables.parse(self.variables)

    @cached_property
    def data(self) -> DataPaths:
        return DataPaths(self.variables.get("ROOT_IMAGE_DIR", ""))

    @cached_property
    def hub(self) -> HubVariables:
        """Raises UsageError naming a malformed ``USE_HF``."""
        return HubVariables.parse(self.variables)

    @cached_property
    def infonce(self) -> InfoNCEVariables:
        return InfoNCEVariables({k: v for k, v in self.variables.items() if k.startswith(INFONCE_PREFIX)})

    @cached_property
    def rerank_sampling(self) -> RerankSampling:
        """Raises ValueError naming a malformed variable."""
        return RerankSampling.parse(self.variables)

    @cached_property
    def reranker(self) -> RerankerVariables:
        return RerankerVariables({k: v for k, v in self.variables.items() if k in VARIABLES["reranker"]})

    @cached_property
    def debug(self) -> bool:
        """``MMEMBED_DEBUG``; a UsageError unless it is a boolean."""
        return parse_bool("MMEMBED_DEBUG", self.variables.get("MMEMBED_DEBUG", ""))

    @cached_property
    def test_hooks(self) -> TestHooks:
        v = self.variables
        return TestHooks(v.get("MMEMBED_TEST_KILL_AT"), v.get("MMEMBED_TEST_FULL_AT"), v.get("MMEMBED_TEST_PAUSE_AT"),
                         v.get("MMEMBED_TEST_PAUSE_FILE"), v.get("RANK"))


EnvironmentLike = Mapping[str, str] | Environment | None


def read(environ: EnvironmentLike = None) -> Environment:
    """The variables mmembed reads, from ``environ`` (``os.environ`` when None; an
    :class:`Environment` is returned as it is)."""
    if isinstance(environ, Environment):
        return environ
    env = os.environ if environ is None else environ
    return Environment({k: v for k, v in env.items() if k in _NAMES or k.startswith(INFONCE_PREFIX)})


# ----------------------------------------------------------------------------- writing


def export(values: Mapping[str, str], defaults: Mapping[str, str] | None = None) -> None:
    """Set variables in this process's environment, for the libraries that read them here
    (torch.distributed, DeepSpeed) and the children it starts: ``values`` always, ``defaults``
    where unset."""
    os.environ.update(values)
    for name, value in (defaults or {}).items():
        os.environ.setdefault(name, value)


def for_children(*, debug: bool = False, defaults: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a child process starts with (``mmembed sft`` relaunched under
    torchrun): this process's, ``defaults`` where unset, and ``MMEMBED_DEBUG=1`` when
    ``debug`` (``--debug true``), so the children show their tracebacks too."""
    env = dict(os.environ)
    for name, value in (defaults or {}).items():
        env.setdefault(name, value)
    if debug:
        env["MMEMBED_DEBUG"] = "1"
    return env
