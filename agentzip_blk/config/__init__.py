"""Configuration: the schema (`schema`), strict validation and loading (`load`), the
drop-ins merged over the file (`dropins`), and the
size and duration quantities config values are written in (`quantities`)."""

from ..errors import ConfigError
from .dropins import DROPIN_DIR, dropin_dir
from .load import (
    LoadedConfig,
    check_device_size,
    config_digest,
    glob_problem,
    load_config,
    load_file,
    load_layers,
    old_key_names,
    parse_config,
)
from .schema import (
    DEFAULT_CONFIG_PATH,
    MAX_DEVICE_SIZE,
    MAX_FRAME_PAGES,
    CompressionConfig,
    Config,
    DeviceConfig,
    PolicyConfig,
    PoolConfig,
    Scope,
    default_scopes,
)

__all__ = [
    "ConfigError", "Config", "CompressionConfig", "PoolConfig", "PolicyConfig", "Scope",
    "DeviceConfig", "DEFAULT_CONFIG_PATH", "MAX_DEVICE_SIZE", "MAX_FRAME_PAGES", "default_scopes", "glob_problem",
    "load_config", "old_key_names", "parse_config", "load_layers", "LoadedConfig", "DROPIN_DIR",
    "dropin_dir", "check_device_size", "load_file", "config_digest",
]
