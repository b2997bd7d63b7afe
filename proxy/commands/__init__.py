"""The proxy's commands, one module per `python -m proxy` command (the top layer; see
docs/architecture.md#the-proxys-layers). A command may import every layer below it."""
