"""Failing tools are visible on the console (issue 55): one warning at the first failed call, with the tool's
error, and a summary when most calls of a window of steps fail. The trajectories come from the real turn loop with
the scripted policy of test_turn_loop."""

from __future__ import annotations

import logging

from ketch.data.builtin.calculator import CALL
from ketch.rollout.multi_turn.metrics import ToolFailureWatch
from multi_turn.test_turn_loop import run

FAILING = {"3*4=": [CALL.format("3*"), "#### 12"], "2+5=": [CALL.format("2+5"), "#### 7"]}
"""One call of two fails: `3*` is no expression."""
FAILED_REPLY = "calculate: error: ValueError: cannot read the expression '3*': invalid syntax"


def warnings(caplog) -> list[str]:
    """The warnings logged (other tests may have set the `ketch` logger to INFO)."""
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_first_failed_tool_call_is_one_warning_with_its_error(caplog):
    out, _ = run(["3*4=", "2+5="], script=FAILING)
    watch = ToolFailureWatch(threshold=0.5, window=10)
    with caplog.at_level(logging.WARNING, logger="ketch"):
        watch(out.non_tensor_batch, step=3)
        watch(out.non_tensor_batch, step=4)
    assert warnings(caplog) == [
        f"a tool call failed at step 3: {FAILED_REPLY}; the model reads the error as the tool's reply (multi_turn/"
        "tool_error_rate counts the failures; a summary follows when more than 50% of the calls of 10 steps fail)"
    ]


def test_a_window_of_steps_where_most_calls_fail_is_summarised(caplog):
    out, _ = run(["3*4="], script=FAILING)  # its only call fails: 3 failed calls in 3 steps
    watch = ToolFailureWatch(threshold=0.5, window=3)
    with caplog.at_level(logging.WARNING, logger="ketch"):
        for step in range(1, 7):
            watch(out.non_tensor_batch, step)
    assert warnings(caplog)[1:] == [
        f"tools failed in 3 of 3 calls (100%) in steps {first}-{last}: check the tools (rollout.multi_turn.tools) "
        "and the calls the model writes (samples.jsonl, multi_turn/tool_error_rate)"
        for first, last in ((1, 3), (4, 6))
    ]


def test_a_window_where_half_the_calls_or_fewer_fail_says_nothing_more(caplog):
    out, _ = run(["3*4=", "2+5="], script=FAILING)  # one call of two fails: 50%, not above it
    watch = ToolFailureWatch(threshold=0.5, window=2)
    with caplog.at_level(logging.WARNING, logger="ketch"):
        for step in range(1, 5):
            watch(out.non_tensor_batch, step)
    assert len(warnings(caplog)) == 1 and warnings(caplog)[0].startswith("a tool call failed at step 1")
