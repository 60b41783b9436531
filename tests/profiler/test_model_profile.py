"""tfplan.profiler.model_profile: a saved profile round-trips, and a damaged one is refused."""
from __future__ import annotations

import pytest

from tfplan.core.errors import SchemaError
from tfplan.profiler.model_profile import ModelProfile
from tests.planner.gpt_profile import gpt_profile


def test_a_profile_round_trips_through_its_dict():
    profile = gpt_profile(2, 64, 4)
    assert ModelProfile.from_dict(profile.to_dict()) == profile


def test_a_profile_without_layers_is_refused_with_what_to_rerun():
    doc = gpt_profile(2, 64, 4).to_dict()
    doc["layers"] = []
    with pytest.raises(SchemaError, match=r"ModelProfile\.layers is empty.*plan analyze"):
        ModelProfile.from_dict(doc)
