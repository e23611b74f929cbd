from __future__ import annotations

import pytest
import torch

from elastic._shared.common.cli import OneLineArgumentParser, positive_int, run_main
from elastic._shared.common.errors import UsageError
from elastic._worker.observe.replicas import gather_digests, parameter_digest
from elastic._worker.runtime.context import init_worker


def test_parser_errors_are_one_line_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineArgumentParser(prog="recipe.py")
    parser.add_argument("--batch-size", type=positive_int)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--batch-size", "-3"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "recipe.py: error: argument --batch-size: -3 must be at least 1\n"


def test_run_main_turns_a_usage_error_into_one_line_and_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    def main(argv: list[str] | None) -> int:
        raise UsageError("--data x: no such file or folder")

    assert run_main(main, []) == 2
    assert capsys.readouterr().err.endswith("error: --data x: no such file or folder\n")


def test_digest_sees_every_bit_of_every_tensor() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    assert parameter_digest(a) == parameter_digest(b)
    with torch.no_grad():
        b.bias[0] = torch.nextafter(b.bias[0], torch.tensor(1.0))  # one ulp
    assert parameter_digest(a) != parameter_digest(b)
    assert gather_digests(init_worker("cpu", environ={}), "abc") == ["abc"]
