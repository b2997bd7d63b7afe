"""The flat checkpoint `step_NNNNNN.bin` (docs/checkpoint-format.md): its layout and names
(`file_format`), reading and validating (`read`), the atomic write (`write`), the run directory's
checkpoints (`directory`), the manifest `checkpoints.json` (`manifest`) and retention
(`retention`). numpy and the standard library only: both sides use it."""
