"""Triton kernels for the model runner's `triton` attention backend (worker/model/triton_attention.py): paged KV
write, paged decode and ragged prefill attention, with torch references in kernels.reference. Import the submodule
you need: this package imports nothing, so `import kernels` stays cheap and pulls in no triton."""
