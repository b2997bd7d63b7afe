"""Files in a run directory other than `.loss.json` do not grow with the number of steps:
`.reports.jsonl` is emptied by its reader once consumed, without losing a report
that a concurrent writer appends. Real files, a real writer thread, the real reader."""
import os
import threading
import time

from shared.run.handshake import ReportReader, ReportWriter
from shared.run.layout import RunLayout


def test_reports_log_stays_bounded_and_loses_nothing_under_a_concurrent_writer(tmp_path):
    layout = RunLayout(tmp_path)
    n, limit = 5_000, 16 << 10
    w = ReportWriter(layout)
    reader = ReportReader(layout, compact_bytes=limit)
    done = threading.Event()

    def write():  # bursts of reports with a pause between, as a worker's steps write them
        for k in range(1, n + 1):
            w.write({"type": "step", "step": k, "loss": 1.0 / k, "pad": "x" * 40})
            if k % 20 == 0:
                time.sleep(0.001)
        done.set()
    t = threading.Thread(target=write)
    t.start()
    got, biggest = [], 0
    while not done.is_set() or len(got) < n:
        got += [r["step"] for r in reader.read()]
        biggest = max(biggest, os.path.getsize(layout.reports))
    t.join()
    w.close()
    assert got == list(range(1, n + 1)), "every report exactly once, in order"
    total = n * 80
    assert biggest < total / 4, f"the file grew to {biggest:,} bytes of {total:,} written"


def test_without_compaction_the_log_keeps_every_report(tmp_path):
    """Negative control: a reader that never compacts leaves the whole history in the file."""
    layout = RunLayout(tmp_path)
    w = ReportWriter(layout)
    reader = ReportReader(layout, compact_bytes=1 << 60)
    for k in range(2000):
        w.write({"type": "step", "step": k})
        if k % 100 == 0:
            reader.read()
    reader.read()
    assert os.path.getsize(layout.reports) > 2000 * 20
