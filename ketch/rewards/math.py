"""Scorer of `\\boxed{}` answers (MATH style): last boxed answer, lightly normalised, string or numeric match."""

from __future__ import annotations

import math
import re
from typing import Any

from ketch.rewards.registry import register_scorer

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_REMOVED = ("\\left", "\\right", "\\!", "\\,", "\\;", "^{\\circ}", "^\\circ", "\\%", "%", "\\$", "$")
_UNITS = re.compile(r"\\(?:text|mbox)\{\s[^{}]*\}(?:\^\{?\d\}?)?(?=[\s.$]*$)")
_TEXT = re.compile(r"\\(?:text|mbox|textbf|mathrm)\{([^{}]*)\}")
_FRAC = re.compile(r"\\frac(\{[^{}]*\}|[^{\\])(\{[^{}]*\}|[^{\\])")
_SQRT = re.compile(r"\\sqrt([^{\\\[])")
_VARIABLE = re.compile(r"^[a-zA-Z]=")
_DECIMAL = r"-?(?:\d+\.?\d*|\.\d+)"
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRACTION = re.compile(rf"^(-?)\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}$")
_SLASH = re.compile(rf"^({_DECIMAL})/({_DECIMAL})$")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}` (balanced braces), or None."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0 or text[start:open_at].strip() not in _BOX_COMMANDS:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1 : i]
    return None


def normalize(answer: str) -> str:
    """Light LaTeX normalisation: spacing, `\\left`/`\\right`, dfrac, degrees, percent, `$`, units, `\\frac12`."""
    s = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _UNITS.sub("", s)
    s = _TEXT.sub(r"\1", s)
    for token in _REMOVED:
        s = s.replace(token, "")
    s = "".join(s.split()).rstrip(".")
    s = _FRAC.sub(lambda m: f"\\frac{_braced(m.group(1))}{_braced(m.group(2))}", s)
    s = _SQRT.sub(lambda m: f"\\sqrt{_braced(m.group(1))}", s)
    if _VARIABLE.match(s) and s.count("=") == 1:
        s = s[2:]
    return s


def to_number(normalized: str) -> float | None:
    """The value of a plain number, `\\frac{a}{b}` or `a/b` (a, b decimals), else None."""
    plain = normalized.replace(",", "") if _THOUSANDS.fullmatch(normalized) else normalized
    try:
        return float(plain)
    except ValueError:
        pass
    if match := _FRACTION.match(normalized):
        sign = -1.0 if match.group(1) else 1.0
        return _divide(sign * float(match.group(2)), float(match.group(3)))
    if match := _SLASH.match(normalized):
        return _divide(float(match.group(1)), float(match.group(2)))
    return None


def is_equivalent(answer: str, truth: str) -> bool:
    """Equal after `normalize`, or both numbers within 1e-6."""
    a, b = normalize(answer), normalize(truth)
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=0.0, abs_tol=1e-6)


@register_scorer("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def score_math(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the last boxed answer matches `ground_truth` (an answer, or a solution with a boxed one)."""
    answer = last_boxed(solution_str)
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return float(answer is not None and is_equivalent(answer, truth))


def _braced(argument: str) -> str:
    return argument if argument.startswith("{") else f"{{{argument}}}"


def _divide(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None
