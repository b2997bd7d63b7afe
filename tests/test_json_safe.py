"""shared/json_safe.py: the one "make JSON-safe" helper, used by `.loss.json` and the worker's
step reports alike, so a NaN loss or a numpy count never breaks either writer. Fast."""
from __future__ import annotations

import json
import math

import numpy as np

from shared.json_safe import jsonable
from shared.run.handshake import ReportReader, ReportWriter
from shared.run.layout import RunLayout
from shared.run.loss_history import LossHistory, iter_records

RECORD = {"step": 3, "loss": math.nan, "lr": np.float32(0.5), "arms": {"a": np.int64(2)},
          "p": (0.25, 0.75), "probe": {"a": math.inf, "b": -math.inf}, "grad": np.array([1.0, np.nan])}
SAFE = {"step": 3, "loss": None, "lr": 0.5, "arms": {"a": 2}, "p": [0.25, 0.75],
        "probe": {"a": None, "b": None}, "grad": [1.0, None]}


def test_jsonable_nulls_non_finite_floats_and_unwraps_numpy_at_any_depth():
    assert jsonable(RECORD) == SAFE
    json.dumps(jsonable(RECORD), allow_nan=False)


def test_the_history_and_the_step_reports_write_the_same_safe_values(tmp_path):
    layout = RunLayout(tmp_path)
    with LossHistory(layout.loss) as h:
        h.append(RECORD)
    assert list(iter_records(layout.loss)) == [SAFE]
    writer = ReportWriter(layout)
    writer.write({"type": "step", **RECORD})  # a numpy count made this raise TypeError before
    writer.close()
    assert ReportReader(layout).read() == [{"type": "step", **SAFE}]
