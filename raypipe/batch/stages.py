"""The Ray Data stages of a batch job; each wraps a piece the online path uses too.

    read_and_pack   (CPU tasks)   bytes from storage -> `inputs.images.load_image` / `inputs.video.load_video`
                                  (same limits and error codes as the endpoint) -> resized to the tower's size
                                  (`resize_for_tower`, as the endpoint does) -> geometry and cost
                                  from the vision adapter -> packs of about equal cost (`packing`)
    EncodeStage     (actor pool)  one `EncoderWorker` (the same class the coordinator drives) per actor
    GenerateStage   (actor pool)  one `LLMEngine` per actor: all rows of a batch decode together in
                                  multi-step rounds, built with the same `build_prompt` as `Pipeline`
    write_rows      (CPU tasks)   one atomic Parquet part file per batch (`output`)

Between stages a row is one visual item (`ROW_SCHEMA`; `kind` "image" or "video", by file extension;
a video's sampled frames travel together and one encoder actor encodes them: a batch has many inputs to
spread, so videos are not cut into chunks here as the online coordinator does);
a pack travels as a single row holding those rows in Arrow IPC form, so that Ray Data cannot regroup
it. Pixels and embeddings travel as raw bytes (float32 / uint8) rather than tensor columns: rows
that failed have none, and Ray Data's tensor columns do not mix with nulls. A bad input never
raises: it becomes a row with `error` set.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import io
import json

import numpy as np
import pyarrow as pa
import torch

from raypipe.batch import packing
from raypipe.batch.inputs import kind_of
from raypipe.batch.output import write_part
from raypipe.encode.budgets import TokenBudgets
from raypipe.errors import InvalidInput
from raypipe.inputs.images import ImageLimits, load_image
from raypipe.inputs.media import DecodedVisual
from raypipe.inputs.video import VideoLimits, VideoSampling, load_video
from raypipe.storage import S3Options, is_s3, open_filesystem, read_bytes

ROW_SCHEMA = pa.schema([
    ("id", pa.string()), ("uri", pa.string()), ("kind", pa.string()), ("prompt", pa.string()),
    ("lora", pa.string()),  # the adapter (of engine.lora_modules) the row is encoded and generated with; null: none
    # The input image's size, as the output reports it; a video's: its sampled frames' (the tower's size).
    ("width", pa.int32()), ("height", pa.int32()),
    ("num_tokens", pa.int32()), ("cost", pa.float64()),
    # (pixel_height, pixel_width, 3) uint8 image or (num_frames, ...) video frames, resized to what the
    # tower consumes; null once encoded. `fps`: the sampled frames' rate (a video's positions need it);
    # `duration_s`: the source video's (MiniCPM-V groups its frames by second of video).
    ("pixels", pa.large_binary()), ("pixel_height", pa.int32()), ("pixel_width", pa.int32()),
    ("num_frames", pa.int32()), ("fps", pa.float64()), ("duration_s", pa.float64()),
    ("embedding", pa.large_binary()),  # (num_tokens, hidden) float32 after encoding
    ("hidden", pa.int32()),
    ("text", pa.string()), ("finish_reason", pa.string()),
    ("error", pa.string()), ("error_message", pa.string()),
])
PACK_SCHEMA = pa.schema([("pack", pa.large_binary()), ("images", pa.int32()), ("cost", pa.float64())])
SUMMARY_SCHEMA = pa.schema([("file", pa.string()), ("rows", pa.int64()), ("errors", pa.string())])  # errors: JSON code -> rows
UNREADABLE = "unreadable_object"


@functools.lru_cache(maxsize=4)
def _vision_adapter(model: str):
    from raypipe.models.registry import vision_adapter

    return vision_adapter(model)


@functools.lru_cache(maxsize=8)
def _filesystem(scheme_root: str, s3: S3Options | None):
    return open_filesystem(scheme_root, s3)[0]


def _read(uri: str, s3: S3Options | None, max_bytes: int) -> bytes:
    fs = _filesystem("s3://" if is_s3(uri) else "/", s3)
    return read_bytes(fs, uri[len("s3://"):] if is_s3(uri) else uri, max_bytes)


def max_image_cost(model: str, cost_model: str) -> float:
    """Cost of the largest image the model's processor produces (any bigger one is resized down)."""
    adapter = _vision_adapter(model)
    huge = np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (16384, 16384, 3))  # shape only, no memory
    return _image_cost(adapter, adapter.make_item(DecodedVisual(huge, "")), cost_model)


def _image_cost(adapter, item, cost_model: str) -> float:
    """An image's cost: the sum of its units' (an image may be cut into slices or views)."""
    return sum(adapter.cost(unit, cost_model) for unit in adapter.units(item))


def read_and_pack(batch: pa.Table, *, model: str, image_limits: ImageLimits, video_limits: VideoLimits,
                  s3: S3Options | None, cost_model: str, budget: float | None, per_pack: int,
                  lora: str | None = None, lora_names: tuple[str, ...] = ()) -> pa.Table:
    """Decode a slice of inputs and return it as packs: by cost (`budget`, at most `per_pack` images
    per pack on average) or by count (`per_pack`). A row's adapter is its `lora` value (a manifest's
    column), else `lora`; one not among `lora_names` makes the row an error."""
    adapter = _vision_adapter(model)
    rows = []
    column = {name: batch.column(name).to_pylist() if name in batch.column_names else [None] * batch.num_rows
              for name in ("prompt", "lora")}
    for id_, uri, prompt, row_lora in zip(batch.column("id").to_pylist(), batch.column("uri").to_pylist(),
                                          column["prompt"], column["lora"]):
        row = {"id": id_, "uri": uri, "kind": kind_of(uri), "prompt": prompt, "lora": row_lora or lora}
        try:
            if row["lora"] is not None and row["lora"] not in lora_names:
                raise InvalidInput(f"the lora adapter {row['lora']!r} is not one of the job's ({', '.join(lora_names)})",
                                   item=id_, code="lora_not_found")
            if row["kind"] == "video":  # frames sampled and resized to the tower's size as they are decoded
                decoded = resized = load_video(_read(uri, s3, video_limits.max_bytes), video_limits,
                                               adapter.plan_frames(VideoSampling()), item=id_)
            else:
                decoded = load_image(_read(uri, s3, image_limits.max_bytes), image_limits, item=id_)
                # As the endpoint does: only what the tower consumes travels to the encoder actors.
                resized = adapter.resize_for_tower(decoded)
            item = adapter.make_item(resized)
            row.update(width=decoded.width, height=decoded.height, num_tokens=item.num_tokens,
                       cost=_image_cost(adapter, item, cost_model), pixels=resized.pixels.tobytes(),
                       pixel_height=resized.height, pixel_width=resized.width, num_frames=resized.num_frames,
                       fps=resized.fps, duration_s=resized.duration_s)
        except InvalidInput as exc:
            row.update(error=exc.code, error_message=exc.reason)
        except OSError as exc:  # missing, forbidden or unreachable object
            row.update(error=UNREADABLE, error_message=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    good = [r for r in rows if r.get("error") is None]
    groups = (packing.by_cost([r["cost"] for r in good], budget, per_pack) if budget is not None
              else packing.by_count(len(good), per_pack))
    packs = [[good[i] for i in group] for group in groups]
    bad = [r for r in rows if r.get("error") is not None]
    if bad:
        packs.append(bad)  # passes through the encoder untouched
    return pa.table({"pack": pa.array([_to_ipc(pa.Table.from_pylist(p, ROW_SCHEMA)) for p in packs], pa.large_binary()),
                     "images": pa.array([len(p) for p in packs], pa.int32()),
                     "cost": pa.array([sum(r.get("cost") or 0.0 for r in p) for p in packs], pa.float64())},
                    schema=PACK_SCHEMA)


class EncodeStage:
    """An encoder actor: one `EncoderWorker` in-process, encoding one pack per call."""

    def __init__(self, model: str, dtype: str, num_threads: int | None, budgets: TokenBudgets,
                 tower_loras: dict | None = None):
        from raypipe.encode.pool import WorkerOptions

        # Built as the online pool builds its actors; Ray Data's actor pool owns the lifecycle here
        # (its GPU share is the map stage's `num_gpus`).
        self.worker = WorkerOptions(model, dtype, num_threads, budgets=budgets).build()
        # adapter name -> `TowerLora`, for the job's adapters that target the tower; a row's units run with its own
        self.tower_loras = tower_loras or {}
        for name, lora in self.tower_loras.items():
            self.worker.check_tower_lora(lora, f"engine.lora_modules.{name}")

    def __call__(self, packs: pa.Table) -> pa.Table:
        rows = pa.concat_tables([_from_ipc(p) for p in packs.column("pack").to_pylist()]).to_pylist()
        todo = [r for r in rows if r["error"] is None]
        adapter = self.worker.adapter
        items = [adapter.make_item(_visual(r)) for r in todo]
        units_of = [adapter.units(item) for item in items]
        flat = [unit for units in units_of for unit in units]
        loras = [self.tower_loras.get(row["lora"]) for row, units in zip(todo, units_of) for _ in units]
        outs = iter(self.worker.encode(flat, loras)[:-1] if flat else ())  # the last return is a receipt
        # An image's embedding from its units' embeddings, as the online coordinator assembles it.
        embeddings = [adapter.join_units(item, [next(outs) for _ in units]) for item, units in zip(items, units_of)]
        for row, embedding in zip(todo, embeddings):
            matrix = embedding.float().numpy()
            row.update(pixels=None, embedding=matrix.tobytes(), hidden=matrix.shape[1])
        for row in rows:
            row["pixels"] = None
        return pa.Table.from_pylist(rows, ROW_SCHEMA)


class GenerateStage:
    """A decode actor: one `LLMEngine`; every row of a call is one request, all decoded together."""

    def __init__(self, model: str, engine_config, image_limits: ImageLimits, video, max_tokens: int,
                 default_prompt: str, json_schema: str | None = None, chat_template_kwargs: dict | None = None):
        from raypipe.decode.engine import LLMEngine
        from raypipe.inputs.sampling import SamplingParams
        from raypipe.models.registry import resolve_model
        from raypipe.parallel import runner_factory

        checkpoint = resolve_model(model)
        # tensor_parallel_size > 1: this actor is rank 0; its group places the other ranks (raypipe/parallel/)
        self.engine = LLMEngine(checkpoint, engine_config, runner_factory(engine_config))
        self.vision = _vision_adapter(str(checkpoint))
        self.image_limits = image_limits
        self.video = video  # raypipe.models.prompt.VideoOptions: the EVS rate the prompt plans for
        structured = {"json": json_schema} if json_schema is not None else None
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured)
        self.default_prompt = default_prompt
        self.chat_template_kwargs = chat_template_kwargs  # e.g. Qwen3.5's enable_thinking; the text keeps any thinking

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        asyncio.run(self._generate_all([r for r in rows if r["error"] is None]))
        for row in rows:
            row["embedding"] = None
        return pa.Table.from_pylist(rows, ROW_SCHEMA)

    async def _generate_all(self, rows: list[dict]) -> None:
        await asyncio.gather(*(self._generate(row) for row in rows))

    async def _generate(self, row: dict) -> None:
        from raypipe.models.prompt import build_prompt

        # Only the item's size (and a video's frame rate) matters to the prompt: a zero-stride array carries it.
        # The tower-size shape gives the same placeholders as the original and needs no resizing again.
        shape_only = _visual(row, shape_only=True)
        messages = [{"role": "user", "content": [{"type": row["kind"], row["kind"]: shape_only},
                                                 {"type": "text", "text": row["prompt"] or self.default_prompt}]}]
        embedding = torch.from_numpy(np.frombuffer(row["embedding"], np.float32).reshape(-1, row["hidden"]).copy())
        try:
            prompt = build_prompt(messages, self.engine.tokenizer, self.vision, self.image_limits, video=self.video,
                                  chat_template_kwargs=self.chat_template_kwargs)
            out = await self.engine.generate_output(row["id"], prompt.without_pixels(), [embedding], self.params,
                                                    row["lora"])
        except InvalidInput as exc:
            row.update(error=exc.code, error_message=exc.reason)
            return
        row.update(text=out.text, finish_reason=out.finish_reason)
        if self.params.structured is not None and out.finish_reason != "stop":  # cut JSON is not JSON
            row.update(error="incomplete_json", error_message=f"output ended by {out.finish_reason} before the JSON "
                                                              "was complete (raise max_tokens)")


def write_rows(batch: pa.Table, *, output: str, s3: S3Options | None, task: str, pooling: str,
               model_name: str) -> pa.Table:
    """Write one part file of final rows (`model`: the row's adapter, else `model_name`); returns one summary row."""
    fs, root = open_filesystem(output, s3)
    table = final_table(batch.to_pylist(), task, pooling, model_name)
    path = write_part(fs, root, table)
    errors = collections.Counter(code for code in table.column("error").to_pylist() if code is not None)
    return pa.table({"file": [path], "rows": [table.num_rows], "errors": [json.dumps(errors)]}, schema=SUMMARY_SCHEMA)


def output_schema(task: str, pooling: str) -> pa.Schema:
    vector = pa.list_(pa.float32())
    fields = [("id", pa.string()), ("path", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
              ("num_tokens", pa.int32())]
    if task == "embed":
        fields.append(("embedding", vector if pooling == "mean" else pa.list_(vector)))
    else:
        fields += [("prompt", pa.string()), ("text", pa.string()), ("finish_reason", pa.string())]
    fields += [("error", pa.string()), ("error_message", pa.string()), ("model", pa.string())]
    return pa.schema(fields)


def final_table(rows: list[dict], task: str, pooling: str, model_name: str) -> pa.Table:
    out = []
    for row in rows:
        final = {"id": row["id"], "path": row["uri"], "width": row["width"], "height": row["height"],
                 "num_tokens": row["num_tokens"], "error": row["error"], "error_message": row["error_message"],
                 "model": row["lora"] or model_name}
        if task == "embed":
            final["embedding"] = pool(row, pooling)
        else:
            final.update(prompt=row["prompt"], text=row["text"], finish_reason=row["finish_reason"])
        out.append(final)
    return pa.Table.from_pylist(out, output_schema(task, pooling))


def pool(row: dict, pooling: str):
    """`mean`: the float32 mean over the image's tokens; `none`: the whole (tokens, hidden) matrix."""
    if row["embedding"] is None:
        return None
    matrix = np.frombuffer(row["embedding"], np.float32).reshape(-1, row["hidden"])
    return matrix.mean(axis=0, dtype=np.float32) if pooling == "mean" else matrix.tolist()


def _visual(row: dict, *, shape_only: bool = False) -> DecodedVisual:
    """The row's visual item at tower size (`shape_only`: zero-stride pixels that carry only its shape)."""
    shape = (row["pixel_height"], row["pixel_width"], 3)
    if row["kind"] == "video":
        shape = (row["num_frames"], *shape)
    pixels = (np.broadcast_to(np.zeros((1,) * len(shape), np.uint8), shape) if shape_only
              else np.frombuffer(row["pixels"], np.uint8).reshape(shape))
    return DecodedVisual(pixels, "", row["kind"], row["fps"], row.get("duration_s"))


def _to_ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(data).read_all()
