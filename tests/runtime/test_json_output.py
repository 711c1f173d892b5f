"""Generations held to a JSON schema, through the runtime, on real models.

Each answer is JSON the schema allows (or, cut by ``max_tokens``, a prefix
of such JSON); each token is the best the constraint allowed, against the
model's own logits over the whole sequence computed cold; free requests
decoding in the same batches are untouched.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import CacheRuntime, InvalidInput
from mlxkv.actors.json_constraint import ConstrainedRow
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, ensure_model
from mlxkv.generation import GeneratedToken

from parity import BS, assert_clean, run

#: A closed schema whose values end quickly (so a random model's answer is whole).
CHOICES = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": [1, 2, 3]},
        "note": {"type": "null"},
    },
    "required": ["ok", "color", "size"],
}
#: Strings held to a pattern, a length and a format; numbers to bounds.
RULED = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2}$"},
        "day": {"type": "string", "format": "date"},
        "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9},
        "tag": {"type": "string", "maxLength": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["code", "day", "n", "tag", "score"],
}
PROMPT = [(i * 37 + (i // 7) ** 2) % 250 for i in range(80)]
#: Alternatives too alike: 300 readings at once after ``{``.
ALIKE = {"anyOf": [{"type": "object", "properties": {"a": {"const": i}}, "required": ["a"]} for i in range(300)]}
#: Logit noise two paths of float arithmetic may leave between equals.
TOLERANCE = 2e-3


@pytest.fixture(params=["llama", "hybrid"])
def model_path(request: pytest.FixtureRequest, model_dir: Any) -> str:
    return str(ensure_model({"llama": TINY_LLAMA, "hybrid": TINY_HYBRID}[request.param], model_dir))


def _schema_values(value: Any) -> None:
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue") and value["size"] in (1, 2, 3)
    assert set(value) <= set(CHOICES["properties"])


class TestAnswers:
    async def test_answers_are_json_the_schema_allows(self, model_path):
        """Greedy and sampled answers, decoding together with a free one, are
        whole JSON of the schema; the free one is its lone run's tokens."""
        import anyio

        async with CacheRuntime(model=model_path, block_size=BS) as rt:
            alone = await run(rt, PROMPT, max_tokens=24, cache_salt="alone")
            results: dict[str, Any] = {}

            async def one(name: str, kwargs: dict[str, Any]) -> None:
                results[name] = await run(rt, PROMPT, **kwargs)

            held = {"max_tokens": 300, "json_schema": CHOICES}
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "greedy", held)
                for seed in range(3):
                    tg.start_soon(one, f"sampled-{seed}", {**held, "temperature": 1.0, "seed": seed})
                tg.start_soon(one, "free", {"max_tokens": 24})
            assert results["free"][0] == alone[0]
            grammar = rt._generation.json_outputs.grammar(CHOICES)
            for name, (_, report) in results.items():
                if name == "free":
                    continue
                assert report.finish_reason == "stop", (name, report.text)
                assert grammar.accepts(report.text.encode()), report.text
                _schema_values(json.loads(report.text))
            await assert_clean(rt)

    async def test_ruled_strings_and_bounded_numbers(self, model_path):
        """Patterns, lengths, a date and bounds hold through the runtime:
        each answer that ends is valid (jsonschema, and Python reads its
        date); one cut short is a prefix of such JSON."""
        import jsonschema

        async with CacheRuntime(model=model_path, block_size=BS) as rt:
            grammar = rt._generation.json_outputs.grammar(RULED)
            ended = 0
            for seed in range(4):
                _, report = await run(rt, PROMPT, max_tokens=120, json_schema=RULED, temperature=1.0, seed=seed)
                if report.finish_reason == "length":
                    assert grammar.read(grammar.start, report.text.encode()), report.text
                    continue
                ended += 1
                value = json.loads(report.text)
                jsonschema.validate(value, RULED)
                datetime.date.fromisoformat(value["day"])
            assert ended >= 2
            await assert_clean(rt)

    async def test_an_answer_cut_short_is_a_prefix(self, model_path):
        async with CacheRuntime(model=model_path, block_size=BS) as rt:
            schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
            tokens, report = await run(rt, PROMPT, max_tokens=12, json_schema=schema)
            assert report.finish_reason == "length" and len(tokens) == 12
            grammar = rt._generation.json_outputs.grammar(schema)
            state = grammar.read(grammar.start, report.text.encode())
            assert state and not grammar.complete(state)
            assert report.text.startswith("{") and '"text"' in report.text

    async def test_each_token_is_the_best_the_constraint_allowed(self, model_path):
        """The warm run (its prompt's blocks cached by a first run) against the
        model called once on prompt and answer, cold: at every step the token
        drawn is allowed and has the highest allowed logit (within float
        noise), and its log-probability is over the allowed tokens."""
        from mlx_lm import load

        async with CacheRuntime(model=model_path, block_size=BS) as rt:
            await run(rt, PROMPT, max_tokens=4)
            records = []
            async with rt.generate(PROMPT, max_tokens=40, json_schema=CHOICES, logprobs=0) as stream:
                async for record in stream:
                    if isinstance(record, GeneratedToken):
                        records.append(record)
            assert stream.report.cached_tokens > 0
            constraint = await rt._generation.json_outputs.constraint(rt._generation.json_outputs.grammar(CHOICES))
        model, _ = load(model_path)
        tokens = [r.token for r in records]
        logits = model(mx.array([PROMPT + tokens]))[0, len(PROMPT) - 1 :].astype(mx.float32)
        logits = np.array(logits)
        row = ConstrainedRow(constraint)
        for step, record in enumerate(records):
            allowed = row.allowed()[: logits.shape[1]]
            assert allowed[record.token], step
            masked = np.where(allowed, logits[step], -np.inf)
            assert masked[record.token] >= masked.max() - TOLERANCE, step
            best = masked.max()
            expected = masked[record.token] - (best + np.log(np.exp(masked - best).sum()))
            assert record.logprob.logprob == pytest.approx(expected, abs=TOLERANCE), step
            if record.token in constraint.end_tokens:
                break
            row.fed(record.token)


class TestFailures:
    async def test_a_schema_too_ambiguous_fails_its_request_alone(self, model_dir):
        """Alternatives too alike fail the generation that reads them
        (``ComputeFailed``, the grammar's error its cause) as its text reveals
        them; a free request decoding beside it is its lone run's tokens."""
        import anyio

        from mlxkv import ComputeFailed
        from mlxkv.actors.json_grammar import GrammarTooAmbiguous

        async with CacheRuntime(model=str(ensure_model(TINY_LLAMA, model_dir)), block_size=BS) as rt:
            alone = await run(rt, PROMPT, max_tokens=16, cache_salt="alone")
            outcome: dict[str, Any] = {}

            async def ambiguous() -> None:
                with pytest.raises(ComputeFailed) as failed:
                    await run(rt, PROMPT, max_tokens=16, json_schema=ALIKE)
                outcome["cause"] = failed.value.cause

            async def free() -> None:
                outcome["free"] = await run(rt, PROMPT, max_tokens=16)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ambiguous)
                tg.start_soon(free)
            assert isinstance(outcome["cause"], GrammarTooAmbiguous)
            assert outcome["free"][0] == alone[0]
            await assert_clean(rt)


class TestRefusals:
    @pytest.mark.parametrize(
        ("schema", "said"),
        [
            ({"type": "string", "pattern": "(a)\\1"}, "backreference"),
            ({"type": "object", "bad": set()}, "JSON"),
            (False, "object"),
        ],
    )
    async def test_a_schema_it_cannot_hold_is_refused_before_anything_is_sent(self, model_dir, schema, said):
        async with CacheRuntime(model=str(ensure_model(TINY_LLAMA, model_dir)), block_size=BS) as rt:
            with pytest.raises(InvalidInput, match=said) as refused:
                rt.generate(PROMPT, max_tokens=4, json_schema=schema)
            assert refused.value.argument == "json_schema"
            await assert_clean(rt)

    async def test_a_schema_is_compiled_once(self, model_dir):
        async with CacheRuntime(model=str(ensure_model(TINY_LLAMA, model_dir)), block_size=BS) as rt:
            outputs = rt._generation.json_outputs
            assert outputs.grammar(dict(CHOICES)) is outputs.grammar(json.loads(json.dumps(CHOICES)))
            reordered = {**CHOICES, "properties": dict(reversed(list(CHOICES["properties"].items())))}
            assert outputs.grammar(reordered) is not outputs.grammar(CHOICES)  # key order is the text's
            first = await outputs.constraint(outputs.grammar(CHOICES))
            second = await outputs.constraint(outputs.grammar(CHOICES))
            # What one generation's constraint finds, the next one's reads back.
            assert second.grammar is first.grammar and second.masks is first.masks
            start = first.grammar.start
            assert second.allowed(start) is first.allowed(start)
