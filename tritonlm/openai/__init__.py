"""An OpenAI-compatible HTTP API in front of Triton (FastAPI + uvicorn).

    errors    OpenAI's error shape; a Triton error message -> HTTP status
    schemas   request models (pydantic) and what each field becomes on the Triton side
    triton    the Triton client: model listing, one asyncio gRPC stream per generation
    chat      chat templates from each model's own tokenizer
    app       the FastAPI application: /v1/models, /v1/completions, /v1/chat/completions
    server    OpenAIServer (uvicorn in a thread) and the `tritonlm openai` command

`tritonlm serve` starts it next to tritonserver (--openai-port, default 9000).
"""
