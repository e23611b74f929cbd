from __future__ import annotations

import io
import logging

import pytest

from elastic._worker.observe.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_with_loss_and_throughput() -> None:
    screen = FakeTerminal()
    progress = Progress(total=4, stream=screen)
    for step in range(1, 5):
        progress.update(step, loss=2.5, tokens_per_s=1000.0)
    progress.close()
    out = screen.getvalue()
    assert "4/4" in out and "loss=2.5000" in out and "tok_s=1,000" in out


def test_a_file_gets_a_log_line_every_n_steps(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="elastic._worker.observe.progress")
    progress = Progress(total=7, stream=io.StringIO(), log_every=3)
    for step in range(1, 8):
        progress.update(step, loss=1.0, tokens_per_s=10.0)
    assert [r.getMessage().split(" loss")[0] for r in caplog.records] == ["step 3/7", "step 6/7", "step 7/7"]


def test_other_ranks_report_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="elastic._worker.observe.progress")
    screen = FakeTerminal()
    progress = Progress(total=2, enabled=False, stream=screen, log_every=1)
    progress.update(1, loss=1.0, tokens_per_s=1.0)
    progress.write("hello")
    assert screen.getvalue() == "" and caplog.records == []


def test_throughput_is_reported_in_the_unit_given(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="elastic._worker.observe.progress")
    screen = FakeTerminal()
    bar = Progress(total=1, stream=screen, unit="images")
    bar.update(1, loss=0.5, tokens_per_s=2048.0)
    bar.close()
    assert "images_s=2,048" in screen.getvalue()
    Progress(total=1, stream=io.StringIO(), log_every=1, unit="images").update(1, loss=0.5, tokens_per_s=2048.0)
    assert caplog.records[-1].getMessage() == "step 1/1 loss 0.5000 2048 images/s"
