"""torchrevive-run's own settings: flags with help and defaults, each with an environment form, from one table."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from elastic._agent.launcher import settings
from elastic._shared.common.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A clean environment for `resolve`, and none of ours in the process's (main writes there)."""
    for setting in settings.SETTINGS:
        monkeypatch.delenv(setting.env, raising=False)
    return {}


def parse(argv: list[str]) -> argparse.Namespace:
    from elastic._agent.launcher.launch import parse_args

    return parse_args([*argv, "train.py", "--survivors", "is the script's"])


def test_a_flag_is_written_in_its_environment_form_and_taken_out_of_torchruns_args(environ) -> None:
    args = parse(["--nnodes=2", "--survivors", "keep", "--frozen-worker-seconds=7.5", "--snapshots", "off",
                  "--preload", "", "--requeue-signal", "sigusr2"])
    chosen = settings.resolve(args, environ)
    assert environ == {"TORCHREVIVE_SURVIVORS": "keep", "TORCHREVIVE_FROZEN_WORKER_SECONDS": "7.5",
                       "TORCHREVIVE_SNAPSHOTS": "0", "TORCHREVIVE_PRELOAD": "", "TORCHREVIVE_REQUEUE_SIGNAL": "USR2"}
    assert chosen["survivors"] == "keep"
    assert not any(hasattr(args, s.name) for s in settings.SETTINGS)  # torch's run never sees them
    assert args.training_script_args == ["--survivors", "is the script's"]  # the script's own flags are its own


def test_the_environment_form_is_taken_when_the_flag_is_not_given_and_the_flag_wins(environ) -> None:
    environ.update({"TORCHREVIVE_SURVIVORS": "train-on", "TORCHREVIVE_SNAPSHOT_HOST": "10.0.0.5"})
    settings.resolve(parse([]), environ)
    assert environ["TORCHREVIVE_SURVIVORS"] == "train-on" and environ["TORCHREVIVE_SNAPSHOT_HOST"] == "10.0.0.5"
    settings.resolve(parse(["--survivors=keep"]), environ)
    assert environ["TORCHREVIVE_SURVIVORS"] == "keep"


def test_nothing_given_leaves_the_environment_as_it_was(environ) -> None:
    assert settings.resolve(parse([]), environ) == {} and environ == {}
    environ["TORCHREVIVE_SURVIVORS"] = ""  # empty: as good as unset, as before
    assert settings.resolve(parse([]), environ) == {}


@pytest.mark.parametrize(
    ("argv", "env", "said"),
    [
        (["--survivors", "shrink"], {}, "--survivors 'shrink' is not one of restart, keep, train-on"),
        ([], {"TORCHREVIVE_SURVIVORS": "shrink"}, "TORCHREVIVE_SURVIVORS='shrink' is not one of restart, keep, train-on"),
        (["--frozen-worker-seconds", "0.1"], {}, "--frozen-worker-seconds '0.1' is not a number of seconds from 0.5 to 86400"),
        ([], {"TORCHREVIVE_FROZEN_WORKER_SECONDS": "soon"}, "TORCHREVIVE_FROZEN_WORKER_SECONDS='soon' is not a number"),
        (["--snapshots", "maybe"], {}, "--snapshots 'maybe' is not 1 (on) or 0 (off)"),
        (["--requeue-signal", "HUP"], {}, "--requeue-signal 'HUP' is not USR1, USR2 or none"),
        (["--snapshot-secret-file", "/no/such/secret"], {}, "--snapshot-secret-file '/no/such/secret' is not a file"),
        (["--snapshot-tls-ca", "/no/such/ca.pem"], {}, "--snapshot-tls-ca '/no/such/ca.pem' is not a file"),
        (["--snapshot-tls-cert", __file__], {}, "--snapshot-tls-cert needs --snapshot-tls-key too"),
    ],
)
def test_an_invalid_value_is_one_usage_error_naming_where_it_came_from_and_nothing_is_written(
    environ, argv: list[str], env: dict[str, str], said: str
) -> None:
    environ.update(env)
    with pytest.raises(UsageError) as info:
        settings.resolve(parse(["--snapshot-host=10.0.0.5", *argv]), environ)
    assert str(info.value).startswith(said), info.value
    assert "\n" not in str(info.value)
    assert environ == env  # checked before anything is written


def test_the_launcher_ends_on_an_invalid_flag_with_one_line_and_exit_2(environ, capsys) -> None:
    from elastic._agent.launcher.launch import main

    with pytest.raises(SystemExit) as info:
        main(["--nnodes=1:2", "--survivors", "shrink", "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "torchrevive-run: error: --survivors 'shrink' is not one of restart, keep, train-on\n", err


def test_help_shows_torchruns_flags_and_ours_with_their_environment_forms_and_defaults(capsys) -> None:
    from elastic._agent.launcher.launch import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: torchrevive-run")
    assert "--nproc-per-node" in out and "--rdzv-endpoint" in out  # torchrun's
    assert settings.GROUP_TITLE in out
    assert "--survivors {restart,keep,train-on}" in out
    for setting in settings.SETTINGS:
        if setting.flag is not None:
            assert setting.flag in out and f"env {setting.env}; default: {setting.default}" in out, setting.name
    assert "--snapshot-secret " not in out  # environment only: a secret on a command line is in `ps`


def test_every_torchrevive_variable_of_the_package_is_a_setting_or_internal_plumbing() -> None:
    named = set()
    for path in (REPO / "elastic").rglob("*.py"):
        named |= set(re.findall(r'^[A-Z_]+ = "(TORCHREVIVE_[A-Z_]+)"', path.read_text(), flags=re.MULTILINE))
    settings_envs = {setting.env for setting in settings.SETTINGS}
    assert len(named) >= 23
    assert not settings_envs & set(settings.INTERNAL)
    assert named <= settings_envs | set(settings.INTERNAL), named - settings_envs - set(settings.INTERNAL)


def test_every_setting_has_help_a_default_and_a_flag_unless_it_is_a_secret() -> None:
    for setting in settings.SETTINGS:
        assert setting.help and setting.default and setting.env.startswith("TORCHREVIVE_")
        assert setting.flag is not None or setting.env == "TORCHREVIVE_SNAPSHOT_SECRET"
