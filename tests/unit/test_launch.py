"""The launcher is torchrun with recovery defaults: it only fills in what the user left out."""

from __future__ import annotations

import pytest

from elastic._agent.launcher.warm_start import (
    DEFAULT_PRELOAD,
    PRELOAD_ENV,
    preload_modules,
)
from elastic._shared.common.errors import UsageError
from elastic._shared.protocol.recovery_defaults import (
    RECOVERY_RDZV_CONF,
    merged_rdzv_conf,
)


def test_defaults_fill_an_empty_conf() -> None:
    assert dict(item.split("=") for item in merged_rdzv_conf("").split(",")) == RECOVERY_RDZV_CONF


def test_user_values_win_and_other_keys_pass_through() -> None:
    merged = merged_rdzv_conf("last_call_timeout=9,join_timeout=120,read_timeout=5")
    pairs = dict(item.split("=") for item in merged.split(","))
    assert pairs["last_call_timeout"] == "9"
    assert pairs["join_timeout"] == "120" and pairs["read_timeout"] == "5"
    assert pairs["keep_alive_interval"] == RECOVERY_RDZV_CONF["keep_alive_interval"]
    assert merged.startswith("last_call_timeout=9,join_timeout=120,read_timeout=5")




def test_preload_defaults_to_torch_and_an_empty_value_turns_warm_starts_off() -> None:
    assert preload_modules({}) == DEFAULT_PRELOAD
    assert preload_modules({PRELOAD_ENV: ""}) == ()
    assert preload_modules({PRELOAD_ENV: " json , torch "}) == ("json", "torch")


def test_preload_of_a_module_that_does_not_exist_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="'no_such_module_xyz'"):
        preload_modules({PRELOAD_ENV: "torch,no_such_module_xyz"})
    with pytest.raises(UsageError, match="'no_such_package_xyz.sub'"):
        preload_modules({PRELOAD_ENV: "no_such_package_xyz.sub"})


def test_standalone_is_settled_before_the_keeper_starts_so_it_knows_the_workers_run_id() -> None:
    from elastic._agent.launcher.launch import parse_args, settle_standalone

    args = parse_args(["--standalone", "--nproc-per-node=2", "train.py"])
    settle_standalone(args)
    assert (args.standalone, args.rdzv_backend, args.rdzv_endpoint) == (False, "c10d", "localhost:0")
    assert len(args.rdzv_id) == 36 and args.rdzv_id != parse_args(["--standalone", "train.py"]).rdzv_id
    given = parse_args(["--rdzv-id=mine", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "train.py"])
    settle_standalone(given)
    assert given.rdzv_id == "mine"


def test_a_quick_rounds_value_that_is_not_a_boolean_ends_the_launcher_in_one_line(capsys) -> None:
    from elastic._agent.launcher.launch import main

    with pytest.raises(SystemExit) as info:
        main(["--nnodes=1:2", "--rdzv-conf=quick_rounds=maybe", "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchrevive-run: error: --rdzv-conf quick_rounds='maybe'"), err


def test_quick_rounds_0_and_1_are_taken() -> None:
    from elastic._agent.launcher.launch import check_rdzv_conf, parse_args

    for value in ("0", "1", "False", "yes"):
        check_rdzv_conf(parse_args([f"--rdzv-conf=join_timeout=60,quick_rounds={value}", "train.py"]))


def test_the_failure_summary_names_a_heal_that_did_not_form() -> None:
    from elastic._agent.launcher.launch import describe_exit
    from elastic._shared.protocol.heal_env import HEAL_FAILED_EXIT

    assert describe_exit(HEAL_FAILED_EXIT) == "exit status 76, a heal in place that did not form (TORCHREVIVE_SURVIVORS=keep or train-on)"
    assert describe_exit(-9) == "killed by SIGKILL"


@pytest.mark.parametrize(
    ("value", "args", "said"),
    [
        ("shrink", ["--rdzv-id=job"], "TORCHREVIVE_SURVIVORS='shrink' is not one of restart, keep, train-on"),
        ("train-on", [], "TORCHREVIVE_SURVIVORS=train-on needs --rdzv-id naming the job"),
    ],
)
def test_a_survivors_setting_the_launcher_cannot_honour_is_one_line(
    capsys, monkeypatch: pytest.MonkeyPatch, value: str, args: list[str], said: str
) -> None:
    from elastic._agent.launcher.launch import main

    monkeypatch.setenv("TORCHREVIVE_SURVIVORS", value)
    with pytest.raises(SystemExit) as info:
        main(["--nnodes=1:2", *args, "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"torchrevive-run: error: {said}"), err


def test_train_on_takes_a_named_or_standalone_job() -> None:
    from elastic._agent.launcher import in_place
    from elastic._agent.launcher.launch import parse_args

    setting = {"TORCHREVIVE_SURVIVORS": "train-on"}
    assert in_place.check_setting(setting, parse_args(["--rdzv-id=job", "train.py"])) == "train-on"
    assert in_place.check_setting(setting, parse_args(["--standalone", "train.py"])) == "train-on"
    assert in_place.check_setting({}, parse_args(["train.py"])) == "restart"


def test_max_restarts_defaults_to_a_number_that_recovers_and_the_help_says_so(monkeypatch, capsys) -> None:
    """torchrun's 0 ended a job at its first failure (the README's own lines did not restart); a flag or
    PET_MAX_RESTARTS still wins, as under torchrun."""
    from elastic._agent.launcher.launch import args_parser, parse_args
    from elastic._agent.launcher.torchrun_defaults import MAX_RESTARTS

    monkeypatch.delenv("PET_MAX_RESTARTS", raising=False)
    assert MAX_RESTARTS > 0 and parse_args(["train.py"]).max_restarts == MAX_RESTARTS
    assert parse_args(["--max-restarts=0", "train.py"]).max_restarts == 0
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    assert parse_args(["train.py"]).max_restarts == 7
    monkeypatch.delenv("PET_MAX_RESTARTS")
    help_text = " ".join(args_parser().format_help().split())
    assert f"(torchrevive-run: {MAX_RESTARTS}; torchrun's 0 ends the job at the first failure" in help_text


def test_several_workers_a_node_get_torchruns_thread_default_before_the_fork_server_starts(capsys) -> None:
    """torchrun sets OMP_NUM_THREADS=1 for several workers a node inside its `run`, after the fork server
    started: set first, the fork server's pools are the workers' own (elastic/_agent/launcher/warm_env.py)."""
    from argparse import Namespace

    from elastic._agent.launcher.warm_env import settle_thread_defaults

    environ: dict[str, str] = {}
    assert settle_thread_defaults(Namespace(nproc_per_node="2"), environ) == "1" and environ == {"OMP_NUM_THREADS": "1"}
    assert "OMP_NUM_THREADS=1 for each of the 2 workers" in capsys.readouterr().err
    chosen = {"OMP_NUM_THREADS": "4"}
    assert settle_thread_defaults(Namespace(nproc_per_node="2"), chosen) is None and chosen == {"OMP_NUM_THREADS": "4"}
    alone: dict[str, str] = {}
    assert settle_thread_defaults(Namespace(nproc_per_node="1"), alone) is None and alone == {}
    assert settle_thread_defaults(Namespace(nproc_per_node="many"), alone) is None and alone == {}


def test_a_range_of_nodes_with_no_backend_chosen_takes_c10d(monkeypatch) -> None:
    """torchrun's static backend cannot serve --nnodes MIN:MAX (its first node waits for MAX, for ever): the
    documented `--nnodes=1:4 --rdzv-endpoint=HOST:29400 --rdzv-id=job1 train.py` hung."""
    from elastic._agent.launcher.launch import parse_args

    monkeypatch.delenv("PET_RDZV_BACKEND", raising=False)
    assert parse_args(["--nnodes=1:4", "--rdzv-endpoint=h:1", "train.py"]).rdzv_backend == "c10d"
    assert parse_args(["--nnodes=2", "--rdzv-endpoint=h:1", "train.py"]).rdzv_backend == "static"  # a fixed count
    assert parse_args(["--nnodes=1:4", "--rdzv-backend=static", "train.py"]).rdzv_backend == "static"  # chosen
    assert parse_args(["--nnodes=1:4", "train.py", "--rdzv-backend=x"]).rdzv_backend == "c10d"  # the script's own flag
    monkeypatch.setenv("PET_RDZV_BACKEND", "static")
    assert parse_args(["--nnodes=1:4", "train.py"]).rdzv_backend == "static"


def test_a_job_that_may_span_hosts_without_a_secret_is_one_line(monkeypatch) -> None:
    """The launcher reads --nnodes' maximum to decide whether the job needs a secret given to every node
    (a NameError here once stopped every torchrevive-run agent at start)."""
    import argparse

    from elastic._agent.launcher import launch
    from elastic._shared.storage import peer_auth

    monkeypatch.delenv(peer_auth.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(peer_auth.SECRET_ENV, raising=False)
    args = argparse.Namespace(rdzv_id="job1", rdzv_endpoint="10.1.2.3:29400", nnodes="1:4")
    with pytest.raises(UsageError, match=peer_auth.SECRET_FILE_ENV):
        launch.signing_secret(args)
