"""The frontend's output path, all pure and synchronous (the actors only feed it).

- `detokenizer`: incremental detokenization of one request, stop strings, text hold-back.
- `stop`: finding stop strings in new text; how much text to withhold.
- `processor`: `OutputProcessor`, engine outputs -> `RequestOutput`s per output kind; `state`: one
  request's `RequestState`.
- `collector`: `RequestOutputCollector`, one request's pending output for its consumer.
- `parallel`: n > 1, a parent request fanned out into children and their outputs gathered back.
"""

from troupe.output.collector import RequestOutputCollector
from troupe.output.detokenizer import IncrementalDetokenizer, make_detokenizer
from troupe.output.processor import OutputProcessor, ProcessedOutputs
from troupe.output.stop import check_stop_strings, hold_back_length

__all__ = [
    "IncrementalDetokenizer",
    "OutputProcessor",
    "ProcessedOutputs",
    "RequestOutputCollector",
    "check_stop_strings",
    "hold_back_length",
    "make_detokenizer",
]
