"""Shared fixtures: offline mode, a private preset cache, one local Ray for the session, one Serve for the
modules that run an OpenAI app (`serve_app`)."""

from __future__ import annotations

import os
import socket
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYPIPE_CACHE", tempfile.mkdtemp(prefix="raypipe-test-cache-"))
# Compiled decode buckets outlive a run (as inductor's default /tmp cache did before raypipe pointed it under
# RAYPIPE_CACHE, which is new per run here): a second suite run on a machine does not compile them again.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "raypipe-test-inductor"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# `@gpu` marks a test for `pytest -m gpu` (what `python -m raypipe.gpucheck` runs); without CUDA it is skipped
gpu = pytest.mark.gpu


@pytest.fixture(scope="session")
def tiny_ckpt():
    from raypipe.models.registry import tiny_checkpoint

    return tiny_checkpoint()


@pytest.fixture(scope="session")
def minicpmv_ckpt():
    from raypipe.models.registry import preset_checkpoint

    return preset_checkpoint("tiny-minicpmv")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session; pipelines started in tests leave it running."""
    import ray

    from raypipe.runtime.ray_cluster import connect_ray

    connect_ray()
    yield ray
    SHARED_SERVE.stop()
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SharedServe:
    """Serve's controller and HTTP proxy on one loopback port, started once for every module that runs its
    app on it (`serve_app`): they cost ~15 s to start on a busy 2-core machine. Started with the packaged
    config's controller options (OpenAI error bodies from the proxy), as `raypipe serve` starts them."""

    FIXTURE = "serve_app"

    def __init__(self):
        self.url: str | None = None

    def start(self) -> str:
        if self.url is None:
            from ray import serve

            from raypipe.serve.proxy_errors import CONTROLLER_OPTIONS

            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=CONTROLLER_OPTIONS)
            self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self.url is not None:
            from ray import serve

            serve.shutdown()
            self.url = None


SHARED_SERVE = SharedServe()

# `RAYPIPE_TEST_STATIC_STEPS=1`: every in-process engine whose config leaves `compiled_decode` unset runs the
# static-shape decode step (inductor-compiled on a CPU), so the generate()-equality tests check that step.
# `RAYPIPE_TEST_COMPILED_FORWARD=1`: every in-process engine runs compiled forwards (`compiled_forward=True`; one
# that cannot, falls back to eager). Slow: each new engine compiles. The terminal summary counts the engines by
# the decode step they ran.
STATIC_STEPS_FORCED = os.environ.get("RAYPIPE_TEST_STATIC_STEPS") == "1"
COMPILED_FORWARD_FORCED = os.environ.get("RAYPIPE_TEST_COMPILED_FORWARD") == "1"
ENGINE_STEPS: dict[str, int] = {}


@pytest.fixture(scope="session", autouse=True)
def _static_steps_forced():
    if not (STATIC_STEPS_FORCED or COMPILED_FORWARD_FORCED):
        yield
        return
    import dataclasses

    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine

    real = LLMEngine.__init__

    def forced(self, checkpoint, config=None, runner_factory=None):
        config = config or EngineConfig()
        if STATIC_STEPS_FORCED and config.compiled_decode is None:
            config = dataclasses.replace(config, compiled_decode=True)
        if COMPILED_FORWARD_FORCED:
            config = dataclasses.replace(config, compiled_forward=True)
        real(self, checkpoint, config, runner_factory)
        step = self.stats()["decode_step"]
        key = step["mode"] if step["mode"] != "eager" else f"eager: {step.get('reason')}"
        ENGINE_STEPS[key] = ENGINE_STEPS.get(key, 0) + 1

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LLMEngine, "__init__", forced)
        yield


def pytest_terminal_summary(terminalreporter):
    if STATIC_STEPS_FORCED or COMPILED_FORWARD_FORCED:
        terminalreporter.write_line(f"engines by decode step: {ENGINE_STEPS}")


def pytest_collection_modifyitems(items):
    """`@gpu` tests are skipped without CUDA. The modules that use the shared Serve run one after another,
    where the first of them stands, so Serve starts once and is down for every other module (one that
    starts a Serve of its own, on its own port, must not find ours running). Pytest runs modules in file
    order otherwise."""
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    modules: dict = {}  # module path -> its items, in collection order
    for item in items:
        modules.setdefault(item.path, []).append(item)
    users = [path for path, group in modules.items() if any(SharedServe.FIXTURE in i.fixturenames for i in group)]
    if not users:
        return
    order = []
    for path in modules:
        if path == users[0]:
            order.extend(users)
        elif path not in users:
            order.append(path)
    items[:] = [item for path in order for item in modules[path]]


@pytest.fixture(scope="module", autouse=True)
def _serve_only_for_its_users(request):
    """Stops the shared Serve before a module that does not use it."""
    if not any(SharedServe.FIXTURE in item.fixturenames for item in request.session.items
               if item.path == request.path):
        SHARED_SERVE.stop()
    yield


@pytest.fixture(scope="module")
def serve_app(ray_local):
    """`run(app, name) -> base URL`: the module's application on the shared Serve at route "/" (one module
    at a time), deleted when the module ends."""
    from ray import serve

    names = []

    def run(app, name: str) -> str:
        url = SHARED_SERVE.start()
        serve.run(app, name=name, route_prefix="/")
        names.append(name)
        return url

    yield run
    for name in names:
        serve.delete(name)


class ThreeWorkerPipelines:
    """One `Pipeline` with three encoder workers (one torch thread each on 2 cores) per checkpoint, for the whole
    session: a family's modules (coordinators over the first 1, 2 or 3 workers through `over_first_workers` or
    their `coordinator.pool`, each with its own cache; batch tests' references) share its workers instead of
    starting their own (a pool start cost 20-40 s on a busy 2-core machine). Its decode actor starts only if a
    test generates with it."""

    def __init__(self):
        self._started: dict[str, object] = {}

    def get(self, checkpoint):
        from raypipe import Pipeline

        key = str(checkpoint)
        if key not in self._started:
            self._started[key] = Pipeline.from_pretrained(checkpoint, num_encoders=3)
        return self._started[key]

    def shutdown(self) -> None:
        for pipeline in self._started.values():
            pipeline.shutdown()
        self._started.clear()


@pytest.fixture(scope="session")
def three_worker_pipelines(ray_local):
    pipelines = ThreeWorkerPipelines()
    yield pipelines
    pipelines.shutdown()


def over_first_workers(pipeline, n: int, cost_model: str | None = None, cache_bytes: int | None = None,
                       engine_config=None):
    """A `Pipeline` over the first `n` encoder workers of `pipeline`, with its own coordinator (`cost_model`,
    default `pipeline`'s), embedding cache (of `cache_bytes`, default `pipeline`'s budget) and decode engine
    (`engine_config`, default `pipeline`'s; it starts with the first generate) and the same adapter: a module
    checking 1, 2 and 3 workers starts three workers once, not six (each costs seconds). Not shut down on its
    own (the workers are `pipeline`'s): `stop_decoder` ends its decode actor."""
    from raypipe import Pipeline
    from raypipe.encode.coordinator import Coordinator
    from raypipe.encode.pool import EncoderPool

    full = pipeline.coordinator
    coordinator = Coordinator(full.adapter, EncoderPool(full.pool.workers[:n], full.pool.options),
                              cost_model=cost_model or full.cost_model,
                              cache_bytes=full.cache.max_bytes if cache_bytes is None else cache_bytes)
    return Pipeline(pipeline.checkpoint, coordinator, pipeline.image_limits, owns_ray=False,
                    engine_config=engine_config or pipeline.engine_config, decode_gpus=pipeline.decode_gpus,
                    video=pipeline.video)


def stop_decoder(pipeline) -> None:
    """Ends the decode actor of a `Pipeline` over another's workers (`over_first_workers`), if it started."""
    import ray

    if pipeline._engine is not None:
        ray.kill(pipeline._engine)


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    """transformers' own full model: the reference every raypipe output is compared with."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt).eval()


def random_images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def reference_embeddings(hf_model, ckpt, images, threads: int | None = None):
    """Per-image embeddings from transformers' vision tower on the whole batch in one call, on `threads` torch
    threads where given (the encoder's count: on some CPUs fp32 GEMMs round differently at another count)."""
    from transformers import AutoImageProcessor

    from raypipe.runtime.cpu_threads import torch_threads

    processor = AutoImageProcessor.from_pretrained(ckpt)
    processed = processor(images=list(images), return_tensors="pt")
    grid = processed["image_grid_thw"]
    with torch_threads(threads or torch.get_num_threads()), torch.no_grad():
        out = hf_model.model.visual(processed["pixel_values"].to(hf_model.device),
                                    grid_thw=grid.to(hf_model.device)).pooler_output
    merge = hf_model.config.vision_config.spatial_merge_size
    return [chunk.cpu() for chunk in torch.split(out, (grid.prod(-1) // merge**2).tolist())]


@pytest.fixture(scope="session")
def step3_ckpt():
    from raypipe.models.registry import preset_checkpoint

    return preset_checkpoint("tiny-step3")


@pytest.fixture(scope="session")
def step3_hf_model(step3_ckpt):
    """transformers' own Step3p7ForConditionalGeneration: the Step3 reference."""
    from transformers import Step3p7ForConditionalGeneration

    return Step3p7ForConditionalGeneration.from_pretrained(step3_ckpt).eval()


@pytest.fixture(scope="session")
def llava_ckpt():
    from raypipe.models.registry import preset_checkpoint

    return preset_checkpoint("tiny-llava-ov")


@pytest.fixture(scope="session")
def llava_workers(three_worker_pipelines, llava_ckpt):
    """Three `tiny-llava-ov` encoder workers (1 thread each) for the family's coordinators over their first
    1, 2 or 3: a pool per test module or worker count cost seconds each on 2 cores."""
    return three_worker_pipelines.get(llava_ckpt).coordinator.pool.workers


@pytest.fixture(scope="session")
def llava_hf_model(llava_ckpt):
    """transformers' own LlavaOnevisionForConditionalGeneration: the LLaVA-OneVision reference."""
    from transformers import LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration.from_pretrained(llava_ckpt).eval()


@pytest.fixture(scope="module")
def minicpmv_video_reference():
    """transformers' MiniCPM-V video processor runnable here: its torchvision kernels pointed at torch stand-ins."""
    from tests import minicpmv_video_reference as vref

    with pytest.MonkeyPatch.context() as monkeypatch:
        vref.install(monkeypatch)
        yield
