"""An OpenAI-compatible HTTP API in front of Triton (FastAPI + uvicorn).

    errors    OpenAI's error shape; a Triton error message -> HTTP status
    schemas   request models (pydantic) and what each field becomes on the Triton side
    triton    the Triton client: model listing, one asyncio gRPC stream per generation
    backend   what the app asks of the server behind it (the Triton client above, or a test's fake)
    chat      chat templates from each model's own tokenizer
    app       the FastAPI application: /v1/models, /v1/completions, /v1/chat/completions
    server    OpenAIServer (uvicorn in a thread)

`tritonlm serve` starts it next to tritonserver (--openai-port, default 9000); `tritonlm openai`
(tritonlm/commands/openai.py) runs it alone.
"""
