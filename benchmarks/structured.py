"""Structured output through HTTP: the share of sampled replies that parse and match their
schema, and output tok/s with a schema against without, at one concurrency (closed loop: each
of C clients sends its next request when the last one ends).

    PYTHONPATH=engine:. python benchmarks/structured.py --url http://127.0.0.1:8000 \
        --model-name qwen3-0.6b --concurrency 64 --num-requests 256 --num-samples 200
    PYTHONPATH=engine:memplan:. python benchmarks/structured.py --shape qwen3-0.6b
    PYTHONPATH=engine:memplan:. python benchmarks/structured.py --shape qwen3-0.6b --smoke \
        --concurrency 8 --num-requests 16 --num-samples 8

`--smoke` shrinks the shape (two layers, a 4,096-token vocabulary) and runs it on the CPU: it
checks the benchmark's plumbing, not its figures. `--out` also writes the report there, with
the device and the versions. `benchmarks/structured_gpu.sh` is the one GPU command.

With `--shape` the engine is started here on random weights at that shape, with the default
flags and a character-level tokenizer padded to the shape's vocabulary (`write_json_tokenizer`:
every printable ASCII character is one token, so the grammar can spell any JSON, and the rest
of the vocabulary are filler words), so the grammar's masks cost what they cost at the real
vocabulary size.

Every pass sends the same chat prompt at temperature 1 with `max_completion_tokens`; the
schema's passes add `response_format` json_schema (`SCHEMA`, whose replies are bounded, so a
random-weight model finishes them too), and the pass without it caps each seed's reply at the
length of that seed's schema reply (`main`). Tokens are counted from each body's `usage`. The goals
(issue 51): every sample matches; with a schema at least 80% of the tok/s without.

Around the schema's throughput pass /metrics is read twice, and `grammar` reports what the
engine observed in between of its `pagekeeper_grammar_*_seconds` histograms (docs/engine.md,
"Metrics"): per series the count (structured steps), the sum, and p50/p90/p99 estimated from
the buckets as Prometheus would; printed as a table on stderr (stdout is the JSON report).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import metric_histograms, serving_server
from benchmarks import serving_workload as wl
from benchmarks.shapes import SHAPES

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
GRAMMAR_PREFIX = "pagekeeper_grammar_"
# The engine core's stats reach /metrics with its step outputs, and within its idle heartbeat
# (0.5 s, `messages.HEARTBEAT_INTERVAL_S`) once a pass is over: wait that long, twice, first.
METRICS_SETTLE_S = 1.0


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


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def write_json_tokenizer(model_dir: Path, config: dict[str, Any]) -> None:
    """One token per printable ASCII character (and newline), the shape's BOS and EOS ids as
    `<s>` and `</s>`, and filler words `w<i>` for the rest of its vocabulary; with a chat
    template, so `/v1/chat/completions` serves it."""
    size, bos, eos = config["vocab_size"], config["bos_token_id"], config["eos_token_id"]
    specials = {bos: "<s>", eos: "</s>", size - 1: "<unk>"}
    assert len(specials) == 3, "BOS, EOS and the last id are three tokens"
    characters = iter([chr(c) for c in range(32, 127)] + ["\n"])
    vocab = {specials.get(i) or next(characters, f"w{i}"): i for i in range(size)}
    tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tokenizer.save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


SMOKE_CONFIG: dict[str, Any] = {  # what --smoke changes in the shape
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def start_engine(
    shape: str, root: Path, max_num_seqs: int, engine_args: list[str], smoke: bool = False
) -> serving_server.Server:
    """The engine with its default flags on random weights at `shape` (the GPU, bf16), or at
    its shrunk copy on the CPU (`smoke`)."""
    from benchmarks.offline_engine import write_checkpoint  # noqa: PLC0415 (imports torch)

    model_dir = write_checkpoint(shape, root)
    config = {**SHAPES[shape], **(SMOKE_CONFIG if smoke else {})}
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    write_json_tokenizer(model_dir, config)
    if smoke:
        engine_args = ["--num-gpu-blocks-override", "1024", *engine_args]
    settings = wl.EngineSettings(
        "cpu" if smoke else "cuda",
        "float32" if smoke else "bfloat16",
        serving_server.MAX_MODEL_LEN,
        max_num_seqs,
        16,
        None,
        None if smoke else 0.9,
        True,
        False,
    )
    args = argparse.Namespace(start_timeout=1200.0, api_server_count=None, server_cpus=None)
    args.engine_arg = engine_args
    return serving_server.start_server(model_dir, settings, args, root / "engine.log")


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


@dataclass
class Reply:
    seed: int
    text: str
    finish_reason: str
    num_tokens: int  # the body's usage.completion_tokens


async def run_pass(
    url: str, model: str, concurrency: int, max_tokens: dict[int, int], with_schema: bool
) -> tuple[float, list[Reply]]:
    """Output tok/s and each reply, for one request a seed with its `max_tokens[seed]`."""
    replies: list[Reply] = []
    next_seed = iter(sorted(max_tokens))
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            for seed in next_seed:
                request = body(model, max_tokens[seed], seed, with_schema)
                async with session.post(f"{url}/v1/chat/completions", json=request) as answer:
                    payload = await answer.json()
                    if answer.status != 200:
                        raise RuntimeError(f"{answer.status}: {payload}")
                choice = payload["choices"][0]
                replies.append(Reply(
                    seed, choice["message"]["content"] or "", choice["finish_reason"],
                    payload["usage"]["completion_tokens"],
                ))  # fmt: skip

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return sum(r.num_tokens for r in replies) / seconds, replies


async def read_metrics(url: str) -> str:
    """The server's /metrics page once the core's newest stats have reached it."""
    await asyncio.sleep(METRICS_SETTLE_S)
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as answer:
        text = await answer.text()
        if answer.status != 200:
            raise RuntimeError(f"/metrics: {answer.status}: {text[:200]}")
        return text


def parses(text: str) -> bool:
    try:
        return matches(json.loads(text))
    except json.JSONDecodeError:
        return False


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """The samples' pass (validity), then the schema's throughput pass, then the same seeds
    without the schema, each capped at the length of its schema reply: a schema's replies end
    early, and shorter replies alone spend more of each second on prefill and admission, so
    the two passes compare the cost of the masks over the same output lengths."""
    url, model = args.url.rstrip("/"), args.model_name
    _, samples = await run_pass(
        url, model, args.concurrency, dict.fromkeys(range(args.num_samples), args.max_tokens), True
    )
    seeds = range(args.num_samples, args.num_samples + args.num_requests)
    metrics_before = await read_metrics(url)
    schema_tok_s, schema_replies = await run_pass(
        url, model, args.concurrency, dict.fromkeys(seeds, args.max_tokens), True
    )
    grammar = metric_histograms.summarize(metrics_before, await read_metrics(url), GRAMMAR_PREFIX)
    print(metric_histograms.format_table(grammar), file=sys.stderr, flush=True)
    lengths = {r.seed: max(1, r.num_tokens) for r in schema_replies}
    plain_tok_s, plain_replies = await run_pass(url, model, args.concurrency, lengths, False)
    num_matching = sum(parses(r.text) for r in samples)
    return {
        "concurrency": args.concurrency,
        "num_samples": len(samples),
        "num_matching": num_matching,
        "num_cut_by_length": sum(r.finish_reason == "length" for r in samples),
        "schema_mean_output_tokens": statistics.mean(lengths.values()),
        "plain_short_of_its_cap": sum(r.num_tokens < lengths[r.seed] for r in plain_replies),
        "plain_output_tok_s": plain_tok_s,
        "schema_output_tok_s": schema_tok_s,
        "schema_over_plain": schema_tok_s / plain_tok_s,
        "grammar": grammar,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.url is not None:
        return asyncio.run(main(args))
    with tempfile.TemporaryDirectory() as tmp:
        server = start_engine(args.shape, Path(tmp), args.max_num_seqs, args.engine_arg, args.smoke)
        try:
            args.url, args.model_name = server.url, serving_server.MODEL_NAME
            report = asyncio.run(main(args))
        finally:
            report_exit = server.stop()
        return {
            "shape": args.shape,
            "smoke": args.smoke,
            "engine_args": args.engine_arg,
            "server_exit_code": report_exit,
            **report,
        }


def environment() -> dict[str, Any]:
    """The device and the versions the figures were measured with."""
    from importlib.metadata import version  # noqa: PLC0415

    import torch  # noqa: PLC0415

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    packages = ("torch", "triton", "xgrammar", "transformers")
    versions = {}
    for name in packages:
        try:
            versions[name] = version(name)
        except ImportError:
            versions[name] = None
    return {"gpu": gpu, "cuda": torch.version.cuda, "versions": versions}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running engine server")
    where.add_argument("--shape", choices=list(SHAPES), help="start the engine here")
    parser.add_argument("--model-name", default=None, help="the served model name, with --url")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="with --shape")
    parser.add_argument(
        "--engine-arg", action="append", default=[], help="with --shape: --engine-arg=--x"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=256, help="per throughput pass")
    parser.add_argument("--num-samples", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="with --shape: tiny, on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parsed = parser.parse_args()
    if parsed.url is not None and parsed.model_name is None:
        parser.error("--url needs --model-name")
    result = {**run(parsed), **environment()}
    print(json.dumps(result, indent=2))
    if parsed.out is not None:
        parsed.out.write_text(json.dumps(result, indent=2) + "\n")
