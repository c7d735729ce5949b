"""The config's shape in one place (docs/architecture.md "The config's shape"): every `serve` flag
fills exactly one field of the sub-config of its own `--help` section, every field of a sub-config
is filled by a flag or is a default documented in `NOT_FLAGS`, and `ServerConfig` is the union of
the sections and nothing more. A flag added without its field, a field added without its flag, a
field declared on `ServerConfig` itself or a flag listed under another section's title fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from rollout_grpc import settings
from rollout_grpc.server.config import (
    SECTIONS,
    FrontDoorConfig,
    NetworkConfig,
    OpenAIConfig,
    SecurityConfig,
    ServerConfig,
    StepConfig,
    WeightsConfig,
)
from rollout_grpc.server.domain.model import GenerateOptions

#: Fields of a section that hold a nested config whose own fields are flags ("openai.x").
NESTED: dict[str, type[Any]] = {"openai": FrontDoorConfig, "default_options": GenerateOptions}


def _own_fields(kind: type[Any]) -> set[str]:
    """The fields a dataclass declares in its own body (not inherited)."""
    return {name for name in vars(kind).get("__annotations__", {}) if name != "SECTION"}


def _section_of_field() -> dict[str, type[Any]]:
    owners: dict[str, list[type[Any]]] = {}
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            owners.setdefault(f.name, []).append(section)
    twice = {name: [s.__name__ for s in kinds] for name, kinds in owners.items() if len(kinds) > 1}
    assert not twice, f"fields declared in more than one section: {twice}"
    return {name: kinds[0] for name, kinds in owners.items()}


def _group_of_flag() -> dict[str, str]:
    return {name: title for title, names in settings.FLAG_GROUPS for name in names}


def test_server_config_is_the_union_of_the_sections_and_nothing_more() -> None:
    sections = _section_of_field()
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert fields == set(sections), "ServerConfig's fields are exactly the sections' fields"
    assert not _own_fields(ServerConfig), (
        f"declare these in their section, not on ServerConfig: {sorted(_own_fields(ServerConfig))}"
    )
    assert set(ServerConfig.__mro__[1:-1]) == set(SECTIONS), "ServerConfig inherits every section"


@pytest.mark.parametrize("kind", [*SECTIONS, FrontDoorConfig, ServerConfig], ids=lambda k: k.__name__)
def test_every_sub_config_is_frozen(kind: type[Any]) -> None:
    value = kind(engines=[]) if kind in (ServerConfig, SECTIONS[0]) else kind()
    name = dataclasses.fields(value)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, name, getattr(value, name))


def test_every_flag_fills_exactly_one_field_of_its_own_sections_sub_config() -> None:
    sections = _section_of_field()
    group_of = _group_of_flag()
    filled: dict[str, str] = {}
    for flag in settings.FLAGS:
        if not flag.field:
            assert flag.name in settings.COMMAND_FLAGS, (
                f"{flag.name} fills no config field: give it one, or say why in COMMAND_FLAGS"
            )
            continue
        assert flag.name not in settings.COMMAND_FLAGS, f"{flag.name} fills {flag.field}: not a command flag"
        top, _, inner = flag.field.partition(".")
        assert top in sections, f"{flag.name} fills {flag.field!r}, which no section of server/config.py has"
        if inner:
            nested = {f.name for f in dataclasses.fields(NESTED[top])}
            assert inner in nested, (
                f"{flag.name} fills {flag.field!r}: {NESTED[top].__name__} has no {inner!r}"
            )
        section = sections[top]
        assert group_of.get(flag.name) == section.SECTION, (
            f"{flag.name} fills {section.__name__}.{top}: list it under {section.SECTION!r} in FLAG_GROUPS"
        )
        assert flag.field not in filled, f"{flag.name} and {filled.get(flag.field)} both fill {flag.field}"
        filled[flag.field] = flag.name


def test_every_sub_config_field_is_filled_by_a_flag_or_a_documented_default() -> None:
    flagged = {flag.field for flag in settings.FLAGS if flag.field}
    flagged_top = {path.partition(".")[0] for path in flagged}
    for name, section in _section_of_field().items():
        if name in settings.NOT_FLAGS:
            assert settings.NOT_FLAGS[name], f"NOT_FLAGS[{name!r}] needs its reason"
            assert name in NESTED or name not in flagged_top, f"{name} is a flag: remove it from NOT_FLAGS"
            continue
        assert name in flagged, f"{section.__name__}.{name} is filled by no flag and not in NOT_FLAGS"
    front_door = {f.name for f in dataclasses.fields(FrontDoorConfig)}
    by_flag = {path.removeprefix("openai.") for path in flagged if path.startswith("openai.")}
    assert front_door == by_flag | set(settings.NOT_OPENAI_FLAGS)
    assert not by_flag & set(settings.NOT_OPENAI_FLAGS)
    stale = set(settings.NOT_FLAGS) - set(_section_of_field())
    assert not stale, f"NOT_FLAGS names fields no section has: {sorted(stale)}"
    assert all(settings.COMMAND_FLAGS.values())
    assert set(settings.COMMAND_FLAGS) <= {flag.name for flag in settings.FLAGS}


def test_the_help_sections_are_the_sub_configs_in_order() -> None:
    titles = [title for title, _ in settings.FLAG_GROUPS]
    assert titles == ["configuration", *(section.SECTION for section in SECTIONS)]
    assert set(_group_of_flag()) - {flag.name for flag in settings.FLAGS} == {"--config"}


def _parsed(argv: list[str]) -> ServerConfig:
    parser = argparse.ArgumentParser(prog="serve")
    settings.add_serve_arguments(parser)
    return settings.server_config(settings.parse_serve_args(parser, argv, {}), ["http://e:1"])


def test_a_flag_reaches_the_room_through_its_section() -> None:
    """What the wiring hands a room is the section the flags filled, as its own frozen value."""
    cfg = _parsed(
        ["--weights-lease-ttl", "7", "--step-buffer-mb", "3", "--openai-port", "0", "--no-reflection"]
    )
    assert cfg.section(WeightsConfig) == WeightsConfig(weights_lease_ttl_s=7.0)
    assert type(cfg.section(WeightsConfig)) is WeightsConfig
    assert cfg.section(StepConfig).buffer_caps().max_bytes_total == 3 << 20
    assert cfg.section(OpenAIConfig) == OpenAIConfig(openai_port=0)
    assert cfg.section(SecurityConfig).reflection is False
    assert cfg.section(NetworkConfig) == NetworkConfig()


def test_flat_construction_fills_the_same_sections() -> None:
    """Tests and Python callers build a ServerConfig from flat keywords, as before the sections."""
    flat = ServerConfig(engines=["http://e:1"], port=0, weights_lease_ttl_s=7.0, step_buffer_mb=3)
    assert flat == dataclasses.replace(_parsed(["--weights-lease-ttl", "7", "--step-buffer-mb", "3"]), port=0)
    assert flat.section(NetworkConfig).port == 0
