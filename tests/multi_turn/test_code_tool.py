"""The `python` tool: output, errors, and its time, memory and network limits."""

from __future__ import annotations

from ketch.rollout.multi_turn import code_tool
from ketch.rollout.multi_turn.code_tool import run_python


def test_a_program_prints_its_result_and_a_failure_says_why():
    assert run_python("print(sum(range(101)))") == "5050\n"
    assert run_python("print('half'); 1/0") == "half\nerror: ZeroDivisionError: division by zero"
    assert run_python("x = 1") == "(no output; print() what you want to see)"


def test_limits_stop_long_hungry_and_networked_programs(monkeypatch):
    monkeypatch.setattr(code_tool, "TIME_LIMIT_S", 1.0)
    assert run_python("while True: pass") == "error: the program ran longer than 1 s and was stopped"
    assert run_python("x = bytearray(2 * 2**30)") == "error: MemoryError"
    network = run_python("import urllib.request; urllib.request.urlopen('http://example.com', timeout=2)")
    assert network == "error: urllib.error.URLError: <urlopen error network access is disabled in the python tool>"
