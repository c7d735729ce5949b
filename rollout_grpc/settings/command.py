"""The `serve` command line: every flag added to argparse in its `--help` section, and parsing with
the precedence flag > environment > config file > default, errors on one line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from rollout_grpc.argtypes import unrecognized_message
from rollout_grpc.settings.flag import ENV_PREFIX, SettingsError, _flag_type, flag_default
from rollout_grpc.settings.groups import FLAG_GROUPS, UNGROUPED
from rollout_grpc.settings.sources import from_config_file, from_environment
from rollout_grpc.settings.table import FLAGS


class _ListAction(argparse.Action):
    """Repeatable flag whose first use on the command line replaces a default from env or file."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        items = getattr(namespace, self.dest)
        items = [] if items is self.default or items is None else items
        setattr(namespace, self.dest, [*items, values])


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every flag of FLAGS (and --config) to `parser` in the sections of FLAG_GROUPS, defaults
    shown in --help."""
    sections = {title: parser.add_argument_group(title) for title, _ in FLAG_GROUPS}
    section_of = {name: sections[title] for title, names in FLAG_GROUPS for name in names}

    def section(name: str) -> argparse._ArgumentGroup:
        if name not in section_of:
            section_of[name] = sections.get(UNGROUPED) or parser.add_argument_group(UNGROUPED)
            sections[UNGROUPED] = section_of[name]
        return section_of[name]

    section("--config").add_argument(
        "--config",
        help=f"TOML file of flag values (keys are flag names); env {ENV_PREFIX}CONFIG",
        default=None,
    )
    for flag in FLAGS:
        group = section(flag.name)
        names = (flag.name, *flag.aliases)
        text = f"{flag.help} [env {flag.env}]"
        default = flag_default(flag)
        if flag.kind in ("switch", "off-switch"):
            group.add_argument(*names, dest=flag.dest, action="store_true", default=default, help=text)
        elif flag.kind == "list":
            group.add_argument(
                *names,
                dest=flag.dest,
                action=_ListAction,
                type=flag.type or str,
                default=default,
                metavar=flag.metavar,
                help=text,
            )
        else:
            group.add_argument(
                *names,
                dest=flag.dest,
                type=_flag_type(flag),
                default=default,
                choices=flag.choices,
                metavar=flag.metavar,
                help=text,
            )


def parse_serve_args(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse `serve` arguments with precedence flag > environment > config file > default."""
    env = os.environ if environ is None else environ
    # No prefix matching here either: `--conf x` must not be read as `--config x`.
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    config_path = known.config or env.get(ENV_PREFIX + "CONFIG")
    layered: dict[str, Any] = {}
    try:
        if config_path:
            layered.update(from_config_file(config_path))
        layered.update(from_environment(env))
    except SettingsError as exc:
        _fail(parser, str(exc))
    parser.set_defaults(**layered)
    # Errors as one line: argparse's own error() prints the whole usage first, 40 lines for `serve`,
    # above the one that says what is wrong.
    parser.exit_on_error = False
    try:
        args, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        _fail(parser, str(exc))
    if extra:
        _fail(parser, unrecognized_message(parser, extra))
    return args


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit 2 (argparse's code for bad usage) with one line on stderr and no traceback."""
    parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")
