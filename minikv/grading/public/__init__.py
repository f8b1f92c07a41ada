"""What exercise notebooks import from the grading machinery: scenarios and helpers for the learner.

A submission's process may import and read these modules; it may not read ``minikv/grading/checks/``
(the reference answers and hidden inputs), see `minikv.grading.isolation`.
"""
