"""Clients of the generation model: tritonclient gRPC streaming and Triton's HTTP generate endpoints."""

from tritonlm.client.generate import GenerateResult, generate_grpc, generate_http, generate_stream_http

__all__ = ["GenerateResult", "generate_grpc", "generate_http", "generate_stream_http"]
