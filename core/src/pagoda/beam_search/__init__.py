"""Beam search in one place.

* ``group``: one prompt's group and its selection policy (transformers' rules);
* ``scheduling``: the component the scheduler calls at its named points
  (admission, idle-beam preemption, new rows, after each update);
* ``frontend``: what ``LLMEngine`` does around it (build the group, turn the
  finished group into a ``RequestOutput``);
* ``outputs``: vLLM's result shapes (``BeamSearchOutput``, ``BeamSearchSequence``).
"""

from pagoda.beam_search.group import BeamGroup, EarlyStopping
from pagoda.beam_search.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    beam_search_score,
    beams_to_request_output,
    request_output_to_beam_search_output,
)
from pagoda.sampling_params import BeamSearchParams

__all__ = [
    "BeamGroup",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "EarlyStopping",
    "beam_search_score",
    "beams_to_request_output",
    "request_output_to_beam_search_output",
]
