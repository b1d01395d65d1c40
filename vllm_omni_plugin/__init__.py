"""vllm-omni-plugin: multi-stage omni generation pipelines served by stock vLLM."""

__version__ = "0.1.0"
