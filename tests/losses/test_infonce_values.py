"""InfoNCE settings given as values (a --dataset_config dataset's ``infonce`` mapping):
``InfoNCEConfig.from_values`` / ``infonce_values`` give what the same settings give as
INFONCE_* variables, with the same checks and messages, and name the file and the key."""

from __future__ import annotations

import pytest

from mmembed.data.dataset_config import ConfigError
from mmembed.losses import InfoNCEConfig
from mmembed.losses.config import ENV_VARS, INFONCE_KEYS, infonce_keys, infonce_values

# (value as written in a YAML/JSON file, the variable's text it stands for)
AS_TEXT = [
    ("temperature", 0.02, "0.02"), ("temperature", 1, "1"), ("temperature", "0.5", "0.5"), ("temperature", " 0.2 ", " 0.2 "),
    ("use_batch", False, "false"), ("use_batch", True, "true"), ("use_batch", 0, "0"), ("use_batch", 1, "1"),
    ("use_batch", "TRUE", "TRUE"), ("hard_negatives", 3, "3"), ("hard_negatives", "2", "2"),
    ("fake_neg_margin", -0.5, "-0.5"), ("include_qq", "0", "0"), ("include_dd", True, "true"),
    ("mask_fake_negative", 1, "1"), ("hard_negatives", None, ""), ("temperature", "", ""),
]

# values every one of which is an error, as its text is for the variable
BAD = [
    ("use_batch", "yes", "yes"), ("use_batch", 2, "2"), ("use_batch", 1.0, "1.0"), ("include_dd", 0.5, "0.5"),
    ("temperature", "warm", "warm"), ("temperature", True, "true"), ("temperature", 0, "0"), ("temperature", -0.1, "-0.1"),
    ("hard_negatives", 0, "0"), ("hard_negatives", 2.5, "2.5"), ("hard_negatives", 2.0, "2.0"),
    ("hard_negatives", False, "false"), ("fake_neg_margin", float("nan"), "nan"), ("fake_neg_margin", "inf", "inf"),
]


def test_the_key_table_is_the_variables_table():
    assert ENV_VARS is INFONCE_KEYS and set(INFONCE_KEYS) == set(InfoNCEConfig.__dataclass_fields__)
    assert all(var == "INFONCE_" + name.upper() for name, var in INFONCE_KEYS.items())


@pytest.mark.parametrize("name, value, text", AS_TEXT)
@pytest.mark.parametrize("keyed_by", ["field", "variable"])
def test_a_value_reads_as_its_variables_text(name, value, text, keyed_by):
    key = name if keyed_by == "field" else INFONCE_KEYS[name]
    from_env = InfoNCEConfig.from_env({INFONCE_KEYS[name]: text})
    assert InfoNCEConfig.from_values({key: value}) == from_env
    got = infonce_values({key: value})
    assert list(got) == [name] and got[name] == getattr(from_env, name) and type(got[name]) is type(getattr(from_env, name))


@pytest.mark.parametrize("name, value, text", BAD)
def test_a_bad_value_has_the_variables_message(name, value, text):
    var = INFONCE_KEYS[name]
    with pytest.raises(ValueError) as env_error:
        InfoNCEConfig.from_env({var: text})
    with pytest.raises(ValueError) as values_error:
        InfoNCEConfig.from_values({name: value})
    assert not isinstance(values_error.value, ConfigError)
    assert str(values_error.value) == f"InfoNCE setting {name!r}: {env_error.value}"
    # with a file: a ConfigError naming the file, the dataset and the key, with the same reason
    with pytest.raises(ConfigError) as e:
        infonce_values({name: value}, "/d/config.yaml", "hn")
    assert (e.value.file, e.value.dataset, e.value.key, e.value.reason) == ("/d/config.yaml", "hn", f"infonce.{name}",
                                                                            str(env_error.value))
    assert str(e.value).startswith(f"--dataset_config /d/config.yaml: dataset hn, key 'infonce.{name}': {var}=")


def test_several_values_and_the_defaults():
    got = InfoNCEConfig.from_values({"use_batch": False, "INFONCE_HARD_NEGATIVES": 2, "temperature": 0.05,
                                     "include_qq": True})
    assert got == InfoNCEConfig(temperature=0.05, use_batch=False, hard_negatives=2, include_qq=True)
    assert InfoNCEConfig.from_values({}) == InfoNCEConfig()


def test_the_variables_are_not_read(monkeypatch):
    monkeypatch.setenv("INFONCE_TEMPERATURE", "0.3")
    monkeypatch.setenv("INFONCE_USE_BATCH", "false")
    assert InfoNCEConfig.from_values({"include_dd": True}) == InfoNCEConfig(include_dd=True)
    # null: the field's default (the variable unset for these settings), not the variable's value
    assert infonce_values({"temperature": None, "use_batch": None}) == {"temperature": 0.1, "use_batch": True}


@pytest.mark.parametrize("values, key, words", [
    ({"temprature": 0.1}, "infonce.temprature", "not an InfoNCE setting; known: temperature, use_batch"),
    ({"INFONCE_TEMP": 0.1}, "infonce.INFONCE_TEMP", "(or their INFONCE_* names)"),
    ({"use_batch": True, "INFONCE_USE_BATCH": False}, "infonce.INFONCE_USE_BATCH",
     "given twice (use_batch and INFONCE_USE_BATCH)"),
    ({"temperature": [0.1]}, "infonce.temperature", "must be a number, a boolean or null, got [0.1]"),
    ({"use_batch": {"a": 1}}, "infonce.use_batch", "must be a number, a boolean or null"),
], ids=["unknown", "unknown-variable", "twice", "list", "mapping"])
def test_keys_and_kinds_are_checked_naming_the_file_and_the_key(values, key, words):
    with pytest.raises(ConfigError) as e:
        InfoNCEConfig.from_values(values, "/d/c.yaml", "a")
    assert e.value.key == key and words in e.value.reason and "/d/c.yaml: dataset a" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="InfoNCE setting"):
        InfoNCEConfig.from_values(values)
    with pytest.raises(ConfigError, match="must be a mapping of InfoNCE settings"):
        infonce_values([("temperature", 0.1)], "/d/c.yaml", "a")


def test_infonce_keys_keys_by_field_and_leaves_values_alone():
    assert infonce_keys({"INFONCE_TEMPERATURE": "hot", "use_batch": None}) == {"temperature": "hot", "use_batch": None}
    with pytest.raises(ConfigError) as e:
        infonce_keys({"colour": 1}, "/d/c.yaml", "a")
    assert e.value.key == "infonce.colour"
