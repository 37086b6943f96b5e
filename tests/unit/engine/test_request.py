"""tritonlm/engine/request.py: sampling settings that would overflow are greedy in effect
or refused, naming the field."""

from __future__ import annotations

import pytest

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_engine
from tritonlm.engine.request import InvalidRequestError, check_priority


def test_overflowing_settings_are_greedy_or_refused():
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, MIXED_PROMPTS[1], max_tokens=8, temperature=1e-38, seed=1)  # greedy in effect
    drain(engine)
    assert col.ids(rid) == hf_greedy_text(MIXED_PROMPTS[1], 8)
    for bad, field in ((dict(repetition_penalty=1e-40, temperature=1.0), "repetition_penalty"),
                       (dict(min_tokens=9, max_tokens=8), "min_tokens")):
        with pytest.raises(InvalidRequestError, match=field):
            col.request(engine, MIXED_PROMPTS[1], **bad)


@pytest.mark.parametrize("value, error", [
    (1001, r"^priority: must be in \[-1000, 1000\].*got 1001"),
    (-1001, r"^priority: must be in \[-1000, 1000\].*got -1001"),
    (True, r"^priority: expected an integer in \[-1000, 1000\].*got bool"),
    (0.5, r"^priority: expected an integer.*got float"),
])
def test_check_priority_refuses_what_is_not_an_integer_in_range(value, error):
    with pytest.raises(InvalidRequestError, match=error):
        check_priority(value)


def test_check_priority_names_the_field_as_sent_and_passes_the_range():
    assert [check_priority(v) for v in (-1000, 0, 1000)] == [-1000, 0, 1000]
    with pytest.raises(InvalidRequestError, match=r"^sampling_parameters\.priority: "):
        check_priority(2000, "sampling_parameters.priority")
