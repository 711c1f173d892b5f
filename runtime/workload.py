"""The ``mlxkv run`` workload: concurrent chat-like requests over shared system prompts.

``conversations = ceil(requests / turns)`` conversations run concurrently,
each under one of ``system_prompts`` system prompts (round robin). Turn 1 of
a conversation is ``system + user_1``; turn n+1 is ``turn n's prompt +
answer n + user_(n+1)``, so it can reuse the blocks turn n stored (its prompt
and its answer). At most ``concurrency`` requests are in flight at once.

Prompts are token ids: the system prompts and user messages are text,
tokenized by the model's tokenizer and cut to length, so the workload runs on
any mlx-lm model. A request is *cold* when it reused nothing from the cache,
*warm* otherwise; the report compares their times to first token.

With ``images`` (a vision-language model), conversation ``c`` is about image
``c % images`` (seeded noise pictures): every turn carries the image, turn 1
puts it after the system prompt (as chat templates do, so conversations
about different images share their system prompt's blocks), and turn n+1
continues turn n's prompt as the model saw it
(``GenerationReport.prompt_ids``, image tokens included).
The report adds how often the vision encoder ran and was skipped.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, Callable, Optional

import anyio
import attrs

from mlxkv.actors.request import top_logprobs_checked
from mlxkv.cache.validators import int_at_least
from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers.tier import TierStatistics
from mlxkv.cache.tiers.tier_url import redact_url
from mlxkv.generation import GenerationReport
from mlxkv.progress import Progress
from mlxkv.runtime import CacheRuntime
from mlxkv.runtime_config import RuntimeConfig
from mlxkv.units import format_bytes

__all__ = ["SUMMARIZED_EVENTS", "WorkloadConfig", "WorkloadReport", "run_workload"]

#: The per-request warning events a :class:`WorkloadReport` counts (so that an
#: application can show the count instead of every event).
SUMMARIZED_EVENTS = frozenset(
    {"generation.not_stored", "generation.prompt_exceeds_pool", "prefill.cold_fallback"}
)

#: Where an image goes in a prompt (Qwen2-VL's chat template; the processor
#: widens the pad token to the image's tokens).
_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

_WORDS = (
    "cache block prefix token model answer question system user assistant memory "
    "request stream thread actor latency value policy context window layer batch "
    "kernel vector matrix schedule review careful precise helpful concise polite "
    "explain summarize compare translate reason verify cite list format table"
).split()


def _runtime(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, RuntimeConfig):
        raise InvalidInput("runtime", value, "must be a RuntimeConfig")
    if value.model is None:
        raise InvalidInput("runtime", value, "must name a model: RuntimeConfig(model=PATH)")


@attrs.frozen(kw_only=True)
class WorkloadConfig:
    """One ``mlxkv run``: the requests it makes, on the runtime it makes them on.

    Attributes:
        runtime: the runtime the workload runs on (its ``model`` given).
        requests: requests in all.
        system_prompts: distinct shared system prompts.
        turns: turns per conversation.
        concurrency: the most requests in flight at once.
        max_tokens: the most tokens each request generates.
        prompt_tokens: tokens in each system prompt.
        user_tokens: tokens in each user message.
        images: distinct images the conversations are about (0: text only;
            needs a vision-language model).
        seed: seeds the texts (decoding is greedy).
        logprobs: every token with its log-probability and this many
            alternatives (the cost of asking), or None: none.
    """

    runtime: RuntimeConfig = attrs.field(validator=_runtime)
    requests: int = attrs.field(default=32, validator=int_at_least(1))
    system_prompts: int = attrs.field(default=4, validator=int_at_least(1))
    turns: int = attrs.field(default=2, validator=int_at_least(1))
    concurrency: int = attrs.field(default=8, validator=int_at_least(1))
    max_tokens: int = attrs.field(default=32, validator=int_at_least(1))
    prompt_tokens: int = attrs.field(default=512, validator=int_at_least(1))
    user_tokens: int = attrs.field(default=48, validator=int_at_least(1))
    images: int = attrs.field(default=0, validator=int_at_least(0))
    seed: int = attrs.field(default=0, validator=int_at_least(0))
    logprobs: Optional[int] = attrs.field(default=None, converter=lambda k: top_logprobs_checked(k, "logprobs"))


@attrs.frozen(kw_only=True)
class WorkloadReport:
    """What a workload did; every time is in milliseconds unless named otherwise.

    Attributes:
        model: the model directory.
        requests: requests completed.
        cold_requests: of those, requests that reused nothing.
        warm_requests: requests that reused cached blocks.
        prompt_tokens: prompt tokens in all.
        reused_tokens: prompt tokens served from the cache.
        reused_percent: ``100 * reused_tokens / prompt_tokens``.
        generated_tokens: tokens generated in all.
        ttft_cold_p50_ms: median time to first token of cold requests.
        ttft_cold_p95_ms: its 95th percentile.
        ttft_warm_p50_ms: median time to first token of warm requests.
        ttft_warm_p95_ms: its 95th percentile.
        decode_tokens_per_second: median over requests of their decode rate.
        throughput_tokens_per_second: generated tokens per second of wall time.
        decode_steps: decode model calls (each serves every decoding request).
        mean_batch_size: requests served per decode model call, on average.
        shared_waits: requests that waited for a prefix another request was
            computing, instead of computing it again.
        image_requests: requests that carried images.
        vision_encoder_runs: requests whose images the vision encoder encoded.
        vision_encoder_skips: image requests that did without it (cached
            embeddings, or a cached prefix covering the images).
        blocks_stored: blocks computed and stored.
        blocks_evicted: cached blocks evicted to make room.
        blocks_cached: blocks cached at the end.
        peak_blocks_cached: most blocks cached at once (sampled).
        block_bytes: bytes of KV in one block.
        pool_blocks: usable blocks in the pool.
        pool_bytes: ``pool_blocks * block_bytes``.
        kv_memory: the byte budget the pool was sized from, or None.
        peak_kv_bytes: ``peak_blocks_cached * block_bytes``.
        peak_mlx_memory_bytes: MLX's peak memory in the process (weights,
            live caches and blocks).
        requests_not_stored: requests that could not cache what they
            computed: the pool had too few free blocks (each one a
            ``generation.not_stored`` warning event).
        blocks_not_stored: the computed blocks those requests did not cache.
        prompts_over_pool: prompts with more full blocks than the pool
            holds (each one a ``generation.prompt_exceeds_pool`` event).
        cold_fallbacks: requests whose cached prefix could not be rebuilt,
            so their whole prompt was computed (``prefill.cold_fallback``).
        compute: where the model ran and how: MLX's device,
            ``model_info.prefix_attention`` (``-`` without shared prefixes),
            the decoder layers whose decode steps run compiled (of all), and
            where there are any, the projection sets fused and the linear
            layers held transposed (:meth:`~mlxkv.actors.model_info.ModelInfo.summary`).
        kv_tiers: the tiers' URLs, passwords redacted (empty without tiers).
        tiers: each tier's counters at the end (written, loaded, missed,
            dropped, corrupt, evicted), in lookup order.
        tier_blocks_loaded: blocks the prompts continued from the tiers
            below the pool (0 without tiers).
        tier_blocks_written: blocks written behind to the tiers (each
            counted once, however many tiers hold it).
        wall_seconds: the workload's duration.
        interrupted: the workload was stopped before every request ran
            (``stop`` was set); the figures cover the requests that finished.
    """

    model: str
    requests: int
    cold_requests: int
    warm_requests: int
    prompt_tokens: int
    reused_tokens: int
    reused_percent: float
    generated_tokens: int
    ttft_cold_p50_ms: Optional[float]
    ttft_cold_p95_ms: Optional[float]
    ttft_warm_p50_ms: Optional[float]
    ttft_warm_p95_ms: Optional[float]
    decode_tokens_per_second: float
    throughput_tokens_per_second: float
    decode_steps: int
    mean_batch_size: float
    shared_waits: int
    image_requests: int
    vision_encoder_runs: int
    vision_encoder_skips: int
    blocks_stored: int
    blocks_evicted: int
    blocks_cached: int
    peak_blocks_cached: int
    block_bytes: int
    pool_blocks: int
    pool_bytes: int
    kv_memory: Optional[int]
    peak_kv_bytes: int
    peak_mlx_memory_bytes: int
    requests_not_stored: int
    blocks_not_stored: int
    prompts_over_pool: int
    cold_fallbacks: int
    wall_seconds: float
    interrupted: bool = False
    compute: str = ""
    kv_tiers: tuple[str, ...] = ()
    tier_blocks_loaded: int = 0
    tier_blocks_written: int = 0
    tiers: tuple[TierStatistics, ...] = ()

    def rows(self) -> list[tuple[str, str]]:
        """The report as ``(name, value)`` rows, in reading order."""

        def ms(value: Optional[float]) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        return [
            ("model", self.model),
            *([("compute", self.compute)] if self.compute else []),
            ("requests", f"{self.requests} ({self.cold_requests} cold, {self.warm_requests} warm)"),
            ("prompt tokens", f"{self.prompt_tokens}"),
            ("tokens reused", f"{self.reused_tokens} ({self.reused_percent:.1f}%)"),
            ("generated tokens", f"{self.generated_tokens}"),
            ("TTFT cold p50 / p95", f"{ms(self.ttft_cold_p50_ms)} / {ms(self.ttft_cold_p95_ms)}"),
            ("TTFT warm p50 / p95", f"{ms(self.ttft_warm_p50_ms)} / {ms(self.ttft_warm_p95_ms)}"),
            ("decode tokens/s", f"{self.decode_tokens_per_second:.1f} per request (median)"),
            ("throughput", f"{self.throughput_tokens_per_second:.1f} generated tokens/s"),
            (
                "decode batch",
                f"{self.mean_batch_size:.1f} requests per model call on average"
                f" ({self.decode_steps} calls)",
            ),
            ("shared in flight", f"{self.shared_waits} requests waited for a prefix being computed"),
            *(
                [
                    (
                        "vision encoder",
                        f"{self.vision_encoder_runs} runs, {self.vision_encoder_skips} skipped"
                        f" ({self.image_requests} requests with images)",
                    )
                ]
                if self.image_requests
                else []
            ),
            (
                "blocks",
                f"{self.blocks_stored} stored, {self.blocks_evicted} evicted,"
                f" {self.blocks_cached} cached at the end",
            ),
            (
                "KV pool",
                f"{self.pool_blocks} blocks x {format_bytes(self.block_bytes)}"
                f" = {format_bytes(self.pool_bytes)}"
                + ("" if self.kv_memory is None else f" (kv_memory {format_bytes(self.kv_memory)})"),
            ),
            (
                "peak KV memory",
                f"{format_bytes(self.peak_kv_bytes)} ({self.peak_blocks_cached} blocks cached)",
            ),
            ("peak MLX memory", format_bytes(self.peak_mlx_memory_bytes)),
            *(
                [("KV tiers", f"{self.tier_blocks_loaded} blocks loaded, {self.tier_blocks_written} written")]
                if self.kv_tiers
                else []
            ),
            *((f"  {tier.name}", tier.summary()) for tier in self.tiers),
            ("wall time", f"{self.wall_seconds:.2f} s"),
        ]

    def format(self) -> str:
        """The report as aligned text lines."""
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _check_fits(config: WorkloadConfig, max_context: Optional[int]) -> None:
    """Refuse a workload whose longest request could outgrow the model's context.

    The last turn's prompt is the system prompt, every user message and every
    earlier answer; it then generates ``max_tokens`` more. (Image tokens are
    not counted here: generation refuses a request they push past it.)

    Raises:
        InvalidInput: naming the setting to lower: the largest of
            ``prompt_tokens``, ``user_tokens`` and ``max_tokens`` when the
            first turn alone does not fit, else ``turns``.
    """
    turn = config.prompt_tokens + config.user_tokens + config.max_tokens
    longest = config.prompt_tokens + config.turns * (config.user_tokens + config.max_tokens)
    if max_context is None or longest <= max_context:
        return
    parts = (
        f"{config.prompt_tokens} system prompt tokens + {config.turns} x ({config.user_tokens}"
        f" user + {config.max_tokens} answer tokens) = {longest}, beyond the model's context of"
        f" {max_context} tokens"
    )
    if turn <= max_context:
        raise InvalidInput("turns", config.turns, f"the last turn holds {parts}")
    name = max(("prompt_tokens", "user_tokens", "max_tokens"), key=lambda field: getattr(config, field))
    raise InvalidInput(name, getattr(config, name), f"a request holds {parts}")


def _percentile(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _pictures(count: int, seed: int) -> list[Any]:
    """``count`` distinct 64x64 RGB noise pictures (uint8 arrays), seeded."""
    if not count:
        return []
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(count)]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _cut(rt: CacheRuntime, text: str, n: int, rng: random.Random) -> list[int]:
    """``n`` token ids of ``text``, extended with more random words if short."""
    tokens = list(await rt.tokenize(text))
    while len(tokens) < n:
        tokens += await rt.tokenize(" " + _text(rng, max(8, n // 4)))
    return tokens[:n]


async def run_workload(
    config: WorkloadConfig,
    *,
    progress: Optional[Progress] = None,
    stop: Optional[anyio.Event] = None,
    on_report: Optional[Callable[[GenerationReport], None]] = None,
) -> WorkloadReport:
    """Run the workload on a fresh :class:`CacheRuntime` and report.

    Args:
        config: the workload.
        progress: updated as requests finish, on the workload's own clock
            (so its last line and the report agree on the wall time).
        stop: once set, the requests in flight are cancelled (each releases
            what it holds, as any cancelled request does), no more start,
            and the runtime closes normally; the report then covers the
            requests that finished and says it was interrupted.
        on_report: called with each finished request's report (its id,
            prompt ids and tokens: what a caller compares across runs).

    Returns:
        The report.

    Raises:
        InvalidInput: the longest request would not fit the model's context
            (checked once the model is loaded, before any request), or a
            request was refused.
        ModelLoadError: the model does not load.
    """
    import mlx.core as mx

    rng = random.Random(config.seed)
    reports: list[GenerationReport] = []
    peak_cached = 0
    num_conversations = math.ceil(config.requests / config.turns)
    async with CacheRuntime(config.runtime) as rt:
        assert rt.model_info is not None, "a runtime with a model describes it"
        _check_fits(config, rt.model_info.max_context)  # before tokenizing anything
        systems = [
            await _cut(
                rt,
                f"System prompt {i}: you are a helpful assistant. {_text(rng, config.prompt_tokens)}",
                config.prompt_tokens,
                rng,
            )
            for i in range(config.system_prompts)
        ]
        users = [
            [
                await _cut(rt, f"\nUser: {_text(rng, config.user_tokens)}", config.user_tokens, rng)
                for _ in range(config.turns)
            ]
            for _ in range(num_conversations)
        ]
        pictures = _pictures(config.images, config.seed)
        placeholder = list(await rt.tokenize(_IMAGE_PLACEHOLDER)) if pictures else []
        limiter = anyio.CapacityLimiter(config.concurrency)
        remaining = [config.requests]
        started = time.perf_counter()

        async def conversation(index: int) -> None:
            history = list(systems[index % len(systems)]) + placeholder
            images = [pictures[index % len(pictures)]] if pictures else None
            for turn in range(config.turns):
                if remaining[0] == 0:
                    return
                remaining[0] -= 1
                prompt = history + users[index][turn]
                async with limiter:
                    answer: list[int] = []
                    async with rt.generate(
                        prompt,
                        images=images,
                        max_tokens=config.max_tokens,
                        request_id=f"c{index}-t{turn}",
                        logprobs=config.logprobs,
                    ) as stream:
                        async for record in stream:
                            if isinstance(record, GenerationReport):
                                reports.append(record)
                                if on_report is not None:
                                    on_report(record)
                                if progress is not None:
                                    _show(progress, reports, time.perf_counter() - started)
                                prompt = list(record.prompt_ids)
                            else:
                                answer.append(record.token)
                history = prompt + answer

        async def sample_blocks() -> None:
            nonlocal peak_cached
            while True:
                stats = await rt.stats()
                peak_cached = max(peak_cached, stats.allocator.num_cached)
                await anyio.sleep(0.05)

        async def stop_requests(scope: anyio.CancelScope) -> None:
            assert stop is not None
            await stop.wait()
            scope.cancel()

        requests = anyio.CancelScope()
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(sample_blocks)
            if stop is not None:
                watchers.start_soon(stop_requests, requests)
            with requests:
                async with anyio.create_task_group() as tg:
                    # Turns of one conversation are sequential; conversations
                    # start in order, so early ones warm the system prompts.
                    for index in range(num_conversations):
                        tg.start_soon(conversation, index)
            watchers.cancel_scope.cancel()
        wall = time.perf_counter() - started
        interrupted = requests.cancelled_caught
        if progress is not None and not interrupted:
            _show(progress, reports, round(wall, 3), final=True)
        await rt.flush_tiers()
        stats = await rt.stats()
    peak_cached = max(peak_cached, stats.allocator.num_cached)

    cold = [r.time_to_first_token * 1e3 for r in reports if r.cached_tokens == 0]
    warm = [r.time_to_first_token * 1e3 for r in reports if r.cached_tokens > 0]
    prompt_tokens = sum(r.prompt_tokens for r in reports)
    reused = sum(r.cached_tokens for r in reports)
    generated = sum(r.generated_tokens for r in reports)
    memory, generation = stats.memory, stats.generation
    assert memory is not None and stats.compute is not None and generation is not None, (
        "a runtime with a model reports its memory, compute and generations"
    )
    block_bytes = memory.block_bytes
    rates = [r.decode_tokens_per_second for r in reports if r.generated_tokens > 1]
    info = rt.model_info
    assert info is not None, "a workload runs on a model"
    return WorkloadReport(
        model=str(config.runtime.model),
        compute=info.summary(),
        requests=len(reports),
        cold_requests=len(cold),
        warm_requests=len(warm),
        prompt_tokens=prompt_tokens,
        reused_tokens=reused,
        reused_percent=round(100 * reused / prompt_tokens, 2) if prompt_tokens else 0.0,
        generated_tokens=generated,
        ttft_cold_p50_ms=_round(_percentile(cold, 50)),
        ttft_cold_p95_ms=_round(_percentile(cold, 95)),
        ttft_warm_p50_ms=_round(_percentile(warm, 50)),
        ttft_warm_p95_ms=_round(_percentile(warm, 95)),
        decode_tokens_per_second=round(_percentile(rates, 50) or 0.0, 1),
        throughput_tokens_per_second=round(generated / wall, 1) if wall > 0 else 0.0,
        decode_steps=stats.compute.num_decode_steps,
        mean_batch_size=round(stats.compute.mean_batch_size, 2),
        shared_waits=stats.index.num_waits,
        image_requests=len(reports) if config.images else 0,
        vision_encoder_runs=stats.compute.num_vision_encoder_runs,
        vision_encoder_skips=stats.compute.num_vision_encoder_skips,
        blocks_stored=stats.allocator.num_stored,
        blocks_evicted=stats.allocator.num_evictions,
        blocks_cached=stats.allocator.num_cached,
        peak_blocks_cached=peak_cached,
        block_bytes=block_bytes,
        pool_blocks=stats.allocator.num_blocks,
        pool_bytes=memory.pool_bytes,
        kv_memory=config.runtime.kv_memory,
        peak_kv_bytes=peak_cached * block_bytes,
        peak_mlx_memory_bytes=int(mx.get_peak_memory()),
        requests_not_stored=generation.num_requests_not_stored,
        blocks_not_stored=generation.num_blocks_not_stored,
        prompts_over_pool=generation.num_prompts_over_pool,
        cold_fallbacks=generation.num_cold_fallbacks,
        kv_tiers=tuple(redact_url(url) for url in config.runtime.kv_tiers),
        tier_blocks_loaded=0 if stats.tiers is None else stats.tiers.num_blocks_found,
        tier_blocks_written=0 if stats.tiers is None else stats.tiers.num_blocks_written,
        tiers=() if stats.tiers is None else stats.tiers.tiers,
        wall_seconds=round(wall, 3),
        interrupted=interrupted,
    )


def _show(
    progress: Progress, reports: list[GenerationReport], elapsed: float, *, final: bool = False
) -> None:
    prompt = sum(r.prompt_tokens for r in reports)
    share = 100 * sum(r.cached_tokens for r in reports) / prompt if prompt else 0.0
    status = f"requests, {share:.0f}% prompt tokens reused"
    (progress.finish if final else progress.update)(len(reports), status, elapsed)


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)
