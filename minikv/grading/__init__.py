"""The graders' machinery: exercises generated from solutions, and submissions graded by the same checks.

* ``grader``: generate exercises, run an exercise's checks, grade a submission notebook (the API below).
* ``batch``: grade many submissions, stopping where the grader's files changed.
* ``sandbox``: the child process a submission's cells run in (the parent's side); ``child``: the script
  that process runs; ``wire``: the messages and proxies between them.
* ``isolation`` and ``landlock``: what the child may reach (another uid, Landlock, a private folder).
* ``integrity``: the digest of the grader's files, taken before each submission and checked after.
* ``delegation``: a static look at a submission for graded code that hands the work to minikv's own.
* ``checks/``: one module of checks per exercise (``exNN_topic.py``), out of a submission's reach;
  ``public/``: what the exercise notebooks import (scenarios, helpers), readable by a submission.

A learner never needs to read this package; an exercise's last cell calls ``grade``.
"""

from minikv.grading.grader import (
                                   CheckResult,
                                   NotImplementedYet,
                                   Report,
                                   call,
                                   generate_exercises,
                                   grade,
                                   grade_notebook,
                                   grade_submission,
                                   learner,
                                   make_exercise,
                                   one_torch_thread,
                                   peek,
                                   print_report,
                                   run_checks,
                                   run_hypothesis,
                                   source_of,
                                   strip_solutions,
)

__all__ = ["CheckResult", "NotImplementedYet", "Report", "call", "generate_exercises", "grade", "grade_notebook",
           "grade_submission", "learner", "make_exercise", "one_torch_thread", "peek", "print_report", "run_checks",
           "run_hypothesis", "source_of", "strip_solutions"]
