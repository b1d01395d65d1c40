"""Every seam between vLLM and this plugin: the hooks vLLM's entry points call."""
