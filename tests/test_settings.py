"""Settings defined once: each ServeConfig and EngineConfig field declares its default and
description, the `troupe serve` flags are built from them, and docs/configuration.md names
every flag (no model, no MLX)."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest

from troupe.actors.config import ServeConfig, serve_settings
from troupe.actors.engine.config import EngineConfig, Setting
from troupe.api.cli import build_parser, serve_config, setting_flags

ROOT = Path(__file__).resolve().parents[1]
ENV = ("TROUPE_API_KEY", "TROUPE_ADMIN_API_KEY")
SETTINGS = serve_settings()


@pytest.fixture(autouse=True)
def _no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return capsys.readouterr().out


def help_flags(text: str) -> set[str]:
    """The option strings `--help` lists (each option line's head), --help aside."""
    heads = [m.group(1) for m in re.finditer(r"^  (-[^ ].*?)(?:  |$)", text, re.M)]
    return {flag for head in heads for flag in re.findall(r"--[a-z][a-z-]*", head)} - {"--help"}


def value_of(config: ServeConfig, name: str) -> Any:
    return getattr(config.engine if name in EngineConfig.__struct_fields__ else config, name)


def kinds(setting: Setting) -> list[Any]:
    tp = setting.type
    found = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
    return [kind for kind in found if kind is not type(None)]


def sample(setting: Setting) -> tuple[list[str], Any]:
    """Arguments after a setting's flag that give a value other than its default, and that
    value."""
    found = kinds(setting)
    if any(get_origin(kind) is list for kind in found):
        if setting.cli.get("split"):
            return ["a,b"], ["a", "b"]
        return (["x"], "x") if str in found else (["x"], ["x"])
    if get_origin(found[0]) is Literal:
        choice = next(c for c in get_args(found[0]) if c != setting.default)
        return [choice], choice
    if setting.cli.get("unit") == "size":
        return ["3MB"], 3_000_000
    if found[0] is int:
        return [str((setting.default or 0) + 7)], (setting.default or 0) + 7
    if found[0] is float:
        return [str((setting.default or 0) + 2.5)], (setting.default or 0) + 2.5
    return ["x"], "x"


def test_every_setting_has_a_description_and_a_flag_in_serve_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    fields = [*ServeConfig.__struct_fields__, *EngineConfig.__struct_fields__]
    assert set(fields) - {"engine"} == set(SETTINGS)  # every field declared with setting()
    flags = {flag.field: flag for flag in setting_flags()}
    listed = help_flags(serve_help(capsys))
    for name, setting in SETTINGS.items():
        assert setting.description, name
        if setting.default is None:
            assert "none" in setting.cli, f"{name}: say what None means"
        if name == "aliases":  # --alias NAME=MODEL, written by hand
            assert "--alias" in listed
            continue
        assert set(flags[name].names) <= listed, name


def test_serve_help_gives_every_settings_default(capsys: pytest.CaptureFixture[str]) -> None:
    text = re.sub(r"\s", "", serve_help(capsys))  # argparse wraps lines, at hyphens too
    for flag in setting_flags():
        assert "(default: " in flag.options["help"], flag.field
        assert re.sub(r"\s", "", flag.options["help"].replace("%%", "%")) in text, flag.field
    assert "(default:32)" in text and "(default:1GiB)" in text


def test_the_parsers_defaults_are_the_structs() -> None:
    args = vars(build_parser().parse_args(["serve"]))
    for name, setting in SETTINGS.items():
        assert args[name] == setting.default, name
    assert serve_config(build_parser().parse_args(["serve"])) == ServeConfig()


@pytest.mark.parametrize("flag", setting_flags(), ids=lambda flag: flag.field)
def test_each_flag_sets_its_field(flag: Any) -> None:
    setting = SETTINGS[flag.field]
    if setting.type is bool:
        argv = [f"--no-{flag.names[0][2:]}" if setting.default else flag.names[0]]
        expected: Any = not setting.default
    else:
        values, expected = sample(setting)
        argv = [flag.names[0], *values]
    assert expected != setting.default
    config = serve_config(build_parser().parse_args(["serve", *argv]))
    assert value_of(config, flag.field) == expected
    others = {name: value_of(config, name) for name in SETTINGS if name != flag.field}
    assert others == {name: s.default for name, s in SETTINGS.items() if name != flag.field}


def test_a_flag_given_twice_makes_a_list_of_a_one_or_many_setting() -> None:
    config = serve_config(build_parser().parse_args(["serve", "--model", "a", "--model", "b"]))
    assert config.model == ["a", "b"]


def test_engine_settings_go_in_the_engine_field_and_of_takes_them_flat() -> None:
    nested = ServeConfig(port=9, engine=EngineConfig(max_batch_size=3, block_size=0))
    assert ServeConfig.of(port=9, max_batch_size=3, block_size=0) == nested
    assert nested != ServeConfig(port=9)
    assert ServeConfig.of(port=9, engine=EngineConfig(block_size=0), max_batch_size=3) == nested


def test_a_wrong_setting_name_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"'max_batch_sise' \(did you mean 'max_batch_size'"):
        ServeConfig.of(max_batch_sise=8)
    with pytest.raises(TypeError, match="max_batch_size"):
        ServeConfig(max_batch_size=8)  # type: ignore[call-arg]


def documented_flags() -> set[str]:
    """The flags docs/configuration.md's `troupe serve` table names in its first column."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("## troupe serve", 1)[1].split("\n\n", 2)[1]
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `-")]
    return {flag for cell in cells for flag in re.findall(r"--[a-z][a-z-]*", cell)}


def test_the_docs_name_every_flag_and_only_flags_that_exist(
        capsys: pytest.CaptureFixture[str]) -> None:
    documented = documented_flags()
    assert "--max-batch-size" in documented
    assert documented == help_flags(serve_help(capsys))
