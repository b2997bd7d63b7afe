"""The readers and writers of the proxy's files in a run directory, one module per file
(docs/architecture.md#the-run-directory). The bottom layer of the proxy: imports only shared/."""
