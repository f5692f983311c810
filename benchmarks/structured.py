"""Structured output through HTTP against a running engine: the share of sampled replies that
parse and match their schema, and output tok/s with a schema against without, at one
concurrency (closed loop: each of C clients sends its next request when the last one ends).

    PYTHONPATH=engine:. python benchmarks/structured.py --url http://127.0.0.1:8000 \
        --model-name qwen3-0.6b --concurrency 64 --num-requests 256 --num-samples 200

Both passes send the same chat prompt at temperature 1 with `max_completion_tokens`; the
schema's pass adds `response_format` json_schema (`SCHEMA`, whose replies are bounded, so a
random-weight model finishes them too). Tokens are counted from each body's `usage`. The goals
(issue 51): every sample matches; with a schema at least 80% of the tok/s without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tier": {"enum": ["free", "pro", "team"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tier", "tags", "active"],
    "additionalProperties": False,
}
PROMPT = "Describe one customer of a software company as a JSON record."


def matches(value: Any) -> bool:
    """`value` matches SCHEMA (checked by hand: the schema is small)."""
    tags = value.get("tags") if isinstance(value, dict) else None
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "tier", "tags", "active"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 24
        and type(value["age"]) is int
        and 0 <= value["age"] <= 150
        and value["tier"] in ("free", "pro", "team")
        and isinstance(tags, list)
        and len(tags) <= 4
        and all(isinstance(t, str) and len(t) <= 12 for t in tags)
        and isinstance(value["active"], bool)
    )


def body(model: str, max_tokens: int, seed: int, with_schema: bool) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 1.0,
        "seed": seed,
        "max_completion_tokens": max_tokens,
    }
    if with_schema:
        spec = {"name": "customer", "schema": SCHEMA}
        request["response_format"] = {"type": "json_schema", "json_schema": spec}
    return request


async def run_pass(
    url: str, model: str, concurrency: int, num_requests: int, max_tokens: int, with_schema: bool
) -> tuple[float, list[tuple[str, str]]]:
    """Output tok/s and each reply's (text, finish reason)."""
    replies: list[tuple[str, str]] = []
    num_tokens = 0
    next_seed = iter(range(num_requests))
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            nonlocal num_tokens
            for seed in next_seed:
                request = body(model, max_tokens, seed, with_schema)
                async with session.post(f"{url}/v1/chat/completions", json=request) as answer:
                    payload = await answer.json()
                    if answer.status != 200:
                        raise RuntimeError(f"{answer.status}: {payload}")
                num_tokens += payload["usage"]["completion_tokens"]
                choice = payload["choices"][0]
                replies.append((choice["message"]["content"] or "", choice["finish_reason"]))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return num_tokens / seconds, replies


def parses(text: str) -> bool:
    try:
        return matches(json.loads(text))
    except json.JSONDecodeError:
        return False


async def main(args: argparse.Namespace) -> dict[str, Any]:
    url, model = args.url.rstrip("/"), args.model_name
    _, samples = await run_pass(
        url, model, args.concurrency, args.num_samples, args.max_tokens, with_schema=True
    )
    plain_tok_s, _ = await run_pass(
        url, model, args.concurrency, args.num_requests, args.max_tokens, with_schema=False
    )
    schema_tok_s, _ = await run_pass(
        url, model, args.concurrency, args.num_requests, args.max_tokens, with_schema=True
    )
    num_matching = sum(parses(text) for text, _ in samples)
    return {
        "concurrency": args.concurrency,
        "num_samples": len(samples),
        "num_matching": num_matching,
        "num_cut_by_length": sum(reason == "length" for _, reason in samples),
        "plain_output_tok_s": plain_tok_s,
        "schema_output_tok_s": schema_tok_s,
        "schema_over_plain": schema_tok_s / plain_tok_s,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="a running engine server")
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=256, help="per throughput pass")
    parser.add_argument("--num-samples", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=256)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
