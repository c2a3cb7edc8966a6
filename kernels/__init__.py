"""Triton kernels for the model runner (paged KV write, paged decode and ragged prefill attention, RMSNorm,
rotary) with torch references in kernels.reference. Import the submodule you need: this package imports nothing,
so `import kernels` stays cheap and pulls in no triton."""
