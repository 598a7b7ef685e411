"""DDPConfig's cap options, refused by name when wrong, as DDP's own arguments would be read; the
plans they make: test_planner.py."""
from __future__ import annotations

import pytest

from graphddp.config import DDPConfig


@pytest.mark.parametrize("option", ["bucket_cap_mb", "first_bucket_cap_mb", "last_bucket_cap_mb"])
@pytest.mark.parametrize(
    "value",
    [
        0,
        -1,
        -0.5,
        True,
        False,
        "25",
        float("nan"),
        float("inf"),
    ],
)
def test_config_rejects_bad_caps_naming_the_option(option, value):
    with pytest.raises(ValueError, match=rf"^{option} "):
        DDPConfig(**{option: value})


def test_config_error_names_the_option_and_the_value():
    with pytest.raises(ValueError) as err:
        DDPConfig(bucket_cap_mb=-1)
    assert str(err.value) == "bucket_cap_mb must be a positive, finite number of megabytes, got -1"


@pytest.mark.parametrize("value", [[1.0, -1], [0], (1, float("nan")), [1, "2"], [True]])
def test_config_rejects_bad_cap_list_entries_naming_the_index_and_value(value):
    bad = next(i for i, v in enumerate(value) if isinstance(v, (bool, str)) or not (v > 0 and v < float("inf")))
    with pytest.raises(ValueError, match=rf"^bucket_cap_mb_list\[{bad}\] must be a positive, finite number .*got {value[bad]!r}"):
        DDPConfig(bucket_cap_mb_list=value)


@pytest.mark.parametrize("value", [2.0, "1,2", {1: 2}])
def test_config_rejects_a_cap_list_that_is_not_a_list(value):
    with pytest.raises(ValueError, match=r"^bucket_cap_mb_list must be a list or tuple"):
        DDPConfig(bucket_cap_mb_list=value)


def test_an_empty_cap_list_means_not_given_as_in_ddp():
    assert DDPConfig(bucket_cap_mb_list=[]) == DDPConfig()
    assert DDPConfig(bucket_cap_mb_list=[1, 2]).bucket_cap_mb_list == (1, 2)  # stored as a tuple


def test_last_bucket_cap_is_off_by_default():
    assert DDPConfig().last_bucket_cap_mb is None
    with pytest.raises(ValueError, match="last_bucket_cap_mb"):
        DDPConfig().last_bucket_cap_bytes


def test_config_accepts_int_and_float_caps():
    cfg = DDPConfig(bucket_cap_mb=2, first_bucket_cap_mb=0.5)
    assert (cfg.bucket_cap_bytes, cfg.first_bucket_cap_bytes) == (2 * 2**20, 2**19)


def test_config_rejects_unknown_backend():
    with pytest.raises(ValueError, match=r"^backend .*'tvm'"):
        DDPConfig(backend="tvm")
