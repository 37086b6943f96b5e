"""`tritonlm generate`: ask a generation model for text and print it as it streams
(through tritonlm/client/generate.py)."""

from __future__ import annotations

import sys
import urllib.error

from tritonlm.errors import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a served model")
    p.add_argument("prompt")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--url", default=None, help="server address (default localhost:8001 for grpc, :8000 for http)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--stop", action="append", dest="stop_words", help="stop string (repeatable)")
    p.add_argument("--bad-word", action="append", dest="bad_words", help="word never to produce (repeatable)")
    p.add_argument("--num-draft-tokens", type=int, help="speculative decoding: draft length (0 = off)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tritonlm.client.generate import GenerateError, generate_grpc, generate_http, generate_stream_http

    params = {
        "max_tokens": args.max_tokens, "min_tokens": args.min_tokens, "temperature": args.temperature,
        "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, "repetition_penalty": args.repetition_penalty,
        "stop_words": args.stop_words, "bad_words": args.bad_words, "num_draft_tokens": args.num_draft_tokens,
        "exclude_input_in_output": True,
    }
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    try:
        if args.protocol == "grpc":
            printer = (lambda piece: (sys.stdout.write(piece), sys.stdout.flush())) if args.stream else None
            result = generate_grpc(url, args.model, args.prompt, on_piece=printer, stream=args.stream, **params)
            if not args.stream:
                sys.stdout.write(result.text)
            print(f"\n[{result.finish_reason}: {result.num_input_tokens} prompt tokens, {result.num_output_tokens} generated]", file=sys.stderr)
        else:
            params = {k: v for k, v in params.items() if v is not None}
            if args.stream:
                for event in generate_stream_http(url, args.model, args.prompt, **params):
                    sys.stdout.write(event.get("text_output", ""))
                    sys.stdout.flush()
                print()
            else:
                print(generate_http(url, args.model, args.prompt, **params).get("text_output", ""))
    except GenerateError as e:
        raise CliError(f"{args.model}: {e}") from None
    except urllib.error.URLError as e:  # HTTP: nothing answers at url (an HTTP error status is a GenerateError)
        raise CliError(f"cannot reach the server at {url}: {e.reason}") from None
    except ConnectionError as e:
        raise CliError(f"cannot reach the server at {url}: {e}") from None
    return 0
