"""SamplingParams' messages say the allowed range in words a user can act on: no float32
limits spelled as 3.4e+38."""

import re

import pytest

from jaxserve.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("repetition_penalty", -1.0),
                                         ("temperature", float("inf")), ("top_p", 2.0), ("min_p", 2.0)])
def test_range_messages_have_no_float32_limits(field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    message = str(exc.value)
    allowed = message.split("; got ")[0]          # the part the server wrote, not the value sent
    assert message.startswith(f"{field} must be") and not re.search(r"\de[+-]?\d", allowed), message
