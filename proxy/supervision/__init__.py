"""Supervision of a run: creating or resuming it, spawning and watching the worker's process
tree, filing its reports (docs/architecture.md#the-proxys-layers). Imports the mixture,
observation and run-file layers and shared/, never a command."""
