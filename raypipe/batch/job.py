"""`run_batch`: one offline job over object storage or local folders, on Ray Data.

    inputs (listing or manifest) - ids already in the output -> Ray Data:
      read_and_pack (CPU tasks) -> EncodeStage (autoscaling actor pool)
      -> GenerateStage (autoscaling actor pool, task=generate) -> write_rows (CPU tasks)

Re-running the same command carries on where a killed run stopped: the ids already written are
read back from the output's part files and left out (see `raypipe.batch.output` for why this, and
not Ray Data's checkpointing, gives exactly once). The CLI (`raypipe batch`) and Python callers
both come here with a `BatchOptions`; the summary is returned, not printed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Literal

import pyarrow as pa

from raypipe.batch import output
from raypipe.batch.inputs import list_inputs
from raypipe.config import EngineConfig, ImageLimits, ModelConfig
from raypipe.inputs.structured import StructuredOutput
from raypipe.inputs.video import VideoLimits
from raypipe.models.prompt import VideoOptions
from raypipe.storage import S3Options, open_filesystem

log = logging.getLogger(__name__)

# Whole-job attempts when Ray Data gives up on an actor of a pool (Ray 2.60 fails a dataset on the
# first pool actor that dies while starting, e.g. on a node preempted while the actor loads its
# model). Safe because every attempt starts from the output folder: only inputs without a written
# row run again.
JOB_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    input: str  # s3://bucket/prefix/, a local folder, or a manifest (.parquet / .jsonl) of image paths
    output: str  # s3://bucket/prefix/ or a local folder: Parquet part files
    task: Literal["embed", "generate"] = "embed"
    model: ModelConfig = ModelConfig(num_encoders=1)  # model, encoder pool (num..max), cost model, dtype
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)  # decode engine limits (generate)
    image_limits: ImageLimits = ImageLimits()
    video_limits: VideoLimits = VideoLimits()
    prompt: str = "Describe this image."  # for rows without a prompt of their own
    prompt_column: str | None = None  # manifest column with a per-row prompt
    path_column: str = "path"  # manifest column with image paths or URIs
    id_column: str = "id"  # manifest column with ids (default: the path)
    max_tokens: int = 32
    json_schema: str | None = None  # generate: a JSON schema (its text) every row's output must follow
    enable_thinking: bool | None = None  # generate: the chat template's thinking switch (Qwen3.5); None: its default
    # generate: the LoRA adapter of `engine.lora_modules` every row is generated with (its tower part, where the
    # family's encoders take one, encodes every image); rows carry its name as their model. None: the base model.
    lora: str | None = None
    # generate, instead of `lora`: the manifest column naming each row's adapter of `engine.lora_modules` (empty:
    # the base model); a row naming another is an error row (lora_not_found)
    lora_column: str | None = None
    pooling: Literal["mean", "none"] = "mean"
    num_decoders: tuple[int, int] = (1, 1)  # decode actor pool (min, max)
    batching: Literal["cost", "count"] = "cost"  # how encoder batches are formed
    batch_cost: float = 4.0  # cost budget per encoder batch, in units of the model's largest image
    batch_images: int = 8  # images per encoder batch with batching="count"; the most on average with "cost"
    read_batch: int = 32  # inputs per CPU decode task (packs are formed within one)
    rows_per_file: int = 256  # rows per output part file (the unit of resume)
    limit: int | None = None  # process at most this many of the missing inputs
    dry_run: bool = False  # list what would be processed; load no model
    s3: S3Options | None = None  # endpoint/region/keys; None: the AWS environment variables

    def __post_init__(self):
        if self.task not in ("embed", "generate"):
            raise ValueError(f"task must be embed or generate, got {self.task!r}")
        if self.pooling not in ("mean", "none"):
            raise ValueError(f"pooling must be mean or none, got {self.pooling!r}")
        if self.batching not in ("cost", "count"):
            raise ValueError(f"batching must be cost or count, got {self.batching!r}")
        lo, hi = self.num_decoders
        if not 1 <= lo <= hi:
            raise ValueError(f"num_decoders must be N or MIN:MAX with 1 <= MIN <= MAX, got {self.num_decoders}")
        if self.json_schema is not None:
            StructuredOutput(json=self.json_schema)  # not JSON: refused before any work starts
        if self.lora is not None and (self.task != "generate" or self.lora not in self.engine.lora_modules):
            raise ValueError(f"lora names an adapter of engine.lora_modules {sorted(self.engine.lora_modules)} and "
                             f"takes task generate; got {self.lora!r} with task {self.task}")
        if self.lora_column is not None and (self.task != "generate" or self.lora is not None
                                             or not self.engine.lora_modules):
            raise ValueError("lora_column takes task generate, adapters in engine.lora_modules and no lora (one "
                             f"adapter for every row); got task {self.task}, lora {self.lora!r}, "
                             f"lora_modules {sorted(self.engine.lora_modules)}")
        for name in ("rows_per_file", "read_batch", "batch_images", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def template_kwargs(self) -> dict:
        """The chat template's keyword arguments the job sets (its thinking switch, where given)."""
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

    def fingerprint(self) -> dict:
        """What decides the content of an output row: a re-run into the same output must match it."""
        fields = {"model": self.model.model, "task": self.task}
        if self.task == "embed":
            fields["pooling"] = self.pooling
        else:
            fields.update(prompt=self.prompt, prompt_column=self.prompt_column, max_tokens=self.max_tokens)
            if self.json_schema is not None:  # absent otherwise, so outputs written before it existed still match
                fields["json_schema"] = StructuredOutput(json=self.json_schema).json
            if self.enable_thinking is not None:  # the same
                fields["enable_thinking"] = self.enable_thinking
            if self.lora is not None:  # the same
                fields["lora"] = {self.lora: self.engine.lora_modules[self.lora]}
            if self.lora_column is not None:  # the same
                fields.update(lora_column=self.lora_column, lora_modules=dict(self.engine.lora_modules))
        return fields

    @property
    def loras(self) -> tuple[str, ...]:
        """The adapters the job's rows may use."""
        if self.lora_column is not None:
            return tuple(self.engine.lora_modules)
        return () if self.lora is None else (self.lora,)


@dataclasses.dataclass
class BatchSummary:
    inputs: int  # inputs listed
    skipped: int  # already in the output before this run
    processed: int  # inputs newly in the output after this run
    errors: dict[str, int]  # error code -> rows, among this run's rows
    seconds: float
    output: str
    dry_run: bool = False
    to_process: int = 0  # what this run set out to do (after skip and limit)
    duplicates_removed: int = 0
    rows_written: int = 0  # rows in the part files this run wrote (a retried write counts again)

    @property
    def images_per_s(self) -> float:
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "images_per_s": self.images_per_s}

    def describe(self) -> str:
        if self.dry_run:
            return (f"dry run: {self.inputs} inputs, {self.skipped} already in {self.output}, "
                    f"would process {self.to_process}")
        errors = ", ".join(f"{code}={n}" for code, n in sorted(self.errors.items())) or "none"
        return (f"{self.inputs} inputs | written {self.processed} | skipped (already done) {self.skipped} | "
                f"errors {errors} | {self.images_per_s:.1f} images/s over {self.seconds:.1f} s | "
                f"output {self.output}")


def run_batch(options: BatchOptions, *, ray_address: str | None = None,
              on_progress: Callable[[int, int], None] | None = None) -> BatchSummary:
    """Run the job; `on_progress(rows written, rows to process)` is called as part files are written."""
    start = time.perf_counter()
    inputs = list_inputs(options.input, options.s3, path_column=options.path_column, id_column=options.id_column,
                         prompt_column=options.prompt_column, lora_column=options.lora_column)
    fs, root = open_filesystem(options.output, options.s3)
    removed = 0
    if not options.dry_run:
        checkpoint, tower_loras = _read_and_check(options)  # before the folder records the job: see there
        output.check_job(fs, root, options.fingerprint())
        removed = output.reconcile(fs, root)  # a previous run may have died mid-way
    done = output.done_ids(fs, root)
    todo = _not_written(inputs, done)
    skipped = inputs.num_rows - todo.num_rows
    if options.limit is not None:
        todo = todo.slice(0, options.limit)
    summary = BatchSummary(inputs=inputs.num_rows, skipped=skipped, processed=0, errors={}, seconds=0.0,
                           output=options.output, dry_run=options.dry_run, to_process=todo.num_rows,
                           duplicates_removed=removed)
    if options.dry_run or todo.num_rows == 0:
        summary.seconds = time.perf_counter() - start
        return summary

    from ray.exceptions import RayActorError

    errors: collections.Counter = collections.Counter()
    for attempt in range(1, JOB_ATTEMPTS + 1):
        try:
            dataset = _dataset(options, todo, ray_address, checkpoint, tower_loras)
            for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
                for counts in batch.column("errors").to_pylist():
                    errors.update(json.loads(counts))
                summary.rows_written += sum(batch.column("rows").to_pylist())
                if on_progress is not None:
                    on_progress(summary.rows_written, summary.to_process)
            break
        except RayActorError as exc:
            if attempt == JOB_ATTEMPTS:
                raise
            summary.duplicates_removed += output.reconcile(fs, root)
            todo = _not_written(todo, output.done_ids(fs, root))
            log.warning("batch attempt %d of %d lost an actor (%s); carrying on with the %d inputs not yet "
                        "written", attempt, JOB_ATTEMPTS, type(exc).__name__, todo.num_rows)
            if todo.num_rows == 0:
                break
    summary.duplicates_removed += output.reconcile(fs, root)
    summary.processed = len(output.done_ids(fs, root)) - len(done)
    summary.errors = dict(errors)
    summary.seconds = time.perf_counter() - start
    return summary


def _not_written(table: pa.Table, done: set[str]) -> pa.Table:
    """The rows of `table` whose id has no row in the output yet, in their order."""
    return table.filter(pa.array([id_ not in done for id_ in table.column("id").to_pylist()], pa.bool_()))


def _read_and_check(options: BatchOptions):
    """`(checkpoint folder, {adapter: its tower part} for the job's adapters that have one)`, read, and the job's
    refusals that need them, all before `output.check_job` records the job in its output folder: a job refused
    after that would leave its options there, and the corrected command (a fixed adapter path, thinking turned
    off) would be refused as a different job. The checkpoint is copied or written on this node once, before the
    actors race to."""
    from raypipe.models.lora import read_tower_adapter
    from raypipe.models.registry import family_of, resolve_model

    checkpoint = resolve_model(options.model.model)
    family = family_of(checkpoint)
    if options.task == "generate" and options.json_schema is not None and family.thinks(options.template_kwargs):
        raise ValueError("json_schema would constrain this model's reasoning, which comes first: set "
                         "enable_thinking false (--no-thinking) with it")
    # Each whole save is read and its rank checked here; its language part is checked against the model where
    # the decoders load it. None: an adapter on the language model alone.
    towers = {name: read_tower_adapter(name, options.engine.lora_modules[name], family,
                                       f"engine.lora_modules.{name}", options.engine.max_lora_rank)
              for name in options.loras}
    return checkpoint, {name: tower for name, tower in towers.items() if tower is not None}


def _dataset(options: BatchOptions, todo, ray_address: str | None, checkpoint, tower_loras: dict):
    import ray

    from raypipe.batch import stages
    from raypipe.encode.pool import WorkerOptions
    from raypipe.encode.tower_lora import TowerLora
    from raypipe.models.registry import model_for_actors
    from raypipe.runtime.ray_cluster import connect_ray

    config = options.model
    model = model_for_actors(config.model, checkpoint)  # a name every node can resolve
    connect_ray(ray_address)
    # In the object store once; each encoder actor checks them against its tower when it starts.
    tower_loras = {name: TowerLora.put(weights) for name, weights in tower_loras.items()}
    budget = (options.batch_cost * stages.max_image_cost(model, config.cost_model)
              if options.batching == "cost" else None)
    lo, hi = config.encoder_range
    worker = WorkerOptions.for_cluster(model, hi, gpus=config.encoder_gpus, dtype=config.dtype,
                                       threads=config.encoder_threads, budgets=config.encoder_budgets)
    # Actors ask for no CPU (an actor holds its CPU slot for life: on 2 cores a third would never start).
    # Ray Data's own defaults restart a dead actor and re-run its calls, and re-run a task whose worker
    # died (setting them again is `ray_remote_args`, deprecated in Ray 2.60): a row is written only by write_rows.

    blocks = [todo.slice(i, options.read_batch) for i in range(0, todo.num_rows, options.read_batch)]
    ds = ray.data.from_arrow(blocks)
    ds = ds.map_batches(stages.read_and_pack, batch_format="pyarrow", batch_size=options.read_batch,
                        fn_kwargs=dict(model=model, image_limits=options.image_limits,
                                       video_limits=options.video_limits, s3=options.s3,
                                       cost_model=config.cost_model, budget=budget, per_pack=options.batch_images,
                                       lora=options.lora, lora_names=options.loras),
                        num_cpus=0.5)  # half a CPU: fits Ray Data's per-stage budget on 2 cores
    ds = ds.map_batches(stages.EncodeStage, batch_format="pyarrow", batch_size=1,
                        compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi),
                        fn_constructor_kwargs=dict(model=model, dtype=worker.dtype, num_threads=worker.num_threads,
                                                   budgets=worker.budgets, tower_loras=tower_loras),
                        num_gpus=worker.num_gpus, num_cpus=0)
    if options.task == "generate":
        decode_gpus = config.decode_gpus if config.decode_gpus is not None else worker.num_gpus
        ds = ds.map_batches(stages.GenerateStage, batch_format="pyarrow", batch_size=options.engine.max_num_seqs,
                            compute=ray.data.ActorPoolStrategy(min_size=options.num_decoders[0],
                                                               max_size=options.num_decoders[1]),
                            num_gpus=decode_gpus,
                            fn_constructor_kwargs=dict(model=model, engine_config=options.engine,
                                                       image_limits=options.image_limits,
                                                       video=VideoOptions(options.video_limits,
                                                                          pruning_rate=config.video_pruning_rate),
                                                       max_tokens=options.max_tokens,
                                                       json_schema=options.json_schema,
                                                       chat_template_kwargs=options.template_kwargs,
                                                       default_prompt=options.prompt),
                            num_cpus=0)
    return ds.map_batches(stages.write_rows, batch_format="pyarrow", batch_size=options.rows_per_file,
                          fn_kwargs=dict(output=options.output, s3=options.s3, task=options.task,
                                         pooling=options.pooling, model_name=config.model),
                          num_cpus=0.1)

