"""A conversation's second turn about the same image: time to first token.

Turn 1 asks about a 128x128 image (64 image tokens); its answer (16 greedy
tokens) and a new question make turn 2. Time to the first token of turn 2,
on the built-in tiny Qwen2-VL, side by side in one process, rounds
alternating:

- ``mlx-vlm cold``: mlx-vlm's ``stream_generate`` on the whole turn-2 prompt
  (image processing, vision encoder, full prefill);
- ``mlx-vlm prompt cache``: the same, with mlx-vlm's own multi-turn reuse
  (a ``PromptCacheState`` that turn 1 filled);
- ``mlxkv``: ``CacheRuntime.generate`` of turn 2 (``report.prompt_ids`` of
  turn 1 + its answer + the question) after turn 1 ran: the image+prompt+
  answer blocks are reused and the encoder is skipped;
- ``ideal, on a worker thread``: the same as ``ideal``, but handed from
  the event loop to a worker thread and back, as any server that keeps its
  event loop free must (what that hop costs on this machine);
- ``ideal``: only the new tokens of turn 2 through the language model, on a
  cache that already holds turn 1's prompt and answer (no lookup, no image
  work): the least any cache can do. The answer's last token counts as new:
  turn 1 sampled it but never ran it through the model, so no cache can
  hold its KV.

``--size small`` runs the same on a larger Qwen2-VL of the same family
(hidden 128, 4 layers; written once like the built-in one), whose turn-2
prefill takes about 45 ms on a 2-core CPU instead of about 6: the
per-request work of a cache is the same, so its share shrinks as a real
model's would.

Every round uses a fresh image (and ``cache_salt``), so turn 1 is always cold.
Also shown: the vision encoder's time for the image (what a skip saves).
Figures are medians over rounds; "paired" is the median over rounds of each
round's own ratio to the ideal (the methods of one round run back to back,
so a slow patch of the machine touches them alike). Greedy tokens of turn 2
must agree.

    .venv/bin/python scripts/bench_vlm.py [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import anyio  # noqa: E402
import anyio.to_thread  # noqa: E402
import attrs  # noqa: E402

QUESTION_1 = "Describe this picture in detail, please: the colours, the shapes, the texture."
QUESTION_2 = " Thank you. Now tell me which part of the picture stands out most, and why?"
ANSWER_TOKENS = 16
BLOCK = 16
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _picture(folder: str, seed: int) -> str:
    import numpy as np
    from PIL import Image

    path = os.path.join(folder, f"picture-{seed}.png")
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (128, 128, 3), dtype=np.uint8)).save(path)
    return path


class MlxVlm:
    """mlx-vlm's own paths on the same model (loaded again, on this thread)."""

    def __init__(self, path: str) -> None:
        from mlx_vlm import load

        self.model, self.processor = load(path)

    def _reset(self) -> None:
        # mlx-vlm's qwen2_vl keeps position state between calls.
        self.model.language_model._position_ids = None
        self.model.language_model._rope_deltas = None

    def _generate(self, ids: list[int], image: str, tokens: int, state: Any) -> Any:
        """mlx-vlm's ``stream_generate`` on token ids (the image processed
        here, as its text path would): the turn's tokens exactly as mlxkv
        has them, whatever text they decode to."""
        import mlx.core as mx
        from mlx_vlm.generate import stream_generate
        from mlx_vlm.utils import prepare_inputs

        self._reset()
        inputs = prepare_inputs(self.processor, images=[image], prompts=PLACEHOLDER)
        input_ids = mx.array(ids)[None]
        return stream_generate(
            self.model,
            self.processor,
            "",
            input_ids=input_ids,
            pixel_values=inputs["pixel_values"],
            mask=mx.ones_like(input_ids),
            image_grid_thw=inputs["image_grid_thw"],
            max_tokens=tokens,
            prompt_cache_state=state,
        )

    def first_token(self, ids: list[int], image: str, state: Any = None) -> tuple[float, int]:
        started = time.perf_counter()
        for result in self._generate(ids, image, 1, state):
            return time.perf_counter() - started, int(result.token)
        raise RuntimeError("mlx-vlm generated nothing")

    def fill(self, ids: list[int], image: str) -> tuple[Any, list[int]]:
        """A PromptCacheState after turn 1 (prompt + answer), and the answer."""
        from mlx_vlm.generate import PromptCacheState

        state = PromptCacheState()
        answer = [int(result.token) for result in self._generate(ids, image, ANSWER_TOKENS, state)]
        return state, answer

    def encoder_seconds(self, image: str) -> float:
        import mlx.core as mx
        from mlx_vlm.utils import prepare_inputs

        inputs = prepare_inputs(self.processor, images=[image], prompts=PLACEHOLDER)
        tower = self.model.vision_tower
        pixels = inputs["pixel_values"].astype(tower.patch_embed.proj.weight.dtype)
        times = []
        for _ in range(3):
            started = time.perf_counter()
            mx.eval(tower(pixels, inputs["image_grid_thw"]))
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def ideal(self, turn1: list[int], turn2: list[int], image: str) -> Callable[[], int]:
        """Turn 2's new tokens on a cache holding turn 1 but its last answer
        token (never run through the model), with the recipe's explicit
        positions: the cache is filled now; the function returned computes
        the new tokens (the part timed) and returns the first token."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache
        from mlx_vlm.utils import prepare_inputs

        language = self.model.language_model
        inputs = prepare_inputs(self.processor, images=[image], prompts=PLACEHOLDER)
        grid = inputs["image_grid_thw"]
        ids = mx.array(turn2)[None]
        positions, deltas = language.get_rope_index(ids, grid)
        tower = self.model.vision_tower
        features = tower(inputs["pixel_values"].astype(tower.patch_embed.proj.weight.dtype), grid)
        computed = len(turn1) - 1
        head = ids[:, :computed]
        embeds = self.model.merge_input_ids_with_image_features(
            self.model.config.image_token_id, self.model.config.video_token_id, features,
            language.model.embed_tokens(head), head,
        )
        cache = [KVCache() for _ in language.layers]
        language(head, inputs_embeds=embeds, cache=cache, position_ids=positions[:, :, :computed])
        mx.eval([c.state for c in cache], positions)

        def new_tokens() -> int:
            # As mlx-lm prefills: the body, then the last token alone (so the
            # output head runs on one position).
            last = len(turn2) - 1
            language(ids[:, computed:last], cache=cache, position_ids=positions[:, :, computed:last])
            logits = language(ids[:, last:], cache=cache, position_ids=positions[:, :, last:]).logits
            token = mx.argmax(logits[0, -1])
            mx.eval(token)
            return int(token.item())

        return new_tokens


def _sizes() -> dict[str, Any]:
    from mlxkv.default_vlm import DEFAULT_VLM

    small = {
        **DEFAULT_VLM.text,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 352,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        # head_dim 32: 16 frequency pairs, split as Qwen2-VL splits 64 (16+24+24).
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    }
    return {"tiny": DEFAULT_VLM, "small": attrs.evolve(DEFAULT_VLM, name="mlxkv-bench-qwen2-vl-small", text=small)}


SIZES = _sizes()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from mlxkv import CacheRuntime, GenerationReport
    from mlxkv.default_vlm import ensure_vlm

    path = args.model or str(ensure_vlm(SIZES[args.size]))
    reference = MlxVlm(path)
    samples: dict[str, list[float]] = {
        "mlx-vlm cold": [], "mlx-vlm prompt cache": [], "mlxkv": [], "ideal, on a worker thread": [], "ideal": []
    }
    encoder: list[float] = []
    mismatches = 0
    async with CacheRuntime(model=path, block_size=BLOCK) as rt:
        with tempfile.TemporaryDirectory() as folder:
            for round_ in range(args.rounds):
                image = _picture(folder, round_)
                salt = f"round-{round_}"
                answer: list[int] = []
                async with rt.generate(QUESTION_1, images=[image], max_tokens=ANSWER_TOKENS, cache_salt=salt) as stream:
                    async for record in stream:
                        if isinstance(record, GenerationReport):
                            prompt1 = list(record.prompt_ids)
                            turn1 = prompt1 + list(record.tokens)
                        else:
                            answer.append(record.token)
                turn2 = turn1 + list(await rt.tokenize(QUESTION_2))
                # Every method runs on these token ids (the answer need not
                # decode to text that encodes back to it).
                state, theirs = reference.fill(prompt1, image)
                if theirs[: len(answer)] != answer:
                    raise RuntimeError("mlx-vlm's greedy answer to turn 1 differs from mlxkv's")
                tokens = {}
                shift = round_ % len(samples)
                order = list(samples)[shift:] + list(samples)[:shift]
                for method in order:
                    if method == "mlxkv":
                        async with rt.generate(turn2, images=[image], max_tokens=1, cache_salt=salt) as stream:
                            async for record in stream:
                                if isinstance(record, GenerationReport):
                                    seconds, token = record.time_to_first_token, record.tokens[0]
                    elif method == "mlx-vlm cold":
                        seconds, token = reference.first_token(turn2, image)
                    elif method == "mlx-vlm prompt cache":
                        seconds, token = reference.first_token(turn2, image, state)
                    elif method == "ideal":
                        new_tokens = reference.ideal(turn1, turn2, image)
                        started = time.perf_counter()
                        token = new_tokens()
                        seconds = time.perf_counter() - started
                    else:
                        # The same, handed to a thread and back, as a server
                        # that keeps its event loop free must.
                        new_tokens = reference.ideal(turn1, turn2, image)
                        started = time.perf_counter()
                        token = await anyio.to_thread.run_sync(new_tokens)
                        seconds = time.perf_counter() - started
                    samples[method].append(seconds)
                    tokens[method] = token
                mismatches += len(set(tokens.values())) > 1
                encoder.append(reference.encoder_seconds(image))
        stats = await rt.stats()
    assert stats.compute is not None
    ideal = samples["ideal"]
    return {
        "ttft_ms": {method: statistics.median(values) * 1e3 for method, values in samples.items()},
        "paired_over_ideal": {
            method: statistics.median(a / b for a, b in zip(values, ideal)) for method, values in samples.items()
        },
        "vision_encoder_ms": statistics.median(encoder) * 1e3,
        "vision_encoder_runs": stats.compute.num_vision_encoder_runs,
        "vision_encoder_skips": stats.compute.num_vision_encoder_skips,
        "token_mismatches": mismatches,
        "rounds": args.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds (7)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the VLM written for it (tiny: the built-in one)")
    parser.add_argument("--model", help="an mlx-vlm model directory instead")
    parser.add_argument("--json", help="also write the results as JSON to FILE")
    args = parser.parse_args()
    results = anyio.run(main_async, args)
    ideal = results["ttft_ms"]["ideal"]
    print("| turn 2, time to first token | median | / ideal | paired / ideal |")
    print("| --- | --- | --- | --- |")
    for method, ms in results["ttft_ms"].items():
        paired = results["paired_over_ideal"][method]
        print(f"| {method} | {ms:.1f} ms | {ms / ideal:.2f}x | {paired:.2f}x |")
    print(
        f"\nvision encoder, one 128x128 image: {results['vision_encoder_ms']:.1f} ms;"
        f" mlxkv ran it {results['vision_encoder_runs']} times and skipped it"
        f" {results['vision_encoder_skips']} times over {results['rounds']} rounds"
    )
    print(f"rounds where the methods' first tokens differed: {results['token_mismatches']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
