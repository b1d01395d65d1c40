"""A one-stage pipeline for the serving tests: a vLLM text generator as the chat stage.

It reaches the plugin the way a third-party pipeline does, through the
`vllm_omni_plugin.pipelines` entry-point group (conftest.py writes the distribution metadata
that names it), so the server under test is the installed plugin, unpatched. It stands in for
Qwen3-Omni's thinker, whose vLLM model needs torchvision (absent from the CPU test setup): the
chat path (text_engine.py, ar_text.py, chat_routes.py) does not depend on the model.
"""

from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec

TEXT_CHAT = PipelineTopology(
    key="test_text_chat",
    stages=(
        StageSpec(
            stage_id=0,
            name="chat",
            kind="ar",
            inputs=[],
            emits="text",
            final_output=True,
            hf_architecture="Qwen2ForCausalLM",
        ),
    ),
    chat_stage=0,
    description="test: one vLLM text-generation stage answering chat (no speech)",
)
