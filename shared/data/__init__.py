"""The data pipeline's files and formats (docs/data.md): the `--arm` option and each arm's
identity (`arms`), reading sources (`sources`), the checks before any work (`checks`),
tokenizing an arm into its token file (`tokenization`, with `tokenizer` and the embedded defaults
in `embedded`), the token files and `data/arms.json` (`token_files`) and an arm's repetitiveness
(`redundancy`). The worker reads only `token_files`, `arms`, `tokenizer` and `embedded`; the rest
is the proxy's, kept here beside the formats it writes (pyproject's import contracts)."""
