"""A lesson's checkpoint: the learner's code on a few cases, one line of verdict, and the code to go on with.

A `your-turn` cell asks the learner to write a small function. The `checkpoint` cell after it calls
``checkpoint(...)``, which tries that function on the cases the lesson chose and prints exactly one line:

* ``✅`` every case right: the lesson goes on with the learner's function;
* ``⏳`` not written yet (the stub's ``NotImplementedError``, or nothing defined): the course's version;
* ``❌`` a wrong answer or an exception: which case, what came back, what was expected, and a hint;
  the lesson goes on with the course's version.

Nothing a learner writes can stop the lesson here: every exception is caught and said in that line, never
shown as a traceback from deep inside minikv. The lesson's own cells then use whatever ``checkpoint``
returned, so an unfinished or wrong answer costs the learner nothing but the message.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

GO_ON_WITH_COURSE = "the lesson goes on with the course's version"
MAX_SHOWN = 70   # characters of a value shown in the message: the line stays one line on screen


@dataclass(frozen=True)
class Case:
    """One call to try: ``yours(*args, **kwargs)`` should return ``expected`` (compared by ``same``)."""

    args: tuple
    expected: Any
    hint: str = ""        # what a wrong answer on this case usually means, said after it
    kwargs: dict = field(default_factory=dict)
    label: str = ""       # how the message names the call; default: the arguments' reprs

    def call_text(self, name: str) -> str:
        if self.label:
            return f"{name}({self.label})"
        shown = [short(a) for a in self.args] + [f"{k}={short(v)}" for k, v in self.kwargs.items()]
        return f"{name}({', '.join(shown)})"


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _name(fn: Any, default: str) -> str:
    return getattr(fn, "__name__", None) or default


def checkpoint(what: str, yours: Callable | None, course: Callable, cases: Sequence[Case] = (), *,
               check: Callable[[Callable], str | None] | None = None,
               same: Callable[[Any, Any], bool] = operator.eq) -> Callable:
    """Try ``yours`` on ``cases`` (or with ``check``, which returns a problem in words or None); print one
    line; return ``yours`` if it passed, else ``course``.

    ``what`` names the task in the message ("bytes per token"). ``check`` is for answers a table of cases
    cannot judge: it gets the learner's function and returns what is wrong, or None.
    """
    verdict, passed = _verdict(what, yours, cases, check, same)
    print(verdict)
    return yours if passed else course


def _verdict(what, yours, cases, check, same) -> tuple[str, bool]:
    if yours is None or not callable(yours):
        return f"⏳ {what}: nothing to check yet (no function defined); {GO_ON_WITH_COURSE}.", False
    name = _name(yours, "yours")
    current = name  # the call being tried, for the message if it raises
    try:
        for case in cases:
            current = case.call_text(name)
            got = yours(*case.args, **case.kwargs)
            if not _same(same, got, case.expected):
                hint = f" {case.hint}" if case.hint else ""
                return (f"❌ {what}: {current} returned {short(got)}, expected {short(case.expected)}.{hint} "
                        f"For now {GO_ON_WITH_COURSE}."), False
        if check is not None:
            current = name
            problem = check(yours)
            if problem:
                return f"❌ {what}: {problem} For now {GO_ON_WITH_COURSE}.", False
    except NotImplementedError as err:
        said = str(err) or "not implemented yet"
        return f"⏳ {what}: {said}; {GO_ON_WITH_COURSE}.", False
    except Exception as err:  # noqa: BLE001 - whatever the learner's code raises is said in one line
        return (f"❌ {what}: {current} raised {type(err).__name__}: {_one_line(err)}. "
                f"For now {GO_ON_WITH_COURSE}."), False
    count = f"{len(cases)} case{'s' if len(cases) != 1 else ''}" if cases else "the check"
    return f"✅ {what}: right on {count}; the lesson goes on with yours.", True


def _same(same, got, expected) -> bool:
    try:
        return bool(same(got, expected))
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not the expected one
        return False


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 2 * MAX_SHOWN else text[: 2 * MAX_SHOWN - 3] + "..."


__all__ = ["Case", "checkpoint"]
