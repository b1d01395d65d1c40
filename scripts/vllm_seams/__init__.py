"""The pieces of scripts/check_vllm_seams.py, the tool that checks a vLLM release still has
every seam vllm-omni-plugin relies on (that script's docstring says what is checked; it is the
entry point and holds the list of checks). `tables` loads the plugin's own tables of seams,
`source` and `ast_helpers` read vLLM's sources with `ast`, `report` tallies the checks,
`project` checks our own code against vLLM, and `serve`, `engine` and `window` check the seams
the plugin patches or hooks into.
"""
