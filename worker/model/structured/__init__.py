"""Structured output (response_format: JSON schema, JSON object, regex, Lark grammar) as token masks, on
llguidance.

- `compile.py`: what compiling one grammar needs, shared by the compiler and its judges (limits, the compiled
  result, the check made before the first step).
- `grammar.py`: the compiler (a cache, compile threads at lowered priority, a first pass at cut limits) and the
  per-request matchers and their bitmask.
- `judge.py`: the judge processes that settle what the first pass cannot.
- `screen.py`: the cheap screen a spec passes before any compile.
- `manager.py`: the engine's side: which requests wait for a grammar, and their masks at each step.
"""
