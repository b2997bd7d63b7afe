"""The data mixture: the bandit, its bounds, the controller that posts policies, collapse watch,
arm changes and the rebuild of the mixture from the history (docs/bandit.md;
docs/architecture.md#the-proxys-layers). Imports only the run-file layer and shared/."""
