"""minikv.speed.operators: the compiled graph's opaque operators, defined once per process."""

import torch

from minikv.speed.operators import operator


def test_a_second_definition_takes_over_as_with_custom_op():
    """A module that defines operators may be loaded twice in one process (`bench ops` loads minikv.speed.linears
    by path, then the package imports it): torch takes one definition of a schema, so the second implementation
    must replace the first, not raise."""
    schema = "test_defined_twice(Tensor x) -> Tensor"
    fake = lambda x: torch.empty_like(x)   # noqa: E731
    first = operator(schema, lambda x: x + 1, fake)
    assert first(torch.zeros(2)).tolist() == [1, 1]
    second = operator(schema, lambda x: x + 2, fake)
    assert second is first and first(torch.zeros(2)).tolist() == [2, 2]
    torch.library.opcheck(second, (torch.zeros(3),), test_utils=("test_schema", "test_faketensor"))
