"""The `serve` command's settings: one source of defaults, three sources of values.

Defaults live in ONE place, the dataclasses of `server/config.py` (the sections whose union is
`ServerConfig`, and `FrontDoorConfig`) and `GenerateOptions` (`server/domain/model.py`); the
command-line flags are derived from their fields through the `FLAGS` table (`table.py`), which adds
only a flag name, a help text and a unit, and shown in the `--help` section of the sub-config they
fill (`groups.py`). `tests/ops/test_config_sections.py` checks that every flag fills one field of
its own section's sub-config (or is in `COMMAND_FLAGS`) and every field is a flag or is listed in
`NOT_FLAGS` / `NOT_OPENAI_FLAGS`.

Every flag can be given three ways; the first one found wins:

1. on the command line (`--grace 10`);
2. in the environment as `ROLLOUT_GRPC_<FLAG>` (`ROLLOUT_GRPC_GRACE=10`; list flags such as
   `--engine` take comma-separated values; switches take 1/0, true/false, yes/no, on/off);
3. in a TOML file given by `--config FILE` (or `ROLLOUT_GRPC_CONFIG`), with the flag names as keys
   (`grace = 10`, `engine = ["http://vllm-0:8000"]`; `-` and `_` are interchangeable);

and otherwise the dataclass default applies.

The package, one job a module: `flag.py` (one flag: field, parser, bounds, default), `table.py`
(the `FLAGS` table and the fields that are not flags), `groups.py` (the sections of `--help`),
`engine_urls.py` (`--engine` and the engines file), `sources.py` (environment, TOML file, unknown
variables), `command.py` (argparse and the precedence), `build.py` (the `ServerConfig`).
"""

from __future__ import annotations

from rollout_grpc.settings.build import (
    server_config as server_config,
)
from rollout_grpc.settings.command import (
    add_serve_arguments as add_serve_arguments,
)
from rollout_grpc.settings.command import (
    parse_serve_args as parse_serve_args,
)
from rollout_grpc.settings.engine_urls import (
    EngineURL as EngineURL,
)
from rollout_grpc.settings.engine_urls import (
    engine_kinds as engine_kinds,
)
from rollout_grpc.settings.engine_urls import (
    engine_list as engine_list,
)
from rollout_grpc.settings.engine_urls import (
    parse_engine_url as parse_engine_url,
)
from rollout_grpc.settings.engine_urls import (
    read_engines_file as read_engines_file,
)
from rollout_grpc.settings.flag import (
    ABOVE_ZERO as ABOVE_ZERO,
)
from rollout_grpc.settings.flag import (
    AT_LEAST_ONE as AT_LEAST_ONE,
)
from rollout_grpc.settings.flag import (
    ENV_PREFIX as ENV_PREFIX,
)
from rollout_grpc.settings.flag import (
    PORTS as PORTS,
)
from rollout_grpc.settings.flag import (
    Flag as Flag,
)
from rollout_grpc.settings.flag import (
    SettingsError as SettingsError,
)
from rollout_grpc.settings.flag import (
    _flag_type as _flag_type,
)
from rollout_grpc.settings.flag import (
    flag_default as flag_default,
)
from rollout_grpc.settings.groups import (
    FLAG_GROUPS as FLAG_GROUPS,
)
from rollout_grpc.settings.groups import (
    UNGROUPED as UNGROUPED,
)
from rollout_grpc.settings.sources import (
    OTHER_PREFIXES as OTHER_PREFIXES,
)
from rollout_grpc.settings.sources import (
    OTHER_VARIABLES as OTHER_VARIABLES,
)
from rollout_grpc.settings.sources import (
    UnknownVariable as UnknownVariable,
)
from rollout_grpc.settings.sources import (
    from_config_file as from_config_file,
)
from rollout_grpc.settings.sources import (
    from_environment as from_environment,
)
from rollout_grpc.settings.sources import (
    unknown_variables as unknown_variables,
)
from rollout_grpc.settings.table import (
    COMMAND_FLAGS as COMMAND_FLAGS,
)
from rollout_grpc.settings.table import (
    FLAGS as FLAGS,
)
from rollout_grpc.settings.table import (
    NOT_FLAGS as NOT_FLAGS,
)
from rollout_grpc.settings.table import (
    NOT_OPENAI_FLAGS as NOT_OPENAI_FLAGS,
)
