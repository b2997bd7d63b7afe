"""What an operator sees of a run: progress lines, the summary, TensorBoard scalars, plots and
the layout of sample audits (docs/architecture.md#the-proxys-layers). Imports only the run-file
layer and shared/."""
