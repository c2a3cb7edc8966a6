"""Tool calling in the worker: the prompt the tools are shown in (render.py), the grammar a forced call follows
(grammar.py), and the calls parsed back out of the output, as it streams (parse.py). One convention runs
through all three, the Hermes/Qwen one: a call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
"""
