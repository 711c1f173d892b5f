"""The rules both sides of the compute path apply to a request: where chunks
end, whether a token ends it, and slicing its prompt and answer as one."""

from __future__ import annotations

from typing import Optional

from hypothesis import given
from hypothesis import strategies as st

from mlxkv.actors.request import RequestSpec, next_chunk_end, prompt_and_answer, stop_reason


def plan_chunks(start: int, total: int, chunk: int, boundary: Optional[int] = None) -> list[int]:
    """Every job end of a prefill of positions ``[start, total)``, in order
    (:func:`next_chunk_end` applied until ``total``)."""
    ends = [next_chunk_end(start, total, chunk, boundary)]
    while ends[-1] < total:
        ends.append(next_chunk_end(ends[-1], total, chunk, boundary))
    return ends


class TestPlanChunks:
    def test_chunks_end_on_absolute_multiples_and_the_last_token_rides_last(self):
        """Chunk ends are multiples of the chunk size; the final job ends at the total."""
        assert plan_chunks(0, 200, 64) == [64, 128, 192, 200]
        assert plan_chunks(100, 300, 64) == [128, 192, 256, 300]
        assert plan_chunks(0, 1, 64) == [1]
        assert plan_chunks(10, 65, 64) == [65]  # the last token joins the only chunk
        assert plan_chunks(10, 66, 64) == [64, 66]

    def test_a_boundary_ends_a_job_at_every_multiple(self):
        """With a boundary stride (block ends of a hybrid model) jobs end on each multiple too."""
        assert plan_chunks(0, 200, 256, boundary=48) == [48, 96, 144, 192, 200]
        assert plan_chunks(0, 200, 64, boundary=96) == [64, 96, 128, 192, 200]

    @given(st.integers(1, 600), st.data())
    def test_each_end_follows_from_the_one_before(self, total, data):
        """Every job starts where the last one ended: a plan is next_chunk_end
        applied from the start, increasing, ending at the total."""
        start = data.draw(st.integers(0, total - 1))
        chunk = data.draw(st.integers(1, 300))
        boundary = data.draw(st.none() | st.integers(1, 100))
        ends = plan_chunks(start, total, chunk, boundary)
        assert ends[-1] == total and ends == sorted(set(ends))
        assert all(b == next_chunk_end(a, total, chunk, boundary) for a, b in zip([start, *ends], ends))
        assert all(end % chunk == 0 or (boundary and end % boundary == 0) for end in ends[:-1])


class TestPromptAndAnswer:
    @given(st.integers(1, 40), st.integers(0, 40), st.data())
    def test_slices_prompt_and_answer_as_one(self, num_prompt, num_answer, data):
        """It equals slicing prompt + answer, wherever the cut falls."""
        prompt = tuple(range(num_prompt))
        answer = list(range(100, 100 + num_answer))
        whole = prompt + tuple(answer)
        start = data.draw(st.integers(0, len(whole)))
        stop = data.draw(st.integers(start, len(whole)))
        assert prompt_and_answer(prompt, answer, start, stop) == whole[start:stop]


class TestStopReason:
    def test_a_stop_token_then_the_length(self):
        """A stop token ends a request as ``stop`` (wherever it comes); the
        ``max_tokens``-th token as ``length``; nothing else ends it."""
        spec = RequestSpec(request_id="r", prompt=(1,), max_tokens=3, block_size=4, stop_tokens=frozenset({7}))
        assert stop_reason(spec, 7, 0) == "stop"
        assert stop_reason(spec, 7, 2) == "stop"
        assert stop_reason(spec, 5, 2) == "length"
        assert stop_reason(spec, 5, 1) is None

    def test_unresolved_stop_tokens_stop_nothing(self):
        """A spec whose stop tokens the actor has not filled in yet ends only by length."""
        spec = RequestSpec(request_id="r", prompt=(1,), max_tokens=2, block_size=4)
        assert stop_reason(spec, 257, 0) is None
