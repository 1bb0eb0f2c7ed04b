"""The line `train-head` shows: answering, then training."""

from __future__ import annotations

import io

from app.train.progress_line import TerminalLine
from backends.train_progress import TrainProgress


def test_the_answering_line_shows_a_rate_only_once_tokens_are_written():
    assert TrainProgress("data", 0, 64).line() == \
        "answering prompts [........................] 0/64"
    assert TrainProgress("data", 32, 64, 12.4).line().endswith("32/64  12 tok/s")


def test_the_training_line_shows_step_rate_loss_and_top1_per_depth():
    line = TrainProgress("train", 3, 10, 678.0, 7.3, (0.11, 0.07), epoch=1).line()
    assert line.startswith("epoch 1 [#######")
    assert line.endswith("step 3/10  678 tok/s  loss 7.300  top-1 by depth 0.11 0.07")


def test_off_a_terminal_each_update_is_its_own_line_and_notes_always_show():
    stream, now = io.StringIO(), [100.0]
    show = TerminalLine(stream, clock=lambda: now[0])
    show(TrainProgress("data", 1, 4, 5.0))
    now[0] += 0.5
    show(TrainProgress("data", 2, 4, 5.0))  # within a second of the last line: left out
    show(TrainProgress("note", 0, 0, message="the checkpoint is for another head"))
    show(TrainProgress("data", 4, 4, 5.0))  # the last one always shows
    assert stream.getvalue().splitlines() == [
        "answering prompts [######..................] 1/4  5 tok/s",
        "the checkpoint is for another head",
        "answering prompts [########################] 4/4  5 tok/s"]
