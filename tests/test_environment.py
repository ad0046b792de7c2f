"""mmembed.environment: the one module that reads the environment, and what it reads."""

import ast
import os
import pickle
import re

import pytest
from conftest import REPO

from mmembed import environment
from mmembed.environment import Environment, TestHooks, export, for_children, read
from mmembed.errors import UsageError

PACKAGE = os.path.join(REPO, "mmembed")
OWNER = os.path.join(PACKAGE, "environment.py")


def _reads(path):
    """``(line, what)`` for every read of the process environment in the file at ``path``:
    ``os.environ`` / ``os.environb`` / ``os.getenv`` (``os.putenv``, ``os.unsetenv`` too), the
    same names imported from ``os``, and ``environ.get(...)``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr in names:
                yield node.lineno, f"os.{node.attr}"
            elif node.value.id == "environ" and node.attr == "get":
                yield node.lineno, "environ.get"
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in names:
                    yield node.lineno, f"from os import {alias.name}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getenv":
            yield node.lineno, "getenv()"


def test_only_the_environment_module_reads_the_environment():
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != OWNER:
                found += [f"{os.path.relpath(path, REPO)}:{line}: {what}" for line, what in _reads(path)]
    assert not found, "read the environment through mmembed.environment:\n" + "\n".join(found)


def test_the_scan_finds_each_way_of_reading(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\nfrom os import getenv\na = os.environ['X']\nb = os.getenv('Y')\nc = environ.get('Z')\n")
    assert [what for _, what in _reads(str(path))] == ["from os import getenv", "os.environ", "os.getenv",
                                                       "environ.get"]
    assert list(_reads(OWNER))  # the module itself does read it


def test_every_variable_is_documented():
    doc = environment.__doc__
    for names in environment.VARIABLES.values():
        for name in names:
            assert f"``{name}``" in doc or (name.startswith("INFONCE_") and "``INFONCE_*``" in doc), name
    from mmembed.losses.config import ENV_VARS

    assert set(environment.VARIABLES["infonce"]) == set(ENV_VARS.values())


def test_read_takes_only_mmembeds_variables_and_the_given_mapping():
    env = read({"FPS": "3", "PATH": "/bin", "INFONCE_TEMPERATURE": "0.05", "INFONCE_TYPO": "1", "ROOT_IMAGE_DIR": "/r"})
    assert env.variables == {"FPS": "3", "INFONCE_TEMPERATURE": "0.05", "INFONCE_TYPO": "1", "ROOT_IMAGE_DIR": "/r"}
    assert read(env) is env
    assert env.get("FPS") == "3" and env.get("MAX_PIXELS") is None and env.get("MAX_PIXELS", "x") == "x"
    assert env.data.root_image_dir == "/r" and read({}).data.root_image_dir == ""
    assert env.infonce.values == {"INFONCE_TEMPERATURE": "0.05", "INFONCE_TYPO": "1"}
    assert env.with_values(FPS="4").media.fps == 4.0 and env.media.fps == 3.0  # a copy
    assert pickle.loads(pickle.dumps(env)).media.fps == 3.0


def test_read_defaults_to_the_process_environment(monkeypatch):
    monkeypatch.setenv("ROOT_IMAGE_DIR", "/images")
    monkeypatch.setenv("FPS", "7")
    env = read()
    assert env.data.root_image_dir == "/images" and env.media.fps == 7.0
    monkeypatch.setenv("FPS", "8")
    assert env.media.fps == 7.0  # a snapshot: read once
    assert read().media.fps == 8.0


def test_a_section_is_parsed_when_asked_for():
    """A malformed variable is an error for the code that uses it, not for every reader."""
    env = read({"FPS": "x", "MMEMBED_DEBUG": "maybe", "MMEMBED_HTTP_TIMEOUT": "0", "NPROC_PER_NODE": "abc",
                "ROOT_IMAGE_DIR": "/r"})
    assert env.data.root_image_dir == "/r"
    with pytest.raises(ValueError, match=r"^environment variable FPS='x' is not a number; use a number > 0$"):
        _ = env.media
    with pytest.raises(UsageError, match=r"^MMEMBED_DEBUG must be true or false \(or 1/0\), got 'maybe'$"):
        _ = env.debug
    with pytest.raises(ValueError, match=r"^environment variable MMEMBED_HTTP_TIMEOUT='0' must be a number > 0$"):
        _ = env.downloads
    with pytest.raises(UsageError, match=r"^NPROC_PER_NODE='abc' must be an integer >= 1$"):
        env.launch.integer("NPROC_PER_NODE", 1, 1)


# ---- media --------------------------------------------------------------------------------------


def test_media_variables():
    m = read({"MAX_PIXELS": "1003520", "MIN_PIXELS": "3136", "VIDEO_MAX_PIXELS": "50176", "VIDEO_MIN_PIXELS": "0",
              "VIDEO_TOTAL_PIXELS": "2e5", "FPS": "1.5", "FPS_MIN_FRAMES": "2", "FPS_MAX_FRAMES": "12",
              "FORCE_QWENVL_VIDEO_READER": " Decord "}).media
    assert (m.max_pixels, m.min_pixels, m.video_max_pixels, m.video_min_pixels, m.video_total_pixels) == \
        (1003520, 3136, 50176, 0, 200000)
    assert (m.fps, m.fps_min_frames, m.fps_max_frames, m.video_reader) == (1.5, 2, 12, "decord")
    empty = read({"MAX_PIXELS": "  ", "FORCE_QWENVL_VIDEO_READER": ""}).media
    assert empty == environment.MediaVariables()  # blank: unset
    for alias in ("av", "torchvision", "PyAV"):
        assert read({"FORCE_QWENVL_VIDEO_READER": alias}).media.video_reader == "pyav"
    assert read({"FORCE_QWENVL_VIDEO_READER": "opencv"}).media.video_reader == "opencv"  # MediaBudget refuses it


@pytest.mark.parametrize("env, message", [
    ({"MAX_PIXELS": "lots"}, "environment variable MAX_PIXELS='lots' is not a number; use a number > 0"),
    ({"MAX_PIXELS": "0"}, "environment variable MAX_PIXELS='0' must be a number > 0"),
    ({"MIN_PIXELS": "-1"}, "environment variable MIN_PIXELS='-1' must be a number >= 0"),
    ({"VIDEO_TOTAL_PIXELS": "inf"}, "environment variable VIDEO_TOTAL_PIXELS='inf' is not a number; use a number > 0"),
    ({"FPS": "nan"}, "environment variable FPS='nan' must be a number > 0"),
    ({"FPS_MIN_FRAMES": "x"}, "environment variable FPS_MIN_FRAMES='x' is not a number; use a number >= 0"),
    ({"FPS_MIN_FRAMES": "10", "FPS_MAX_FRAMES": "8"},
     "FPS_MIN_FRAMES=10 is above FPS_MAX_FRAMES=8; the minimum must not exceed the maximum"),
    ({"FPS": "x", "MAX_PIXELS": "y"}, "environment variable FPS='x'"),  # in the order they always were
])
def test_media_variables_refused(env, message):
    with pytest.raises(ValueError) as e:
        _ = read(env).media
    assert str(e.value).startswith(message), str(e.value)


def test_media_budget_and_settings_read_through_the_module(monkeypatch):
    from mmembed.encoding.media import MediaBudget, MediaSettings

    monkeypatch.setenv("FPS", "3")
    assert MediaBudget.from_env().fps == 3.0
    assert MediaBudget.from_env({"FPS": "4"}).fps == 4.0
    assert MediaBudget.from_env(read({"FPS": "5"})).fps == 5.0
    with pytest.raises(ValueError, match="unknown video reader 'opencv'"):
        MediaBudget.from_env({"FORCE_QWENVL_VIDEO_READER": "opencv"})
    env = read({"MAX_PIXELS": "lots", "MMEMBED_OFFLINE": "1"})
    settings = MediaSettings.from_env(env, max_pixels=50176)
    assert settings.budget.max_pixels == 50176 and settings.downloads.offline == "MMEMBED_OFFLINE=1"


# ---- downloads ----------------------------------------------------------------------------------


def test_download_variables(tmp_path):
    d = read({"MMEMBED_HTTP_TIMEOUT": "2.5", "MMEMBED_MEDIA_MAX_BYTES": "1e3", "MMEMBED_OFFLINE": "yes",
              "HF_HUB_OFFLINE": "0", "MMEMBED_MEDIA_CACHE": str(tmp_path / "c")}).downloads
    assert (d.timeout, d.max_bytes, d.offline, d.hf_hub_offline, d.cache) == (2.5, 1000, "yes", "0", str(tmp_path / "c"))
    assert d.offline_switches() == "MMEMBED_OFFLINE=yes"
    assert d.offline_switches(offline=True) == "MMEMBED_OFFLINE=1"
    both = read({"MMEMBED_OFFLINE": "on", "HF_HUB_OFFLINE": "TRUE"}).downloads
    assert both.offline_switches() == "MMEMBED_OFFLINE=on and HF_HUB_OFFLINE=TRUE"
    assert read({"HF_HUB_OFFLINE": "1"}).downloads.offline_switches() == "HF_HUB_OFFLINE=1"
    assert read({"MMEMBED_OFFLINE": "off", "HF_HUB_OFFLINE": ""}).downloads.offline_switches() == ""
    unset = read({}).downloads
    assert (unset.timeout, unset.max_bytes, unset.offline, unset.hf_hub_offline) == (None, None, None, None)


def test_the_media_cache_folder(tmp_path):
    assert read({"MMEMBED_MEDIA_CACHE": "~/m"}).downloads.cache == os.path.expanduser("~/m")
    assert read({"XDG_CACHE_HOME": str(tmp_path)}).downloads.cache == str(tmp_path / "mmembed" / "media")
    assert read({"MMEMBED_MEDIA_CACHE": " ", "XDG_CACHE_HOME": ""}).downloads.cache == \
        os.path.expanduser(os.path.join("~", ".cache", "mmembed", "media"))
    assert read({"MMEMBED_MEDIA_CACHE": "rel"}).downloads.cache == os.path.abspath("rel")


@pytest.mark.parametrize("env, message", [
    ({"MMEMBED_HTTP_TIMEOUT": "abc"}, "environment variable MMEMBED_HTTP_TIMEOUT='abc' is not a number; use a number > 0"),
    ({"MMEMBED_MEDIA_MAX_BYTES": "-5"}, "environment variable MMEMBED_MEDIA_MAX_BYTES='-5' must be a number > 0"),
    ({"MMEMBED_OFFLINE": "maybe"},
     "environment variable MMEMBED_OFFLINE='maybe' must be true or false (1/0, yes/no, on/off)"),
    ({"HF_HUB_OFFLINE": "sometimes"},
     "environment variable HF_HUB_OFFLINE='sometimes' must be true or false (1/0, yes/no, on/off)"),
])
def test_download_variables_refused(env, message):
    with pytest.raises(ValueError) as e:
        _ = read(env).downloads
    assert str(e.value) == message


# ---- launch -------------------------------------------------------------------------------------


def test_launch_variables():
    launch = read({}).launch
    assert (launch.launched, launch.in_process_group, launch.local_process, launch.processes,
            launch.local_processes, launch.address) == (False, False, 0, 1, 1, "127.0.0.1")
    launch = read({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "", "MASTER_ADDR": "10.0.0.1"}).launch
    assert (launch.launched, launch.in_process_group, launch.local_process, launch.processes,
            launch.local_processes, launch.address) == (False, True, 3, 4, 1, "10.0.0.1")
    launch = read({"RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).launch
    assert (launch.launched, launch.local_process, launch.local_processes) == (True, 1, 2)
    launch = read({"NPROC_PER_NODE": " 4 ", "NNODES": "", "NODE_RANK": "1", "MASTER_PORT": "1234"}).launch
    assert launch.integer("NPROC_PER_NODE", 1, 1) == 4 and launch.integer("NNODES", 1, 1) == 1
    assert launch.integer("NODE_RANK", 0, 0, 1) == 1 and launch.integer("MASTER_PORT", 29500, 1, 65535) == 1234


@pytest.mark.parametrize("env, args, message", [
    ({"NPROC_PER_NODE": "abc"}, ("NPROC_PER_NODE", 1, 1), "NPROC_PER_NODE='abc' must be an integer >= 1"),
    ({"NNODES": "0"}, ("NNODES", 1, 1), "NNODES='0' must be an integer >= 1"),
    ({"NODE_RANK": "5"}, ("NODE_RANK", 0, 0, 1), "NODE_RANK='5' must be an integer from 0 to 1"),
    ({"MASTER_PORT": "70000"}, ("MASTER_PORT", 29500, 1, 65535), "MASTER_PORT='70000' must be an integer from 1 to 65535"),
])
def test_launch_variables_refused(env, args, message):
    with pytest.raises(UsageError) as e:
        read(env).launch.integer(*args)
    assert str(e.value) == message


def test_malformed_ranks_fail_as_they_always_did():
    with pytest.raises(ValueError):
        _ = read({"WORLD_SIZE": "x"}).launch.processes
    with pytest.raises(ValueError):
        _ = read({"LOCAL_RANK": "x"}).launch.local_process


# ---- debug, InfoNCE, test hooks -----------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("yes", True), ("on", True), ("y", True),
                                             ("0", False), ("false", False), ("No", False), ("off", False),
                                             ("", False), (None, False)])
def test_debug(value, expected):
    assert read({} if value is None else {"MMEMBED_DEBUG": value}).debug is expected


def test_take_debug_reads_through_the_module(monkeypatch):
    from mmembed.tools.cli import take_debug

    monkeypatch.setenv("MMEMBED_DEBUG", "1")
    assert take_debug([]) == ([], True)
    assert take_debug([], False) == ([], False)
    assert take_debug(["--debug", "false"]) == ([], False)
    monkeypatch.setenv("MMEMBED_DEBUG", "maybe")
    with pytest.raises(UsageError, match="MMEMBED_DEBUG must be true or false"):
        take_debug([])


def test_infonce_reads_through_the_module(monkeypatch):
    from mmembed.losses import InfoNCEConfig
    from mmembed.losses.config import env_temperature

    monkeypatch.setenv("INFONCE_TEMPERATURE", "0.05")
    monkeypatch.setenv("INFONCE_USE_BATCH", "False")
    assert InfoNCEConfig.from_env() == InfoNCEConfig(temperature=0.05, use_batch=False)
    env = read({"INFONCE_HARD_NEGATIVES": "3"})
    assert InfoNCEConfig.from_env(env) == InfoNCEConfig.from_variables(env.infonce) == InfoNCEConfig(hard_negatives=3)
    assert env_temperature(0.01) == 0.05 and env_temperature(0.01, env) == 0.01
    with pytest.raises(ValueError, match=r"INFONCE_HARD_NEGATIVES='x' is not an integer"):
        InfoNCEConfig.from_env({"INFONCE_HARD_NEGATIVES": "x"})


def test_test_hooks():
    assert not read({}).test_hooks and read({}).test_hooks == TestHooks()
    hooks = read({"MMEMBED_TEST_PAUSE_AT": "train:step:3", "MMEMBED_TEST_PAUSE_FILE": "/tmp/f", "RANK": "1",
                  "MMEMBED_TEST_KILL_AT": "save:marked:1", "MMEMBED_TEST_FULL_AT": "save:renamed:2"}).test_hooks
    assert hooks == TestHooks("save:marked:1", "save:renamed:2", "train:step:3", "/tmp/f", "1") and hooks


def test_test_hooks_are_read_once_per_run(monkeypatch, tmp_path):
    """hooks.test_point follows the hooks the run was armed with, not the environment of the
    moment."""
    from mmembed.training import hooks as checkpoints

    flag = tmp_path / "pause"
    monkeypatch.setenv("MMEMBED_TEST_PAUSE_AT", "x:1")
    monkeypatch.setenv("MMEMBED_TEST_PAUSE_FILE", str(flag))
    try:
        checkpoints.arm_test_hooks(TestHooks())
        checkpoints.test_point("x")  # not armed with it: no pause (it would wait for the file's removal)
        assert not flag.exists()
        checkpoints.arm_test_hooks(TestHooks(pause_at="y:2", pause_file=str(flag), rank="3"))
        monkeypatch.setattr(checkpoints.time, "monotonic", iter([0.0, 1e9]).__next__)  # no waiting
        checkpoints.test_point("y")
        assert not (tmp_path / "pause.rank3").exists()
        checkpoints.test_point("y")
        assert (tmp_path / "pause.rank3").read_text().startswith("y ")
    finally:
        checkpoints.arm_test_hooks(TestHooks())


# ---- writing ------------------------------------------------------------------------------------


def test_for_children(monkeypatch):
    monkeypatch.setenv("SOME_VARIABLE", "a")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")
    monkeypatch.delenv("MMEMBED_DEBUG", raising=False)
    env = for_children(defaults={"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGUSR1", "OTHER": "b"})
    assert env["SOME_VARIABLE"] == "a" and env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM" and env["OTHER"] == "b"
    assert "MMEMBED_DEBUG" not in env and "OTHER" not in os.environ
    assert for_children(debug=True)["MMEMBED_DEBUG"] == "1" and "MMEMBED_DEBUG" not in os.environ


def test_export(monkeypatch):
    for name in ("MMEMBED_X_ONE", "MMEMBED_X_TWO"):
        monkeypatch.setenv(name, "")  # so that monkeypatch removes them afterwards
        monkeypatch.delenv(name)
    monkeypatch.setenv("MMEMBED_X_THREE", "kept")
    export({"MMEMBED_X_ONE": "1"}, defaults={"MMEMBED_X_TWO": "2", "MMEMBED_X_THREE": "3"})
    assert (os.environ["MMEMBED_X_ONE"], os.environ["MMEMBED_X_TWO"], os.environ["MMEMBED_X_THREE"]) == ("1", "2", "kept")


def test_one_process_group_env_goes_through_the_module(monkeypatch):
    from mmembed.training.arguments import one_process_group_env

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # so that monkeypatch puts back (or removes) what the call sets
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_ADDR", "10.1.1.1")
    assert one_process_group_env()
    launch = read().launch
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size, launch.address) == \
        ("0", "0", "1", "1", "10.1.1.1")
    assert 0 < launch.integer("MASTER_PORT", 0, 1, 65535)
    assert not one_process_group_env()  # a launcher's process (or this one, now) is left alone


def test_environment_is_frozen():
    env = read({})
    with pytest.raises(AttributeError):
        env.variables = {}
    assert isinstance(env, Environment)


# ---- reranker sampling --------------------------------------------------------------------------


def test_rerank_sampling_variables():
    assert read({}).rerank_sampling == environment.RerankSampling(1, 7)  # ms-swift's defaults
    s = read({"MAX_POSITIVE_SAMPLES": "2", "MAX_NEGATIVE_SAMPLES": "0"}).rerank_sampling
    assert (s.max_positive, s.max_negative) == (2, 0)
    for value, message in (("0", "must be a number > 0"), ("1.5", "must be a whole number"), ("x", "is not a number")):
        with pytest.raises(ValueError, match=rf"^environment variable MAX_POSITIVE_SAMPLES='{re.escape(value)}' {message}"):
            _ = read({"MAX_POSITIVE_SAMPLES": value}).rerank_sampling
    with pytest.raises(ValueError, match=r"^environment variable MAX_NEGATIVE_SAMPLES='-1' must be a number >= 0$"):
        _ = read({"MAX_NEGATIVE_SAMPLES": "-1"}).rerank_sampling
