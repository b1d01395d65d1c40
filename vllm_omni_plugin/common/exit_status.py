"""Exit statuses a stage process ends with that its starter acts on."""

# The stage's engine refused its settings (sysexits' EX_CONFIG): a start with the same settings
# would be refused again, so the orchestrator does not retry it.
EXIT_CONFIG = 78
