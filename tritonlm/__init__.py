"""tritonlm: serve GPT-2-class language models on NVIDIA Triton Inference Server."""

__version__ = "0.1.0"
