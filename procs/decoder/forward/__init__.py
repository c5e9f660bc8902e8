"""The model forward: the lean Llama-family model, its linear layers and quantised blocks,
the native CPU build (csrc/), CUDA graphs, and how many threads it runs on.
"""
