"""The self-check reads well in a notebook: a hint once, lines that wrap at words (issue 19)."""

from minikv.grading.grader import SCREEN_WIDTH, SELF_CHECK, CheckResult, result_lines


def test_a_hint_met_by_several_checks_is_printed_once():
    hint = "not implemented yet: first the bytes one token costs in ONE layer; then, layer by layer, " \
           "how many tokens that layer keeps"
    results = [CheckResult("a", False, hint), CheckResult("b", False, hint), CheckResult("c", True),
               CheckResult("d", False, hint), CheckResult("e", False, "another hint")]
    text = "\n".join(result_lines(results))
    assert text.count("ONE layer") == 1 and text.count("another hint") == 1
    assert "FAIL  b: the same as above" in text and "PASS  c" in text


def test_lines_fit_the_screen_and_break_between_words():
    words = ["allocate", "free", "refcount", "copy-on-write"] * 20
    lines = result_lines([CheckResult("long", False, " ".join(words))]) + SELF_CHECK.splitlines()
    assert all(len(line) <= SCREEN_WIDTH for line in "\n".join(lines).splitlines())
    assert set(" ".join(lines).split()) == {"FAIL", "long:", *words} | set(" ".join(SELF_CHECK.split()).split())
