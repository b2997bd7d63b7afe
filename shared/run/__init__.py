"""The run directory's contract between proxy and worker (docs/architecture.md#the-run-directory):
its names (`layout`), `run.json`'s configuration (`config`), the worker's command line
(`worker_options`), the handshake (`handshake`), `.loss.json` (`loss_history`) and a stop asked
for during creation (`stop_request`)."""
