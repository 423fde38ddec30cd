"""The config loading: a mapping from a YAML or JSON document is refused with a ConfigError whatever its
shape (an int key beside str keys, or no mapping at all raised Python's TypeError from sorting the names)."""

from __future__ import annotations

from typing import Any

import pytest

from aioembed import ConfigError, TransferConfig


@pytest.mark.parametrize("values", [{"pool_tokens": 65536, 8192: "x"}, {1: 2, "blok_size": 3}])
def test_a_non_str_setting_name_is_a_config_error_naming_it(values: dict[Any, Any]) -> None:
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \[.*(8192|1)"):
        TransferConfig.from_mapping(values, source="settings.yaml")


@pytest.mark.parametrize("values", [None, ["pool_tokens", 65536], 5])
def test_settings_that_are_not_a_mapping_are_a_config_error(values: Any) -> None:
    with pytest.raises(ConfigError, match=r"settings in settings\.yaml must be a table"):
        TransferConfig.from_mapping(values, source="settings.yaml")
