"""Model resolution, GGUF conversion and BLAS set-up."""
