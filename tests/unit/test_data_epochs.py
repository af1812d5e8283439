"""recipes/inputs.py's account of how often a run goes through its training data: the banner's
note when --max_steps repeats map-style data, the closing note when a stream wraps, and
all_results.json's ``data`` record. The launched runs: tests/recipe/test_data_repeat.py."""

import pytest

from recipes.inputs import data_epochs, data_record, repeat_note, stream_note


def test_repeat_note_when_max_steps_exceeds_one_epoch():
    note = repeat_note(80, 37, 80, 1)
    assert note == ("note: --max_steps 80 is 2.16 epochs of the training data (37 steps/epoch): the data repeat, "
                    "3 epochs are needed (--num_epochs 1 applies only without --max_steps)")
    assert repeat_note(74, 37, 74, 2) == ("note: --max_steps 74 is 2.00 epochs of the training data (37 "
                                          "steps/epoch): the data repeat, 2 epochs are needed")
    assert repeat_note(37, 37, 37, 1) is None  # one epoch exactly: nothing repeats
    assert repeat_note(10, 37, 10, 1) is None
    assert repeat_note(111, 37, None, 3) is None  # the length came from --num_epochs: asked for
    assert repeat_note(60, None, 60, 1) is None  # a stream: no epochs known in advance


def test_stream_note_and_data_record():
    assert stream_note(0, 60) is None
    assert stream_note(1, 60) == ("note: the training stream reached the end of a rank's shard once and went on from "
                                  "its start (the data repeat): --max_steps 60 needs more than 1 pass over this corpus")
    assert "2 times" in stream_note(2, 60) and "more than 2 passes" in stream_note(2, 60)
    assert data_epochs(80, 37) == pytest.approx(80 / 37) and data_epochs(80, None) is None
    assert data_record(80, 37, None) == {"source": "map-style", "steps_per_epoch": 37, "epochs": pytest.approx(80 / 37),
                                         "stream_passes": None, "repeated": True}
    assert data_record(30, 37, None)["repeated"] is False
    assert data_record(60, None, 1) == {"source": "stream", "steps_per_epoch": None, "epochs": None,
                                        "stream_passes": 1, "repeated": True}
    assert data_record(60, None, 0)["repeated"] is False
