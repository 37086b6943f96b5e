"""Export a causal LM into Triton-servable artifacts (ONNX with KV cache, int8/fp16 ONNX,
TorchScript) and write a model repository around them.

Modules, one job each:
    wrapper         the flat-cache forward (the I/O contract every artifact follows)
    onnx_export     torch -> ONNX (dynamo), int8 quantization, fp16 conversion
    torchscript_export  torch.jit.trace of the same wrapper
    verify          artifact vs PyTorch on prefill / decode / padded batches
    repository      config.pbtxt writers (forward models, the generation entry)
    pipeline        what `tritonlm export` runs: load, export, verify, write, atomically

The commands that drive it (`tritonlm export`, `tritonlm serve-default`) are in tritonlm/commands.
"""
